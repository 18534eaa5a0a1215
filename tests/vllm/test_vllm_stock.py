"""vLLM's own LMCacheConnectorV1 on vLLM's CPU build: LMCache stores a prompt and loads it back, through the CPU
connector (plugins/lmcache_cpu) that the general-plugin entry point installs in vLLM's worker."""

from __future__ import annotations

from typing import Any

import pytest
from vllmstage import CHUNK, chunk_prefix, events_of, lmcache_yaml

N = 5 * CHUNK + 60


@pytest.mark.timeout(300)
def test_stock_lmcache_connector_stores_then_loads_the_chunk_aligned_prefix(driver_factory: Any) -> None:
    d = driver_factory("stock")
    res = d.run(
        {
            "connector": "stock",
            "scenarios": [
                {"name": "store", "tokens": N, "seed": 1},
                {"name": "load", "tokens": N, "seed": 1},
                {"name": "other", "tokens": N, "seed": 9},  # a prompt never stored: nothing to load
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", d.disk),
    )
    store, load, other = (res["by_name"][n] for n in ("store", "load", "other"))
    # The first request computed everything and LMCache stored its full chunks out of vLLM's CPU KV.
    assert store["num_cached_tokens"] == 0
    assert sum(e["tokens"] for e in events_of(store, "lmcache_cpu_store")) == chunk_prefix(N)
    assert not events_of(store, "lmcache_cpu_load")
    # The second got exactly that prefix from LMCache, written into vLLM's KV by the CPU connector...
    assert load["num_cached_tokens"] == chunk_prefix(N)
    assert sum(e["tokens"] for e in events_of(load, "lmcache_cpu_load")) == chunk_prefix(N)
    assert f"Retrieved {chunk_prefix(N)} out of {chunk_prefix(N)} required tokens" in res["log"]
    # ...and generated exactly what recomputing produced.
    assert load["output"] == store["output"]
    assert other["num_cached_tokens"] == 0 and not events_of(other, "lmcache_cpu_load")
    assert "No supported cpu connector found" not in res["log"]
