"""A vLLM KV connector with BSR's restore semantics on top of LMCache's (``vllm_bsr.connector.BSRConnector``).

Importing this package imports nothing heavy; ``vllm_bsr.logic`` is plain Python, ``vllm_bsr.connector`` needs
vLLM and LMCache 0.5.6 (through ``lmcache_bsr._lmcache``). Put ``plugins/`` on PYTHONPATH of every vLLM process.
"""
