"""One TP rank of the BSR runtime over a real LMCache engine, and the in-process RankClient that drives it.

Each rank owns an LMCache engine (its storage backends are bsr's tiers: LocalDiskBackend = "fs",
RemoteBackend/Mooncake = "mooncake"), a CPU paged destination KV (bsr's PagedKV: the same synthetic model and
hashes as the embedded engine, so ``bsr submit`` verifies outputs) and the LMCache connector between them.

Ranks are threads, not processes: the coordinator is in-process, LMCache's engine registry supports several
engines per process, importing LMCache costs 3-6 s and ~340 MiB per process, and the heavy work (torch copies,
Mooncake transfers, object checksums) releases the GIL. Inside vLLM each worker process already is one rank and
hosts exactly one ``LMCacheRank`` (see docs/deployment.md).

``LMCacheRank`` serves the rank-ops contract (bsr_cli.api.ranks.RankOps) as bsr_cli/engine/worker.py does, so
bsr's Coordinator drives it unchanged; ``ThreadRank`` runs its typed requests on threads.

Over 500 lines on purpose: a request's window steps (``_RestoreRun``: admit, fetch ahead, check, install, give back
to L1) and the budget, lock and cleanup that keep it fail-closed must be read together.

Admission is per window, under the budget B (``L1Budget``): a window's bytes are admitted before its fetch is issued
and given back once it is installed, first come first served across requests, so restores overlap window by window
as they do in the embedded engine. The engine lock is held only around the LMCache calls that write through the
connector (a window's install, a store), never across windows: a second request waits for one window, not for the
whole first restore.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from bsr_cli.api.jobs import ObjectRef
from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    RankOps,
    RankRequest,
    RemoveAllRequest,
    RemoveAllResult,
    ResetPeakRequest,
    ResetPeakResult,
    RestoreJob,
    RestoreRequest,
    RestoreResult,
    ScrubRequest,
    ScrubResult,
    SetBudgetRequest,
    SetBudgetResult,
    SetFsConcurrencyRequest,
    SetFsConcurrencyResult,
    StatsRequest,
    StatsResult,
    StoreRequest,
    StoreResult,
    TierStatus,
    UnsupportedOp,
    WindowJob,
    dispatch,
)
from bsr_cli.core.bitmap import encode_row
from bsr_cli.core.events import Event, WindowFetched, WindowStepped
from bsr_cli.core.evidence import CapacityCause, Stage, TimedStage, WindowStep
from bsr_cli.core.keys import parse_key
from bsr_cli.core.registration import Registration
from bsr_cli.errors import BadRequest, CapacityError
from bsr_cli.mooncake.health import health_url_for, master_healthy
from bsr_cli.runtime import failures
from bsr_cli.runtime.faulty import ArmedFaults, WindowStage
from bsr_cli.runtime.kv_ops import KVOps
from bsr_cli.runtime.paged_kv import PagedKV
from bsr_cli.runtime.rank_host import AbortSignals, RankHost
from bsr_cli.runtime.restore import RankOutcome, RestoreFailed, aborted, run_windows
from bsr_cli.runtime.stage_clock import StageClock
from bsr_cli.runtime.transport_share import ShareTicket, TransportShare

from . import _lmcache as lm
from . import integrity
from .tokens import TokenRegistry, full_chunks
from .window import MooncakeWindows, WindowFetch, fetch_window, install_window

Emit = Callable[[Event], None]
R = TypeVar("R")
VISIBLE_DEADLINE_S = 10.0  # remote/disk puts must be readable within this; a full segment never gets there
# Fetches one restore runs ahead of its install, and in flight on one rank: two restores' windows at once.
FETCHES_AHEAD = 2
FETCHES_IN_FLIGHT = 2 * FETCHES_AHEAD
RETRIEVE_GRACE_S = 30.0  # after a window's deadline, how long a still-running LMCache fetch may take to end


class L1Budget:
    """The admission budget B over a rank's LMCache L1, in bytes: a window is admitted before its fetch is issued
    and given back once installed (or when its restore ends). Waiters are served in arrival order; a fetch issued
    ahead (``try_admit``) never jumps the queue, so two restores under B = 2 RWS alternate window by window."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0  # the most admitted at once since the last reset_peak
        self.windows = 0
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()

    @property
    def waiters(self) -> int:
        with self._cond:
            return len(self._queue)

    def set_budget(self, budget_bytes: int) -> None:
        with self._cond:
            self.budget_bytes = budget_bytes
            self._cond.notify_all()

    def try_admit(self, nbytes: int) -> bool:
        """Admit now if B has room and nobody waits (a fetch ahead); never waits."""
        with self._cond:
            if self._queue or self.live_bytes + nbytes > self.budget_bytes:
                return False
            self._admitted(nbytes)
            return True

    def admit(self, nbytes: int, deadline: float, abort: threading.Event) -> bool:
        """Wait in line until B has room for ``nbytes`` (True), the deadline passes or the restore is aborted
        (False; ``abort.is_set()`` says which). ``wake`` ends the wait of an aborted one at once."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self.live_bytes + nbytes <= self.budget_bytes):
                    left = deadline - time.monotonic()
                    if abort.is_set() or left <= 0:
                        return False
                    self._cond.wait(left)
                self._admitted(nbytes)
                return True
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _admitted(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.windows += 1

    def reset_peak(self) -> None:
        with self._cond:
            self.peak_bytes = self.live_bytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.live_bytes -= nbytes
            self.windows -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


def _transfer_threads(rank: int) -> ThreadPoolExecutor:
    """The threads a rank's window transfers run on: at lower priority, so that the store's completion poll on them
    yields the CPU to the transfer itself and to the install (as LMCache's own transfer threads do under bsr's
    restore: lm.lower_transfer_priority)."""
    return ThreadPoolExecutor(
        max_workers=FETCHES_IN_FLIGHT, thread_name_prefix=f"bsr-lmc-io{rank}", initializer=lm.lower_this_thread
    )


def _one_tier(objs: list[ObjectRef], win: WindowJob) -> str | None:
    """The tier a window's objects come from, when it is one (a failure is then blamed on it)."""
    tiers = {objs[c].tier for c in range(win.chunk_start, win.chunk_end)}
    return next(iter(tiers)) if len(tiers) == 1 else None


