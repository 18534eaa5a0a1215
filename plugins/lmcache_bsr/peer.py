"""One measurement of `bsr bench peer`, run in the LMCache venv: stock LMCache against bsr's windowed retrieve.

``python -m lmcache_bsr.peer CASE.json`` builds the plugin host (``LMCacheHost``: one real LMCache 0.5.6 engine per
TP rank, Mooncake as its remote backend, L1 of exactly ``l1_bytes``), runs one case and prints one JSON line
prefixed ``BSR-PEER-RESULT``. Cases (``mode``):

``store``   LMCache's store of the prompt (through the host's submit: computed, stored, visible remotely).
``stock``   LMCache's own retrieve of the whole prefix on every rank at once (its whole plan staged in L1), into
            the paged KV (``destination: paged``, the default), or, with ``destination: contiguous``, after an
            untimed ``lookup`` and with its transfer threads at bsr's lower priority, into one contiguous buffer
            in LMCache's own object layout (a plain copy per chunk: the most favourable setup stock can have).
``bsr``     bsr's windowed restore through the host (probe, windows of at most W chunks, commit on every rank).
``raw``     the reference: a raw Mooncake ``batch_get_into`` of the very objects LMCache stored, per rank.

Every case runs in its own process: LMCache's retrieve below its L1 rung busy-waits on the allocator inside its
storage event loop, so after ``blocking_timeout_secs`` it returns 0 tokens and leaves that thread spinning; such a
process is ended with ``os._exit`` after reporting (the parent kills it if even that does not happen in time).

With ``BSR_PEER_PROFILE=<dir>`` the stock and bsr cases write a cProfile of their operation there (for finding
where CPU goes; the profiler inflates the times, so a profiled run's numbers are not a measurement).

Measured, not predicted: L1 peak bytes (the allocator's high-water, ``PeakTracker``), CPU seconds of this process
and of the Mooncake master and segment holder (``/proc/<pid>/stat``) around the operation only, and the CPU
seconds spent installing into the destination KV (thread CPU time inside the connector's copy). For stock, the
wall seconds of each stage of its retrieve: ``lookup`` (which tier holds each chunk: a Mooncake existence RPC),
``fetch`` (L1 allocation and the transfer into it) and ``install`` (the connector's copies), so the time between
LMCache's call and the raw GET of the same bytes can be accounted for. Every case also reports its stage costs
(``stage_costs``, ``core.stage_costs``): wall and CPU seconds of fetch, verify, install and wait, and the process's
CPU. bsr's come from its restore report (each stage timed on the thread doing it); stock's and the raw GET's fetch
is the thread CPU inside the store's transfer calls (``TransferMeter``), stock's install the connector's copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    from bsr_cli.core.wire import JsonObject
    from lmcache_bsr._lmcache import LMCacheConfig
    from lmcache_bsr.host import HostConfig, ModelConfig

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep Mooncake's transfer endpoint on loopback

RESULT_PREFIX = "BSR-PEER-RESULT "
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str = "self") -> float | None:
    """utime + stime of every thread of a process, from /proc (None when it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuMeter:
    """CPU seconds of this process and the watched ones between start() and stop()."""

    def __init__(self, watch: dict[str, int]) -> None:
        self.watch = watch
        self.t0: dict[str, float | None] = {}

    def _now(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {"self": cpu_seconds("self")}
        for name, pid in self.watch.items():
            out[name] = cpu_seconds(pid)
        return out

    def start(self) -> None:
        self.t0 = self._now()

    def stop(self) -> dict[str, float]:
        t1 = self._now()
        out: dict[str, float] = {}
        for name, v in t1.items():
            a = self.t0.get(name)
            if v is not None and a is not None:
                out["process" if name == "self" else name] = round(v - a, 4)
        return out


class MasterAddress(TypedDict):
    """Where a case process reaches the Mooncake master."""

    rpc_address: str
    metadata_url: str


class PeerCase(TypedDict):
    """One case as `bsr bench peer` writes it (bsr_cli/bench/peer.py: CaseBase, then Case)."""

    model: ModelConfig  # with the TP size its KV is split over
    master: MasterAddress
    seed: int
    deadline_s: NotRequired[float]
    watch_pids: NotRequired[dict[str, int]]  # the service processes to watch: name -> pid
    mode: str  # store, raw, stock or bsr
    tokens: int
    l1_bytes: int
    destination: NotRequired[str]  # stock only: "contiguous"
    W: NotRequired[int]  # the windowed modes
    # stock into a contiguous destination: each rank's buffer, set up by run_case (never on the wire)
    _contiguous: NotRequired[list[ContiguousDestination]]


def _checksums(case: PeerCase) -> bool:
    mode = case.get("mode")
    if mode == "bsr":
        return os.environ.get("BSR_PEER_CHECKSUMS", "on") != "off"
    return mode == "store"  # the stored objects carry them; stock LMCache and the raw GET never look


def lmcache_config(mc: MasterAddress, l1_bytes: int, deadline_s: float, checksums: bool) -> LMCacheConfig:
    """LMCache's configuration over the case's Mooncake master: L1 is staging only (no hot-cache write-back, so
    every hit is read from Mooncake), the segment holder holds the objects, TCP on loopback."""
    return {
        "local_cpu": False,
        "max_local_cpu_size": l1_bytes / 2**30,  # GB in LMCache's config means GiB
        "blocking_timeout_secs": deadline_s,
        "remote_url": f"mooncakestore://{mc['rpc_address']}/",
        "remote_serde": "naive",
        "extra_config": {
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_metadata_server": mc["metadata_url"],
            "mooncake_master_server_addr": mc["rpc_address"],
            "mooncake_protocol": "tcp",
            "mooncake_global_segment_size": 0,  # the segment holder holds the objects
            "mooncake_local_buffer_size": 64 << 20,
            "save_chunk_meta": False,
            "transfer_timeout": max(5, int(deadline_s)),
            "bsr_checksums": checksums,
        },
    }


def host_config(case: PeerCase) -> HostConfig:
    m = case["model"].copy()
    mc = case["master"]
    n = int(case["tokens"])
    return {
        "model": m,
        # Stock LMCache stores and verifies nothing; bsr's store and restore carry a CRC32C per object
        # (lmcache_bsr/integrity.py). BSR_PEER_CHECKSUMS=off restores without them: their cost, measured.
        "lmcache": lmcache_config(mc, int(case["l1_bytes"]), float(case.get("deadline_s", 10.0)), _checksums(case)),
        "settings": {
            "w": int(case.get("W") or 1),
            "tiers": ["mooncake"],
            "kv_tokens": n + int(m.get("chunk_size", 256)),
            "faults_enabled": False,
            "fetch_timeout_s": float(case.get("deadline_s", 10.0)) * 6,
        },
    }


class InstallMeter:
    """Thread CPU seconds inside the connector's install copy (to_gpu), summed over every thread, and its wall
    seconds (summed too: per rank, the install is one thread's)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.wall_seconds = 0.0
        self.lock = threading.Lock()

    def wrap(self, connector: Any) -> None:
        orig = connector.to_gpu

        def to_gpu(*a: Any, **k: Any) -> Any:
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                dt, dw = time.thread_time() - t0, time.perf_counter() - w0
                with self.lock:
                    self.seconds += dt
                    self.wall_seconds += dw

        connector.to_gpu = to_gpu


class TransferMeter:
    """Thread CPU and wall seconds inside the Mooncake store's transfer calls (``batch_get_into``), summed over every
    thread that makes one: the calling thread polls for the transfer's completion, so its CPU is the fetch stage's
    (the transport's own threads are what the process's CPU has beyond the stages)."""

    def __init__(self) -> None:
        self.cpu_seconds = 0.0
        self.wall_seconds = 0.0
        self.lock = threading.Lock()

    def timed(self, call: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                dc, dw = time.thread_time() - c0, time.perf_counter() - w0
                with self.lock:
                    self.cpu_seconds += dc
                    self.wall_seconds += dw

        return run

    def wrap(self, connector: Any) -> None:
        """Time the transfer calls LMCache's Mooncake connector makes (its store, behind a forwarding wrapper)."""
        connector.store = _TimedStore(connector.store, self)

    def stage_costs(self, cpu: dict[str, float], install: InstallMeter | None = None) -> JsonObject:
        """The case's stage costs (``core.stage_costs``): its transfers as the fetch stage, the connector's copy as
        the install, the case process's CPU (``cpu``: a CpuMeter's reading); no verify stage, no window loop."""
        from bsr_cli.core.evidence import TimedStage
        from bsr_cli.core.stage_costs import StageCosts

        costs = StageCosts(process_cpu_s=cpu.get("process", 0.0))
        costs = costs.plus(TimedStage.FETCH, self.wall_seconds, self.cpu_seconds)
        if install is not None:
            costs = costs.plus(TimedStage.INSTALL, install.wall_seconds, install.seconds)
        return dict(costs.rounded().to_wire())


class _TimedStore:
    """The real store, its ``batch_get_into`` timed by a TransferMeter; every other call passed through as is."""

    def __init__(self, store: Any, meter: TransferMeter) -> None:
        self._store, self._meter = store, meter

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        return self._meter.timed(real) if name == "batch_get_into" else real


_STOCK_STAGES = {"lookup": "get_block_mapping", "fetch": "batched_get"}  # stage -> StorageManager method


class StageClock:
    """Wall seconds of stock LMCache's retrieve before its install, by stage, summed over the ranks: ``lookup``
    (``StorageManager.get_block_mapping``: which tier holds each chunk) and ``fetch`` (``batched_get``: L1
    allocation and the transfer into it). The rest of the call (key hashing, bookkeeping) is what is left of it."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(_STOCK_STAGES, 0.0)
        self.lock = threading.Lock()

    def wrap(self, storage_manager: Any) -> None:
        for stage, name in _STOCK_STAGES.items():
            orig = getattr(storage_manager, name)

            def timed(*a: Any, _orig: Any = orig, _stage: str = stage, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **k)
                finally:
                    dt = time.perf_counter() - t0
                    with self.lock:
                        self.seconds[_stage] += dt

            setattr(storage_manager, name, timed)


class ContiguousDestination:
    """One contiguous buffer per rank in LMCache's object layout (``[chunks, 2, layers, chunk tokens, heads *
    head_size]``): each retrieved chunk lands with one plain copy, no paging, no permute. Verified afterwards by
    replaying the buffer into the paged KV through the paged connector (outside the clock) and hashing that."""

    def __init__(self, rk: Any, n_tokens: int) -> None:
        import torch

        self.rk = rk
        self.cs = rk.reg.chunk_size
        shape = rk.connector.get_shape(self.cs)
        dtype = rk.kvcaches[0].dtype
        self.buf = torch.zeros((-(-n_tokens // self.cs), *shape), dtype=dtype)  # written once: no first-touch
        self.paged_to_gpu = rk.connector.to_gpu

    def install(self) -> None:
        """Route the connector's installs into the buffer (before InstallMeter wraps them)."""

        def to_gpu(memory_obj: Any, start: int, end: int, **_: Any) -> None:
            self.buf[start // self.cs, :, :, : end - start].copy_(memory_obj.tensor)

        self.rk.connector.to_gpu = to_gpu

    def replay_into_paged(self, n_tokens: int, slots: Any) -> None:
        from types import SimpleNamespace

        for c in range(self.buf.shape[0]):
            s, e = c * self.cs, min(n_tokens, (c + 1) * self.cs)
            obj = SimpleNamespace(tensor=self.buf[c, :, :, : e - s])
            self.paged_to_gpu(obj, s, e, kvcaches=self.rk.kvcaches, slot_mapping=slots)


def _tokens(case: PeerCase) -> list[int]:
    from bsr_cli.core.keys import synthetic_tokens

    return list(synthetic_tokens(int(case["tokens"]), seed=int(case["seed"])))


def run_store(host: Any, case: PeerCase) -> dict[str, object]:
    """The synthetic KV computed into each rank's blocks, then stored through LMCache a few chunks at a time (L1
    holds what one store call stages, not the prompt), each step waited for until Mooncake serves it."""
    from bsr_cli.core.keys import chunk_hashes

    toks = _tokens(case)
    n = len(toks)
    t0 = time.perf_counter()
    stored = 0
    for r in range(len(host.ranks)):
        rk = host.rank(r)
        cs = rk.reg.chunk_size
        step = max(1, int(case["l1_bytes"]) // rk.chunk_bytes - 1)
        table = list(range(-(-n // rk.reg.groups[0].block_size)))
        rk.kv.prefill(chunk_hashes(toks, cs), n, 0, {rk.group: table})
        for c in range(0, n // cs, step):
            stored += rk.store_tokens(toks[: min(n, (c + step) * cs)], table, skip_chunks=c)
    return {
        "seconds": round(time.perf_counter() - t0, 4),
        "objects": stored,
        "ok": stored == n // host.reg.chunk_size * len(host.ranks),
    }


def run_bsr(host: Any, case: PeerCase, meter: CpuMeter) -> dict[str, object]:
    from bsr_cli.core.events import Event, RestoreEnded
    from bsr_cli.core.evidence import Outcome
    from bsr_cli.core.keys import chunk_hashes
    from bsr_cli.core.results import ManualRestoreResult

    toks = _tokens(case)
    c = host.coordinator
    # The store step (another process) put this prompt's synthetic KV in the tiers: the canonical hash applies.
    c.vouch_for(chunk_hashes(toks, host.reg.chunk_size)[: len(toks) // host.reg.chunk_size])
    c.reset_peak()
    cpu: dict[str, float] = {}
    decided: list[float] = []

    def progress(ev: Event) -> None:
        # The commit decision: time and CPU up to here are the restore's (probe, plan, every window); the hashes
        # verified after it are not.
        decides = (Outcome.COMMITTED, Outcome.FAILED_CLOSED)
        if isinstance(ev, RestoreEnded) and ev.outcome in decides and not decided:
            decided.append(time.perf_counter())
            cpu.update(meter.stop())

    meter.start()
    t0 = time.perf_counter()
    res: ManualRestoreResult = c.restore(toks, w=int(case["W"]), progress=progress)
    wall = (decided[0] if decided else time.perf_counter()) - t0
    if not cpu:
        cpu.update(meter.stop())
    hashes = res.hashes.hash_ok if res.hashes is not None else None
    report = res.report
    from bsr_cli.core.stage_costs import StageCosts

    staged = StageCosts.total([o.stages for o in (report.ranks if report is not None else ()) if o.stages])
    ranks = [
        {
            "rank": o.rank,
            "ok": o.ok,
            "l1_peak_bytes": o.peak_live_bytes,
            "bytes": o.bytes_restored,
            "fetch_seconds": round(float(o.fetch_seconds), 4),
            "seconds": round(float(o.seconds), 4),
        }
        for o in (report.ranks if report is not None else ())
    ]
    return {
        "outcome": res.outcome.value,
        "loaded_tokens": res.committed_tokens,
        "windows": report.windows if report is not None else 0,
        # From the call (probe included, as stock's retrieve includes its own lookup) to the commit decision.
        "seconds": round(wall, 4),
        "windows_seconds": round(float(report.seconds), 4) if report is not None else 0.0,
        "l1_peak_bytes": max((r["l1_peak_bytes"] for r in ranks), default=0),
        "l1_capacity_bytes": host.rank(0).tracker.heap_bytes,
        "ranks": ranks,
        "failures": [f.to_wire() for f in report.failures] if report is not None else [],
        "hash_ok": hashes,
        "cpu": cpu,
        # The window install (bsr's own copy, or the connector's where a window's objects are not at one stride).
        "install_cpu_seconds": round(staged.install.cpu_s, 4),
        # By stage, summed over the ranks; the process's CPU is the case process's (every rank's thread in it).
        "stage_costs": dict(staged.with_process_cpu(cpu.get("process", 0.0)).rounded().to_wire()),
        "timed_out": False,
        "ok": res.outcome is Outcome.COMMITTED and hashes is True,
    }


class _StockRank(TypedDict):
    """One rank's part of stock's retrieve."""

    rank: int
    loaded_tokens: int
    seconds: float
    l1_peak_bytes: int
    error: str | None


def run_stock(host: Any, case: PeerCase, meter: CpuMeter, install: InstallMeter) -> dict[str, object]:
    from lmcache_bsr import _lmcache as lm

    toks = _tokens(case)
    n = len(toks)
    ranks = [host.rank(r) for r in range(len(host.ranks))]
    bs = ranks[0].reg.groups[0].block_size
    table = list(range(-(-n // bs)))
    contiguous: list[ContiguousDestination] = case.get("_contiguous") or []
    clock, transfers = _stock_meters(ranks)
    lookup_s = _untimed_lookup(ranks, toks, clock) if contiguous else 0.0
    results: list[_StockRank | None] = [None for _ in ranks]
    barrier = threading.Barrier(len(ranks))

    def work(i: int) -> None:
        rk = ranks[i]
        slots = rk.slots(table, n)
        rk.tracker.reset()
        barrier.wait()
        t0 = time.perf_counter()
        try:
            ret = lm.stock_retrieve(rk.engine, toks, kvcaches=rk.kvcaches, slot_mapping=slots)
            got, err = int(ret.sum()), None
        except Exception as e:  # noqa: BLE001 - LMCache's failure is the measurement
            got, err = 0, f"{type(e).__name__}: {e}"
        results[i] = {
            "rank": rk.rank,
            "loaded_tokens": got,
            "seconds": round(time.perf_counter() - t0, 4),
            "l1_peak_bytes": rk.tracker.peak,
            "error": err,
        }

    deadline = float(case.get("deadline_s", 10.0))
    for rk in ranks:
        rk.kv.invalidate({rk.group: table})
    meter.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline * 3 + 30 - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    stuck = any(t.is_alive() for t in threads)
    loaded = min((r["loaded_tokens"] if r is not None else 0 for r in results), default=0)
    timed_out = stuck or (loaded < n and wall >= deadline)
    hash_ok = _stock_hash_ok(ranks, contiguous, toks, table) if loaded == n and not stuck else None
    return {
        "outcome": "loaded" if loaded == n else ("timed_out" if timed_out else "short"),
        "loaded_tokens": loaded,
        "windows": 1,
        "seconds": round(max((r["seconds"] or wall if r is not None else wall for r in results), default=wall), 4),
        "wall_seconds": round(wall, 4),
        "l1_peak_bytes": max((int(r["l1_peak_bytes"]) if r is not None else 0 for r in results), default=0),
        "l1_capacity_bytes": ranks[0].tracker.heap_bytes,
        "ranks": [r for r in results if r is not None],
        "hash_ok": hash_ok,
        "cpu": cpu,
        "install_cpu_seconds": round(install.seconds, 4),
        "stage_costs": transfers.stage_costs(cpu, install),
        # Summed over the ranks; with TP 1 they add up to the call's time, less its key hashing and bookkeeping.
        "stage_seconds": {
            **{k: round(v, 4) for k, v in clock.seconds.items()},
            "install": round(install.wall_seconds, 4),
        },
        "destination": "contiguous" if contiguous else "paged",
        "untimed_lookup_seconds": round(lookup_s, 4) if contiguous else None,
        "timed_out": timed_out,
        "stuck_thread": stuck,
        "ok": loaded == n and hash_ok is True,
    }


def _untimed_lookup(ranks: list[Any], toks: list[int], clock: StageClock) -> float:
    """Stock with every advantage bsr's restore has, or an independent benchmark gave it: the transfer calls'
    completion poll at bsr's lower priority (equal to the process's when it already runs at nice 10), and
    LMCache's lookup first, outside the clock, as a serving engine's scheduler does before its worker retrieves (it
    also warms the master RPC path the retrieve then uses). The lookup's seconds; the stage clock starts afresh."""
    from lmcache_bsr import _lmcache as lm

    t0 = time.perf_counter()
    for rk in ranks:
        lm.lower_transfer_priority(rk.engine)
        rk.engine.lookup(torch_tokens(toks))
    lookup_s = time.perf_counter() - t0
    clock.seconds = dict.fromkeys(clock.seconds, 0.0)
    return lookup_s


def _stock_hash_ok(
    ranks: list[Any], contiguous: list[ContiguousDestination], toks: list[int], table: list[int]
) -> bool:
    """Whether every rank's KV hashes as the prompt's canonical KV (a contiguous destination replayed into the
    paged KV first, outside the clock)."""
    from bsr_cli.core.keys import chunk_hashes

    n = len(toks)
    for dest, rk in zip(contiguous, ranks, strict=False):
        dest.replay_into_paged(n, rk.slots(table, n))  # the contiguous bytes, checked as the paged ones are
    hashes = chunk_hashes(toks, ranks[0].reg.chunk_size)
    return all(rk.kv.output_hash({rk.group: table}, n) == rk.kv.canonical_hash(hashes, n) for rk in ranks)


def _stock_meters(ranks: list[Any]) -> tuple[StageClock, TransferMeter]:
    """Stock's retrieve timed by stage, and its transfer calls' thread CPU, on every rank."""
    from lmcache_bsr import _lmcache as lm

    clock, transfers = StageClock(), TransferMeter()
    for rk in ranks:
        clock.wrap(rk.engine.storage_manager)
        conn = lm.mooncake_connector(rk.engine)
        if conn is not None:
            transfers.wrap(conn)
    return clock, transfers


def torch_tokens(toks: list[int]) -> Any:
    import torch

    return torch.tensor(toks, dtype=torch.long)


def run_raw(host: Any, case: PeerCase, meter: CpuMeter) -> dict[str, object]:
    """batch_get_into of the objects LMCache stored for this prompt, one raw Mooncake client per rank, all at
    once: the rate a caller of the store gets for the same bytes, without LMCache or bsr."""
    import torch
    from mooncake.store import MooncakeDistributedStore

    from lmcache_bsr import _lmcache as lm

    toks = _tokens(case)
    mc = case["master"]
    clients: list[Any] = []
    bufs: list[torch.Tensor] = []
    try:
        jobs = []
        for r in range(len(host.ranks)):
            rk = host.rank(r)
            keys = [lm.key_string(k) for k in rk.keys(toks)]
            store = MooncakeDistributedStore()
            rc = store.setup("127.0.0.1", mc["metadata_url"], 0, 0, "tcp", "", mc["rpc_address"])
            if rc != 0:
                raise RuntimeError(f"raw Mooncake client setup failed with code {rc}")
            clients.append(store)
            sizes = [int(store.get_size(k)) for k in keys]
            if any(s <= 0 for s in sizes):
                raise RuntimeError(f"{sum(s <= 0 for s in sizes)} of {len(keys)} objects are not in the store")
            # Touched before the clock starts, as LMCache's L1 is (the kernel would otherwise fault pages in during
            # the GET and charge that to the transport).
            buf = torch.empty(sum(sizes), dtype=torch.uint8).fill_(1)
            bufs.append(buf)
            store.register_buffer(buf.data_ptr(), buf.numel())
            ptrs, off = [], buf.data_ptr()
            for s in sizes:
                ptrs.append(off)
                off += s
            jobs.append((store, keys, ptrs, sizes))
        barrier = threading.Barrier(len(jobs))
        spans: list[tuple[float, float, int]] = [(0.0, 0.0, 0)] * len(jobs)
        transfers = TransferMeter()

        def work(i: int) -> None:
            store, keys, ptrs, sizes = jobs[i]
            get = transfers.timed(store.batch_get_into)
            barrier.wait()
            t0 = time.perf_counter()
            bad = 0
            for lo in range(0, len(keys), 1024):
                rcs = get(keys[lo : lo + 1024], ptrs[lo : lo + 1024], sizes[lo : lo + 1024])
                bad += sum(1 for rc, s in zip(rcs, sizes[lo : lo + 1024], strict=True) if rc != s)
            spans[i] = (t0, time.perf_counter(), bad)

        meter.start()
        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu = meter.stop()
        wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
        bad = sum(b for _, _, b in spans)
        return {
            "outcome": "loaded" if not bad else "short",
            "loaded_tokens": 0 if bad else len(toks) // host.reg.chunk_size * host.reg.chunk_size,
            "bytes_per_rank": sum(jobs[0][3]),
            "seconds": round(wall, 4),
            "wall_seconds": round(wall, 4),
            "l1_peak_bytes": 0,
            "ranks": [
                {"rank": i, "seconds": round(e - s, 4), "failed_objects": b} for i, (s, e, b) in enumerate(spans)
            ],
            "cpu": cpu,
            "install_cpu_seconds": 0.0,
            "stage_costs": transfers.stage_costs(cpu),
            "timed_out": False,
            "ok": not bad,
        }
    finally:
        for store in clients:
            with contextlib.suppress(Exception):  # closing after the measurement; nothing left to report
                store.close()


def prefault(rk: Any) -> None:
    """Touch the destination KV and LMCache's L1 buffer before any clock starts: a serving process has written
    both long before a restore, and a fresh process would otherwise charge first-touch page faults to whichever
    side touches more new memory (stock's whole-plan L1 against bsr's one window)."""
    import torch

    for t in rk.kvcaches:
        t.zero_()
    buf = getattr(rk.tracker.allocator, "buffer", None)  # the L1 tensor PeakTracker already watches
    if isinstance(buf, torch.Tensor) and buf.numel():
        buf.zero_()


def run_case(case: PeerCase) -> tuple[dict[str, object], bool]:
    """(result, clean): clean is False when a thread may still spin inside LMCache (do not destroy the engine)."""
    from lmcache_bsr.host import LMCacheHost

    t0 = time.perf_counter()
    host = LMCacheHost(host_config(case))
    setup_s = time.perf_counter() - t0
    clean = True
    try:
        install = InstallMeter()
        if case["mode"] == "stock" and case.get("destination") == "contiguous":
            case["_contiguous"] = [
                ContiguousDestination(host.rank(r), int(case["tokens"])) for r in range(len(host.ranks))
            ]
            for dest in case["_contiguous"]:
                dest.install()
        for r in range(len(host.ranks)):
            install.wrap(host.rank(r).connector)
            prefault(host.rank(r))
        meter = CpuMeter({k: int(v) for k, v in (case.get("watch_pids") or {}).items()})
        mode = case["mode"]
        profile_dir = os.environ.get("BSR_PEER_PROFILE")
        if profile_dir and mode in ("bsr", "stock"):
            # A cProfile of the measured operation, for finding where CPU goes (times are inflated by the profiler).
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
            try:
                res = run_bsr(host, case, meter) if mode == "bsr" else run_stock(host, case, meter, install)
            finally:
                prof.disable()
                prof.dump_stats(str(Path(profile_dir) / f"{mode}-{case['tokens']}-{os.getpid()}.prof"))
            clean = not res.get("timed_out")
        elif mode == "store":
            res = run_store(host, case)
        elif mode == "bsr":
            res = run_bsr(host, case, meter)
        elif mode == "stock":
            res = run_stock(host, case, meter, install)
            clean = not res["timed_out"]
        elif mode == "raw":
            res = run_raw(host, case, meter)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        res["setup_seconds"] = round(setup_s, 3)
        res["nice"] = os.getpriority(os.PRIO_PROCESS, 0)  # the case process's (bsr's transfer threads add 10)
        return res, clean
    finally:
        if clean:
            host.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lmcache_bsr.peer CASE.json", file=sys.stderr)
        return 2
    case = json.loads(Path(argv[0]).read_text())
    try:
        res, clean = run_case(case)
    except Exception as e:  # noqa: BLE001 - reported to the parent as the case's error
        res, clean = {"ok": False, "error": f"{type(e).__name__}: {e}"}, True
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    if not clean:
        # LMCache's storage loop still spins on the allocator: destroying the engine would wait for it forever.
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
