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


@pytest.mark.timeout(300)
def test_without_the_cpu_connector_stock_lmcache_stores_nothing(driver_factory: Any) -> None:
    """The control for the test above: the same run without the general-plugin entry point is what LMCache 0.5.6
    does on vLLM's CPU build by itself, degraded: nothing stored, nothing loaded."""
    d = driver_factory("stock-degraded")
    res = d.run(
        {
            "connector": "stock",
            "scenarios": [{"name": "a", "tokens": N, "seed": 1}, {"name": "b", "tokens": N, "seed": 1}],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", d.disk),
        with_entry_point=False,
    )
    a, b = res["by_name"]["a"], res["by_name"]["b"]
    assert "No supported cpu connector found" in res["log"]
    assert b["num_cached_tokens"] == 0 and not any(f.is_file() for f in d.disk.rglob("*"))
    assert not events_of(a, "lmcache_cpu_store") and not events_of(b, "lmcache_cpu_load")
    assert b["output"] == a["output"]