def _layer_shape(reg: Registration) -> tuple[int, int, str]:
    """(kv_heads, head_size, dtype) of the registration's layers; refused unless LMCache can hold them: one KV
    group, one [2, kv_heads, head_size] tensor per layer, all one dtype."""
    if len(reg.groups) != 1:
        raise BadRequest(
            f"LMCache keeps one KV layout per engine; this registration has {len(reg.groups)} KV groups",
            hint="register a single KV group for the LMCache host",
        )
    shapes = {t.shape for t in reg.tensors}
    dtypes = {t.dtype for t in reg.tensors}
    if len(shapes) != 1 or len(dtypes) != 1 or len(next(iter(shapes))) != 3 or next(iter(shapes))[0] != 2:
        raise BadRequest("the LMCache host needs one [2, kv_heads, head_size] tensor per layer, all one dtype")
    _, heads, head_size = next(iter(shapes))
    return heads, head_size, next(iter(dtypes))


def _rank_disk(local_disk: object, rank: int) -> str:
    """Each rank its own directory: one LocalDiskBackend per engine, each with its own in-memory index."""
    d = Path(str(local_disk)) / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    return str(d) + "/"


def _healthy_master(metadata_server: object, *, remote: bool) -> str | None:
    """The health URL of the Mooncake master a remote backend uses (None without one), refused when that master is
    not healthy: LMCache's Mooncake setup against a dead master stalls ~90 s and then builds a broken engine
    anyway."""
    url = health_url_for(str(metadata_server)) if metadata_server and remote else None
    if url and not master_healthy(url, timeout=2.0):
        raise CapacityError(
            f"the Mooncake master at {url} is not healthy; refusing to build the LMCache engine",
            hint="start mooncake_master (and a segment holder) first, or drop remote_url",
        )
    return url


