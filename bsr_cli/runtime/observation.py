"""The coordinator's observation: rank and tier health, the pool/stats aggregation a monitor draws, the rank events
that feed them, the live view of running restores, and each restore's recorded report.

Tier health joins what each rank sees of its tiers with what the coordinator knows (armed faults, recent real
failures). Each rank's liveness (heartbeats, progress, stuck calls) is ``RankCalls``'s (``rank_calls.py``).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace

from bsr_cli import API_VERSION, __version__
from bsr_cli.api.ranks import RestoreResult, StatsRequest, StatsResult, TierStatus
from bsr_cli.core import accounting
from bsr_cli.core.events import (
    PROGRESS,
    Event,
    Failure,
    ObjectQuarantined,
    RestoreEnded,
    WindowFetched,
    WindowReleased,
    in_pass,
    rank_of,
    request_of,
)
from bsr_cli.core.evidence import FailureKind, Outcome, RankState, Stage, TierCondition
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.results import InvalidCell, RankRestore, RestoreReport
from bsr_cli.core.scrub import ScrubProgress
from bsr_cli.core.status import (
    ActiveRestore,
    Admission,
    EngineInfo,
    Health,
    PoolEntry,
    QuarantinedFile,
    RankTierStatus,
    RecentRestore,
    RegistrationSummary,
    Snapshot,
    TierHealth,
)
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.runtime import failures
from bsr_cli.runtime.coordinator_state import HEALTH_WAIT_S, TIER_FAILURE_TTL_S, CoordinatorContext
from bsr_cli.runtime.rank_calls import RankCalls
from bsr_cli.runtime.store_losses import StoreLosses


@dataclass(frozen=True)
class _TierFailure:
    """A tier's last real failure, until a committed restore from it (or its TTL) clears it."""

    reason: str
    rank: int | None
    request: str
    at: float
    injected: bool  # an armed fault fired: forgotten when the operator clears faults


def _rank_tier(status: TierStatus) -> RankTierStatus:
    """A rank's answer about one tier, as the engine reports it."""
    return RankTierStatus(
        ok=status.ok,
        detail=status.detail,
        condition=TierCondition(status.condition),
        quarantined=tuple(status.quarantined),
        quarantined_total=status.quarantined_total,
        scrubs=tuple(status.scrubs),
    )


def _rank_tiers(stats: StatsResult) -> dict[str, RankTierStatus] | None:
    return None if stats.tiers is None else {name: _rank_tier(t) for name, t in stats.tiers.items()}


def _failures(outcomes: Sequence[RestoreResult], committed: int, invalid: Sequence[tuple[int, str]]) -> list[Failure]:
    """Each failed rank's failure; when every rank said it succeeded yet nothing was committed, each invalid
    (rank, group) cell: the rank did not report that group, which only the rank can explain (a host bug), never a
    tier."""
    fails = [failures.failure_of(o) for o in outcomes if not o.ok]
    if committed or fails:
        return fails
    return [
        Failure(
            rank=r,
            reason=f"rank {r} reported no valid install of KV group {g}",
            kind=FailureKind.RANK,
            stage=Stage.COMMIT,
        )
        for r, g in invalid
    ]


class _TierJoin:
    """One tier's health while ``tier_health`` joins what every rank and the coordinator know of it."""

    def __init__(self) -> None:
        self.ok = True
        self.real = False  # a reason it is unhealthy that no injected fault caused
        self.detail: list[str] = []
        self.conditions: list[TierCondition] = []
        self.quarantined: list[QuarantinedFile] = []
        self.dirs: dict[str, int] = {}  # its quarantine directories' totals
        self.failed_at: float | None = None  # when a restore from it failed (the coordinator's own evidence)
        self.scrubs: list[ScrubProgress] = []
        self.armed: list[str] = []  # faults armed against it: shown, never a reason it is unhealthy
        self.lost: list[SegmentLoss] = []  # segments its store lost

    def unhealthy(self, condition: TierCondition, why: str, *, injected: bool = False) -> None:
        self.ok = False
        self.real = self.real or not injected
        self.detail.append(why)
        if condition is not TierCondition.OK and condition not in self.conditions:
            self.conditions.append(condition)

    def health(self) -> TierHealth:
        return TierHealth(
            ok=self.ok,
            detail=tuple(self.detail),
            conditions=tuple(self.conditions),
            quarantined=tuple(sorted(self.quarantined, key=lambda q: -q.at)),
            quarantined_total=sum(self.dirs.values()),
            condition=self.conditions[0] if self.conditions else TierCondition.OK,
            failed_at=self.failed_at,
            # Every rank's, the running ones first.
            scrubs=tuple(sorted(self.scrubs, key=lambda p: (p.state.finished, -p.started_at))),
            injected=not self.ok and not self.real,
            faults_armed=tuple(self.armed),
            lost_segments=tuple(self.lost),
        )


