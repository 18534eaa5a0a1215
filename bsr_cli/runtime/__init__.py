"""The engine-agnostic BSR runtime: restore pool, probe-only lookup, windowed fail-closed restore, admission,
faults and events. Hosts (the embedded engine, the LMCache plugin, a vLLM worker) supply tiers and destination KV,
and serve the admin API from bsr_cli/server.
"""
