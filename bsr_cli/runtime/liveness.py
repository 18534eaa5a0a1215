"""What the kernel knows about a process and about the host, read from ``/proc``: the only place bsr reads it.

- ``/proc/PID/stat``: the process's state letter (``T``/``t`` stopped, ``Z``/``X`` dead, ``D`` waiting on I/O); and
  each thread's (``/proc/PID/task/TID/stat``).
- ``/proc/stat``: the host's runnable threads now (``procs_running``).
- ``/proc/PID/task/TID/schedstat``: per thread, nanoseconds on a CPU and nanoseconds waiting in the run queue
  (runnable, not running). A process whose threads waited to run for much of an interval, and got little of the
  CPU they asked for, was starved in it. A wait is added when it ends (the thread gets a CPU): a thread held off
  the CPU all along (a CPU quota throttling it) shows nothing yet, and its state (R, runnable) says it waits.
- ``/proc/pressure/{cpu,memory,io}``: pressure stall information (PSI), the share of the last 10 s in which
  tasks waited for the resource.

A file that is missing or unreadable is *unknown* (None), never "fine": a kernel without PSI says nothing about
pressure. The parsers are pure functions over the files' text (the fast lane runs them on recorded samples); the
reader (``ProcReader``) only opens the files; it lists a process's threads once for each look at them
(``threads``), so their states and their waits are of one set of threads. Judging what the figures mean is
``runtime/judge.py``'s.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from bsr_cli.core.overload import Psi

NS = 1e-9
PRESSURE_RESOURCES = ("cpu", "memory", "io")


class ProcState(Enum):
    """A process's state as ``/proc/PID/stat`` gives it, in the classes liveness cares about."""

    RUNNING = "running"  # R: on a CPU or runnable (waiting for one)
    SLEEPING = "sleeping"  # S, I: waiting for an event (a pipe, a lock, a timer)
    DISK = "disk"  # D: uninterruptible wait (I/O, a page fault under memory pressure)
    STOPPED = "stopped"  # T (SIGSTOP), t (a tracer)
    DEAD = "dead"  # Z (zombie), X/x (dead), or no such process
    UNKNOWN = "unknown"  # not readable here


_STATE_LETTERS = {
    "R": ProcState.RUNNING,
    "S": ProcState.SLEEPING,
    "I": ProcState.SLEEPING,
    "D": ProcState.DISK,
    "T": ProcState.STOPPED,
    "t": ProcState.STOPPED,
    "Z": ProcState.DEAD,
    "X": ProcState.DEAD,
    "x": ProcState.DEAD,
}


def parse_stat_state(text: str) -> ProcState:
    """The state of ``/proc/PID/stat``'s text. The command name (in parentheses) may hold spaces and parentheses
    itself, so the state is the first field after the *last* closing parenthesis."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or not fields:
        return ProcState.UNKNOWN
    return _STATE_LETTERS.get(fields[0], ProcState.UNKNOWN)


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """Nanoseconds a thread has run on a CPU and waited in the run queue, from ``/proc/PID/task/TID/schedstat``
    (``<on-cpu ns> <run-queue wait ns> <timeslices>``); None when the text is not that."""
    fields = text.split()
    if len(fields) < 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    return int(fields[0]), int(fields[1])


def parse_procs_running(text: str) -> int | None:
    """The host's runnable threads now, from ``/proc/stat``'s ``procs_running`` line; None without one."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "procs_running" and value.strip().isdigit():
            return int(value.strip())
    return None


