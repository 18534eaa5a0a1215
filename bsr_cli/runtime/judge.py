"""Whether a rank that went quiet is at fault, or the host: the one place a missed heartbeat or a missed progress
deadline is judged.

On an overloaded host every process is late, the coordinator included, so a deadline alone cannot tell a rank
that stopped from one that waited to run. When a rank is past its deadline the judge asks the kernel
(``runtime/liveness.py``) and the coordinator's own clock, and gives one ``Verdict``:

    dead      no process (or a zombie)                                      the rank's fault, at once
    stopped   /proc/PID/stat state T or t (SIGSTOP, a debugger)             the rank's fault, at once
    starved   it waited to run: its threads waited in the run queue for     nobody's yet: the deadline stretches,
              half the span looked at and got at most a quarter of the      up to the engine's overload ceiling;
              CPU they asked for; or a thread of it is runnable now and    past it, the host's (host_overloaded)
              it ran next to nothing (a wait schedstat counts only when
              it ends); or the coordinator itself ran late by half the
              span; or (where the rank's own figures cannot be read) the
              host is under pressure (PSI)
    hung      alive, able to run, the host has CPU, still no progress      the rank's fault; one whose threads ran
              while idle (its threads neither ran nor waited to run for    or waited to run for half the span
              half the span)                                                (busy, or sharing a busy host) is
                                                                            stretched like unknown first
    unknown   the kernel cannot say which of starved and hung               stretched like starved; at the ceiling
                                                                            judged hung (nothing shows starvation)

The coordinator never blames a rank for time in which it did not run itself: silence is measured on a
``JudgeClock``, which leaves out every span in which the coordinator's own loop was late (a SIGSTOP of the engine,
a starved host), and a rank that has said something the coordinator has not yet read (heartbeats queued in its
pipe after a SIGCONT) is live. Which failure kind a verdict makes, and whom it blames, is ``runtime/failures.py``'s.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from bsr_cli.core.evidence import RankState
from bsr_cli.core.overload import HostLoad, Psi, RankDelay
from bsr_cli.runtime.liveness import (
    CpuGrowth,
    Pressure,
    ProcessReader,
    ProcReader,
    ProcState,
    RunDelays,
    Threads,
    cpu_growth,
)

STARVED_SHARE = 0.5  # waited to run for at least this share of the span looked at ...
STARVED_GOT = 0.25  # ... and got at most this share of the CPU it asked for: starved
IDLE_RAN_SHARE = 0.05  # ran at most this share of the span: next to nothing (see `waiting_now`)
OCCUPIED_SHARE = 0.5  # ran, or waited to run, for at least this share of the span: not idle (see `occupied`)
PSI_CPU_STARVED = 50.0  # cpu "some" avg10 (%) at or above which the host starves runnable tasks
PSI_STALL_STARVED = 20.0  # memory or io "full" avg10 (%): every task stalled for a fifth of the time
MIN_SPAN_S = 1.0  # evidence is gathered over at least this long before a rank is judged hung
EVIDENCE_EVERY_S = 0.5  # a suspect rank's /proc files are read at most this often
# The ceiling on stretched deadlines (`bsr engine up --overload-ceiling`), and its bounds.
DEFAULT_OVERLOAD_CEILING_S = 60.0
MAX_OVERLOAD_CEILING_S = 3600.0


class JudgeClock:
    """The coordinator's own lateness, one per process: a ticker thread wakes every ``TICK_S``, and whatever it
    (or any judge looking at the clock) finds beyond ``TICK_S + SLACK_S`` since the last look is time the process
    did not run. ``judged(since)`` is real time since then less that lost time."""

    TICK_S = 0.1
    SLACK_S = 0.05
    HORIZON_S = 3600.0  # lost time is remembered this long

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._lost = 0.0  # lost in total since this clock started
        self._marks: deque[tuple[float, float]] = deque()  # (when a lateness was found, total lost then)
        self._base = 0.0  # total lost at the oldest mark forgotten

    def observe(self) -> float:
        """Look at the clock: a look later than one tick (and its slack) after the previous one records the excess
        as lost. Returns now."""
        now = self._clock()
        with self._lock:
            late = now - self._last - self.TICK_S - self.SLACK_S
            if late > 0:
                self._lost += late
                self._marks.append((now, self._lost))
                while self._marks and self._marks[0][0] < now - self.HORIZON_S:
                    self._base = self._marks.popleft()[1]
            self._last = max(self._last, now)
        return now

    def lost(self, since: float) -> float:
        """Seconds the process did not run on time between ``since`` and now (a lateness found after ``since``
        counts whole: the judge errs towards not blaming)."""
        self.observe()
        with self._lock:
            i = bisect.bisect_right(self._marks, (since, float("inf")))
            before = self._marks[i - 1][1] if i else self._base
            return self._lost - before

    def judged(self, since: float) -> float:
        """Seconds since ``since`` in which the coordinator ran on time."""
        return max(0.0, self._clock() - since - self.lost(since))

    def tick_forever(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            self.observe()


_CLOCK: JudgeClock | None = None
_CLOCK_LOCK = threading.Lock()


def judge_clock() -> JudgeClock:
    """This process's judge clock (its ticker thread starts on first use)."""
    global _CLOCK
    with _CLOCK_LOCK:
        if _CLOCK is None:
            _CLOCK = JudgeClock()
            threading.Thread(target=_CLOCK.tick_forever, name="bsr-judge-clock", daemon=True).start()
        return _CLOCK


