"""What a calibration and each replay of `bsr bench trace` read of the engine's processes between two moments
(bsr_cli.bench.calibration.EngineCpu over a directory laid out as /proc, as the kernel writes it): every thread's
CPU and run-queue wait, summed over the engine's processes, and from such intervals the cores the engine got while
it had more work than cores."""

from __future__ import annotations

from pathlib import Path

import pytest

from bsr_cli.bench.calibration import EngineCpu
from bsr_cli.core.host_model import CpuSpan, contended_cores
from bsr_cli.runtime.liveness import ProcReader

S = 1_000_000_000  # ns


def _threads(root: Path, pid: int, threads: dict[int, tuple[int, int]]) -> None:
    """Process ``pid``'s threads as /proc shows them now: (ns on a CPU, ns waiting in the run queue) each."""
    for tid, (ran, waited) in threads.items():
        (root / str(pid) / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
        (root / str(pid) / "task" / str(tid) / "schedstat").write_text(f"{ran} {waited} 9\n")


def test_a_span_sums_what_the_engine_s_threads_ran_and_waited_between_two_readings(tmp_path: Path) -> None:
    _threads(tmp_path, 10, {10: (1 * S, 0), 11: (2 * S, 1 * S)})
    _threads(tmp_path, 20, {20: (5 * S, 0)})
    cpu = EngineCpu([10, 20, 30], ProcReader(tmp_path))  # 30: a process already gone
    before = cpu.delays()
    assert set(before) == {10, 20}
    # A quarter of a second later: thread 11 ran 0.1 s and waited 0.2 s; thread 12 started and ran 0.05 s (counted
    # whole); process 20 ran 0.05 s and waited 0.05 s.
    _threads(tmp_path, 10, {10: (1 * S, 0), 11: (2 * S + S // 10, S + S // 5), 12: (S // 20, 0)})
    _threads(tmp_path, 20, {20: (5 * S + S // 20, S // 20)})
    span = cpu.span(before, cpu.delays(), 0.25)
    assert span == CpuSpan(0.25, pytest.approx(0.2), pytest.approx(0.25))
    # Contended (a thread-second waited per second): the engine got 0.8 cores in it.
    assert contended_cores([span]) == pytest.approx(0.8)
    # The negative control: nothing ran or waited in between (the same reading twice), so nothing is read as
    # contended.
    same = cpu.delays()
    idle = cpu.span(same, same, 0.25)
    assert idle == CpuSpan(0.25, 0.0, 0.0) and contended_cores([idle]) is None


class CountedProc(ProcReader):
    """A directory laid out as /proc that counts the listings of a process's threads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings = 0

    def _thread_ids(self, pid: int) -> list[str] | None:
        self.listings += 1
        return super()._thread_ids(pid)


def test_a_sample_counts_the_runnable_threads_whose_figures_it_reads(tmp_path: Path) -> None:
    """What the run-queue sampler reads at each sample: the engine's threads runnable now (the host's run queue less
    them is what runs beside bsr) and their figures, from one listing of each process's threads."""
    _threads(tmp_path, 10, {10: (1 * S, 0), 11: (2 * S, 1 * S)})
    _threads(tmp_path, 20, {20: (5 * S, 0)})
    for pid, tid, state in ((10, 10, "S"), (10, 11, "R"), (20, 20, "R")):
        (tmp_path / str(pid) / "task" / str(tid) / "stat").write_text(f"{tid} (bsr rank) {state} 1 2 3")
    reader = CountedProc(tmp_path)
    cpu = EngineCpu([10, 20, 30], reader)  # 30: a process already gone
    reader.listings = 0
    sample = cpu.sample()
    assert sample.running == 2 and reader.listings == 3  # one listing per process, the gone one's included
    figures = {pid: d.threads for pid, d in sample.delays.items()}
    assert figures == {10: {10: (S, 0), 11: (2 * S, S)}, 20: {20: (5 * S, 0)}}
    # The negative control: a thread asleep is not counted runnable.
    (tmp_path / "20" / "task" / "20" / "stat").write_text("20 (bsr rank) S 1 2 3")
    assert cpu.sample().running == 1
