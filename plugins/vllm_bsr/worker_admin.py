"""bsr's admin API served from inside one vLLM worker, over that worker's own LMCache engine.

LMCache serves its internal API server per worker but cannot host third-party routes, so each worker runs bsr's
``AdminServer`` (``/bsr/v1``) in a daemon thread next to it: a one-rank Coordinator whose only RankClient wraps
the worker's engine (the engine is LMCache's, built by its vLLM adapter: bsr never builds or destroys it, so
``LMCacheRank``, which owns its engine and a CPU paged KV, does not fit; this is the thin adapter instead,
driven through ``ThreadRank``).

What it serves (``WorkerRankOps``, the rank-ops contract's ``probe``/``stats``/``reset_peak``; every other op answers
``UnsupportedOp``): ``probe`` (the per-tier, per-chunk bitmap of THIS rank over the prompt's full chunks, the only
ones LMCache stores; probe-only: no pins, no bytes moved), ``status``/``info``/``registration`` with the connector's
real settings (W = ``bsr_window_chunks``, the budget one window needs, vLLM's ``max_model_len``), the last loads of
this worker as the connector saw them (``record_load``: advertised, loaded, failed window, recomputed; as bsr's
restore events, so ``bsr explain``/``events`` read them), the force-local markers the scheduler holds (read from
what the scheduler-side connector publishes, vllm_bsr/board.py: markers live in vLLM's scheduler process, not in
this worker), and faults when the connector's ``bsr_admin_faults`` is set (they fire inside the worker's load
windows, ``take_fault``). What it refuses: ``submit``/``restore``/stores, settings changes and the bench
(``info.serves_restores`` is false), since in a vLLM deployment KV moves only through vLLM's scheduler and the BSR
connector, configured by vLLM's ``kv_connector_extra_config``; and clearing markers, which the scheduler owns (the
next admission of a prompt starting with the marked prefix clears it).
The coordinator is one-rank, so the bitmap and the events call this worker "rank 0"; ``info.engine`` and
``info.worker.tp_rank`` name the real TP rank.

Every worker also reports its instance (``info.vllm_instance``, vllm_bsr/instance.py): the admin URLs of all its TP
ranks, the Mooncake endpoints and LMCache's key format, which ``bsr engine endpoints`` prints.

Bound to loopback; port ``bsr_admin_port + rank``; bearer token ``bsr_admin_token`` or ``$BSR_TOKEN``.
Verified with real LMCache engines (tests/plugins/test_vllm_lookup.py) and inside real vLLM workers (tests/vllm).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_bsr.host import LMCacheCoordinator
from lmcache_bsr.rank import ThreadRank
from lmcache_bsr.tokens import TokenRegistry

from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    ResetPeakRequest,
    ResetPeakResult,
    StatsRequest,
    StatsResult,
    TierStatus,
    UnsupportedOp,
    UnsupportedOps,
)
from bsr_cli.core import accounting
from bsr_cli.core.bitmap import HitBitmap, encode_row
from bsr_cli.core.events import MarkerSet, parse_event
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.keys import chunk_hashes
from bsr_cli.core.registration import KVGroup, Registration, TensorSpec
from bsr_cli.core.results import ManualRestoreResult, SubmitResult, TierErrors
from bsr_cli.core.status import EngineInfo, MarkerView, RecentRestore, Snapshot
from bsr_cli.core.wire import JsonObject, JsonValue
from bsr_cli.errors import BadRequest
from bsr_cli.runtime.coordinator import EngineSettings
from bsr_cli.runtime.events import EventLog
from bsr_cli.server.admin import AdminServer

from . import board, instance
from .logic import LoadReport, load_events
from .probe_lookup import EngineFn, RankProber

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class WorkerLimits:
    """The connector's settings and vLLM's limits, as the admin API reports them (``bsr status``, ``bsr pool``)."""

    window_chunks: int  # W: the connector's bsr_window_chunks
    max_model_len: int  # vLLM's longest prompt + output
    kv_tokens: int  # vLLM's paged KV capacity in tokens (max_model_len when not known yet)
    staging_bytes: int  # LMCache's local CPU buffer (max_local_cpu_size), where a window is staged
    board: str | None = None  # where the scheduler-side connector publishes its markers (vllm_bsr/board.py)
    mooncake_admin: str | None = None  # the Mooncake master's admin/metrics URL (bsr_mooncake_admin), for probe --store


class Staging:
    """The window the connector is loading now, by accounting (its chunks x bytes per chunk: LMCache's masked
    retrieve stages exactly the window's chunks), and the largest since the last reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0
        self.windows_live = 0

    def begin(self, nbytes: int) -> None:
        with self._lock:
            self.live, self.windows_live = nbytes, 1
            self.peak = max(self.peak, nbytes)

    def end(self) -> None:
        with self._lock:
            self.live, self.windows_live = 0, 0

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live


def registration_of(eng: Any, block_size: int = 16) -> Registration:
    """bsr's registration for an LMCache engine's layout (one group, one tensor per layer), as a one-rank view."""
    md = eng.metadata
    layers, _two, chunk, heads, head_size = (int(x) for x in md.kv_shape)
    dtype = DTYPES.get(md.kv_dtype, "bf16")
    tensors = tuple(TensorSpec(f"layers.{i}.kv", dtype, (2, heads, head_size), "attn") for i in range(layers))
    return Registration(
        model=str(md.model_name),
        tp_size=1,
        groups=(KVGroup("attn", block_size),),
        tensors=tensors,
        chunk_size=chunk,
        source=f"vllm-lmcache-worker{md.worker_id}",
    )


class WorkerRankOps(UnsupportedOps):
    """The ops a per-worker coordinator drives (bsr_cli.api.ranks.RankOps), over an existing engine: probe, stats
    and reset_peak; every op that would move or write KV is refused (``UnsupportedOp``)."""

    rank = 0  # the coordinator's index: one rank per admin server
    host_name = "a vLLM worker"

    def __init__(
        self,
        engine_fn: EngineFn,
        tp_rank: int,
        registry: TokenRegistry,
        group: str = "attn",
        *,
        limits: WorkerLimits | None = None,
        slot_bytes: int = 0,
    ) -> None:
        self.tp_rank = tp_rank
        self.prober = RankProber(engine_fn)
        self.registry = registry
        self.group = group
        self.limits = limits
        self.slot_bytes = slot_bytes
        self.staging = Staging()

    def unsupported(self, op: str) -> UnsupportedOp:
        return UnsupportedOp(
            op,
            f"op {op!r} is not served from a vLLM worker: KV moves only through vLLM's scheduler and the BSR "
            "connector there",
            hint="use `bsr probe` / `bsr status` against a worker; submit and restore through vLLM",
        )

    def probe(self, req: ProbeRequest) -> ProbeResult:
        eng = self.prober.engine_fn()
        if eng is None:
            return ProbeResult({self.group: "0" * len(req.hashes)}, {"engine": "no LMCache engine"})
        tokens = self.registry.tokens_for(req.hashes)
        keys = [k for _, _, k in lm.chunk_keys(eng, tokens)]
        held, errors = self.prober.presence(keys)
        return ProbeResult({self.group: encode_row(held, req.tiers, len(req.hashes))}, errors)

    def stats(self, req: StatsRequest) -> StatsResult:
        lim, st = self.limits, self.staging
        pool = {
            "capacity_bytes": lim.staging_bytes if lim else 0,
            "budget_bytes": lim.window_chunks * self.slot_bytes if lim else 0,  # one window at a time
            "slot_bytes": self.slot_bytes,
            "live_bytes": st.live,
            "peak_bytes": st.peak,
            "windows_live": st.windows_live,
            "waiters": 0,
        }
        tiers: dict[str, TierStatus] | None = None
        if req.health:
            eng = self.prober.engine_fn()
            tiers = {}
            names = self.prober.tiers()
            if "mooncake" in names:
                from .probe_lookup import mooncake_health_url

                url = mooncake_health_url(eng)
                ok = url is None or self.prober.master_ok(url)
                tiers["mooncake"] = TierStatus(ok, f"LMCache RemoteBackend; master {url} {'up' if ok else 'DOWN'}")
            if "fs" in names:
                tiers["fs"] = TierStatus(True, f"LMCache LocalDiskBackend at {eng.config.local_disk}")
        return StatsResult(self.rank, pool, tiers, tp_rank=self.tp_rank)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        self.staging.reset_peak()
        return ResetPeakResult()

    def close(self) -> None:
        return None  # the engine belongs to LMCache's vLLM adapter: never destroyed here


class WorkerCoordinator(LMCacheCoordinator):
    """A one-rank coordinator that refuses to move KV (in a vLLM deployment only vLLM's scheduler does), serves the
    scheduler's markers from its board and records this worker's loads as the connector saw them."""

    def __init__(self, *a: Any, tp_rank: int = 0, limits: WorkerLimits | None = None, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.tp_rank = tp_rank
        self.limits = limits
        self._loads: dict[str, LoadReport] = {}  # request -> its last load report (bounded by ``recent``)
        self._loads_lock = threading.Lock()
        self.instance: JsonObject | None = None  # the vLLM instance's endpoints (vllm_bsr/instance.py)

    def _refuse(self, what: str) -> NoReturn:
        raise BadRequest(
            f"{what} is not served from a vLLM worker: KV moves only through vLLM's scheduler and the BSR connector",
            hint="send the prompt to vLLM; use `bsr probe` / `bsr status` against the workers",
        )

    def submit(self, tokens: Any, **kw: Any) -> SubmitResult:
        self._refuse("submit")

    def restore(self, tokens: Any, **kw: Any) -> ManualRestoreResult:
        self._refuse("restore")

    def probe(self, tokens: Any, hashes: list[str] | None = None) -> tuple[HitBitmap, TierErrors]:
        """The bitmap over the prompt's full chunks: LMCache never stores a partial last chunk (vLLM always computes
        that tail), so probing it would report a miss no store could ever fill."""
        cs = self.reg.chunk_size
        full = len(tokens) // cs
        if full == 0:
            return super().probe(tokens, hashes)
        hashes = (hashes or chunk_hashes(tokens, cs))[:full]
        return super().probe(tokens[: full * cs], hashes)

    def info(self) -> EngineInfo:
        out: JsonObject = {"serves_restores": False}  # what a worker adds to the engine's info
        if self.instance is not None:
            out["vllm_instance"] = self.instance
        lim = self.limits
        if lim is not None:
            out["worker"] = {
                "tp_rank": self.tp_rank,
                "window_chunks": lim.window_chunks,
                "max_model_len": lim.max_model_len,
                "kv_tokens": lim.kv_tokens,
                "staging_bytes": lim.staging_bytes,
                "scheduler_board": lim.board,
                "scheduler_published": lim.board is not None and board.read(lim.board) is not None,
                "stores": "full chunks only (LMCache's save_unfull_chunk is off)",
                "window_numbering": "0-based in JSON and events (window: 1); G1..GK in text (window G2)",
            }
        return super().info().with_host_fields(**out)

    def update_settings(self, **changes: Any) -> None:
        # W is the connector's bsr_window_chunks, fixed when vLLM starts; B and the fs concurrency govern bsr's own
        # restores, which a worker does not run.
        raise BadRequest(
            "changing restore settings is not served from a vLLM worker: W is the connector's bsr_window_chunks",
            hint="set kv_connector_extra_config.bsr_window_chunks and restart vLLM",
        )

    # -- what the scheduler holds --------------------------------------------------------------------------------
    def scheduler_state(self) -> JsonObject | None:
        return board.read(self.limits.board) if self.limits is not None and self.limits.board else None

    def list_markers(self) -> list[MarkerView]:
        """The force-local markers vLLM's scheduler holds now, as it published them. A vLLM marker sends the next
        admission of any prompt starting with its prefix to local compute: every tier is excluded."""
        doc = self.scheduler_state() or {}
        with self._loads_lock:
            loads = dict(self._loads)
        out = []
        for published in _array(doc.get("markers")):
            if not isinstance(published, dict):
                continue
            m: JsonObject = published | {"excluded_tiers": [*self.settings.tiers]}
            load = loads.get(str(m.get("request")))
            if load is not None and load["failures"]:
                m["reason"] = self._marker_reason(load)
                m["failed_window"] = load["failures"][0]["window"]
            out.append(MarkerView.from_wire(m))
        return out

    def _marker_reason(self, load: LoadReport) -> str:
        """Why a failed load left its prefix a force-local marker, as `markers list` and the events say it."""
        f = load["failures"][0]
        failed = f["window"]
        window = f"window G{failed + 1}" if failed is not None else "its first window"
        return (
            f"load of {load['advertised_tokens']:,} tokens failed at {window} on tp-rank {self.tp_rank} "
            f"({f['reason']}); vLLM recomputed them"
        )

    def clear_markers(self, *a: Any, **kw: Any) -> int:
        raise BadRequest(
            "clearing force-local markers is not served from a vLLM worker: they live in vLLM's scheduler (the BSR "
            "connector), keyed by the failed prefix, and clear on the next admission of a prompt that starts with it",
            hint="`bsr markers list` shows them; send the prompt to vLLM again to clear its marker",
        )

    def snapshot(self, health: bool = True, events_since: int | None = None) -> Snapshot:
        snap = super().snapshot(health=health, events_since=events_since)  # the markers are this host's already
        doc = self.scheduler_state()
        held = doc or {}
        # loads that failed on a rank
        failed = {str(f.get("request")) for f in _array(held.get("load_failed")) if isinstance(f, dict)}
        scheduler: JsonObject = {
            "published": doc is not None,
            "updated_at": held.get("updated_at"),
            "forced_local": [*_array(held.get("forced"))],
        }
        return replace(
            snap,
            recent=tuple(self._request_level(r, failed) for r in snap.recent),
            host_fields={**snap.host_fields, "scheduler": scheduler},
        )

    @staticmethod
    def _request_level(entry: RecentRestore, failed: set[str]) -> RecentRestore:
        """A load this rank completed, of a request whose load failed on another TP rank: vLLM recomputed the
        whole request (every rank's blocks), so nothing this rank loaded was used."""
        if entry.outcome is not Outcome.COMMITTED or entry.request not in failed:
            return entry
        sent = entry.to_wire()
        return RecentRestore.from_wire(
            sent
            | {
                "outcome": Outcome.FAILED_CLOSED.value,
                "loaded_tokens": 0,
                "recomputed_tokens": sent.get("prefix_tokens", sent.get("advertised_tokens", 0)),
                "this_rank": Outcome.COMMITTED.value,
                "reason": "this rank's windows completed, but the load failed on another TP rank: vLLM recomputed "
                "the whole request",
            }
        )

    # -- what this worker loaded ---------------------------------------------------------------------------------
    def record_load(self, report: LoadReport) -> None:
        """One load as the connector saw it: its events (bsr's restore vocabulary) and a recent-restores entry."""
        for ev in load_events(report):
            self.events.append(parse_event(ev | {"tp_rank": self.tp_rank}))
        if report.get("failures"):
            # The connector reports the failed blocks; vLLM's scheduler then marks the load's prefix force-local,
            # under the prefix's prompt hash: the id this load's events carry (``prompt``), and `markers list` shows.
            self.events.append(
                MarkerSet(
                    prompt=report["prompt"],
                    request=report["request"],
                    excluded_tiers=tuple(self.settings.tiers),
                    reason=self._marker_reason(report),
                )
            )
        # The worker's own entry (its keys, in its order): read back, it is written as it is built here.
        entry: JsonObject = {
            "request": report["request"],
            "prompt": report["prompt"],
            "prefix_tokens": report["prefix_tokens"],
            "outcome": report["outcome"],
            "tokens": report["advertised_tokens"],
            "advertised_tokens": report["advertised_tokens"],
            "loaded_tokens": report["loaded_tokens"],
            "recomputed_tokens": report["recomputed_tokens"],
            "windows": report["windows"],
            "windows_run": report["windows_run"],
            "failed_window": report["failed_window"],
            "W": report["W"],
            "tiers": [*report["tiers"]],
            "seconds": report["seconds"],
            "finished": time.time(),
            "reason": report["reason"],
            "failure_kind": report["failure_kind"],
            "tp_rank": self.tp_rank,
        }
        self.observation.remember(RecentRestore.from_wire(entry))
        keep = {e.request for e in self.observation.recent()}
        with self._loads_lock:
            self._loads[report["request"]] = report
            self._loads = {k: v for k, v in self._loads.items() if k in keep}


def _array(value: JsonValue) -> list[JsonValue]:
    """A JSON array the scheduler published, or none."""
    return value if isinstance(value, list) else []


class WorkerAdmin:
    """The admin server of one vLLM worker. ``stop()`` it (the connector does on shutdown)."""

    def __init__(
        self,
        engine_fn: EngineFn,
        tp_rank: int,
        *,
        token: str,
        port: int,
        host: str = "127.0.0.1",
        faults: bool = False,
        limits: WorkerLimits | None = None,
    ) -> None:
        eng = engine_fn()
        if eng is None:
            raise RuntimeError("LMCache has no engine in this worker: bsr's admin API cannot start")
        reg = registration_of(eng)
        self.registry = TokenRegistry(reg.chunk_size)
        self.ops = WorkerRankOps(engine_fn, tp_rank, self.registry, limits=limits, slot_bytes=reg.bytes_per_chunk)
        tiers = tuple(self.ops.prober.tiers()) or ("fs",)
        w = limits.window_chunks if limits else 0
        settings = EngineSettings(
            name=f"vllm-lmcache tp-rank {tp_rank}",
            tiers=tiers,
            w=w,
            # The connector loads one window at a time: its budget is what one window of W chunks needs.
            budget_bytes=accounting.rws_bytes(reg, w) if w else 0,
            pool_bytes=limits.staging_bytes if limits else 0,
            # Without the connector's limits (a worker admin started on its own) bsr's default prompt limit holds.
            max_tokens=limits.max_model_len if limits else EngineSettings.max_tokens,
            kv_tokens=limits.kv_tokens if limits else reg.chunk_size,
            faults_enabled=faults,
        )
        self.rank = ThreadRank(self.ops, max_workers=4)
        self.coordinator = WorkerCoordinator(
            reg, [self.rank], settings, EventLog(), registry=self.registry, tp_rank=tp_rank, limits=limits
        )
        self.server = AdminServer(self.coordinator, token=token, host=host, port=port)
        self.server.start()
        self.coordinator.instance = instance.describe(
            eng, tp_rank=tp_rank, admin_url=self.url, master_admin=limits.mooncake_admin if limits else None
        )

    def take_fault(self, window: int) -> Any:
        """The armed fault that fires in load window ``window`` (0-based) of this worker, if any; counts it as
        fired (and drops it once its count is spent). Called by the BSR connector inside every window."""
        c = self.coordinator
        fired = c.armed_faults.fire(rank=0, window=window)
        if fired is None:
            return None
        c.events.append(parse_event({"type": "fault_fired", "window": window, **fired.to_wire()}))
        return fired

    @property
    def staging(self) -> Staging:
        return self.ops.staging

    def record_load(self, report: LoadReport) -> None:
        self.coordinator.record_load(report)

    @property
    def url(self) -> str:
        return str(self.server.url)

    def stop(self) -> None:
        self.server.stop()
        self.rank.close()


__all__ = ["Staging", "WorkerAdmin", "WorkerCoordinator", "WorkerLimits", "WorkerRankOps", "registration_of"]