@dataclass(frozen=True)
class Evidence:
    """What the judge knows of one rank past (or near) its deadline."""

    rank: int
    what: str  # what is missing: "no heartbeat", "no restore progress"
    silent_s: float  # real seconds since the rank was last heard (or progressed)
    judged_s: float  # the same, less the time the coordinator itself did not run on time
    alive: bool
    state: ProcState
    unread: bool  # the rank has said something the coordinator has not read yet
    span_s: float  # how long the figures below were gathered over
    cpu: CpuGrowth | None  # what the rank's threads ran and waited to run over the span (None: unknown)
    coordinator_lag_s: float  # the coordinator's own lost time over the span
    pressure: Pressure
    in_process: bool = False  # the rank runs on the coordinator's threads: its delay is the coordinator's lag
    runnable_threads: int = 0  # its threads runnable now (state R), whose current wait schedstat has yet to count


@dataclass(frozen=True)
class Verdict:
    """The judge's answer for one rank: its state, one line saying why (with the figures), whether to act on it
    now (``final``: blame the rank, or name the host), and the figures."""

    state: RankState
    reason: str = ""
    final: bool = False
    load: HostLoad | None = None

    @property
    def blames_rank(self) -> bool:
        return self.final and self.state.rank_at_fault

    @property
    def names_host(self) -> bool:
        return self.final and self.state is RankState.STARVED


LIVE = Verdict(RankState.LIVE)


def cpu_starved(cpu: CpuGrowth, span_s: float) -> bool:
    """A process starved of CPU over a span: its threads waited to run for at least half of it, and got at most a
    quarter of the CPU they asked for (a process merely sharing a busy host gets more: two CPU-bound loops beside a
    polling thread on two cores leave it two thirds)."""
    asked = cpu.ran_s + cpu.waited_s
    return cpu.waited_s >= STARVED_SHARE * span_s and cpu.ran_s <= STARVED_GOT * asked


def occupied(cpu: CpuGrowth, span_s: float) -> bool:
    """A process that was not idle over a span: its threads ran, or waited to run, for at least half of it. A rank
    that says nothing while idle with CPU to spare is hung (a deadlock); one that was occupied may be busy in a long
    call or kept waiting by a busy host, and is not blamed before the overload ceiling."""
    return span_s > 0 and max(cpu.ran_s, cpu.waited_s) >= OCCUPIED_SHARE * span_s


