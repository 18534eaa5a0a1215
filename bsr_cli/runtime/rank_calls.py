"""The coordinator's calls to its ranks: every rank asked at once, with liveness, and the settings every rank
applies.

A rank is judged by its heartbeat (a rank in another process beats on its own) and, during a restore, by its
progress events; a call to every rank fails fast (``RankUnresponsive``) when a rank stops beating instead of waiting
out the whole deadline. A rank call still running after its restore was failed keeps the rank unhealthy until it
returns.
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
from bsr_cli.core.events import RankUnresponsive as RankUnresponsiveEvent
from bsr_cli.core.evidence import EventKind, FailureKind
from bsr_cli.core.status import RankFault, RankHealth
from bsr_cli.runtime import failures
from bsr_cli.runtime.coordinator_state import POLL_S, CoordinatorContext, RankUnresponsive

R = TypeVar("R")


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
        self._stuck: dict[int, set[str]] = {}

    # -- liveness ----------------------------------------------------------------------------------------------
    @property
    def stall_s(self) -> float:
        """A rank silent this long (no heartbeat) is stalled: derived from the fetch timeout, at least 1 s."""
        return max(1.0, float(self.settings.fetch_timeout_s))

    def silent(self, r: RankClient) -> str | None:
        """Why rank ``r`` cannot answer now (dead, or no heartbeat for longer than stall_s), or None."""
        if not r.alive():
            return "its process is not running"
        age_fn = getattr(r, "heartbeat_age", None)
        age = age_fn() if age_fn is not None else None
        if age is not None and age > self.stall_s:
            return f"no heartbeat for {age:.1f}s (process stopped or hung)"
        return None

    def rank_fault(self, rank: int, reason: str, request: str | None = None) -> None:
        """A rank stopped answering (no heartbeat, no progress): remembered, counted and logged."""
        with self._lock:
            self._rank_faults[rank] = RankFault(reason=reason, request=request, at=time.time())
        self.counters.unresponsive.labels(str(rank)).inc()
        self.events.append(RankUnresponsiveEvent(rank=rank, reason=reason, request=request))

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
        """Every rank's answer to one call, failing fast (RankUnresponsive) when a rank stops beating instead of
        waiting out the whole deadline."""
        deadline = time.monotonic() + timeout_s
        pending = [f for f in futures if not f.done()]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                r = next(r for r, f in zip(self.ranks, futures, strict=True) if not f.done())
                reason = f"did not answer {what} within {timeout_s:.0f}s"
                self.rank_fault(r.rank, reason)
                raise RankUnresponsive(r.rank, reason)
            wait(pending, timeout=min(POLL_S, left), return_when=FIRST_COMPLETED)
            pending = [f for f in pending if not f.done()]
            for r, f in zip(self.ranks, futures, strict=True):
                why = None if f.done() else self.silent(r)
                if why:
                    self.rank_fault(r.rank, f"{why} during {what}")
                    raise RankUnresponsive(r.rank, f"{why} during {what}")
        return [f.result() for f in futures]

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
        """Per rank: healthy when its process runs, it beats, and no call of it is stuck past its deadline."""
        out = []
        for r in self.ranks:
            why = self.silent(r)
            with self._lock:
                stuck = sorted(self._stuck.get(r.rank, ()))
                last = self._rank_faults.get(r.rank)
            if why is None and stuck:
                why = f"restore of {', '.join(stuck)} still running past its deadline"
            age_fn = getattr(r, "heartbeat_age", None)
            out.append(
                RankHealth(
                    rank=r.rank,
                    healthy=why is None,
                    alive=r.alive(),
                    heartbeat_age_s=round(age_fn(), 3) if age_fn is not None else None,
                    reason=why,
                    last_fault=last,
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

    def progressed(self, request: str, rank: int, kind: EventKind) -> None:
        """A progress event of a watched restore (one not watched, or no longer, is ignored)."""
        with self._lock:
            if (request, rank) in self._progress:
                self._progress[(request, rank)] = (time.monotonic(), kind)

    def last_progress(self, request: str, rank: int) -> tuple[float, EventKind | None] | None:
        """When ``rank`` last made progress on ``request``'s restore, and what it was (None: it only started)."""
        with self._lock:
            return self._progress.get((request, rank))

    def note_stuck(self, rank: int, request: str, fut: Future[Any]) -> None:
        """A rank call still running after its restore was failed: the rank is unhealthy until it returns."""
        with self._lock:
            self._stuck.setdefault(rank, set()).add(request)

        def done(_: Future[Any]) -> None:
            with self._lock:
                self._stuck.get(rank, set()).discard(request)

        fut.add_done_callback(done)


__all__ = ["RankCalls"]
