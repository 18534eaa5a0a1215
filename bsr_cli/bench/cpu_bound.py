"""`bsr bench cpu-bound`: bsr's restore runtime made CPU-bound on purpose, its CPU cost per stage, and the model of
what it sustains at RDMA speeds.

Over TCP on loopback the transport (~1 GB/s here) hides bsr's own CPU passes. At the paper's 10.3 GB/s RDMA per
rank they decide the speed. This experiment measures them where nothing else is the limit: the runtime's real
``RankRestorer`` (pool leases, completeness check, CRC32C verify, install, release, fail-closed loop) restores into
a real torch ``PagedKV`` from a tier that serves every object from memory.

That tier (``MemoryTier``) is the only stand-in, and it is one on purpose: a transport that costs one memcpy per
byte and no waiting, so the run is CPU-bound. Its copy runs on the runtime's fetch threads and releases the GIL, as
a real transport's receive would. On RDMA the NIC writes the staging buffer and that copy costs the CPU nothing; the
model below therefore counts it separately.

Per window the stages are timed in thread CPU seconds: fetch (the tier's copy), verify (CRC32C over every byte,
on the runtime's verify thread), install (the copy into the paged KV, on the restore thread); the process's total
CPU minus the three is per-object and per-window overhead (Python, leases, events). In the same run, interleaved
with the restores, the same bytes are put through each pass alone (memcpy, CRC32C) as baselines.

The model: with per-GB CPU costs ``c_verify``, ``c_install``, ``c_other`` (and ``c_fetch`` only where the CPU moves
the bytes), a rank sustains ``min(T, 1 / c_verify, 1 / c_install, cores / c_total)`` GB/s on a transport of ``T``
GB/s: verify and install each run on one thread, and together they need ``T * c_total`` cores. The loopback check
predicts this run's own rate from its own stage costs (``c_fetch`` included, with the cores other work left free
when it started: the machine's less its 1-minute load average, at least one) and reports measured over predicted.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bsr_cli.api.codec import to_json
from bsr_cli.bench.evidence import Bundle, Interruption, OnRow, RowMeta, RowStatus, SentRecord, Target
from bsr_cli.core import wire
from bsr_cli.core.evidence import Stage
from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
from bsr_cli.core.plan import windows_for
from bsr_cli.core.registration import Registration
from bsr_cli.runtime.tiers import MISSING, StagingSlice, TierHealth

TRANSPORTS_GBPS = (1.0, 10.3, 25.0)  # loopback TCP here, the paper's RDMA per rank, a 200 Gb/s NIC
GB = 1e9
# The restore's stages timed per window are the runtime's (Stage.FETCH, VERIFY, INSTALL); the rest of its CPU is this.
OTHER = "other"


# -- the evidence (fields in the order of its keys) --------------------------------------------------------------


@dataclass(frozen=True)
class BaselineRow:
    """The same bytes through one pass alone (memcpy or CRC32C)."""

    kind: str  # "memcpy" or "crc32c"
    trial: int
    bytes: int
    seconds: float
    gbps: float
    cpu_s_per_gb: float
    checks: dict[str, bool]
    status: RowStatus  # a baseline always passes: it has nothing to check

    to_wire = wire.writer()

    @property
    def meta(self) -> RowMeta:
        return RowMeta(status=self.status, checks=self.checks)


@dataclass(frozen=True, kw_only=True)
class RestoreRow:
    """One restore of the whole prompt under a budget of ``budget_windows`` windows."""

    kind: str = "restore"
    trial: int
    budget_windows: int
    budget_bytes: int
    bytes: int
    windows: int
    seconds: float
    gbps: float
    cpu_s_per_gb: float
    stage_cpu_s_per_gb: dict[str, float]  # fetch, verify, install, other
    peak_live_bytes: int
    hash_ok: bool
    checks: dict[str, bool]
    status: RowStatus  # pass or fail
    reason: str | None = wire.field(omit_none=True)  # why the restore failed closed; said only then

    to_wire = wire.writer()

    @property
    def meta(self) -> RowMeta:
        return RowMeta(status=self.status, checks=self.checks, reason=self.reason)


Row = BaselineRow | RestoreRow


@dataclass(frozen=True)
class PassStats:
    """Medians of one baseline pass over its trials."""

    gbps: float | None
    gbps_range: list[float] | None
    cpu_s_per_gb: float | None


@dataclass(frozen=True)
class RdmaPoint:
    """What a rank sustains on a transport of ``transport_gbps``, by the model."""

    transport_gbps: float
    sustained_gbps: float
    sustained_gbps_one_core: float
    cores_needed: float


@dataclass(frozen=True)
class BudgetStats:
    """The passing restores under one budget: medians, the model's prediction and the RDMA model."""

    gbps: float
    gbps_range: list[float]
    cpu_s_per_gb: float | None
    stage_cpu_s_per_gb: dict[str, float]
    predicted_gbps: float
    predicted_gbps_all_cores: float
    measured_over_predicted: float | None
    # bsr's own CPU per GB (everything but the transport's copy) against one memcpy pass over the bytes.
    bsr_cpu_s_per_gb: float
    bsr_cpu_in_memcpy_passes: float | None
    rdma_model: list[RdmaPoint]


