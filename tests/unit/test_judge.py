"""Liveness from what the kernel knows: the /proc parsers over recorded text, the judge's verdicts (dead, stopped,
hung, starved, unknown) and a judge clock that was itself stopped, and how the failure taxonomy blames each.

The kernel's files are recorded text here (a 2-core machine under load and at rest); the real reader runs against
/proc in tests/engine/test_overload.py."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import FailureKind, Outcome, RankState, Stage
from bsr_cli.core.overload import HostLoad, Psi, RankDelay
from bsr_cli.core.results import ManualRestoreResult, RestoreReport
from bsr_cli.errors import ExitCode, HostOverloaded
from bsr_cli.runtime import failures
from bsr_cli.runtime import judge as judging
from bsr_cli.runtime.judge import Evidence, Judge, JudgeClock, Verdict, fetch_starved, judge, starved
from bsr_cli.runtime.liveness import (
    CpuGrowth,
    Pressure,
    ProcessReader,
    ProcReader,
    ProcState,
    RunDelays,
    Threads,
    cpu_growth,
    parse_pressure,
    parse_procs_running,
    parse_schedstat,
    parse_stat_state,
)

# -- recorded /proc text --------------------------------------------------------------------------------------------
STAT_SLEEPING = "4242 (python) S 4100 4242 4100 0 -1 4194560 52311 0 0 0 812 97 0 0 20 0 23 0 1289 3214114816 61234"
STAT_STOPPED = "4242 (python) T 4100 4242 4100 0 -1 4194560 52311 0 0 0 812 97 0 0 20 0 23 0 1289 3214114816 61234"
# A command name with a space and a parenthesis of its own: the state follows the *last* ')'.
STAT_ODD_NAME = "77 (bsr (rank) 1) t 1 77 77 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 3 0 99 1000 10"
STAT_ZOMBIE = "4243 (python) Z 4100 4243 4100 0 -1 4227084 0 0 0 0 0 0 0 0 20 0 1 0 1300 0 0"
SCHEDSTAT = "812345678 9876543210 4321\n"
PSI_CPU_LOADED = (
    "some avg10=92.41 avg60=85.02 avg300=60.11 total=912345678\nfull avg10=31.50 avg60=20.00 avg300=9.00 total=1\n"
)
PSI_CPU_OLD_KERNEL = "some avg10=4.19 avg60=9.85 avg300=6.46 total=34597649\n"  # no "full" line for cpu
PSI_QUIET = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
QUIET = Pressure(cpu=Psi(0.5, 0.0), memory=Psi(0.0, 0.0), io=Psi(0.0, 0.0))
LOADED = Pressure(cpu=Psi(92.4, 31.5), memory=Psi(0.0, 0.0), io=Psi(0.0, 0.0))
UNKNOWN = Pressure(cpu=None, memory=None, io=None)


def test_stat_state_is_the_field_after_the_last_parenthesis() -> None:
    assert parse_stat_state(STAT_SLEEPING) is ProcState.SLEEPING
    assert parse_stat_state(STAT_STOPPED) is ProcState.STOPPED
    assert parse_stat_state(STAT_ODD_NAME) is ProcState.STOPPED  # "t": stopped by a tracer
    assert parse_stat_state(STAT_ZOMBIE) is ProcState.DEAD
    assert parse_stat_state("") is ProcState.UNKNOWN and parse_stat_state("12 (x)") is ProcState.UNKNOWN


def test_schedstat_gives_the_run_queue_wait_and_refuses_anything_else() -> None:
    assert parse_schedstat(SCHEDSTAT) == (812_345_678, 9_876_543_210)
    assert parse_schedstat("") is None and parse_schedstat("12 x 3") is None


def test_pressure_reads_avg10_and_a_missing_full_line_is_unknown_not_zero() -> None:
    assert parse_pressure(PSI_CPU_LOADED) == Psi(92.41, 31.5)
    old = parse_pressure(PSI_CPU_OLD_KERNEL)
    assert old == Psi(4.19, None) and old is not None and old.full_avg10 is None
    assert parse_pressure("full avg10=1.00 avg60=0 avg300=0 total=0\n") is None  # no "some" line
    assert parse_pressure("some avg10=abc\n") is None


def test_cpu_growth_is_summed_over_threads_and_a_new_thread_counts_whole() -> None:
    """Threads taking turns at the GIL each wait part of the time; summed, the process waited the whole span."""
    before = RunDelays(10.0, {1: (0, 1_000_000_000), 2: (10, 5_000_000_000)})
    after = RunDelays(12.0, {1: (20_000_000, 1_100_000_000), 2: (10, 6_500_000_000), 3: (5_000_000, 700_000_000)})
    growth = cpu_growth(before, after)
    assert growth.waited_s == pytest.approx(0.1 + 1.5 + 0.7) and growth.ran_s == pytest.approx(0.025)
    assert cpu_growth(after, after) == CpuGrowth(0.0, 0.0)


def _fake_proc(root: Path, pid: int, stat: str, waits: dict[int, int], pressure: dict[str, str]) -> None:
    """A directory laid out as /proc: one process, its threads' schedstat (100 ns on a CPU each), the PSI files."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(stat)
    for tid, wait in waits.items():
        (root / str(pid) / "task" / str(tid)).mkdir(parents=True)
        (root / str(pid) / "task" / str(tid) / "schedstat").write_text(f"100 {wait} 7\n")
    (root / "pressure").mkdir(exist_ok=True)
    for name, text in pressure.items():
        (root / "pressure" / name).write_text(text)