def parse_pressure(text: str) -> Psi | None:
    """The avg10 figures of one ``/proc/pressure/<resource>`` file (``some avg10=1.20 avg60=... total=...`` and,
    on most resources, a ``full`` line); None when there is no ``some`` line."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        for item in rest.split():
            key, _, value = item.partition("=")
            if key == "avg10":
                try:
                    found[kind] = float(value)
                except ValueError:
                    return None
    if "some" not in found:
        return None
    return Psi(some_avg10=found["some"], full_avg10=found.get("full"))


@dataclass(frozen=True)
class RunDelays:
    """Every thread's CPU time and run-queue wait (ns, since the thread started) of one process at one moment
    (``at``: ``time.monotonic()``)."""

    at: float
    threads: dict[int, tuple[int, int]]  # thread id -> (ns on a CPU, ns waiting in the run queue)


@dataclass(frozen=True)
class Threads:
    """A process's threads from one listing of ``/proc/PID/task``: each one's state and, where the kernel keeps
    schedstat, its CPU time and run-queue wait. Both are of the same threads, so the runnable threads counted are
    among those whose waits are summed (two listings would each see threads that start and end in between)."""

    states: dict[int, ProcState]  # thread id -> its state now
    delays: RunDelays | None  # None where no thread's schedstat could be read

    @property
    def runnable(self) -> int:
        """Threads runnable now (state R), whose current wait schedstat has yet to count."""
        return sum(state is ProcState.RUNNING for state in self.states.values())


@dataclass(frozen=True)
class CpuGrowth:
    """What a process's threads did between two readings, in seconds, summed over its threads: ran on a CPU, and
    waited in the run queue (runnable, not running). Summed, not the most delayed thread's: threads that take turns
    at one lock (Python's GIL) each wait only part of the time, sleeping on the lock the rest, while at any moment
    one of them is runnable and waiting."""

    ran_s: float
    waited_s: float


def cpu_growth(before: RunDelays, after: RunDelays) -> CpuGrowth:
    """A thread that started in between counts whole (all of it lies in the span); one that ended is not seen."""
    ran = waited = 0
    for tid, (r, w) in after.threads.items():
        r0, w0 = before.threads.get(tid, (0, 0))
        ran += max(0, r - r0)
        waited += max(0, w - w0)
    return CpuGrowth(ran * NS, waited * NS)


@dataclass(frozen=True)
class Pressure:
    """The host's pressure now, per resource (None: unknown here)."""

    cpu: Psi | None
    memory: Psi | None
    io: Psi | None


class ProcessReader(Protocol):
    """What the liveness judge reads of a rank's process and of the host: ``ProcReader`` here, a stand-in in the
    fast lane's tests. One look at a rank reads its threads once (``threads``)."""

    def state(self, pid: int) -> ProcState: ...

    def threads(self, pid: int, at: float) -> Threads | None: ...

    def pressure(self) -> Pressure: ...


class ProcReader:
    """Reads the files above (``root``: a directory laid out as ``/proc``, for tests of the reader itself)."""

    def __init__(self, root: Path = Path("/proc")) -> None:
        self.root = root

    def _read(self, path: Path) -> str | None:
        try:
            return path.read_text()
        except OSError:
            return None

    def state(self, pid: int) -> ProcState:
        """The process's state; DEAD when there is no such process, UNKNOWN when /proc cannot be read at all."""
        text = self._read(self.root / str(pid) / "stat")
        if text is not None:
            return parse_stat_state(text)
        return ProcState.DEAD if self.root.is_dir() and not (self.root / str(pid)).exists() else ProcState.UNKNOWN

    def _thread_ids(self, pid: int) -> list[str] | None:
        """One listing of the process's threads (None where the process is gone): every figure of one look at its
        threads comes from one such listing."""
        try:
            return [tid for tid in os.listdir(self.root / str(pid) / "task") if tid.isdigit()]
        except OSError:
            return None

    def run_delays(self, pid: int, at: float) -> RunDelays | None:
        """Every thread's run-queue wait now; None where the kernel keeps no schedstat (or the process is gone)."""
        tids = self._thread_ids(pid)
        if tids is None:
            return None
        threads: dict[int, tuple[int, int]] = {}
        for tid in tids:
            got = self._schedstat(pid, tid)
            if got is not None:
                threads[int(tid)] = got
        return RunDelays(at, threads) if threads else None

    def threads(self, pid: int, at: float) -> Threads | None:
        """Each thread's state and run-queue wait now, from one listing (None where the process is gone). A thread
        that ended after the listing, its ``stat`` gone, is left out of both."""
        tids = self._thread_ids(pid)
        if tids is None:
            return None
        states: dict[int, ProcState] = {}
        delays: dict[int, tuple[int, int]] = {}
        for tid in tids:
            text = self._read(self.root / str(pid) / "task" / tid / "stat")
            if text is None:
                continue
            states[int(tid)] = parse_stat_state(text)
            got = self._schedstat(pid, tid)
            if got is not None:
                delays[int(tid)] = got
        return Threads(states, RunDelays(at, delays) if delays else None)

    def _schedstat(self, pid: int, tid: str) -> tuple[int, int] | None:
        text = self._read(self.root / str(pid) / "task" / tid / "schedstat")
        return parse_schedstat(text) if text is not None else None

    def procs_running(self) -> int | None:
        """The host's runnable threads now (None: unknown here)."""
        text = self._read(self.root / "stat")
        return parse_procs_running(text) if text is not None else None

    def pressure(self) -> Pressure:
        got = {}
        for resource in PRESSURE_RESOURCES:
            text = self._read(self.root / "pressure" / resource)
            got[resource] = parse_pressure(text) if text is not None else None
        return Pressure(cpu=got["cpu"], memory=got["memory"], io=got["io"])


class OwnRunDelays:
    """This process's threads' run-queue waits, read afresh (``now``) or at most ``max_age_s`` old (``recent``): a
    rank notes where each fetch starts without reading every thread's file for every window."""

    def __init__(
        self, reader: ProcReader | None = None, max_age_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.reader = reader or ProcReader()
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: RunDelays | None = None

    def now(self) -> RunDelays | None:
        got = self.reader.run_delays(os.getpid(), self._clock())
        with self._lock:
            self._last = got
        return got

    def recent(self) -> RunDelays | None:
        with self._lock:
            last = self._last
        if last is not None and self._clock() - last.at <= self.max_age_s:
            return last
        return self.now()


__all__ = [
    "PRESSURE_RESOURCES",
    "CpuGrowth",
    "OwnRunDelays",
    "Pressure",
    "ProcReader",
    "ProcState",
    "ProcessReader",
    "RunDelays",
    "Threads",
    "cpu_growth",
    "parse_pressure",
    "parse_procs_running",
    "parse_schedstat",
    "parse_stat_state",
]
