"""The coordinator's calls to its ranks: every rank asked at once, with liveness, and the settings every rank
applies.

A rank is watched by its heartbeat (a rank in another process beats on its own) and, during a restore, by its
progress events; when a deadline passes, ``runtime/judge.py`` judges it by what the kernel knows: dead, stopped or
hung is the rank's fault, and a call to every rank fails fast (``RankUnresponsive``) instead of waiting out the whole
deadline; a rank the host starves has its deadline stretched up to the overload ceiling, past which the host is named
(``HostStarved``), never the rank. A call that meets a rank whose process is gone (judged dead), on a host that
starts it again, is refused with when to retry (``RankRestarting``). A rank call still running after its restore was
failed keeps the rank unhealthy until it returns.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from bsr_cli.api.ranks import (
    RankClient,
    RankRequest,
    ResetPeakRequest,
    SetBudgetRequest,
    SetFsConcurrencyRequest,
    UnsupportedOp,
)
from bsr_cli.core import accounting, limits
from bsr_cli.core.events import Failure
from bsr_cli.core.events import RankStarved as RankStarvedEvent
from bsr_cli.core.events import RankUnresponsive as RankUnresponsiveEvent
from bsr_cli.core.evidence import EventKind, FailureKind, RankState
from bsr_cli.core.status import RankFault, RankHealth
from bsr_cli.errors import BsrError, RankDied, RankRestarting, ServerError
from bsr_cli.runtime import failures
from bsr_cli.runtime.coordinator_state import (
    POLL_S,
    CoordinatorContext,
    HostStarved,
    RankRestarts,
    RankUnresponsive,
)
from bsr_cli.runtime.judge import Judge, Verdict

R = TypeVar("R")
# What a settings change that broke on a rank says to do next.
_RETRY = "`bsr status` shows the ranks' health; the engine's log says what the rank raised, then retry"
_HEARTBEAT = "heartbeat"  # the judge's key for a rank's heartbeat (a restore's progress is keyed by its request)
_CALL = "call"

# The settings each rank holds itself, as the API names them, with the request that sets one (the default W is the
# coordinator's alone).
RANK_SETTINGS: dict[str, Callable[[int], RankRequest[Any]]] = {
    "budget_bytes": SetBudgetRequest,
    "fs_concurrency": SetFsConcurrencyRequest,
}


@dataclass
class OutOfStep:
    """A rank that may hold other values than the engine's for ``names`` (it did not confirm a change, or the
    put-back after a failed one). ``calls``: the settings calls sent to it; nothing is sent again until all have
    returned (the order a rank applies calls in flight is not known), then the engine's values are, and it is in
    step once those succeed (``resent``)."""

    rank: RankClient
    names: set[str]
    calls: list[Future[Any]]
    why: str
    resent: bool = False


def _confirmed(fut: Future[Any]) -> bool:
    """A settings call that left the rank with the value sent (a host that does not serve the op has no such
    setting to differ in)."""
    return fut.done() and (fut.exception() is None or isinstance(fut.exception(), UnsupportedOp))


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
        # The host's restarts of dead ranks (None: a dead rank stays dead). Settings changes, the put-backs and a
        # restarted rank's adoption run one at a time (``_settings_lock``); ranks that may hold other values than
        # the engine's, by their place in the list.
        self.restarts: RankRestarts | None = None
        self._settings_lock = threading.RLock()
        self._out_of_step: dict[int, OutOfStep] = {}

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

    def _gather(
        self, ranks: Sequence[RankClient], futures: Sequence[Future[R]], timeout_s: float, what: str
    ) -> list[R]:
        """Every rank's answer to one call (``futures``: one per rank of ``ranks``, the ranks it was sent to),
        failing fast when a rank is judged dead (``RankRestarting`` where the host starts it again), stopped or
        hung (``RankUnresponsive``) or the host starved it past the overload ceiling (``HostStarved``), instead of
        waiting out the whole deadline; the call's own deadline is judged the same way (never for time the
        coordinator did not run)."""
        start = time.monotonic()
        key = (_CALL, id(futures))
        pending = [f for f in futures if not f.done()]
        try:
            while pending:
                wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                pending = [f for f in pending if not f.done()]
                for r, f in zip(ranks, futures, strict=True):
                    if not f.done():
                        self._judge_call(r, (r.rank, key), start, timeout_s, what)
        finally:
            for r in ranks:
                self.judge.forget((r.rank, key))
        return [self._answer(r, f, what) for r, f in zip(ranks, futures, strict=True)]

    def _answer(self, r: RankClient, f: Future[R], what: str) -> R:
        """One rank's answer; a call that failed because the rank's process is gone is ``unavailable``."""
        try:
            return f.result()
        except Exception as e:
            # A broken pipe says the process is going before the kernel may report it gone (``alive`` can still
            # be true for a moment after a SIGKILL): unavailable either way, not a server error.
            alive = r.alive()
            if alive and not isinstance(e, RankDied):
                raise
            why = f"{'its pipe closed' if alive else self._down(r)} during {what}"
            self.rank_fault(r.rank, why)
            raise self.unavailable(r, why, dead=True) from e

    @staticmethod
    def _down(r: RankClient) -> str:
        """Why rank ``r``'s process is gone, as its client says (``down_reason``, optional), e.g. ``killed by
        SIGKILL``."""
        reason = getattr(r, "down_reason", None)
        return f"its process is not running ({reason})" if reason else "its process is not running"

    def unavailable(self, r: RankClient, why: str, *, dead: bool = False) -> RankRestarting | RankUnresponsive:
        """The error for a call that met rank ``r`` unable to answer (503 either way): ``RankRestarting``, with
        when to retry, when its process is gone (``dead``: the judge found it so, else its client says it) and the
        host starts it again; ``RankUnresponsive`` otherwise (stopped, hung, or a host that restarts no rank)."""
        if (r.alive() and not dead) or self.restarts is None:
            return RankUnresponsive(r.rank, why)
        replaced = all(x is not r for x in self.ranks)
        wait_s = 0.0 if replaced else max(0.0, self.restarts.restart_in(r.rank))
        retry = max(1, math.ceil(wait_s))
        if replaced:
            when = "it has been started again since"
        elif wait_s == 0:
            when = "the engine is starting it again"
        else:
            when = f"the engine starts it again in {retry}s"
        return RankRestarting(
            f"rank {r.rank} is down ({why}): {when}",
            hint=f"retry in {retry}s; `bsr engine status` shows the rank's restarts",
            rank=r.rank,
            retry_after_s=retry,
        )

    def _judge_call(self, r: RankClient, key: tuple[int, object], start: float, timeout_s: float, what: str) -> None:
        verdict = self.liveness(r)
        late = ""
        if not verdict.final:
            verdict, fresh = self.judge.judge(r, key, start, timeout_s, self.ceiling_s, f"no answer to {what}")
            if fresh:
                self.rank_starved(r.rank, verdict, None)
            late = " (the call's deadline)"
        if verdict.blames_rank:
            # A dead rank says why its process is gone (``exit code -9``); the host may be starting it again.
            said = self._down(r) if verdict.state is RankState.DEAD else verdict.reason
            reason = f"{said} during {what}{late}"
            self.rank_fault(r.rank, reason)
            raise self.unavailable(r, reason, dead=verdict.state is RankState.DEAD)
        if verdict.names_host:
            raise HostStarved(r.rank, f"{verdict.reason} during {what}", verdict.load)

    def call_all(self, request: RankRequest[R], timeout_s: float | None = None) -> list[R]:
        """The same request on every rank; each rank's typed result, in rank order."""
        ranks = list(self.ranks)  # a rank started again meanwhile was not sent this call
        futures = [r.submit(request) for r in ranks]
        return self._gather(ranks, futures, timeout_s or self.settings.call_timeout_s, request.op)

    def restart_retry_after(self) -> int | None:
        """Seconds (at least 1) until the host next tries to start a dead rank again (1 when none is down any more:
        it was just started again); None when the host does not restart ranks. What /health's 503 says in
        Retry-After while it names a rank that is not running."""
        if self.restarts is None:
            return None
        waits = [self.restarts.restart_in(r.rank) for r in self.ranks if not r.alive()]
        return max(1, math.ceil(min(waits, default=0.0)))

    # -- settings every rank applies -------------------------------------------------------------------------------
    def update_settings(
        self, *, budget_bytes: int | None = None, fs_concurrency: int | None = None, w: int | None = None
    ) -> None:
        """Change B, the filesystem load concurrency and the default W at run time. The resulting set is checked
        as `bsr engine up` checks it (raises InvalidInput) and applied to every rank or to none (``apply``)."""
        with self._settings_lock:
            s = self.settings
            budget = s.budget_bytes if budget_bytes is None else budget_bytes
            fsc = s.fs_concurrency if fs_concurrency is None else fs_concurrency
            new_w = s.w if w is None else w
            if w is not None:
                limits.check_request_window(self.reg, accounting.check_window(w), s.max_tokens)
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
            given = {"budget_bytes": budget_bytes, "fs_concurrency": fs_concurrency}
            self.apply({name: value for name, value in given.items() if value is not None})
            s.w = new_w

    def set_budget(self, budget_bytes: int) -> None:
        """Every rank's admission budget B, then the engine's setting (all or nothing, as ``apply``)."""
        self.apply({"budget_bytes": budget_bytes})

    def set_fs_concurrency(self, value: int) -> None:
        self.apply({"fs_concurrency": value})

    def apply(self, changes: Mapping[str, int]) -> None:
        """Set rank settings (``RANK_SETTINGS`` names) on every rank, then the engine's. Refused before any rank is
        asked while one cannot answer (dead: ``RankRestarting``; silent or out of step: ``RankUnresponsive``); a
        rank that fails the change has the ranks that took it put back, and the error says what each rank holds."""
        if not changes:
            return
        with self._settings_lock:
            self._settle_locked()
            self._refuse_unless_every_rank_answers()
            ranks = list(self.ranks)
            sent: dict[str, list[Future[Any]]] = {}
            for name, value in changes.items():
                request = RANK_SETTINGS[name](value)
                sent[name] = [r.submit(request) for r in ranks]
                try:
                    self._gather(ranks, sent[name], self.settings.call_timeout_s, request.op)
                except Exception as e:  # raised again, saying what each rank holds after the put-back
                    raise self._put_back(ranks, sent, changes, e) from e
            for name, value in changes.items():
                setattr(self.settings, name, value)
            for i, o in list(self._out_of_step.items()):
                o.names -= set(changes)  # every rank confirmed these, and no older call of it was in flight
                if not o.names:
                    del self._out_of_step[i]

    def _refuse_unless_every_rank_answers(self) -> None:
        for i, r in enumerate(self.ranks):
            verdict = self.liveness(r)
            if verdict.names_host:  # the host starved it past the overload ceiling: the host's, not the rank's
                raise HostStarved(r.rank, f"{verdict.reason}; no settings were changed", verdict.load)
            if verdict.final:
                dead = verdict.state is RankState.DEAD
                raise self.unavailable(r, f"{verdict.reason}; no settings were changed", dead=dead)
            o = self._out_of_step.get(i)
            if o is not None:
                wait(o.calls, timeout=self.stall_s)  # a rank that answers again returns its late calls at once
                if not all(f.done() for f in o.calls):
                    raise RankUnresponsive(r.rank, f"it has not answered an earlier settings change ({o.why})")

    def _put_back(
        self,
        ranks: Sequence[RankClient],
        sent: Mapping[str, Sequence[Future[Any]]],
        changes: Mapping[str, int],
        cause: Exception,
    ) -> BsrError:
        """After a change failed on some rank: each rank that took a new value is sent the engine's value again;
        a rank that did not answer, or does not confirm the put-back within the stall time, is out of step. The
        error (``cause``'s kind) says what each rank holds."""
        back: dict[tuple[int, str], Future[Any]] = {}
        for name, futures in sent.items():
            for i, (r, f) in enumerate(zip(ranks, futures, strict=True)):
                if f.done() and f.exception() is None:
                    back[(i, name)] = r.submit(RANK_SETTINGS[name](getattr(self.settings, name)))
        wait(list(back.values()), timeout=self.stall_s)
        held: list[str] = []
        for name, futures in sent.items():
            old, new = getattr(self.settings, name), changes[name]
            for i, (r, f) in enumerate(zip(ranks, futures, strict=True)):
                put = back.get((i, name))
                if put is not None and _confirmed(put):
                    held.append(f"rank {r.rank} was put back to {name} {old}")
                    continue
                if not r.alive():
                    held.append(f"rank {r.rank} is down and starts again with {name} {old}")
                    continue
                if f.done() and put is None:
                    continue  # it refused the change: it keeps the engine's value
                calls = [f] + ([put] if put is not None else [])
                why = f"{name} {new} sent, {old} not confirmed"
                held.append(f"rank {r.rank} may hold {name} {new} until it confirms {old}")
                o = self._out_of_step.setdefault(i, OutOfStep(r, set(), [], why))
                o.names.add(name)
                o.calls.extend(calls)
                o.why, o.resent = why, False
        if not held:
            return (
                cause if isinstance(cause, BsrError) else ServerError(f"{type(cause).__name__}: {cause}", hint=_RETRY)
            )
        message = f"{', '.join(changes)} not changed: {getattr(cause, 'message', cause)}; {'; '.join(held)}"
        if not isinstance(cause, BsrError):
            return ServerError(message, hint=_RETRY)
        cause.message, cause.args = message, (message,)
        return cause

    def settle(self) -> None:
        """Send the engine's values again to each rank out of step whose settings calls have all returned (the
        host's loop calls this; every change does it first); a rank is in step once they are confirmed."""
        if self._out_of_step:
            with self._settings_lock:
                self._settle_locked()

    def _settle_locked(self) -> None:
        for i, o in list(self._out_of_step.items()):
            if i >= len(self.ranks) or self.ranks[i] is not o.rank:
                del self._out_of_step[i]  # started again: it took the engine's values before it served (adopt)
            elif not all(f.done() for f in o.calls):
                continue
            elif o.resent and all(_confirmed(f) for f in o.calls):
                del self._out_of_step[i]
            elif self.silent(o.rank) is None:
                o.calls = [o.rank.submit(RANK_SETTINGS[name](getattr(self.settings, name))) for name in sorted(o.names)]
                o.resent = True

    def adopt(self, index: int, rank: RankClient) -> None:
        """A rank started again takes its predecessor's place once it confirmed the engine's settings: changes are
        refused while the old one is down and wait for this, so it never serves other values than the engine
        reports. Raises when it does not confirm them (the host then starts it again)."""
        with self._settings_lock:
            for name, request in RANK_SETTINGS.items():
                fut = rank.submit(request(getattr(self.settings, name)))
                wait([fut], timeout=self.settings.call_timeout_s)
                if not fut.done():
                    raise TimeoutError(f"rank {rank.rank} did not confirm {name} {getattr(self.settings, name)}")
                if not _confirmed(fut):
                    raise fut.exception()  # type: ignore[misc]  # done and not confirmed: it failed
            self.ranks[index] = rank
            self._out_of_step.pop(index, None)

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
            healthy = not state.rank_at_fault
            if state is RankState.LIVE and stuck:
                host = [req for req, kind in sorted(stuck.items()) if kind is FailureKind.HOST_OVERLOADED]
                own = [req for req in sorted(stuck) if req not in host]
                state = RankState.HUNG if own else RankState.STARVED
                healthy = not own
                why = (
                    f"restore of {', '.join(own)} still running past its deadline"
                    if own
                    else f"restore of {', '.join(host)} still running after the host overloaded it"
                )
            step = self._out_of_step.get(r.rank)
            if healthy and step is not None:
                # It runs, but may serve other settings than the engine reports: unhealthy until it confirms them.
                healthy, why = False, f"its settings may differ from the engine's ({step.why})"
            age_fn = getattr(r, "heartbeat_age", None)
            out.append(
                RankHealth(
                    rank=r.rank,
                    healthy=healthy,
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


__all__ = ["RANK_SETTINGS", "OutOfStep", "RankCalls"]