class Observation:
    """Owns what the coordinator observes of its ranks and restores: tier health (each rank's view, real failures),
    the live view of running restores, the recent ones and their counters. Reads each rank's liveness from
    ``calls`` (and feeds it the progress events) and the armed faults through ``armed_faults`` (listed beside the
    tier they act on; arming one changes no tier's health)."""

    def __init__(self, ctx: CoordinatorContext, calls: RankCalls, armed_faults: Callable[[], list[FaultSpec]]) -> None:
        self.reg = ctx.reg
        self.ranks = ctx.ranks
        self.settings = ctx.settings
        self.events = ctx.events
        self.counters = ctx.counters
        self.started_at = time.time()
        self._calls = calls
        self._armed_faults = armed_faults
        # Every mutable field below is read and written under ``_lock``.
        self._lock = threading.Lock()
        self._active: dict[str, ActiveRestore] = {}  # the running restores, as a monitor draws them
        self._passes: dict[str, int] = {}  # each running restore's admission pass, until it ends
        self._recent: deque[RecentRestore] = deque(maxlen=50)
        self._rate: dict[int, deque[tuple[float, int]]] = {r.rank: deque(maxlen=4096) for r in ctx.ranks}
        # Tier health from real restores: the last failure per tier, cleared by a later committed restore from it.
        self._tier_failures: dict[str, _TierFailure] = {}
        # Each rank's last answer about its tiers (for a quick /health), and the ranks asked and not answered yet.
        self._tier_views: dict[int, tuple[float, dict[str, RankTierStatus]]] = {}
        self._tier_asks: set[int] = set()
        # The segments each tier's store lost (the engine's store watch reports them).
        self.store_losses = StoreLosses(ctx.events, ctx.counters)

    # -- rank and tier health --------------------------------------------------------------------------------------
    def health(self) -> Health:
        """What /health answers: ``ok`` when every rank is healthy (the engine can serve); ``degraded`` names
        the tiers that are not (the engine still serves, from a lower tier or by recomputing)."""
        ranks = self._calls.rank_health()
        return Health(ranks=tuple(ranks), tiers=self.tier_health(self._rank_tier_views(HEALTH_WAIT_S)))

    def _rank_tier_views(self, wait_s: float) -> list[tuple[int, dict[str, RankTierStatus]]]:
        """Each rank's own view of its tiers, for /health, which must stay quick: ask every rank that beats (one
        question in flight per rank), wait at most ``wait_s``, and use the freshest answer from the last 30 s
        (a slow answer lands in the cache for the next call)."""
        futures = []
        for r in self.ranks:
            with self._lock:
                busy = r.rank in self._tier_asks
                if not busy:
                    self._tier_asks.add(r.rank)
            if busy:
                continue
            if not r.alive() or self._calls.silent(r) is not None:
                with self._lock:
                    self._tier_asks.discard(r.rank)
                continue
            fut = r.submit(StatsRequest(health=True))
            fut.add_done_callback(functools.partial(self._keep_tier_view, r.rank))
            futures.append(fut)
        if futures:
            wait(futures, timeout=wait_s)
        now = time.monotonic()
        with self._lock:
            return [(rk, tiers) for rk, (at, tiers) in sorted(self._tier_views.items()) if now - at <= 30]

    def _keep_tier_view(self, rank: int, fut: Future[StatsResult]) -> None:
        tiers = (_rank_tiers(fut.result()) or {}) if fut.exception() is None else None
        with self._lock:
            self._tier_asks.discard(rank)
            if tiers is not None:
                self._tier_views[rank] = (time.monotonic(), tiers)

    def tier_health(self, ranks: Sequence[tuple[int, dict[str, RankTierStatus]]]) -> dict[str, TierHealth]:
        """Per tier: what each rank (``(rank, its tiers)``, as ``pool(health=True)`` answers: its condition, e.g.
        full or read-only, and the objects it set apart) sees of it joined with what the coordinator knows (segments
        its store lost, armed faults, recent real failures). ``condition`` is the first reason it is unhealthy
        (``ok`` when none); ``conditions`` every one."""
        tiers: dict[str, _TierJoin] = defaultdict(_TierJoin)
        # A lost segment first: it is the cause of what the ranks see then (no segment mounted, objects missing).
        for name, losses in self.store_losses.standing().items():
            t = tiers[name]
            for loss in losses:
                t.unhealthy(TierCondition.SEGMENT_LOST, loss.line())
                t.lost.append(loss)
        for rank, rank_tiers in ranks:
            for name, h in rank_tiers.items():
                t = tiers[name]
                if not h.ok:
                    t.unhealthy(h.condition, f"rank{rank}: {h.detail}")
                # Ranks may share one directory (the embedded engine's fs tier): count each quarantine directory
                # once, and each quarantined file once (its reason names the rank that found it).
                known = {x.file for x in t.quarantined}
                t.quarantined.extend(q for q in h.quarantined if q.file not in known)
                if h.quarantined:
                    t.dirs[os.path.dirname(h.quarantined[0].file)] = h.quarantined_total
                t.scrubs.extend(h.scrubs)
        for name in self.settings.tiers:  # every configured tier is listed, healthy or not
            tiers.setdefault(name, _TierJoin())
        for f in self._armed_faults():
            for name in f.tiers_affected():
                tiers[name].armed.append(f"fault #{f.id} {f.kind} armed")
        now = time.time()
        with self._lock:
            recent = {t: v for t, v in self._tier_failures.items() if now - v.at <= TIER_FAILURE_TTL_S}
        for name, v in recent.items():
            # A recent failure that no committed restore from the tier has cleared since, dated so that a later
            # restore's evidence can be told apart from it; one an injected fault caused (a drill's) is told apart,
            # so that it pages nobody.
            why = f"restore {v.request} from it failed {now - v.at:.0f}s ago on rank {v.rank}: {v.reason}"
            tiers[name].failed_at = v.at
            tiers[name].unhealthy(
                TierCondition.RESTORE_FAILED, why + (" (injected fault)" if v.injected else ""), injected=v.injected
            )
        return {name: t.health() for name, t in tiers.items()}

    def _note_tier_health(
        self,
        committed: bool,
        used: set[str],
        blamed: set[str],
        fails: Sequence[Failure],
        request: str,
        injected: bool = False,
    ) -> None:
        with self._lock:
            if committed:
                for t in used:
                    self._tier_failures.pop(t, None)
                return
            for t in blamed:
                f = next((x for x in fails if x.tier == t), fails[0] if fails else None)
                self._tier_failures[t] = _TierFailure(
                    reason=f.reason if f is not None else "",
                    rank=f.rank if f is not None else None,
                    request=request,
                    at=time.time(),
                    injected=injected,
                )

    def report_restore(
        self,
        *,
        request: str,
        w: int,
        k: int,
        windows: int,
        ext_tokens: int,
        committed_tokens: int,
        invalid: Sequence[tuple[int, str]],
        outcomes: Sequence[RestoreResult],
        tiers_used: set[str],
        fired: set[int],
        seconds: float,
    ) -> RestoreReport:
        """One restore's report (what the CLI shows), recorded: the failures classified and blamed by stage, tier
        and rank health noted, the outcome counted and logged, and the recent-restores entry."""
        total_bytes = sum(o.bytes_restored for o in outcomes)
        fails = _failures(outcomes, committed_tokens, invalid)
        kind = None if committed_tokens else failures.classify(fails)
        outcome = failures.outcome(kind)
        deciding = next((f for f in fails if f.kind is kind), None)
        blamed = failures.blamed_tiers(kind, fails, sorted(tiers_used))
        hint = None
        if kind is FailureKind.CAPACITY and deciding is not None:
            hint = failures.capacity_hint(
                deciding.cause,
                w=w,
                slot_bytes=self.reg.bytes_per_chunk,
                budget_bytes=self.settings.budget_bytes,
                pool_bytes=self.settings.pool_bytes,
            )
        self._note_tier_health(committed_tokens > 0, tiers_used, blamed, fails, request, bool(fired))
        self._calls.note_rank_failures(fails, request)
        result = RestoreReport(
            request=request,
            w=w,
            tiers=tuple(sorted(tiers_used)),
            advertised_tokens=ext_tokens,
            committed_tokens=committed_tokens,
            outcome=outcome,
            invalid=tuple(InvalidCell(r, g) for r, g in invalid),
            failures=tuple(fails),
            failure_kind=kind,
            failure_stage=deciding.stage if deciding is not None else None,
            blamed_tiers=tuple(sorted(blamed)),
            blamed_ranks=tuple(failures.blamed_ranks(fails)),
            hint=hint,
            windows=windows,
            chunks=k,
            seconds=seconds,
            bytes=total_bytes,
            gbps=total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            ranks=tuple(RankRestore.from_wire(o.to_wire()) for o in outcomes),
            rws_bytes=accounting.rws_bytes(self.reg, w) if w else None,
            whole_plan_bytes=accounting.whole_plan_bytes(self.reg, k),
            fired_faults=tuple(sorted(fired)),
        )
        self.restore_ended(
            request=request,
            outcome=outcome,
            kind=kind,
            fails=fails,
            advertised=ext_tokens,
            committed=committed_tokens,
            seconds=seconds,
            tokens=ext_tokens,
            w=w,
            tiers=sorted(tiers_used),
            injected=bool(fired),
        )
        return result

    def restore_ended(
        self,
        *,
        request: str,
        outcome: Outcome,
        kind: FailureKind | None,
        fails: Sequence[Failure],
        w: int,
        advertised: int = 0,
        committed: int = 0,
        seconds: float = 0.0,
        tokens: int = 0,
        tiers: Sequence[str] = (),
        injected: bool = False,
    ) -> None:
        """Every ended restore, once: counted, listed among the recent ones, then logged as its outcome's event (so
        whoever sees the event finds the rest already recorded). The amounts default to a restore that ended before
        any byte moved (nothing to restore, refused, a rank that stopped answering); ``injected``: an injected fault
        fired in it (counted and logged as such, so that a drill pages nobody)."""
        deciding = next((f for f in fails if f.kind is kind), None)
        self.counters.restore_ended(outcome, kind, deciding.stage if deciding is not None else None, injected)
        with self._lock:
            pass_no = self._passes.pop(request, None)
            self._recent.appendleft(
                RecentRestore(
                    request=request,
                    outcome=outcome,
                    tokens=tokens,
                    w=w,
                    tiers=tuple(tiers),
                    seconds=seconds,
                    finished=time.time(),
                    reason=failures.describe(deciding) if deciding is not None else "",
                    failure_kind=kind,
                    failure_stage=deciding.stage if deciding is not None and deciding.stage else None,
                )
            )
        if outcome is not Outcome.NOTHING_TO_RESTORE:
            self.events.append(
                RestoreEnded(
                    outcome=outcome,
                    request=request,
                    committed_tokens=committed,
                    advertised_tokens=advertised,
                    failures=tuple(fails),
                    failure_kind=kind,
                    seconds=seconds,
                    pass_no=pass_no,
                    injected=injected,
                )
            )

    def on_rank_event(self, ev: Event) -> None:
        """A rank's progress, as the coordinator receives it: the liveness watch and the live view updated, the
        window and fetch counters incremented (each event counted once, here, in whatever order ranks send
        them), then logged."""
        with self._lock:
            pass_no = self._passes.get(request_of(ev) or "")
        ev = in_pass(ev, pass_no)
        if ev.kind in PROGRESS:
            rank = rank_of(ev)
            self._calls.progressed(request_of(ev) or "", rank if rank is not None else -1, ev.kind)
        if isinstance(ev, WindowReleased):
            self.counters.window_released(ev.rank, ev.bytes)
            with self._lock:
                st = self._active.get(ev.request)
                if st is not None:
                    self._active[ev.request] = replace(
                        st,
                        done=st.done | {ev.rank: st.done.get(ev.rank, 0) + 1},
                        bytes=st.bytes | {ev.rank: st.bytes.get(ev.rank, 0) + ev.bytes},
                    )
                self._rate.setdefault(ev.rank, deque(maxlen=4096)).append((time.monotonic(), ev.bytes))
        elif isinstance(ev, WindowFetched):
            self.counters.window_fetched(ev.rank, ev.tiers, ev.bytes, ev.seconds)
        elif isinstance(ev, ObjectQuarantined):
            self.counters.object_quarantined(ev.tier)
        self.events.append(ev)

    # -- what a monitor draws ----------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        s = self.settings
        return EngineInfo(
            api=API_VERSION,
            version=__version__,
            engine=s.name,
            started_at=self.started_at,
            ranks=len(self.ranks),
            registration=RegistrationSummary(
                identity=self.reg.identity,
                model=self.reg.model,
                tensors=len(self.reg.tensors),
                bytes_per_chunk=self.reg.bytes_per_chunk,
                groups=tuple(self.reg.group_names),
            ),
            chunk_size=self.reg.chunk_size,
            tiers=tuple(s.tiers),
            w=s.w,
            rws_bytes=accounting.rws_bytes(self.reg, s.w) if s.w else None,
            pool_bytes=s.pool_bytes,
            budget_bytes=s.budget_bytes,
            max_tokens=s.max_tokens,
            kv_tokens=s.kv_tokens,
            fetch_timeout_s=s.fetch_timeout_s,
            faults_enabled=s.faults_enabled,
            fs_concurrency=s.fs_concurrency,
            tokenizer=s.tokenizer,
            overload_ceiling_s=s.overload_ceiling_s,
        )

    def pool(self, health: bool = False) -> list[PoolEntry]:
        out = []
        futures: list[Future[StatsResult] | None] = []
        states = self._calls.rank_health()
        for r, h in zip(self.ranks, states, strict=True):
            # A silent or starved rank is not asked (it would only make the caller wait): its health says why.
            asked = r.alive() and h.state is RankState.LIVE
            futures.append(r.submit(StatsRequest(health=health)) if asked else None)
        now = time.monotonic()
        for r, fut, h in zip(self.ranks, futures, states, strict=True):
            entry = PoolEntry(
                rank=r.rank,
                alive=r.alive(),
                healthy=h.healthy,
                reason=h.reason,
                heartbeat_age_s=h.heartbeat_age_s,
                last_fault=h.last_fault,
                state=h.state,
            )
            if fut is not None:
                try:
                    stats = fut.result(timeout=5.0)
                    tiers = _rank_tiers(stats)
                    entry = replace(entry, rank=stats.rank, pool=dict(stats.pool), tiers=tiers, tp_rank=stats.tp_rank)
                    if health:
                        with self._lock:
                            self._tier_views[r.rank] = (time.monotonic(), dict(tiers or {}))
                except Exception as e:  # noqa: BLE001 - a rank that cannot answer is shown as such
                    why = str(e) or "no answer to stats within 5s"
                    entry = replace(entry, alive=False, healthy=False, reason=why, error=why)
            with self._lock:
                recent = [(t, b) for t, b in self._rate.get(r.rank, ()) if now - t <= 5.0]
            out.append(replace(entry, restore_bps=sum(b for _, b in recent) / 5.0))
        return out

    def snapshot(self, health: bool = True, events_since: int | None = None) -> Snapshot:
        """What a monitor draws of the ranks, the tiers and the restores at once, with the engine's info (the
        coordinator adds the markers, the faults and the queue for blocks). ``events_since``: every event after
        that sequence number (up to 2,000) instead of the last 50, so a poller sees bursts whole."""
        ranks = self.pool(health=health)
        with self._lock:
            active = tuple(self._active.values())
            recent = tuple(self._recent)
        tiers = self.tier_health([(r.rank, r.tiers) for r in ranks if r.tiers is not None])
        return Snapshot(
            time=time.time(),
            info=self.info(),
            ranks=tuple(ranks),
            active=active,
            recent=recent,
            admission=Admission(
                budget_bytes=self.settings.budget_bytes,
                live_bytes=sum(r.live_bytes for r in ranks),
                queued=sum(r.waiters for r in ranks),
            ),
            tiers=tiers,
            events=[e.to_wire() for e in self._events_for(events_since)],
            seq=self.events.last_seq,
        )

    def _events_for(self, events_since: int | None) -> list[Event]:
        return self.events.recent(50) if events_since is None else self.events.since(events_since, limit=2000)

    # -- what the coordinator remembers --------------------------------------------------------------------------
    def recent(self) -> list[RecentRestore]:
        """The recent restores, newest first."""
        with self._lock:
            return list(self._recent)

    def remember(self, entry: RecentRestore) -> None:
        """A restore a host ran itself (a vLLM worker's load), listed first among the recent ones."""
        with self._lock:
            self._recent.appendleft(entry)

    def forget_injected_tier_failures(self) -> None:
        """A tier that failed only because of an injected fault is not remembered as failing once faults are
        cleared; a real failure stays until its TTL or the tier's next committed restore."""
        with self._lock:
            self._tier_failures = {t: v for t, v in self._tier_failures.items() if not v.injected}

    # -- the running restores ------------------------------------------------------------------------------------
    def restore_began(self, request: str, state: ActiveRestore, pass_no: int | None = None) -> None:
        """A restore started on every rank: shown live, and each rank's progress watched from now on (its events
        stamped with its admission pass ``pass_no``, until it ends)."""
        with self._lock:
            self._active[request] = state
            if pass_no is not None:
                self._passes[request] = pass_no
        self._calls.watch(request)

    def restore_over(self, request: str) -> None:
        self._calls.unwatch(request)
        with self._lock:
            self._active.pop(request, None)

    def is_restoring(self, request: str) -> bool:
        with self._lock:
            return request in self._active


__all__ = ["Observation"]
