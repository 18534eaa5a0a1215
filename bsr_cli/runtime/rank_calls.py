"""The coordinator's calls to its ranks: every rank asked at once, with liveness, and the settings every rank
applies.

A rank is watched by its heartbeat (a rank in another process beats on its own) and, during a restore, by its
progress events; when a deadline passes, ``runtime/judge.py`` judges it by what the kernel knows: dead, stopped or
hung is the rank's fault, and a call to every rank fails fast (``RankUnresponsive``) instead of waiting out the whole
deadline; a rank the host starves has its deadline stretched up to the overload ceiling, past which the host is named
(``HostStarved``), never the rank. A rank call still running after its restore was failed keeps the rank unhealthy
until it returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

from bsr_cli.api.ranks import (
    RankClient,
    RankRequest,
    ResetPeakRequest,
    SetBudgetRequest,
    SetFsConcurrencyRequest,
)
from bsr_cli.core import limits
from bsr_cli.core.events import Failure
from bsr_cli.core.events import RankStarved as RankStarvedEvent
from bsr_cli.core.events import RankUnresponsive as RankUnresponsiveEvent
from bsr_cli.core.evidence import EventKind, FailureKind, RankState
from bsr_cli.core.status import RankFault, RankHealth
from bsr_cli.runtime import failures
from bsr_cli.runtime.coordinator_state import POLL_S, CoordinatorContext, HostStarved, RankUnresponsive
from bsr_cli.runtime.judge import Judge, Verdict

R = TypeVar("R")
_HEARTBEAT = "heartbeat"  # the judge's key for a rank's heartbeat (a restore's progress is keyed by its request)
_CALL = "call"


class RankCalls:
    """Owns each rank's liveness: the last progress of every running restore per rank, each rank's last fault and
    the rank calls still running past their restore (under ``_lock``)."""

    def __init__(self, ctx: CoordinatorContext) -> None:
        self.reg = ctx.reg
        self.ranks = ctx.ranks
        self.settings = ctx.settings
        self.events = ctx.events
        self.counters = ctx.counters
        self._lock = threading.Lock()
        # Per (request, rank) the time and kind of the last progress event of a running restore (None: it just
        # started); the last fault seen on each rank; per rank the requests whose rank call is still running after
        # the restore was failed.
        self._progress: dict[tuple[str, int], tuple[float, EventKind | None]] = {}
        self._rank_faults: dict[int, RankFault] = {}
        self._stuck: dict[int, dict[str, FailureKind]] = {}
        # Judges a quiet rank by what the kernel knows (dead, stopped, hung, or starved by the host).
        self.judge = Judge()

    # -- liveness ----------------------------------------------------------------------------------------------
    @property
    def stall_s(self) -> float:
        """A rank silent this long (no heartbeat) is judged: derived from the fetch timeout, at least 1 s."""
        return max(1.0, float(self.settings.fetch_timeout_s))

    @property
    def ceiling_s(self) -> float:
        """The longest a deadline is stretched while the host starves a rank (the engine's overload ceiling)."""
        return float(self.settings.overload_ceiling_s)

    def liveness(self, r: RankClient) -> Verdict:
        """The judge's verdict on rank ``r``'s heartbeat (``runtime/judge.py``): live, starved (its deadline
        stretched), or judged dead, stopped, hung, or starved past the ceiling (the host's)."""
        age_fn = getattr(r, "heartbeat_age", None)
        age = float(age_fn()) if age_fn is not None else 0.0  # a rank that does not beat is judged by progress
        last = time.monotonic() - age
        verdict, fresh = self.judge.judge(r, (r.rank, _HEARTBEAT), last, self.stall_s, self.ceiling_s, "no heartbeat")
        if fresh:
            self.rank_starved(r.rank, verdict, None)
        return verdict

    def silent(self, r: RankClient) -> str | None:
        """Why rank ``r`` cannot answer now (a final verdict: dead, stopped, hung, or starved past the overload
        ceiling), or None."""
        verdict = self.liveness(r)
        return verdict.reason if verdict.final else None

    def judge_progress(self, request: str, r: RankClient) -> Verdict:
        """The per-window progress deadline of ``request``'s restore on rank ``r``: 2 x the fetch timeout since its
        last progress (plus the admission deadline while it waits for budget), judged as a heartbeat is."""
        at, what = self.last_progress(request, r.rank) or (time.monotonic(), None)
        waiting = what is EventKind.WINDOW_WAITING
        limit = 2 * self.settings.fetch_timeout_s + (self.settings.admit_timeout_s if waiting else 0)
        verdict, fresh = self.judge.judge(r, (r.rank, request), at, limit, self.ceiling_s, "no restore progress")
        if fresh:
            self.rank_starved(r.rank, verdict, request)
        return verdict

    def rank_fault(self, rank: int, reason: str, request: str | None = None) -> None:
        """A rank stopped answering (no heartbeat, no progress): remembered, counted and logged."""
        with self._lock:
            self._rank_faults[rank] = RankFault(reason=reason, request=request, at=time.time())
        self.counters.unresponsive.labels(str(rank)).inc()
        self.events.append(RankUnresponsiveEvent(rank=rank, reason=reason, request=request))

    def rank_starved(self, rank: int, verdict: Verdict, request: str | None) -> None:
        """A rank's deadline ran out while the host starved it (or the judge cannot tell): stretched, not blamed;
        counted and logged once per episode."""
        self.counters.starved.labels(str(rank)).inc()
        self.events.append(
            RankStarvedEvent(rank=rank, reason=verdict.reason, request=request, state=verdict.state, load=verdict.load)
        )

    def note_rank_failures(self, fails: Sequence[Failure], request: str) -> None:
        """A rank that failed at its own stage (install, synchronize) is remembered as that rank's last fault, so
        `bsr status` says "rank N failed at install"; it still answers, so it stays healthy."""
        with self._lock:
            for f in fails:
                if f.kind is FailureKind.RANK and f.rank is not None and f.stage is not None:
                    self._rank_faults[f.rank] = RankFault(
                        reason=failures.describe(f), request=request, at=time.time(), stage=f.stage
                    )

    def _gather(self, futures: Sequence[Future[R]], timeout_s: float, what: str) -> list[R]:
        """Every rank's answer to one call, failing fast when a rank is judged dead, stopped or hung
        (``RankUnresponsive``) or the host starved it past the overload ceiling (``HostStarved``), instead of
        waiting out the whole deadline; the call's own deadline is judged the same way (never for time the
        coordinator did not run)."""
        start = time.monotonic()
        key = (_CALL, id(futures))
        pending = [f for f in futures if not f.done()]
        try:
            while pending:
                wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                pending = [f for f in pending if not f.done()]
                for r, f in zip(self.ranks, futures, strict=True):
                    if not f.done():
                        self._judge_call(r, (r.rank, key), start, timeout_s, what)
        finally:
            for r in self.ranks:
                self.judge.forget((r.rank, key))
        return [f.result() for f in futures]

    def _judge_call(self, r: RankClient, key: tuple[int, object], start: float, timeout_s: float, what: str) -> None:
        verdict = self.liveness(r)
        late = ""
        if not verdict.final:
            verdict, fresh = self.judge.judge(r, key, start, timeout_s, self.ceiling_s, f"no answer to {what}")
            if fresh:
                self.rank_starved(r.rank, verdict, None)
            late = " (the call's deadline)"
        if verdict.blames_rank:
            reason = f"{verdict.reason} during {what}{late}"
            self.rank_fault(r.rank, reason)
            raise RankUnresponsive(r.rank, reason)
        if verdict.names_host:
            raise HostStarved(r.rank, f"{verdict.reason} during {what}", verdict.load)

    def call_all(self, request: RankRequest[R], timeout_s: float | None = None) -> list[R]:
        """The same request on every rank; each rank's typed result, in rank order."""
        futures = [r.submit(request) for r in self.ranks]
        return self._gather(futures, timeout_s or self.settings.call_timeout_s, request.op)

    # -- settings every rank applies -------------------------------------------------------------------------------
    def update_settings(
        self, *, budget_bytes: int | None = None, fs_concurrency: int | None = None, w: int | None = None
    ) -> None:
        """Change B, the filesystem load concurrency and the default W at run time. The resulting set is checked
        as `bsr engine up` checks it and applied whole or not at all (raises InvalidInput/CapacityError)."""
        s = self.settings
        budget = s.budget_bytes if budget_bytes is None else budget_bytes
        fsc = s.fs_concurrency if fs_concurrency is None else fs_concurrency
        new_w = s.w if w is None else w
        limits.check_engine_settings(
            self.reg,
            w=new_w,
            pool_bytes=s.pool_bytes or None,
            budget_bytes=budget,
            max_tokens=s.max_tokens,
            kv_tokens=s.kv_tokens,
            fs_concurrency=fsc,
            fetch_timeout_s=s.fetch_timeout_s,
            window_within_budget=False,  # B may be set for the W of particular requests (the benchmarks do)
        )
        if budget_bytes is not None:
            self.set_budget(budget)
        if fs_concurrency is not None:
            self.set_fs_concurrency(fsc)
        s.w = new_w

    def set_budget(self, budget_bytes: int) -> None:
        """Every rank's admission budget B, then the engine's setting."""
        self.call_all(SetBudgetRequest(budget_bytes))
        self.settings.budget_bytes = budget_bytes

    def set_fs_concurrency(self, value: int) -> None:
        self.call_all(SetFsConcurrencyRequest(value))
        self.settings.fs_concurrency = value

    def reset_peak(self) -> None:
        self.call_all(ResetPeakRequest())

    # -- rank health ----------------------------------------------------------------------------------------
    def rank_health(self) -> list[RankHealth]:
        """Per rank: healthy when its process runs, it beats (or the host is what keeps it from beating: starved,
        shown as such) and no call of it is stuck past its deadline through its own fault."""
        out = []
        for r in self.ranks:
            verdict = self.liveness(r)
            with self._lock:
                stuck = dict(self._stuck.get(r.rank, {}))
                last = self._rank_faults.get(r.rank)
            state, why = verdict.state, verdict.reason or None
            if state is RankState.LIVE and stuck:
                host = [req for req, kind in sorted(stuck.items()) if kind is FailureKind.HOST_OVERLOADED]
                own = [req for req in sorted(stuck) if req not in host]
                state = RankState.HUNG if own else RankState.STARVED
                why = (
                    f"restore of {', '.join(own)} still running past its deadline"
                    if own
                    else f"restore of {', '.join(host)} still running after the host overloaded it"
                )
            age_fn = getattr(r, "heartbeat_age", None)
            out.append(
                RankHealth(
                    rank=r.rank,
                    healthy=not state.rank_at_fault,
                    alive=r.alive(),
                    heartbeat_age_s=round(age_fn(), 3) if age_fn is not None else None,
                    reason=why,
                    last_fault=last,
                    state=state,
                )
            )
        return out

    def rank_faults(self) -> dict[int, RankFault]:
        """Each rank's last fault (it stopped answering, or failed at its own stage)."""
        with self._lock:
            return dict(self._rank_faults)

    # -- a restore's progress -----------------------------------------------------------------------------------
    def watch(self, request: str) -> None:
        """Watch every rank's progress on ``request``'s restore from now on."""
        now = time.monotonic()
        with self._lock:
            for r in self.ranks:
                self._progress[(request, r.rank)] = (now, None)

    def unwatch(self, request: str) -> None:
        with self._lock:
            for r in self.ranks:
                self._progress.pop((request, r.rank), None)
        for r in self.ranks:
            self.judge.forget((r.rank, request))

    def progressed(self, request: str, rank: int, kind: EventKind) -> None:
        """A progress event of a watched restore (one not watched, or no longer, is ignored)."""
        with self._lock:
            if (request, rank) in self._progress:
                self._progress[(request, rank)] = (time.monotonic(), kind)

    def last_progress(self, request: str, rank: int) -> tuple[float, EventKind | None] | None:
        """When ``rank`` last made progress on ``request``'s restore, and what it was (None: it only started)."""
        with self._lock:
            return self._progress.get((request, rank))

    def note_stuck(self, rank: int, request: str, fut: Future[Any], kind: FailureKind = FailureKind.RANK) -> None:
        """A rank call still running after its restore was failed: the rank is unhealthy until it returns (shown
        starved instead when the restore failed because the host starved it: ``kind`` host_overloaded)."""
        with self._lock:
            self._stuck.setdefault(rank, {})[request] = kind

        def done(_: Future[Any]) -> None:
            with self._lock:
                self._stuck.get(rank, {}).pop(request, None)

        fut.add_done_callback(done)


__all__ = ["RankCalls"]