def test_the_reader_says_unknown_where_a_file_is_missing_and_dead_where_the_process_is(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 4242, STAT_STOPPED, {4242: 10, 4250: 3_000_000_000}, {"cpu": PSI_CPU_LOADED})
    reader = ProcReader(tmp_path)
    assert reader.state(4242) is ProcState.STOPPED
    assert reader.state(9999) is ProcState.DEAD  # no such process
    delays = reader.run_delays(4242, 1.0)
    assert delays is not None and delays.threads == {4242: (100, 10), 4250: (100, 3_000_000_000)}
    assert reader.run_delays(9999, 1.0) is None
    p = reader.pressure()
    assert p.cpu == Psi(92.41, 31.5) and p.memory is None and p.io is None  # missing: unknown, never 0
    assert ProcReader(tmp_path / "nowhere").state(1) is ProcState.UNKNOWN


def test_the_reader_gives_each_thread_s_state_and_the_host_s_runnable_threads(tmp_path: Path) -> None:
    """What a calibration of the trace planner reads: the engine's runnable threads and the host's run queue."""
    _fake_proc(tmp_path, 4242, STAT_STOPPED, {4242: 10, 4250: 20}, {})
    (tmp_path / "4242" / "task" / "4242" / "stat").write_text("4242 (python3 (x)) R 1 2 3")
    (tmp_path / "4242" / "task" / "4250" / "stat").write_text("4250 (bsr-fetch-0) S 1 2 3")
    (tmp_path / "stat").write_text("cpu  1 2 3\nprocs_running 7\nprocs_blocked 1\n")
    reader = ProcReader(tmp_path)
    threads = reader.threads(4242, 1.0)
    assert threads is not None and threads.states == {4242: ProcState.RUNNING, 4250: ProcState.SLEEPING}
    assert threads.runnable == 1 and threads.delays == RunDelays(1.0, {4242: (100, 10), 4250: (100, 20)})
    assert reader.threads(9999, 1.0) is None
    assert reader.procs_running() == 7
    assert parse_procs_running("cpu 1 2\nprocs_blocked 3\n") is None  # no such line: unknown, never 0
    assert ProcReader(tmp_path / "nowhere").procs_running() is None