@dataclass(frozen=True)
class CpuBoundSummary:
    cores: float
    free_cores: float
    memcpy: PassStats
    crc32c: PassStats
    by_budget_windows: dict[str, BudgetStats]


class MemoryTier:
    """A tier that serves every object from process memory (the experiment's transport; see the module doc).

    ``get_into`` copies each payload into its staging slice with ``ctypes.memmove`` (the GIL is released for the
    copy) and returns the CRC32C stored with it, as every tier does; the runtime verifies it."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, tuple[Any, int, int]] = {}  # key -> (buffer, its address, CRC32C)
        self.cpu_seconds = 0.0
        self._lock = threading.Lock()

    def add(self, key: str, payload: bytes, crc: int) -> None:
        buf = ctypes.create_string_buffer(payload, len(payload))
        self.objects[key] = (buf, ctypes.addressof(buf), crc)

    def health(self) -> TierHealth:
        return TierHealth(True, f"{len(self.objects)} objects in memory")

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return [k in self.objects for k in keys]

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        for k, p, c in zip(keys, payloads, checksums, strict=True):
            self.add(k, bytes(p), c)

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        t0 = time.thread_time()
        codes: list[int] = []
        sums: list[int | None] = []
        for k, d in zip(keys, dests, strict=True):
            held = self.objects.get(k)
            if held is None:
                codes.append(MISSING)
                sums.append(None)
                continue
            buf, addr, crc = held
            n = min(len(buf), len(d.view))
            ctypes.memmove(d.ptr, addr, n)
            codes.append(n)
            sums.append(crc)
        dt = time.thread_time() - t0
        with self._lock:
            self.cpu_seconds += dt
        return codes, sums

    def close(self) -> None:
        self.objects.clear()


class _Meter:
    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.thread_time() - t0
                with self._lock:
                    self.seconds += dt

        return run


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system


def predict_gbps(costs: dict[str, float], transport_gbps: float | None, cores: float) -> float:
    """What a rank sustains, GB/s, given per-GB CPU seconds per stage (see the module doc). ``transport_gbps``
    None: the transport is the CPU copy itself (``costs['fetch']``), as in the loopback run."""
    total = costs[Stage.VERIFY] + costs[Stage.INSTALL] + costs[OTHER]
    limits = [1 / costs[Stage.VERIFY], 1 / costs[Stage.INSTALL]]
    if transport_gbps is None:
        total += costs[Stage.FETCH]
        limits.append(1 / costs[Stage.FETCH])
    else:
        limits.append(transport_gbps)
    limits.append(cores / total)
    return min(limits)


def run_cpu_bound(
    *,
    reg: Registration,
    tokens: int,
    w: int,
    budget_windows: Sequence[int] = (1, 2),
    trials: int = 3,
    salt: int | None = None,
    cores: float | None = None,
    on_row: OnRow | None = None,
) -> Bundle:
    """Run the experiment and return its evidence bundle."""
    from bsr_cli.bench import evidence as ex

    salt = ex.new_salt() if salt is None else salt
    run_id = ex.new_run_id("cpu")
    started_at, t_start = ex.now(), time.monotonic()
    machine = ex.machine_info()
    cores = float(cores or os.cpu_count() or 1)
    # The cores this run can have: the machine's, less the other work running when it starts (1-minute load).
    load = machine.loadavg or [0.0]
    free_cores = max(1.0, min(cores, round(cores - float(load[0]), 2)))
    rig = _Rig(reg, tokens, w, max(budget_windows), salt, on_row)
    interrupted_by = _run_trials(rig, trials, budget_windows)
    summary = summarize(rig.rows, cores, free_cores)
    return Bundle(
        experiment="cpu-bound",
        run_id=run_id,
        salt=salt,
        bsr_version=None,  # cpu-bound bundles have never named it
        started_at=started_at,
        finished_at=ex.now(),
        elapsed_s=round(time.monotonic() - t_start, 3),
        registration=ex.registration_identity(reg),
        engine={
            "url": "in-process RankRestorer (memory tier)",
            "embedded": False,
            "startup_s": None,
            "info": {
                "api": "bsr_cli.runtime.restore",
                "registration": reg.identity,
                "chunk_size": reg.chunk_size,
                "tiers": [rig.tier.name],
                "pool_bytes": rig.pool_bytes,
                "budget_bytes": rig.pool_bytes,
            },
        },
        machine=machine,
        params=SentRecord(  # what it was asked: no params type of its own yet
            {
                "tokens": rig.n,
                "W": w,
                "trials": trials,
                "budget_windows": list(budget_windows),
                "cores": cores,
                "free_cores": free_cores,
                "torch_threads": 1,
            }
        ),
        rows=list(rig.rows),
        summary=SentRecord.from_wire(to_json(summary)),  # the api codec's JSON, as cpu-bound bundles have it
        targets=tuple(targets(summary)),
        interrupted=interrupted_by is not None,
        interrupted_by=interrupted_by,
        ok=interrupted_by is None and all(r.status == RowStatus.PASS for r in rig.rows),
    )


def _run_trials(rig: _Rig, trials: int, budget_windows: Sequence[int]) -> Interruption | None:
    """Every trial on one torch thread, the tier closed afterwards; what interrupted them (None: nothing did)."""
    import torch

    # One torch thread, as each rank process of the embedded engine runs: with torch's intra-op pool a copy's
    # CPU would land on pool threads that no stage's thread clock sees.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for trial in range(trials):
            # Interleaved: each trial runs every baseline and every restore once, back to back.
            rig.baseline("memcpy", rig.memcpy_all, trial)
            rig.baseline("crc32c", rig.crc_all, trial)
            for bw in budget_windows:
                rig.restore(bw, trial)
    except KeyboardInterrupt:
        return Interruption.OPERATOR
    finally:
        torch.set_num_threads(torch_threads)
        rig.tier.close()
    return None


class _Rig:
    """The experiment's parts: rank 0's real paged KV, the memory tier holding every object of the prompt (the
    synthetic model's KV, with its CRC32C), the baselines' buffers (one contiguous copy of every object and a
    destination for memcpy) and a restore pool for the largest budget. Each row goes to ``rows`` and ``on_row``."""

    def __init__(
        self, reg: Registration, tokens: int, w: int, max_budget_windows: int, salt: int, on_row: OnRow | None
    ):
        import torch

        from bsr_cli.runtime.checksum import object_checksum
        from bsr_cli.runtime.paged_kv import PagedKV
        from bsr_cli.runtime.restore import ObjectRef, WindowJob

        self.reg, self.w, self.on_row = reg, w, on_row
        self.rows: list[Row] = []
        cs = reg.chunk_size
        self.n = tokens // cs * cs
        n_chunks = self.n // cs
        self.hashes = chunk_hashes(synthetic_tokens(self.n, seed=salt), cs)[:n_chunks]
        blocks = {g.name: -(-self.n // g.block_size) for g in reg.groups}
        self.kv = PagedKV(reg, 0, blocks, torch.device("cpu"))
        self.tables = {g: list(range(nb)) for g, nb in blocks.items()}
        self.tier = MemoryTier()
        self.objects: dict[str, list[ObjectRef]] = {g: [] for g in reg.group_names}
        for g in reg.group_names:
            for ch in self.hashes:
                payload = self.kv.synthetic_object(ch, g, cs).numpy().tobytes()
                key = object_key(reg, 0, g, ch)
                self.tier.add(key, payload, object_checksum(key, payload))
                self.objects[g].append(ObjectRef(key, self.tier.name, len(payload)))
        self.nbytes = n_chunks * reg.bytes_per_chunk
        self.canonical = self.kv.canonical_hash(self.hashes, self.n)
        self.windows = [
            WindowJob(win.index, win.chunk_start, win.chunk_end, win.token_start, win.token_end,
                      {b.group: (b.start, b.end) for b in win.blocks})
            for win in windows_for(reg, w, n_chunks, self.n)
        ]  # fmt: skip
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8)
        off = 0
        for g in reg.group_names:
            for ref in self.objects[g]:
                _buf, addr, _crc = self.tier.objects[ref.key]
                ctypes.memmove(self.flat.data_ptr() + off, addr, ref.size)
                off += ref.size
        self.sink = torch.empty_like(self.flat).fill_(1)
        self.offsets, o = {}, 0
        for g in reg.group_names:
            self.offsets[g] = o
            o += reg.group_bytes_per_chunk(g)
        self.pool_tensor = torch.zeros(max_budget_windows * w * reg.bytes_per_chunk, dtype=torch.uint8)
        self.pool_bytes = self.pool_tensor.numel()
        pool_ptr = self.pool_tensor.data_ptr()
        self.pool_view = memoryview((ctypes.c_ubyte * self.pool_bytes).from_address(pool_ptr)).cast("B")

    def add(self, row: Row) -> None:
        self.rows.append(row)
        if self.on_row:
            self.on_row(row)

    def memcpy_all(self) -> None:
        self.sink.copy_(self.flat)

    def crc_all(self) -> None:
        from bsr_cli.runtime.checksum import crc32c_at

        step = self.reg.bytes_per_chunk
        for lo in range(0, self.nbytes, step):
            crc32c_at(self.flat.data_ptr() + lo, min(step, self.nbytes - lo))

    def baseline(self, kind: str, fn: Callable[[], object], trial: int) -> None:
        """The same bytes through one pass alone (memcpy, CRC32C): its rate and CPU per GB."""
        c0, t0 = _cpu_now(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, _cpu_now() - c0
        self.add(
            BaselineRow(
                kind=kind,
                trial=trial,
                bytes=self.nbytes,
                seconds=round(wall, 4),
                gbps=round(self.nbytes / wall / GB, 3),
                cpu_s_per_gb=round(cpu / (self.nbytes / GB), 4),
                checks={},
                status=RowStatus.PASS,
            )
        )

    def restore(self, bw: int, trial: int) -> None:
        """One restore of the whole prompt under a budget of ``bw`` windows, each stage's thread CPU timed."""
        from bsr_cli.runtime.pool import RestorePool
        from bsr_cli.runtime.restore import RankRestorer, RestoreJob

        reg, w = self.reg, self.w
        budget = bw * w * reg.bytes_per_chunk
        pool = RestorePool(self.pool_tensor.data_ptr(), self.pool_view, reg.bytes_per_chunk, budget)
        verify, install = _Meter(), _Meter()
        restorer = RankRestorer(0, reg.group_names, self.offsets, pool, {self.tier.name: self.tier}, self.kv, _drop)
        restorer._verify = verify.timed(restorer._verify)  # type: ignore[method-assign]
        restorer._install = install.timed(restorer._install)  # type: ignore[method-assign]
        self.kv.invalidate(self.tables)
        job = RestoreJob(
            f"cpu-{bw}-{trial}", w, self.windows, self.objects, self.tables, fetch_timeout_s=60.0, admit_timeout_s=60.0
        )
        self.tier.cpu_seconds = 0.0
        try:
            c0, t0 = _cpu_now(), time.perf_counter()
            out = restorer.restore(job, threading.Event())
            wall, cpu = time.perf_counter() - t0, _cpu_now() - c0
        finally:
            restorer.close()
        gb = self.nbytes / GB
        stages = {Stage.FETCH: self.tier.cpu_seconds, Stage.VERIFY: verify.seconds, Stage.INSTALL: install.seconds}
        stage_costs = {str(k): v for k, v in stages.items()} | {OTHER: max(0.0, cpu - sum(stages.values()))}
        hash_ok = out.ok and self.kv.output_hash(self.tables, self.n) == self.canonical
        peak_ok = 0 < out.peak_live_bytes <= budget
        self.add(
            RestoreRow(
                trial=trial,
                budget_windows=bw,
                budget_bytes=budget,
                bytes=self.nbytes,
                windows=out.windows_done,
                seconds=round(wall, 4),
                gbps=round(self.nbytes / wall / GB, 3),
                cpu_s_per_gb=round(cpu / gb, 4),
                stage_cpu_s_per_gb={k: round(v / gb, 4) for k, v in stage_costs.items()},
                peak_live_bytes=out.peak_live_bytes,
                hash_ok=hash_ok,
                checks={
                    "committed": out.ok and out.windows_done == len(self.windows),
                    "hash_ok": hash_ok,
                    "peak_at_most_budget": peak_ok,
                },
                status=RowStatus.PASS if hash_ok and peak_ok else RowStatus.FAIL,
                reason=None if out.ok else out.reason,
            )
        )


def _drop(_event: object) -> None:
    """The experiment keeps no events."""


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarize(rows: Sequence[Row], cores: float, free_cores: float | None = None) -> CpuBoundSummary:
    """Medians per kind and budget; the loopback check predicts with ``free_cores`` (the cores not busy with other
    work at the start), the RDMA model with ``cores``."""
    free = cores if free_cores is None else free_cores
    passes = {kind: _pass_stats([r for r in rows if isinstance(r, BaselineRow) and r.kind == kind]) for kind in
              ("memcpy", "crc32c")}  # fmt: skip
    restores = [r for r in rows if isinstance(r, RestoreRow)]
    memcpy = passes["memcpy"].cpu_s_per_gb or 0.0
    by_budget: dict[str, BudgetStats] = {}
    for bw in sorted({r.budget_windows for r in restores}):
        rs = [r for r in restores if r.budget_windows == bw and r.status == RowStatus.PASS]
        if rs:
            by_budget[str(bw)] = _budget_stats(rs, bw, memcpy, cores, free)
    return CpuBoundSummary(cores, free, passes["memcpy"], passes["crc32c"], by_budget)


def _pass_stats(rs: Sequence[BaselineRow]) -> PassStats:
    return PassStats(
        gbps=_median([r.gbps for r in rs]),
        gbps_range=[min(r.gbps for r in rs), max(r.gbps for r in rs)] if rs else None,
        cpu_s_per_gb=_median([r.cpu_s_per_gb for r in rs]),
    )


def _budget_stats(rs: Sequence[RestoreRow], bw: int, memcpy: float, cores: float, free: float) -> BudgetStats:
    costs = {k: float(_median([r.stage_cpu_s_per_gb[k] for r in rs]) or 0.0) for k in rs[0].stage_cpu_s_per_gb}
    measured = float(_median([r.gbps for r in rs]) or 0.0)
    # Serialized (one window live): a window's fetch does not overlap anything but the previous one's verify.
    predicted = (
        predict_gbps(costs, None, free)
        if bw > 1
        else 1 / (costs[Stage.FETCH] + max(costs[Stage.VERIFY], costs[Stage.INSTALL]) + costs[OTHER])
    )
    bsr_cpu = costs[Stage.VERIFY] + costs[Stage.INSTALL] + costs[OTHER]
    return BudgetStats(
        gbps=measured,
        gbps_range=[min(r.gbps for r in rs), max(r.gbps for r in rs)],
        cpu_s_per_gb=_median([r.cpu_s_per_gb for r in rs]),
        stage_cpu_s_per_gb={k: round(v, 4) for k, v in costs.items()},
        predicted_gbps=round(predicted, 3),
        predicted_gbps_all_cores=round(predict_gbps(costs, None, cores), 3) if bw > 1 else round(predicted, 3),
        measured_over_predicted=round(measured / predicted, 3) if predicted else None,
        bsr_cpu_s_per_gb=round(bsr_cpu, 4),
        bsr_cpu_in_memcpy_passes=round(bsr_cpu / memcpy, 2) if memcpy else None,
        rdma_model=[
            RdmaPoint(
                transport_gbps=t,
                sustained_gbps=round(predict_gbps(costs, t, cores), 2),
                sustained_gbps_one_core=round(predict_gbps(costs, t, 1.0), 2),
                cores_needed=round(min(t, 1 / costs[Stage.VERIFY], 1 / costs[Stage.INSTALL]) * bsr_cpu, 2),
            )
            for t in TRANSPORTS_GBPS
        ],
    )


def targets(summary: CpuBoundSummary) -> list[Target]:
    two = summary.by_budget_windows.get("2")
    ratio = two.measured_over_predicted if two else None
    return [
        Target(
            name="model_checked_against_cpu_bound_run",
            target="the per-stage model predicts the CPU-bound loopback run within 25 %",
            measured=f"measured / predicted = {ratio}" if ratio is not None else "no passing restore",
            met=None if ratio is None else bool(0.75 <= ratio <= 1.25),
        )
    ]


__all__ = ["MemoryTier", "predict_gbps", "run_cpu_bound", "summarize", "targets"]
