"""`bsr bench cpu-bound` at a small prefix: the real restore runtime from the memory tier, the bundle, the model.
Checks the evidence, never the timings."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from bsr_cli.bench import bundle as bundles
from bsr_cli.bench import cpu_bound as cb
from bsr_cli.bench.evidence import record_wire
from bsr_cli.loaders import builtin_registration

N = 8192
W = 4


@pytest.mark.timeout(120)
def test_cpu_bound_restores_bit_exact_within_the_budget_and_models_rdma() -> None:
    reg = builtin_registration("demo")
    served: list[int] = []
    orig = cb.MemoryTier.get_into

    def counting(self: cb.MemoryTier, keys, dests, timeout_s):  # type: ignore[no-untyped-def]
        codes, sums = orig(self, keys, dests, timeout_s)
        served.extend(c for c in codes if c > 0)
        return codes, sums

    cb.MemoryTier.get_into = counting  # type: ignore[method-assign]
    try:
        d = cb.run_cpu_bound(reg=reg, tokens=N, w=W, budget_windows=(1, 2), trials=1, salt=3, cores=2)
    finally:
        cb.MemoryTier.get_into = orig  # type: ignore[method-assign]
    assert bundles.validation_errors(d.to_wire()) == [] and d.ok is True
    chunks = N // reg.chunk_size
    restores = [r.to_wire() for r in d.rows if isinstance(r, cb.RestoreRow)]
    assert len(restores) == 2 and sum(served) == 2 * chunks * reg.bytes_per_chunk  # every byte, from the tier
    for r in restores:
        assert r["hash_ok"] is True and r["windows"] == chunks // W
        # The pool's measured peak: one window at B = RWS, two at B = 2 RWS (the next fetch during the install).
        assert r["peak_live_bytes"] == r["budget_windows"] * W * reg.bytes_per_chunk
        assert all(v >= 0 for v in r["stage_cpu_s_per_gb"].values())
    model = record_wire(d.summary)["by_budget_windows"]["2"]["rdma_model"]
    assert [m["transport_gbps"] for m in model] == list(cb.TRANSPORTS_GBPS)
    assert all(m["sustained_gbps"] <= m["transport_gbps"] for m in model)


@pytest.mark.timeout(120)
def test_a_corrupt_object_in_the_memory_tier_fails_the_restore() -> None:
    reg = builtin_registration("demo")
    orig = cb.MemoryTier.add

    def corrupting(self: cb.MemoryTier, key: str, payload: bytes, crc: int) -> None:
        orig(self, key, payload, crc)
        if len(self.objects) == 3:  # one object flipped after its checksum was taken
            _buf, addr, _ = self.objects[key]
            ctypes.memset(addr + 7, (payload[7] ^ 0xFF), 1)

    cb.MemoryTier.add = corrupting  # type: ignore[method-assign]
    try:
        d = cb.run_cpu_bound(reg=reg, tokens=N, w=W, budget_windows=(2,), trials=1, salt=3, cores=2)
    finally:
        cb.MemoryTier.add = orig  # type: ignore[method-assign]
    (r,) = [r.to_wire() for r in d.rows if isinstance(r, cb.RestoreRow)]
    assert r["status"] == "fail" and r["checks"]["committed"] is False and "checksum mismatch" in r["reason"]
    assert d.ok is False


def test_the_model_is_bounded_by_each_single_thread_stage_and_the_cores() -> None:
    costs = {"fetch": 0.1, "verify": 0.08, "install": 0.1, "other": 0.02}
    assert cb.predict_gbps(costs, 25.0, 64) == pytest.approx(10.0)  # the install thread: 1 / 0.1
    assert cb.predict_gbps(costs, 25.0, 1) == pytest.approx(1 / 0.2)  # one core for verify + install + other
    assert cb.predict_gbps(costs, 2.0, 64) == pytest.approx(2.0)  # the transport
    assert cb.predict_gbps(costs, None, 2) == pytest.approx(2 / 0.3)  # loopback: the CPU copy counts too


@pytest.mark.timeout(120)
def test_bench_cpu_bound_command_writes_a_valid_bundle(bsr, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    res = bsr("--json", "bench", "cpu-bound", "-n", str(N), "-W", str(W), "--trials", "1", "--out", str(tmp_path),
              "--no-plots")  # fmt: skip
    assert res.code == 0, res.err[-2000:]
    saved = bundles.load(Path(res.json()["files"]["bundle"]))
    assert saved["experiment"] == "cpu-bound" and bundles.validation_errors(saved) == []