# -- the verdicts ---------------------------------------------------------------------------------------------------
def _ev(**kw: object) -> Evidence:
    base = Evidence(
        rank=1,
        what="no heartbeat",
        silent_s=12.0,
        judged_s=12.0,
        alive=True,
        state=ProcState.SLEEPING,
        unread=False,
        span_s=6.0,
        cpu=CpuGrowth(ran_s=1.2, waited_s=0.05),
        coordinator_lag_s=0.0,
        pressure=QUIET,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


DEADLINE, CEILING = 10.0, 60.0


def test_dead_and_stopped_ranks_are_the_ranks_fault_at_once() -> None:
    dead = judge(_ev(alive=False), DEADLINE, CEILING)
    assert dead.state is RankState.DEAD and dead.blames_rank
    stopped = judge(_ev(state=ProcState.STOPPED, span_s=0.0), DEADLINE, CEILING)
    assert stopped.state is RankState.STOPPED and stopped.blames_rank and "stopped" in stopped.reason


def test_a_rank_the_host_lets_run_that_makes_no_progress_is_hung_even_on_a_loaded_host() -> None:
    """Its own run delay is known and small: it slept (a deadlock), the host's pressure did not keep it waiting."""
    for pressure in (QUIET, LOADED):
        v = judge(_ev(pressure=pressure), DEADLINE, CEILING)
        assert v.state is RankState.HUNG and v.blames_rank and v.load is not None
        assert "though the host let it run" in v.reason


def test_a_rank_that_waited_to_run_is_starved_its_deadline_stretches_then_the_host_is_named() -> None:
    waited = CpuGrowth(ran_s=0.1, waited_s=5.5)
    stretched = judge(_ev(cpu=waited), DEADLINE, CEILING)
    assert stretched.state is RankState.STARVED and not stretched.final and not stretched.blames_rank
    assert stretched.load is not None and stretched.load.ranks == (RankDelay(1, RankState.STARVED, 5.5, 0.1),)
    assert "rank 1's threads waited 5.5 s to run and ran 0.1 s in 6.0 s" in stretched.reason
    assert "cpu pressure some 0.5%" in stretched.reason
    past = judge(_ev(cpu=waited, silent_s=61.0, judged_s=61.0), DEADLINE, CEILING)
    assert past.names_host and not past.blames_rank
    assert failures.quiet_rank_kind(past.state) is FailureKind.HOST_OVERLOADED


def test_host_pressure_decides_only_where_the_ranks_own_delay_is_unknown() -> None:
    assert judge(_ev(cpu=None, pressure=LOADED), DEADLINE, CEILING).state is RankState.STARVED
    assert judge(_ev(cpu=None, pressure=QUIET), DEADLINE, CEILING).state is RankState.HUNG
    # No schedstat and no PSI: unknown, never "fine": stretched, and judged hung only at the ceiling.
    unknown = judge(_ev(cpu=None, pressure=UNKNOWN), DEADLINE, CEILING)
    assert unknown.state is RankState.UNKNOWN and not unknown.final
    assert "cpu pressure unknown" in unknown.reason and "0%" not in unknown.reason
    at_ceiling = judge(_ev(cpu=None, pressure=UNKNOWN, silent_s=60.5, judged_s=60.5), DEADLINE, CEILING)
    assert at_ceiling.state is RankState.HUNG and at_ceiling.blames_rank
    # One resource unknown, another under pressure: the pressure that is known is evidence enough.
    partly = replace(UNKNOWN, memory=Psi(40.0, 25.0))
    assert starved(None, 6.0, 0.0, ProcState.RUNNING, partly) is True


def test_a_rank_sharing_a_busy_host_is_not_starved_one_that_gets_little_of_what_it_asks_is() -> None:
    """Two CPU-bound loops beside a polling thread on two cores: it waits a third of the time and runs two thirds
    (not starved: a tier it polls is still the tier's fault); a quota of 0.5% of a CPU: it waits nearly all of it."""
    sharing = CpuGrowth(ran_s=4.0, waited_s=2.0)
    assert starved(sharing, 6.0, 0.0, ProcState.RUNNING, LOADED) is False
    gil_turns = CpuGrowth(ran_s=0.6, waited_s=5.0)  # its threads took turns at the GIL on a host running 10 per core
    assert starved(gil_turns, 6.0, 0.0, ProcState.RUNNING, QUIET) is True
    many_threads_busy = CpuGrowth(ran_s=5.0, waited_s=7.0)  # waited long in total, but got most of what it asked
    assert starved(many_threads_busy, 6.0, 0.0, ProcState.RUNNING, QUIET) is False


def test_a_rank_busy_or_kept_waiting_is_not_hung_at_its_deadline_only_at_the_ceiling() -> None:
    """Silent past its deadline, not starved, but not idle either: it ran (a long call keeping its heartbeat from
    running) or waited to run for half the span (a third of what it asked: a loaded host's share). Stretched, and
    judged hung only at the ceiling; the same rank idle (the control) is hung at once."""
    for cpu in (CpuGrowth(ran_s=3.5, waited_s=0.2), CpuGrowth(ran_s=1.5, waited_s=3.2)):
        assert not starved(cpu, 6.0, 0.0, ProcState.RUNNING, QUIET)
        v = judge(_ev(cpu=cpu), DEADLINE, CEILING)
        assert v.state is RankState.UNKNOWN and not v.final and not v.blames_rank, v.reason
        assert "busy, or on a busy host" in v.reason and f"stretched up to {CEILING:g}s" in v.reason
        at_ceiling = judge(_ev(cpu=cpu, silent_s=61.0, judged_s=61.0), DEADLINE, CEILING)
        assert at_ceiling.state is RankState.HUNG and at_ceiling.blames_rank
        assert "past the overload ceiling" in at_ceiling.reason
    idle = judge(_ev(cpu=CpuGrowth(ran_s=0.4, waited_s=0.3)), DEADLINE, CEILING)
    assert idle.state is RankState.HUNG and idle.blames_rank and "though the host let it run" in idle.reason


def test_a_rank_runnable_now_that_ran_nothing_is_waiting_not_hung() -> None:
    """schedstat counts a wait when it ends: a rank held off every CPU for the whole span (a CPU quota throttling
    it) shows neither a wait nor a run, and looks idle. A thread runnable now (state R) says it is waiting: starved,
    stretched, the host named at the ceiling. Controls: the same figures with every thread asleep are hung; a
    runnable thread that ran a real share of the span is not waiting."""
    blank = CpuGrowth(ran_s=0.0, waited_s=0.0)
    v = judge(_ev(cpu=blank, runnable_threads=1), DEADLINE, CEILING)
    assert v.state is RankState.STARVED and not v.final and not v.blames_rank, v.reason
    assert "1 of its threads runnable now, though they ran 0.0s in 6.0s" in v.reason
    past = judge(_ev(cpu=blank, runnable_threads=1, silent_s=61.0, judged_s=61.0), DEADLINE, CEILING)
    assert past.names_host and not past.blames_rank
    assert judge(_ev(cpu=blank), DEADLINE, CEILING).state is RankState.HUNG
    ran = judge(_ev(cpu=CpuGrowth(ran_s=1.2, waited_s=0.0), runnable_threads=1), DEADLINE, CEILING)
    assert ran.state is RankState.HUNG and ran.blames_rank


def test_the_judge_reads_which_threads_are_runnable() -> None:
    t, reader = FakeTime(), FakeReader()
    j, clock = _judge_over(t, reader)
    last = t.now
    reader.states = [ProcState.SLEEPING, ProcState.RUNNING]  # throttled: runnable, and its figures stand still
    for _ in range(40):
        t.advance(0.1, clock=clock)
        verdict, _ = j.judge(QuietRank(), "k", last, 2.0, 60.0, "no heartbeat")
    assert verdict.state is RankState.STARVED and not verdict.final, verdict.reason
    reader.states = [ProcState.SLEEPING, ProcState.SLEEPING]  # the control: asleep with the CPU free
    t.advance(0.6, clock=clock)
    verdict, _ = j.judge(QuietRank(), "k", last, 2.0, 60.0, "no heartbeat")
    assert verdict.state is RankState.HUNG and verdict.blames_rank, verdict.reason


def test_an_in_process_rank_is_judged_by_the_coordinators_own_lag() -> None:
    assert judge(_ev(in_process=True, cpu=None), DEADLINE, CEILING).state is RankState.HUNG
    v = judge(_ev(in_process=True, cpu=None, coordinator_lag_s=4.0), DEADLINE, CEILING)
    assert v.state is RankState.STARVED and not v.final


def test_time_the_coordinator_did_not_run_is_never_the_ranks() -> None:
    """Silent 15 s by the wall clock, but the coordinator itself was stopped for 14 of them: live."""
    v = judge(_ev(silent_s=15.0, judged_s=1.0, coordinator_lag_s=14.0), DEADLINE, CEILING)
    assert v.state is RankState.LIVE and not v.final
    # Past the ceiling by the wall clock, the time being the coordinator's own: the host is named, not the rank.
    late = judge(_ev(silent_s=61.0, judged_s=1.0, coordinator_lag_s=60.0), DEADLINE, CEILING)
    assert late.names_host and "the coordinator itself did not run for 60.0s" in late.reason
    # Heartbeats still queued in the pipe: it spoke, whatever its age.
    assert judge(_ev(unread=True, state=ProcState.STOPPED), DEADLINE, CEILING).state is RankState.LIVE


def test_a_verdict_waits_for_evidence_over_a_span() -> None:
    v = judge(_ev(span_s=0.2), DEADLINE, CEILING)
    assert v.state is RankState.UNKNOWN and not v.final and v.load is None


# -- the judge clock ------------------------------------------------------------------------------------------------
class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float, *, clock: JudgeClock | None = None, step: float = 0.1) -> None:
        """Time passes; a clock given is looked at every ``step`` (its loop runs on time)."""
        end = self.now + s
        while self.now < end - 1e-9:
            self.now = min(end, self.now + step)
            if clock is not None:
                clock.observe()


