"""Counts a restore's wall and CPU seconds by stage (``core.stage_costs``) as its threads do the work.

Each stage is timed on the thread that does it (``time.thread_time``: that thread's CPU, whatever else the process
runs meanwhile). Work a stage hands to another thread is counted where the other thread says so: a tier that runs
its transfer on a worker of its own reports that worker's CPU to the calling thread (``report_call_cpu``), and the
fetch stage takes it (``take_call_cpu``). Threads add concurrently (fetches run ahead of installs).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from bsr_cli.core.evidence import TimedStage
from bsr_cli.core.stage_costs import StageCosts

__all__ = ["StageClock", "report_call_cpu", "take_call_cpu"]

_handed = threading.local()


def report_call_cpu(seconds: float) -> None:
    """Called on the thread that made a call: the CPU seconds another thread spent doing it (a tier's worker)."""
    _handed.cpu = getattr(_handed, "cpu", 0.0) + max(seconds, 0.0)


def take_call_cpu() -> float:
    """The CPU seconds reported to this thread since it last took them."""
    seconds = float(getattr(_handed, "cpu", 0.0))
    _handed.cpu = 0.0
    return seconds


class StageClock:
    """One restore's stage costs on one rank, added to from any thread; ``costs()`` closes them with the process's
    CPU since the clock started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs = StageCosts()
        self._process_cpu0 = time.process_time()

    def add(self, stage: TimedStage, wall_s: float, cpu_s: float) -> None:
        with self._lock:
            self._costs = self._costs.plus(stage, wall_s, cpu_s)

    @contextlib.contextmanager
    def timing(self, stage: TimedStage) -> Iterator[None]:
        """Time the block on this thread as ``stage`` (with the CPU other threads reported doing it for this one)."""
        take_call_cpu()  # what an earlier call reported belongs to that call's stage, not this one
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - w0, time.thread_time() - c0 + take_call_cpu())

    def costs(self) -> StageCosts:
        with self._lock:
            costs = self._costs
        return costs.with_process_cpu(time.process_time() - self._process_cpu0).rounded()
