"""LMCache's KV connector for vLLM's CPU build (plugins/lmcache_cpu), over real LMCache 0.5.6.

vLLM's CPU attention packs each block's interior for its ISA, so the connector moves whole blocks: these tests
check that a chunk's blocks arrive intact in the destination's blocks and that nothing else is written. That the
bytes are right for vLLM's kernels is checked inside real vLLM (tests/vllm: outputs identical to recompute).
Run through scripts/test-plugins; skipped when LMCache is absent.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_cpu import install
from lmcache_cpu.connector import VLLMPagedMemCPUConnector

LAYERS, HEADS, D, BS, NB = 3, 2, 32, 32, 8
CS = 64  # two blocks per chunk


def paged_kv(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, HEADS, BS, 2 * D, generator=g) for _ in range(LAYERS)]


def slots_of(blocks: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(b * BS, (b + 1) * BS) for b in blocks]).to(torch.long)


def memobj(n: int) -> Any:
    return SimpleNamespace(tensor=torch.zeros(2, LAYERS, n, HEADS * D))


def test_a_chunk_moves_as_its_blocks() -> None:
    src = paged_kv()
    conn = VLLMPagedMemCPUConnector(LAYERS, HEADS, D)
    obj = memobj(CS)
    assert conn.get_shape(CS) == obj.tensor.shape
    # tokens [64, 128) of a request whose blocks are 6, 3 | 4, 1
    conn.from_gpu(obj, CS, 2 * CS, kvcaches=src, slot_mapping=slots_of([6, 3, 4, 1]))
    assert conn.stored_tokens == CS
    dst = [torch.zeros_like(t) for t in src]
    conn.to_gpu(obj, CS, 2 * CS, kvcaches=dst, slot_mapping=slots_of([0, 7, 2, 5]))
    assert conn.loaded_tokens == CS
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][2], src[layer][4])
        assert torch.equal(dst[layer][5], src[layer][1])
        for b in (0, 1, 3, 4, 6, 7):  # nothing else written
            assert not dst[layer][b].any()


def test_blocks_vllm_already_holds_are_left_alone() -> None:
    src = paged_kv(1)
    conn = VLLMPagedMemCPUConnector(LAYERS, HEADS, D)
    obj = memobj(CS)
    conn.from_gpu(obj, 0, CS, kvcaches=src, slot_mapping=slots_of([2, 3]))
    dst = [torch.zeros_like(t) for t in src]
    conn.to_gpu(obj, 0, CS, kvcaches=dst, slot_mapping=slots_of([5, 6]), vllm_cached_tokens=BS)
    assert conn.loaded_tokens == BS
    for layer in range(LAYERS):
        assert not dst[layer][5].any()
        assert torch.equal(dst[layer][6], src[layer][3])
    conn.to_gpu(obj, 0, CS, kvcaches=dst, slot_mapping=slots_of([5, 6]), vllm_cached_tokens=CS)
    assert conn.loaded_tokens == BS  # all held: nothing loaded
    with pytest.raises(ValueError, match="not whole blocks"):
        conn.to_gpu(obj, 0, CS, kvcaches=dst, slot_mapping=slots_of([5, 6]), vllm_cached_tokens=10)


def test_anything_but_whole_blocks_fails_with_a_clear_error() -> None:
    conn = VLLMPagedMemCPUConnector(LAYERS, HEADS, D)
    kv = paged_kv()
    with pytest.raises(ValueError, match="multiple of vLLM's block_size"):
        conn.from_gpu(memobj(48), 0, 48, kvcaches=kv, slot_mapping=slots_of([1, 2])[:48])
    shuffled = slots_of([1, 2])
    shuffled[[3, 4]] = shuffled[[4, 3]]
    with pytest.raises(ValueError, match="not whole vLLM blocks"):
        conn.from_gpu(memobj(CS), 0, CS, kvcaches=kv, slot_mapping=shuffled)
    with pytest.raises(ValueError, match="not whole vLLM blocks"):
        conn.from_gpu(memobj(CS), 0, CS, kvcaches=kv, slot_mapping=torch.full((CS,), -1, dtype=torch.long))
    with pytest.raises(ValueError, match="CPU_ATTN layout"):
        conn.from_gpu(memobj(CS), 0, CS, kvcaches=[torch.zeros(2, NB, BS, HEADS, D)] * LAYERS, slot_mapping=[0])
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.to_gpu(memobj(CS), 0, CS, kvcaches=kv)
    with pytest.raises(ValueError, match="3-layer"):
        conn.to_gpu(memobj(CS), 0, CS, kvcaches=kv[:1], slot_mapping=slots_of([1, 2]))


def metadata(chunk: int = CS) -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.float32,
        kv_shape=(LAYERS, 2, chunk, HEADS, D),
        chunk_size=chunk,
    )


def test_install_makes_lmcache_pick_it_for_vllm_on_cpu() -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    mod, engine_type, device = lm.gpu_connector_factory()
    assert device == "cpu"
    assert install() is True
    assert install() is True  # idempotent: wrapped once
    assert getattr(mod.CreateGPUConnector, "_bsr_cpu", False)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CS)
    conn = mod.CreateGPUConnector(cfg, metadata(), engine_type.VLLM)
    assert isinstance(conn, VLLMPagedMemCPUConnector)
    assert (conn.num_layers, conn.num_kv_heads, conn.head_size) == (LAYERS, HEADS, D)
    # other engines keep LMCache's own choice
    assert not isinstance(mod.CreateGPUConnector(cfg, metadata(), engine_type.MOCK), VLLMPagedMemCPUConnector)
    with pytest.raises(ValueError, match="not supported"):
        mod.CreateGPUConnector(
            LMCacheEngineConfig.from_defaults(chunk_size=CS, use_layerwise=True), metadata(), engine_type.VLLM
        )


def test_real_engine_stores_and_loads_through_it(tmp_path: Any) -> None:
    """A real LMCache engine (L1 + local disk) stores a request's KV out of one paged cache and loads it into
    another, through the connector: every loaded token equals the stored one, in the destination's slots."""
    src = paged_kv(2)
    conn = VLLMPagedMemCPUConnector(LAYERS, HEADS, D)
    n = 3 * CS
    tokens = list(range(7, 7 + n))
    src_blocks = [7, 0, 3, 5, 1, 6]
    dst_blocks = [2, 4, 6, 1, 0, 3]
    src_slots, dst_slots = slots_of(src_blocks), slots_of(dst_blocks)
    name = "bsr-lmcache-cpu-test"
    eng = lm.build_engine(
        name,
        {
            "chunk_size": CS,
            "local_cpu": True,
            "max_local_cpu_size": 0.05,
            "local_disk": str(tmp_path),
            "max_local_disk_size": 0.1,
        },
        model="tiny",
        world_size=1,
        worker_id=0,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=D,
        dtype="fp32",
        connector=conn,
    )
    try:
        lm.store(eng, tokens, 0, kvcaches=src, slot_mapping=src_slots)
        dst = [torch.zeros_like(t) for t in src]
        got = lm.stock_retrieve(eng, tokens, kvcaches=dst, slot_mapping=dst_slots)
        assert int(got.sum()) == n
        assert conn.loaded_tokens == n
        for layer in range(LAYERS):
            for sb, db in zip(src_blocks, dst_blocks, strict=True):
                assert torch.equal(dst[layer][db], src[layer][sb])
    finally:
        lm.destroy_engine(name)


def test_vllm_plugin_hook_waits_for_lmcache_then_wraps_its_factory() -> None:
    """vLLM runs ``register()`` in every process before its CPU worker scans loaded modules, so the hook must import
    nothing, and wrap LMCache's factory as soon as LMCache imports it (fresh interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, lmcache_cpu\n"
        "lmcache_cpu.register()\n"
        "assert not any(m == 'lmcache' or m.startswith('lmcache.') for m in sys.modules), 'imported LMCache early'\n"
        "import lmcache.v1.gpu_connector as f\n"
        "assert getattr(f.CreateGPUConnector, '_bsr_cpu', False), 'factory not wrapped'\n"
        "print('hook-ok')\n"
    )
    plugins = Path(__file__).resolve().parents[2] / "plugins"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{plugins}:{plugins.parent}"},
        check=False,
    )
    assert out.returncode == 0 and "hook-ok" in out.stdout, out.stderr[-2000:]
