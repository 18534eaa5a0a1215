"""bsr's BSR runtime inside LMCache (supported: LMCache 0.5.6).

Importable with ``plugins/`` on ``sys.path`` (``PYTHONPATH=plugins``); the plugins are not part of the ``bsr``
wheel because they pin LMCache and torch. Importing this package imports nothing heavy; LMCache is imported only
by ``lmcache_bsr._lmcache`` (through ``lmcache_bsr.rank`` / ``lmcache_bsr.host``).
"""