class LMCacheRank(RankHost):
    def __init__(
        self,
        rank: int,
        reg: Registration,
        lmcache_config: lm.LMCacheConfig,
        *,
        kv_tokens: int,
        registry: TokenRegistry,
        emit: Emit,
        budget_bytes: int = 0,
        instance_prefix: str = "bsr",
    ) -> None:
        heads, head_size, dtype = _layer_shape(reg)
        self.rank = rank
        self.reg = reg
        self.group = reg.group_names[0]
        self.registry = registry
        self.emit = emit
        self.layers = len(reg.tensors)
        cfg = lmcache_config.copy()
        cfg["chunk_size"] = reg.chunk_size
        if cfg.get("local_disk"):
            cfg["local_disk"] = _rank_disk(cfg["local_disk"], rank)
        self.disk_dir = cfg.get("local_disk")
        extra = cfg.get("extra_config") or lm.MooncakeExtraConfig()
        remote = bool(cfg.get("remote_url"))
        self.health_url = _healthy_master(extra.get("mooncake_metadata_server"), remote=remote)
        self.connector = lm.CPUPagedConnector(self.layers, heads, head_size)
        self.instance_id = f"{instance_prefix}-rank{rank}-{id(self):x}"
        self.engine = lm.build_engine(
            self.instance_id,
            cfg,
            model=reg.model,
            world_size=reg.tp_size,
            worker_id=rank,
            num_layers=self.layers,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=dtype,
            connector=self.connector,
        )
        self._destroyed = False
        try:
            # The hot-cache write-back would keep every retrieved chunk in L1 (beyond the window bound).
            lm.disable_hot_cache(self.engine)
            self.tracker = lm.PeakTracker(self.engine)
            # A checksum beside every chunk stored in Mooncake, verified on every load (lmcache_bsr/integrity.py).
            self.checksums = (
                integrity.install(self.engine, load_unverified=bool(extra.get("bsr_load_unverified", False)))
                if extra.get("bsr_checksums", True)
                else None
            )
            self.windows = MooncakeWindows.of(self.engine, self.checksums)  # a window: one transfer into L1
            blocks = {self.group: -(-kv_tokens // reg.groups[0].block_size)}
            self.kv = PagedKV(reg, rank, blocks, torch.device("cpu"))
            self.kv_ops = KVOps(self.kv)
        except BaseException:
            self.close()
            raise
        self.kvcaches = [self.kv.tensors[t.name] for t in reg.tensors]
        self.tiers = {name for name, be in lm.TIER_BACKENDS.items() if be in lm.backends(self.engine)}
        self.tiers.discard("cpu")  # L1 is staging only (hot cache off), never a tier
        self.l1 = L1Budget(budget_bytes or self.tracker.heap_bytes)  # B: admission of windows across requests
        self.lock = threading.Lock()  # one LMCache write through the connector (an install or a store) at a time
        self._waiters = 0  # threads waiting for ``lock`` (counted under ``_count_lock``: += is not atomic)
        self._count_lock = threading.Lock()
        self.aborts = AbortSignals()
        self._written: set[str] = set()  # remote keys this rank stored: waited for before destroy
        self._io = _transfer_threads(rank)
        self._health_cache: tuple[float, dict[str, TierStatus]] = (0.0, {})

    # -- helpers -----------------------------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self.l1.budget_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.reg.bytes_per_chunk

    def slots(self, block_table: list[int], n_tokens: int) -> torch.Tensor:
        return self.kv.rows(self.group, block_table, n_tokens)

    def keys(self, tokens: tuple[int, ...] | list[int]) -> list[Any]:
        return [k for _, _, k in lm.chunk_keys(self.engine, tokens)]

    def pool_stats(self) -> dict[str, int]:
        """The restore pool as every engine reports it: live and peak are the restore windows' bytes, the ones B
        bounds. LMCache's L1 also stages what LMCache stores (freed a while after the objects are written), so its
        own totals, the process's real memory, come beside them (``l1_live_bytes``, ``l1_peak_bytes``): an L1 above
        B right after a store is LMCache's, not a window over budget."""
        return {
            "capacity_bytes": self.tracker.heap_bytes,
            "budget_bytes": self.budget_bytes,
            "slot_bytes": self.chunk_bytes,
            "live_bytes": self.l1.live_bytes,
            "peak_bytes": self.l1.peak_bytes,
            "l1_live_bytes": self.tracker.live,
            "l1_peak_bytes": self.tracker.peak,
            "windows_live": self.l1.windows,
            "waiters": self.l1.waiters + self._waiters,
        }

    @contextlib.contextmanager
    def _engine_lock(self) -> Any:
        self._acquire()
        try:
            yield
        finally:
            self.lock.release()

    def master_ok(self) -> bool:
        return self.health_url is None or master_healthy(self.health_url, timeout=1.0)

    # -- direct API (tests, the vLLM worker) -------------------------------------------------------------------
    def store_tokens(self, tokens: list[int] | tuple[int, ...], block_table: list[int], skip_chunks: int = 0) -> int:
        """Store the full chunks of ``tokens`` from the blocks through LMCache; wait until they are readable."""
        n = full_chunks(len(tokens), self.reg.chunk_size) * self.reg.chunk_size
        if n <= skip_chunks * self.reg.chunk_size:
            return 0
        toks = list(tokens[:n])
        with self._engine_lock():
            lm.store(
                self.engine,
                toks,
                skip_chunks * self.reg.chunk_size,
                kvcaches=self.kvcaches,
                slot_mapping=self.slots(block_table, n),
            )
        keys = self.keys(toks)[skip_chunks:]
        errors = self.wait_visible(keys)
        if errors:
            raise RuntimeError("; ".join(f"{t}: {e}" for t, e in errors.items()))
        return len(keys)

    def wait_visible(self, keys: list[Any]) -> dict[str, str]:
        """Puts are asynchronous in LMCache: wait (with a deadline) until every tier can serve them."""
        errors: dict[str, str] = {}
        if "mooncake" in self.tiers:
            names = [lm.key_string(k) for k in keys]
            self._written.update(names)
            if not lm.wait_remote_visible(self.engine, names, VISIBLE_DEADLINE_S):
                errors["mooncake"] = f"puts not visible within {VISIBLE_DEADLINE_S:g}s (segment full or down?)"
            else:
                self._written.difference_update(names)
        if "fs" in self.tiers:
            deadline = time.monotonic() + VISIBLE_DEADLINE_S
            while not all(lm.disk_contains(self.engine, keys)):
                if time.monotonic() >= deadline:
                    errors["fs"] = f"disk writes not indexed within {VISIBLE_DEADLINE_S:g}s"
                    break
                time.sleep(0.005)
        return errors

    def presence(self, tokens: tuple[int, ...] | list[int], tiers: list[str]) -> tuple[dict[str, list[bool]], dict]:
        """Per tier, per full chunk: does the tier hold this rank's object. No pins, no LRU touch, no bytes."""
        keys = self.keys(tokens)
        out: dict[str, list[bool]] = {}
        errors: dict[str, str] = {}
        for name in tiers:
            if name not in self.tiers:
                continue
            try:
                if name == "fs":
                    out[name] = lm.disk_contains(self.engine, keys)
                elif name == "mooncake":
                    if not self.master_ok():
                        # Asking a dead master costs ~4.5 s per call and answers -900: say so instead.
                        raise ConnectionError(f"Mooncake master unreachable ({self.health_url})")
                    out[name] = lm.remote_exists(self.engine, keys)
            except Exception as e:  # noqa: BLE001 - an unreachable tier holds nothing, and says why
                errors[name] = f"{type(e).__name__}: {e}"
                out[name] = [False] * len(keys)
        return out, errors

    # -- ops (bsr_cli.api.ranks.RankOps) ----------------------------------------------------------------------------
    def probe(self, req: ProbeRequest) -> ProbeResult:
        tokens = self.registry.tokens_for(req.hashes)
        held, errors = self.presence(tokens, req.tiers)
        return ProbeResult({self.group: encode_row(held, req.tiers, len(req.hashes))}, errors)

    def store(self, req: StoreRequest) -> StoreResult:
        """LMCache stores to every backend at once (it cannot target one tier): store from the first chunk any
        requested tier lacks."""
        tokens = self.registry.tokens_for(req.hashes)[: req.n_tokens]
        nfull = full_chunks(len(tokens), self.reg.chunk_size)
        wanted = {t: [c for c in idx if c < nfull] for t, idx in req.chunks.items() if t in self.tiers}
        lacking = sorted({c for idx in wanted.values() for c in idx})
        if not lacking:
            return StoreResult(dict.fromkeys(wanted, 0))
        first = lacking[0]
        try:
            with self._engine_lock():
                lm.store(
                    self.engine,
                    list(tokens[: nfull * self.reg.chunk_size]),
                    first * self.reg.chunk_size,
                    kvcaches=self.kvcaches,
                    slot_mapping=self.slots(req.block_tables[self.group], nfull * self.reg.chunk_size),
                )
        except Exception as e:  # noqa: BLE001 - a failed store loses reuse, not the request
            return StoreResult(dict.fromkeys(wanted, 0), {t: f"{type(e).__name__}: {e}" for t in wanted})
        errors = self.wait_visible(self.keys(tokens)[first:nfull])
        return StoreResult({t: 0 if t in errors else len(idx) for t, idx in wanted.items()}, errors)

    def restore(self, req: RestoreRequest) -> RestoreResult:
        job = req.job
        job.validate([self.group])
        with self.aborts.held(job.request_id) as abort:
            return _RestoreRun(self, job, abort).run()

    def _verify_step(self, keys: list[Any], first_chunk: int, window: int) -> None:
        """A window came back short: when a chunk of it failed its checksum (or had none, and unverified chunks are
        refused), the tier is blamed at the verify stage, naming the chunk."""
        assert self.checksums is not None
        findings = self.checksums.take(keys)
        bad = next((f for f in findings if f.dropped), None)
        if bad is None:
            return
        chunk = first_chunk + integrity.chunk_of(keys, bad.key)  # type: ignore[operator]
        raise RestoreFailed(bad.describe(chunk), window, kind=failures.TIER, stage=Stage.VERIFY, tier=bad.tier)

    def _acquire(self) -> None:
        with self._count_lock:
            self._waiters += 1
        try:
            self.lock.acquire()
        finally:
            with self._count_lock:
                self._waiters -= 1

    def stats(self, req: StatsRequest) -> StatsResult:
        tiers: dict[str, TierStatus] | None = None
        if req.health:
            at, cached = self._health_cache
            if time.monotonic() - at > 1.0:
                cached = {}
                if "fs" in self.tiers:
                    ok = bool(self.disk_dir) and Path(str(self.disk_dir)).is_dir()
                    cached["fs"] = TierStatus(ok, f"LMCache LocalDiskBackend at {self.disk_dir}")
                if "mooncake" in self.tiers:
                    ok = self.master_ok()
                    cached["mooncake"] = TierStatus(
                        ok, f"LMCache RemoteBackend; master {self.health_url} {'healthy' if ok else 'DOWN'}"
                    )
                self._health_cache = (time.monotonic(), cached)
            tiers = dict(cached)
        return StatsResult(self.rank, self.pool_stats(), tiers)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        self.tracker.reset()
        self.l1.reset_peak()
        return ResetPeakResult()

    def set_budget(self, req: SetBudgetRequest) -> SetBudgetResult:
        self.l1.set_budget(min(int(req.budget_bytes), self.tracker.heap_bytes))
        return SetBudgetResult(self.pool_stats())

    def set_fs_concurrency(self, req: SetFsConcurrencyRequest) -> SetFsConcurrencyResult:
        raise UnsupportedOp(
            req.op,
            "fs concurrency cannot be set over LMCache: its LocalDiskBackend runs its own I/O workers",
            hint="configure LMCache's disk backend instead (see docs/deployment.md)",
        )

    def remove_all(self, req: RemoveAllRequest) -> RemoveAllResult:
        raise UnsupportedOp(req.op, "removing objects is not supported over LMCache from bsr; use LMCache's own tools")

    def scrub(self, req: ScrubRequest) -> ScrubResult:
        raise UnsupportedOp(
            req.op,
            "scrubbing is not served over LMCache: its backends cannot read an object back and check it for bsr",
            hint="a load from LMCache's Mooncake tier is verified as it arrives (bsr_checksums)",
        )

    # -- lifetime ----------------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.l1.wake()  # a restore waiting for room in B ends now

    def close(self) -> None:
        """Wait for remote puts, then destroy the engine (both guard LMCache crashes: segfault with puts in
        flight, a process that never exits without destroy)."""
        if self._destroyed:
            return
        self._destroyed = True
        with contextlib.suppress(Exception):  # best effort: the engine is destroyed either way
            if self._written and self.master_ok():
                lm.wait_remote_visible(self.engine, sorted(self._written), VISIBLE_DEADLINE_S)
        io = getattr(self, "_io", None)
        if io is not None:
            io.shutdown(wait=True, cancel_futures=True)
        lm.destroy_engine(self.instance_id)


# Fetches issued and not yet consumed, in window order: (its place in the share of the transport, the fetch, the bytes
# admitted under B for it).
_Ahead = tuple[ShareTicket, Future[WindowFetch], int]


class _RestoreRun:
    """One request's restore on an LMCacheRank, window by window: admit a window under B, fetch it into L1 (one
    Mooncake transfer, ``window.py``; the next windows' fetches issued while B has room, see ``_run_ahead``),
    check every object against its checksum and that the window loaded whole, install it (one copy per layer),
    give its objects back to L1 and its bytes back to B. Armed faults wrap its parts (bsr_cli/runtime/faulty.py)."""

    def __init__(self, rank: LMCacheRank, job: RestoreJob, abort: threading.Event) -> None:
        self.rank = rank
        self.job = job
        self.abort = abort
        self.windows = list(job.windows)
        self.objs: list[ObjectRef] = []
        self.keys: list[Any] = []  # LMCache's key of every planned chunk, computed once for the request
        self.slot_mapping: torch.Tensor | None = None
        self.bounded = job.w > 0
        self.timeout_s = float(job.fetch_timeout_s)
        self.ahead: deque[_Ahead] = deque()
        self.issued = 0  # the next window whose fetch is to be issued
        # LMCache's get has no deadline of its own: a window's fetch runs aside and is waited for with one, counted
        # in its share of the transport (the fetches in flight share it), from where its thread began it.
        self.share = TransportShare()
        self.clock = StageClock()
        self.locate: Callable[[WindowJob, str], str] = lambda _win, tier: lm.TIER_BACKENDS.get(tier, lm.FAULT_LOCATION)
        self.window_stage: WindowStage = self._fetch_and_install
        self.armed = ArmedFaults.of(job, rank.rank, abort)
        if self.armed is not None:
            # An injected "tier down" reads from a location no backend has, LMCache's own failure path.
            self.locate = self.armed.locations(self.locate, lm.FAULT_LOCATION, rank.group)
            self.window_stage = self.armed.window(
                self.window_stage, rank.group, self.timeout_s, lambda win: _one_tier(self.objs, win)
            )

    def run(self) -> RankOutcome:
        out = run_windows(
            rank=self.rank.rank,
            groups=[self.rank.group],
            request=self.job.request_id,
            windows=self.windows,
            abort=self.abort,
            step=self._step,
            scrub=lambda: self.rank.kv.invalidate(self.job.block_tables),
            emit=self.rank.emit,
            pool_stats=self.rank.pool_stats,
            prepare=self._prepare,
            cleanup=self._cleanup,
            fired=lambda: self.armed.fired if self.armed is not None else [],
        )
        out.stages = self.clock.costs()
        return out

    def _prepare(self) -> None:
        rank, cs = self.rank, self.rank.reg.chunk_size
        self.objs.extend(self.job.objects[rank.group])
        if not self.windows:
            return
        end_tokens = self.windows[-1].token_end
        # The tokens behind the plan, from the last planned chunk's bsr hash (keys are LMCache's own).
        tokens = rank.registry.tokens_for_hash(parse_key(self.objs[-1].key)[3])
        if len(tokens) < end_tokens or end_tokens % cs:
            raise RestoreFailed(
                f"plan covers {end_tokens} tokens; only full chunks can come from LMCache",
                None,
                kind=failures.TIER,
                stage=Stage.FETCH,
            )
        self.keys.extend(rank.keys(tokens[:end_tokens]))
        lm.lower_transfer_priority(rank.engine)  # once per engine: the transfer's completion poll yields
        self.slot_mapping = rank.slots(list(self.job.block_tables[rank.group]), end_tokens)

    def _window_bytes(self, win: WindowJob) -> int:
        return (win.chunk_end - win.chunk_start) * self.rank.chunk_bytes

    def _tiers(self, win: WindowJob) -> list[str]:
        return sorted({self.objs[c].tier for c in range(win.chunk_start, win.chunk_end)})

    def _step(self, win: WindowJob, out: RankOutcome) -> int:
        nbytes = self._window_bytes(win)
        if self.bounded and nbytes > self.rank.budget_bytes:
            raise failures.WindowRefused(
                f"a window of {win.chunk_end - win.chunk_start} chunks needs {nbytes:,} bytes of L1; "
                f"the budget is {self.rank.budget_bytes:,}",
                cause=CapacityCause.WINDOW_OVER_BUDGET,
            )
        return self.window_stage(win, out)

    def _fetch_and_install(self, win: WindowJob, out: RankOutcome) -> int:
        pos = out.windows_done  # run_windows steps through the windows in order
        nbytes = self._window_bytes(win)
        t0 = time.monotonic()
        self.rank.tracker.mark()
        if not self.ahead:
            self._admit_and_issue(pos)
        self._run_ahead()  # B has the room the window before gave back: the next fetch runs beside this one's
        ticket, fut, admitted = self.ahead[0]
        with self.clock.timing(TimedStage.WAIT):
            # At the deadline the fetch stays in its entry ahead for cleanup, which gives its objects back when it
            # returns; a fetch that raised gave its own back.
            if not self.share.wait(fut, ticket, self.timeout_s):
                raise RestoreFailed(
                    f"timeout: window {win.index} did not arrive within {self.timeout_s}s of the transport",
                    win.index,
                    kind=failures.TIER,
                    stage=Stage.FETCH,
                )
            fetched = fut.result()
        self.ahead.popleft()
        try:
            out.fetch_seconds += time.monotonic() - t0
            self._run_ahead()  # when none is in flight yet, the next transfer runs during this check and install
            with self.clock.timing(TimedStage.VERIFY):
                got = fetched.checked(self.rank.windows)
            self._check_loaded(win, got)
            self.rank.emit(
                WindowFetched(
                    request=self.job.request_id,
                    rank=self.rank.rank,
                    window=win.index,
                    bytes=nbytes,
                    seconds=time.monotonic() - t0,
                    tiers=tuple(self._tiers(win)),
                    pool=self.rank.pool_stats(),
                )
            )
            out.install_seconds += self._install(win, got)
        finally:
            fetched.release()
            if admitted:
                self.rank.l1.release(admitted)
            out.peak_live_bytes = max(out.peak_live_bytes, self.rank.tracker.window_peak)
        return nbytes

    def _admit_and_issue(self, pos: int) -> None:
        """Admit window ``pos`` under B (waiting in line for room) and issue its fetch."""
        win, l1 = self.windows[pos], self.rank.l1
        nbytes = self._window_bytes(win)
        if self.bounded and not l1.try_admit(nbytes):
            # Other restores' windows hold B: waiting for room is admission, not a stall.
            self.rank.emit(
                WindowStepped(
                    step=WindowStep.WAITING, request=self.job.request_id, rank=self.rank.rank, window=win.index
                )
            )
            if not l1.admit(nbytes, time.monotonic() + float(self.job.admit_timeout_s), self.abort):
                if self.abort.is_set():
                    raise aborted(win.index, Stage.FETCH)
                raise failures.WindowRefused(
                    f"window {win.index} waited {self.job.admit_timeout_s:g}s for room in the budget B "
                    f"({self.rank.budget_bytes:,} bytes) held by other restores",
                    cause=CapacityCause.ADMISSION_TIMEOUT,
                )
        self._issue(pos, nbytes if self.bounded else 0)  # W=0, the whole plan, is bounded by the pool, not B

    def _issue(self, pos: int, admitted: int) -> None:
        """Issue window ``pos``'s fetch (one transfer for its chunks on Mooncake), from the tier the coordinator
        chose per chunk (from the probe bitmap, force-local exclusions included)."""
        win = self.windows[pos]
        locations = [self.locate(win, self.objs[c].tier) for c in range(win.chunk_start, win.chunk_end)]
        keys = self.keys[win.chunk_start : win.chunk_end]
        rk = self.rank
        try:
            ticket = self.share.ticket()
            fut = rk._io.submit(self._fetch_sharing, ticket, keys, locations)
        except BaseException:
            if admitted:
                rk.l1.release(admitted)  # never issued: its bytes of B go back at once
            raise
        self.ahead.append((ticket, fut, admitted))
        self.issued = pos + 1

    def _fetch_sharing(self, ticket: ShareTicket, keys: list[Any], locations: list[str]) -> WindowFetch:
        """A window's transfer, counted in the restore's share of the transport."""
        with ticket:
            return fetch_window(self.rank.engine, self.rank.windows, keys, locations, self.clock)

    def _run_ahead(self) -> None:
        """Issue the next window's fetch now when B has room for it beside the windows live (this restore's fetches
        in flight and the one being checked and installed), at most ``FETCHES_AHEAD`` in flight: the transfers then
        overlap this window's check and install and each other's per-call latency. With B = RWS(W) only one window
        is ever live, the paper's serialized restore. Never waits (a window that must wait for room is admitted
        in line by ``_admit_and_issue``)."""
        if not self.bounded or len(self.ahead) >= FETCHES_AHEAD or self.issued >= len(self.windows):
            return
        nbytes = self._window_bytes(self.windows[self.issued])
        if self.rank.l1.try_admit(nbytes):
            self._issue(self.issued, nbytes)

    def _check_loaded(self, win: WindowJob, got: list[Any]) -> None:
        """Completeness: LMCache loaded every token of the window (a short load names the chunk that failed its
        checksum, when that is why)."""
        want = win.token_end - win.token_start
        loaded = sum(self.rank.reg.chunk_size for o in got if o is not None)
        if loaded == want:
            return
        if self.rank.checksums is not None:
            self.rank._verify_step(self.keys[win.chunk_start : win.chunk_end], win.chunk_start, win.index)
        tiers = self._tiers(win)
        raise RestoreFailed(
            f"LMCache loaded {loaded} of {want} tokens of window {win.index} (tiers {', '.join(tiers)})",
            win.index,
            kind=failures.TIER,
            stage=Stage.FETCH,
            tier=tiers[0] if len(tiers) == 1 else None,
        )

    def _install(self, win: WindowJob, got: list[Any]) -> float:
        """Write the window into its destination blocks, one copy per layer straight from L1 (``install_window``),
        or through the connector chunk by chunk where the window's objects are not at one stride in L1; returns
        the seconds it took."""
        t1, cs = time.monotonic(), self.rank.reg.chunk_size
        starts = list(range(win.token_start, win.token_end, cs))
        assert self.slot_mapping is not None
        rows = self.slot_mapping[win.token_start : win.token_end]
        conn = self.rank.connector
        try:
            with self.rank._engine_lock(), self.clock.timing(TimedStage.INSTALL):  # one write at a time
                if not install_window(got, self.rank.kvcaches, rows, conn.heads, conn.head_size):
                    lm.install_window(
                        self.rank.engine,
                        got,
                        starts,
                        [x + cs for x in starts],
                        kvcaches=self.rank.kvcaches,
                        slot_mapping=self.slot_mapping,
                    )
        except Exception as e:
            raise RestoreFailed(
                f"install failed: {type(e).__name__}: {e}", win.index, kind=failures.RANK, stage=Stage.INSTALL
            ) from e
        return time.monotonic() - t1

    def _cleanup(self) -> None:
        # A fetch issued ahead may still run: wait for it (with a grace), give its objects back to L1 and its
        # bytes back to B. Fetches only fill L1; nothing here writes the destination blocks. A transfer still
        # running after the grace keeps its L1 objects and its bytes of B until it returns (Mooncake may still
        # write them), as an abandoned transfer keeps its pool slots in the embedded engine.
        while self.ahead:
            _, fut, admitted = self.ahead.popleft()
            try:
                fut.result(timeout=RETRIEVE_GRACE_S).release()
            except FutureTimeout:
                fut.add_done_callback(functools.partial(self._give_back, admitted=admitted))
                continue
            except Exception:  # noqa: BLE001 - its failure is already subsumed by ours
                pass
            if admitted:
                self.rank.l1.release(admitted)

    def _give_back(self, fut: Future[WindowFetch], *, admitted: int) -> None:
        """A fetch that returned after the restore gave up on it: its objects back to L1, its bytes back to B."""
        with contextlib.suppress(Exception):  # a fetch that failed holds no objects
            fut.result().release()
        if admitted:
            self.rank.l1.release(admitted)


class HostedRank(RankOps, Protocol):
    """A rank host ThreadRank can drive: the ops, its index, and a close."""

    rank: int

    def close(self) -> None: ...


H = TypeVar("H", bound=HostedRank)


class ThreadRank(Generic[H]):
    """The RankClient for an in-process rank host (an LMCacheRank, or the vLLM worker admin's ops): each call runs
    on a thread and returns a Future of the request's result."""

    def __init__(self, rank: H, max_workers: int = 8) -> None:
        self.rank = rank.rank
        self.impl = rank
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"bsr-lmc-rank{rank.rank}")
        self._closed = False

    def submit(self, request: RankRequest[R]) -> Future[R]:
        if self._closed:
            fut: Future[R] = Future()
            fut.set_exception(RuntimeError(f"rank {self.rank} is closed"))
            return fut
        return self._pool.submit(dispatch, self.impl, request)

    def abort(self, request: str) -> None:
        self.impl.abort(request)

    def alive(self) -> bool:
        return not self._closed

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.impl.close()