def test_a_judge_clock_that_was_itself_stopped_leaves_that_time_out() -> None:
    t = FakeTime()
    clock = JudgeClock(t)
    t.advance(2.0, clock=clock)
    heard = t.now
    t.advance(1.0, clock=clock)
    assert clock.judged(heard) == pytest.approx(1.0)
    t.now += 15.0  # SIGSTOP ... SIGCONT: nothing looked at the clock
    assert clock.judged(heard) == pytest.approx(1.0 + JudgeClock.TICK_S + JudgeClock.SLACK_S)
    assert clock.lost(heard) == pytest.approx(15.0 - JudgeClock.TICK_S - JudgeClock.SLACK_S)
    t.advance(3.0, clock=clock)
    assert clock.judged(heard) == pytest.approx(4.15)
    after = t.now
    assert clock.lost(after) == 0.0  # the stop lies before: it does not excuse what follows


class FakeReader:
    """Stands in for /proc (a ProcessReader): the tests set each figure. The first thread ran and waited the figures
    set; the others (``states`` holds one state per thread) neither ran nor waited."""

    def __init__(self) -> None:
        self.proc_state = ProcState.SLEEPING
        self.wait_ns = 0
        self.ran_ns = 0
        self.psi = QUIET
        self.states = [ProcState.SLEEPING]

    def state(self, pid: int) -> ProcState:
        return self.proc_state

    def threads(self, pid: int, at: float) -> Threads:
        figures = {pid + i: (self.ran_ns, self.wait_ns) if i == 0 else (0, 0) for i in range(len(self.states))}
        return Threads(dict(zip(figures, self.states, strict=True)), RunDelays(at, figures))

    def pressure(self) -> Pressure:
        return self.psi