def waiting_now(cpu: CpuGrowth, span_s: float, runnable_threads: int) -> bool:
    """A process waiting to run right now that the run-queue figures do not show yet: schedstat adds a wait to a
    thread's figure only when the wait ends (the thread gets a CPU), so a thread held off a CPU for the whole span
    (a CPU quota that throttles it, SCHED_IDLE beside busy loops) shows neither a wait nor a run. Runnable now (the
    kernel's state R) and ran next to nothing over the span: it is waiting, not idle."""
    return runnable_threads > 0 and span_s > 0 and cpu.ran_s <= IDLE_RAN_SHARE * span_s


def starved(
    cpu: CpuGrowth | None, span_s: float, coordinator_lag_s: float, state: ProcState, pressure: Pressure
) -> bool | None:
    """Whether a rank (or a fetch) was starved over a span: True, False, or None when the kernel cannot say.
    ``cpu``: what its threads ran and waited over the span (None: unknown); ``coordinator_lag_s``: the
    coordinator's own lost time in it. The rank's own figures decide when they are known (a host under pressure
    need not have starved a rank that slept in a deadlock); host pressure decides only where they are not."""
    mem, io = _full(pressure.memory), _full(pressure.io)
    if span_s > 0 and coordinator_lag_s >= STARVED_SHARE * span_s:
        return True
    if cpu is not None and span_s > 0 and cpu_starved(cpu, span_s):
        return True
    if state is ProcState.DISK and max(mem or 0.0, io or 0.0) >= PSI_STALL_STARVED:
        return True  # waiting on a page or a disk the whole host is stalled on
    if cpu is not None:
        return False
    host_cpu = pressure.cpu.some_avg10 if pressure.cpu is not None else None
    if (host_cpu or 0.0) >= PSI_CPU_STARVED or max(mem or 0.0, io or 0.0) >= PSI_STALL_STARVED:
        return True
    return None if host_cpu is None or mem is None or io is None else False


def fetch_starved(rank: int, before: RunDelays | None, after: RunDelays | None, pressure: Pressure) -> HostLoad | None:
    """A rank's own verdict on a fetch deadline that ran out: the figures when the rank waited to run for a large
    share of the time since the fetch began (its threads' run-queue delay; the host's pressure where that cannot be
    read), so the failure is the host's and no tier is blamed; None when it could run (the tier was late)."""
    span = after.at - before.at if before is not None and after is not None else 0.0
    cpu = cpu_growth(before, after) if before is not None and after is not None and span > 0 else None
    if not starved(cpu, span, 0.0, ProcState.RUNNING, pressure):
        return None
    return HostLoad(
        span_s=round(span, 3),
        ranks=(_rank_delay(rank, RankState.STARVED, cpu),),
        cpu=pressure.cpu,
        memory=pressure.memory,
        io=pressure.io,
    )


def _full(psi: Psi | None) -> float | None:
    if psi is None:
        return None
    return psi.full_avg10 if psi.full_avg10 is not None else psi.some_avg10


def _rank_delay(rank: int, state: RankState, cpu: CpuGrowth | None) -> RankDelay:
    if cpu is None:
        return RankDelay(rank, state)
    return RankDelay(rank, state, run_delay_s=round(cpu.waited_s, 3), ran_s=round(cpu.ran_s, 3))


def load_of(e: Evidence, state: RankState) -> HostLoad:
    p = e.pressure
    return HostLoad(
        span_s=round(e.span_s, 3),
        coordinator_lag_s=round(e.coordinator_lag_s, 3),
        ranks=(_rank_delay(e.rank, state, e.cpu),),
        cpu=p.cpu,
        memory=p.memory,
        io=p.io,
    )


