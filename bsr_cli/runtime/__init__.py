"""The engine-agnostic BSR runtime: restore pool, probe-only lookup, windowed fail-closed restore, admission,
faults and the admin API. Hosts (the embedded engine, the LMCache plugin) supply tiers and destination KV.
"""