class QuietRank:
    rank = 1
    pid = 4242

    def alive(self) -> bool:
        return True


def _judge_over(t: FakeTime, reader: ProcessReader) -> tuple[Judge, JudgeClock]:
    clock = JudgeClock(t)
    return Judge(reader, clock), clock


@pytest.mark.parametrize("starving", [True, False])
def test_the_judge_gathers_evidence_from_half_the_deadline_and_announces_a_stretch_once(starving: bool) -> None:
    t, reader = FakeTime(), FakeReader()
    j, clock = _judge_over(t, reader)
    last = t.now
    seen = []
    for _ in range(120):  # 12 s of a rank that says nothing, looked at every 0.1 s as the loops do
        t.advance(0.1, clock=clock)
        if starving:
            reader.wait_ns += 90_000_000  # it waited 0.09 s of every 0.1 s to run, and ran 0.001 s
            reader.ran_ns += 1_000_000
        seen.append(j.judge(QuietRank(), "k", last, 10.0, 60.0, "no heartbeat"))
    verdicts = [v for v, _ in seen]
    assert all(v.state is RankState.LIVE for v in verdicts[:49])  # before half the deadline: nothing read
    if starving:  # the negative control below is the same rank, let run: it is hung
        assert verdicts[-1].state is RankState.STARVED and not verdicts[-1].final
        assert [fresh for _, fresh in seen].count(True) == 1
    else:
        assert verdicts[-1].state is RankState.HUNG and verdicts[-1].blames_rank
        assert not any(fresh for _, fresh in seen)