def judge(e: Evidence, deadline_s: float, ceiling_s: float) -> Verdict:
    """The verdict on one rank whose deadline is ``deadline_s`` (the longest a deadline may stretch while the host
    starves it: ``ceiling_s``, never below the deadline itself). Pure."""
    ceiling_s = max(ceiling_s, deadline_s)
    silence = f"{e.what} for {e.judged_s:.1f}s (deadline {deadline_s:g}s)"
    if not e.alive or e.state is ProcState.DEAD:
        return Verdict(RankState.DEAD, "its process is not running", final=True)
    if e.unread and e.silent_s < ceiling_s:
        return LIVE  # it spoke; the coordinator has yet to read it
    if e.judged_s <= deadline_s:
        if e.silent_s < ceiling_s:
            return LIVE  # late only by the coordinator's own lateness
        load = load_of(e, RankState.STARVED)
        why = f"{e.what} for {e.silent_s:.1f}s, of which the coordinator itself did not run for "
        return Verdict(RankState.STARVED, why + f"{e.coordinator_lag_s:.1f}s: {load.describe()}", True, load)
    if e.state is ProcState.STOPPED:
        return Verdict(RankState.STOPPED, f"its process is stopped (state T): {silence}", final=True)
    if e.span_s < MIN_SPAN_S:
        return Verdict(RankState.UNKNOWN, f"{silence}; reading the kernel's figures")  # not final: look again
    # A rank on the coordinator's threads waited as long as the coordinator did.
    cpu = CpuGrowth(0.0, e.coordinator_lag_s) if e.in_process else e.cpu
    found = starved(cpu, e.span_s, e.coordinator_lag_s, e.state, e.pressure)
    note = ""  # what turned a "could run" into starved or unknown, for the reason
    if found is False and cpu is not None and waiting_now(cpu, e.span_s, e.runnable_threads):
        found = True
        note = f"; {e.runnable_threads} of its threads runnable now, though they ran {cpu.ran_s:.1f}s in "
        note += f"{e.span_s:.1f}s (a CPU quota, or a host that does not run it)"
    elif found is False and cpu is not None and occupied(cpu, e.span_s):
        # Not starved, yet not idle either: busy in a long call that keeps its heartbeat from running, or sharing
        # a host that keeps it waiting (a third of its time). Not a deadlock: it may yet answer, so it is stretched.
        found, note = None, ", while its threads ran or waited to run for much of the time (busy, or on a busy host)"
    if found is False:
        load = load_of(e, RankState.HUNG)
        return Verdict(RankState.HUNG, f"{silence}, though the host let it run: {load.describe()}", True, load)
    if found is None:
        load = load_of(e, RankState.UNKNOWN)
        if e.judged_s < ceiling_s:
            unsure = note or "; starved or hung cannot be told here"
            why = f"{silence}{unsure}, stretched up to {ceiling_s:g}s: {load.describe()}"
            return Verdict(RankState.UNKNOWN, why, load=load)
        why = f"{silence}{note}, past the overload ceiling {ceiling_s:g}s, and nothing shows it was starved"
        return Verdict(RankState.HUNG, f"{why}: {load.describe()}", True, load)
    load = load_of(e, RankState.STARVED)
    if e.silent_s < ceiling_s:
        why = f"starved: {silence}{note}, stretched up to {ceiling_s:g}s: {load.describe()}"
        return Verdict(RankState.STARVED, why, load=load)
    why = f"{e.what} for {e.silent_s:.1f}s, past the overload ceiling {ceiling_s:g}s, while the host starved it{note}"
    return Verdict(RankState.STARVED, f"{why}: {load.describe()}", True, load)


@dataclass
class _Watch:
    """A suspect rank's evidence so far: the first reading (``base``), and the last verdict with when it was made."""

    base_at: float
    base: RunDelays | None
    verdict: Verdict = LIVE
    at: float = 0.0
    announced: bool = False  # a stretched deadline already reported (one rank_starved event per episode)