def test_a_stopped_rank_is_named_at_its_deadline_without_waiting_for_a_span() -> None:
    t, reader = FakeTime(), FakeReader()
    j, clock = _judge_over(t, reader)
    reader.proc_state = ProcState.STOPPED
    last = t.now
    t.advance(10.2, clock=clock)
    v, _ = j.judge(QuietRank(), "k", last, 10.0, 60.0, "no heartbeat")
    assert v.state is RankState.STOPPED and v.blames_rank


class ThreadsComingAndGoing(ProcReader):
    """/proc (a directory laid out as it) in which a rank's thread 4250 starts and ends between any two listings of
    its threads, as a rank's fetch threads do; it records the listings, and which threads' ``stat`` (state) and
    ``schedstat`` (run-queue wait) were read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.listings = 0
        self.read: dict[str, set[int]] = {"stat": set(), "schedstat": set()}

    def _thread_ids(self, pid: int) -> list[str] | None:
        flicker = self.root / str(pid) / "task" / "4250"
        if flicker.exists():
            shutil.rmtree(flicker)
        else:
            flicker.mkdir()
            (flicker / "stat").write_text("4250 (bsr-fetch-0) R 1 2 3")
            (flicker / "schedstat").write_text("0 0 1\n")
        self.listings += 1
        return super()._thread_ids(pid)

    def _read(self, path: Path) -> str | None:
        if path.parent.parent.name == "task":
            self.read[path.name].add(int(path.parent.name))
        return super()._read(path)


def test_one_look_at_a_rank_lists_its_threads_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The states counted runnable and the run-queue waits summed are of one listing of the rank's threads, read
    once per look, however its threads come and go."""
    _fake_proc(tmp_path, 4242, STAT_SLEEPING, {4242: 0}, {})
    (tmp_path / "4242" / "task" / "4242" / "stat").write_text(STAT_SLEEPING)
    t, reader = FakeTime(), ThreadsComingAndGoing(tmp_path)
    j, clock = _judge_over(t, reader)
    looked: list[Evidence] = []

    def judge_and_note(e: Evidence, deadline_s: float, ceiling_s: float) -> Verdict:
        looked.append(e)
        return judge(e, deadline_s, ceiling_s)

    monkeypatch.setattr(judging, "judge", judge_and_note)
    last = t.now
    for _ in range(40):  # 4 s of a rank that says nothing, looked at every 0.1 s
        t.advance(0.1, clock=clock)
        reader.listings, reader.read = 0, {"stat": set(), "schedstat": set()}
        before = len(looked)
        j.judge(QuietRank(), "k", last, 2.0, 60.0, "no heartbeat")
        if len(looked) > before:  # the judge read the kernel's figures: one listing, both readings of its threads
            assert reader.listings == 1
            assert reader.read["stat"] == reader.read["schedstat"] and 4242 in reader.read["stat"], reader.read
            assert looked[-1].runnable_threads == (4250 in reader.read["stat"])
        else:  # not yet half the deadline, or looked at under EVIDENCE_EVERY_S ago: nothing read
            assert reader.listings == 0
    assert len(looked) >= 5 and {e.runnable_threads for e in looked} == {0, 1}  # the thread came and went


# -- a rank's own fetch deadline ----------------------------------------------------------------------------------
def test_a_fetch_deadline_missed_while_the_rank_waited_to_run_is_the_hosts() -> None:
    before = RunDelays(0.0, {10: (0, 0), 11: (0, 0)})
    starved_after = RunDelays(2.0, {10: (10_000_000, 1_600_000_000), 11: (0, 10)})
    load = fetch_starved(0, before, starved_after, QUIET)
    assert load is not None and load.ranks[0].run_delay_s == pytest.approx(1.6) and load.coordinator_lag_s is None
    ran_after = RunDelays(2.0, {10: (1_500_000_000, 600_000_000), 11: (0, 10)})  # a poller sharing a busy host
    assert fetch_starved(0, before, ran_after, LOADED) is None  # it could run: the tier was late
    assert fetch_starved(0, None, None, LOADED) is not None  # its delay unknown: the host's pressure decides
    assert fetch_starved(0, None, None, UNKNOWN) is None  # nothing shows starvation: the tier's, as before


# -- blame --------------------------------------------------------------------------------------------------------
LOAD = HostLoad(span_s=6.0, coordinator_lag_s=0.0, ranks=(RankDelay(1, RankState.STARVED, 5.5),), cpu=Psi(92.0))


def test_a_host_verdict_blames_no_rank_and_no_tier_and_exits_17() -> None:
    host = Failure(rank=1, reason="starved", kind=FailureKind.HOST_OVERLOADED, load=LOAD)
    aborted = Failure(rank=0, reason="still running", kind=FailureKind.ABORTED)
    timeout = Failure(rank=0, reason="timeout", kind=FailureKind.TIER, stage=Stage.FETCH, tier="mooncake")
    fails = [aborted, timeout, host]
    assert failures.classify(fails) is FailureKind.HOST_OVERLOADED
    assert (
        failures.blamed_ranks(fails) == [] and failures.blamed_tiers(FailureKind.HOST_OVERLOADED, fails, ["x"]) == set()
    )
    assert host.component.value == "host" and FailureKind.HOST_OVERLOADED.outcome is Outcome.FAILED_CLOSED
    report = RestoreReport.from_wire(
        {
            "request": "req-1",
            "W": 1,
            "outcome": "failed_closed",
            "failure_kind": "host_overloaded",
            "failures": [host.to_wire()],
        }
    )
    assert report.failures[0].load == LOAD  # the figures travel with the failure
    err = failures.restore_error(ManualRestoreResult("req-1", "p", 1024, 1, lookup=None, report=report))
    assert isinstance(err, HostOverloaded) and err.exit_code is ExitCode.HOST_OVERLOADED == 17
    assert "no rank or tier blamed" in err.message and "the host was overloaded" in err.message
    assert err.hint and "--overload-ceiling" in err.hint
    # Negative control: the same rank judged hung is the rank's, as before.
    hung = failures.quiet_rank_failure(1, RankState.HUNG, "no heartbeat", LOAD)
    assert hung.kind is FailureKind.RANK and failures.blamed_ranks([hung]) == [1]