class Judge:
    """Judges ranks by their silence (``what``, since ``last``) against a deadline, gathering the kernel's figures
    from half the deadline on (so the evidence spans the time before it passes). One per coordinator; the clock is
    the process's."""

    def __init__(self, reader: ProcessReader | None = None, clock: JudgeClock | None = None) -> None:
        self.reader: ProcessReader = reader or ProcReader()
        self.clock = clock or judge_clock()
        self._lock = threading.Lock()
        self._watches: dict[Hashable, _Watch] = {}

    def judge(
        self, r: object, key: Hashable, last: float, deadline_s: float, ceiling_s: float, what: str
    ) -> tuple[Verdict, bool]:
        """The verdict on rank client ``r`` (watched under ``key``), and whether it newly stretched a deadline
        (a starved or unknown rank that the caller should report once)."""
        now = self.clock.observe()
        alive = _alive(r)
        judged = self.clock.judged(last)
        if alive and judged <= deadline_s / 2 and now - last < ceiling_s:
            with self._lock:
                self._watches.pop(key, None)
            return LIVE, False
        pid = _pid(r)
        with self._lock:
            watch = self._watches.get(key)
        threads: Threads | None = None  # this look's one reading of the rank's threads
        if watch is None:
            threads = self._threads(pid, now)
            first = _Watch(now, threads.delays if threads is not None else None)
            with self._lock:
                watch = self._watches.setdefault(key, first)
        if watch.at and now - watch.at < EVIDENCE_EVERY_S and alive:
            return watch.verdict, False
        if threads is None:
            threads = self._threads(pid, now)
        # The watch stays until the rank is heard again: a later look judges over a longer span, and a rank judged
        # hung stays hung.
        evidence = self._evidence(r, pid, threads, watch, what, now, last, judged, alive)
        verdict = judge(evidence, deadline_s, ceiling_s)
        with self._lock:  # several callers judge the same rank (the restore's loop, /health): announce once
            fresh = not verdict.final and verdict.load is not None and not watch.announced
            watch.verdict, watch.at, watch.announced = verdict, now, watch.announced or fresh
        return verdict, fresh

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._watches.pop(key, None)

    def _threads(self, pid: int | None, now: float) -> Threads | None:
        return self.reader.threads(pid, now) if pid is not None else None

    def _evidence(
        self,
        r: object,
        pid: int | None,
        threads: Threads | None,
        watch: _Watch,
        what: str,
        now: float,
        last: float,
        judged: float,
        alive: bool,
    ) -> Evidence:
        rank = int(getattr(r, "rank", -1))
        state = self.reader.state(pid) if pid is not None else ProcState.UNKNOWN
        current = threads.delays if threads is not None else None
        cpu = cpu_growth(watch.base, current) if watch.base is not None and current is not None else None
        unread_fn = getattr(r, "unread", None)
        return Evidence(
            rank=rank,
            what=what,
            silent_s=now - last,
            judged_s=judged,
            alive=alive,
            state=state,
            unread=bool(unread_fn()) if callable(unread_fn) else False,
            span_s=now - watch.base_at,
            cpu=cpu,
            coordinator_lag_s=self.clock.lost(watch.base_at),
            pressure=self.reader.pressure(),
            in_process=pid is None,
            runnable_threads=threads.runnable if threads is not None else 0,
        )


def _alive(r: object) -> bool:
    alive = getattr(r, "alive", None)
    return bool(alive()) if callable(alive) else True


def _pid(r: object) -> int | None:
    """The rank's own process, when it has one (the embedded engine's ranks); None for a rank that runs on the
    coordinator's threads (a plugin's in-process rank), whose delay is then the coordinator's own."""
    pid = getattr(r, "pid", None)
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


__all__ = [
    "DEFAULT_OVERLOAD_CEILING_S",
    "LIVE",
    "MAX_OVERLOAD_CEILING_S",
    "STARVED_SHARE",
    "Evidence",
    "Judge",
    "JudgeClock",
    "Verdict",
    "fetch_starved",
    "judge",
    "judge_clock",
    "occupied",
    "starved",
    "waiting_now",
]
