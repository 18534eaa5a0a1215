"""An overloaded host is not a faulty rank: against the real embedded engine (its coordinator process, one process
per rank, the filesystem tier), real stops and real starvation.

- The engine's own coordinator stopped (SIGSTOP) for 15 s in the middle of a W=1 restore, then continued: the
  restore commits, or fails closed blaming no rank (on a host so loaded that a rank then starves past the overload
  ceiling, it is refused as the host's, host_overloaded, still blaming no rank). The control: rank 1's process
  stopped for 15 s instead is blamed (stopped), and rank 0 is not.
- Both ranks starved in the middle of a W=1 restore (every thread moved to SCHED_IDLE and held to 0.5% of a CPU
  by a cgroup quota, or, where no quota can be set, beside CPU-bound loops at normal priority): committed, or
  failed closed naming the host with the pressure figures; no rank and no tier is blamed, no marker is left, no
  rank is ever shown unhealthy, and once the load is gone the prompt restores whole.

Every wait polls the engine for a condition under a deadline; every stopped or starved process is given back in a
``finally`` (the test process is never the one stopped)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from own_engine import own_engine

from bsr_cli.core.events import Event, WindowReleased
from bsr_cli.core.evidence import EventKind, FailureKind, Outcome, RankState
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.results import ManualRestoreResult
from bsr_cli.core.status import Health
from bsr_cli.errors import ExitCode, HostOverloaded, ServerError

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
STOP_S = 15.0  # how long a process stays stopped (the fault under test, not a wait for anything)
STARVE_S = 90.0  # the longest the ranks are starved (four and a half overload ceilings), the fault under test
CEILING_S = 20.0  # the engine's overload ceiling here: the longest a starved rank's deadline stretches
FETCH_TIMEOUT_S = 2.0
STOPPED_TOKENS, STARVED_TOKENS = 65_536, 131_072
STOPPED_PROMPT = Prompt.synthetic_of(STOPPED_TOKENS, 71)
STARVED_PROMPT = Prompt.synthetic_of(STARVED_TOKENS, 72)


@pytest.fixture(scope="module")
def overload_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """An engine of its own (its ranks are stopped and starved here): W=1 by default, prompts up to 131,072
    tokens on the filesystem tier, a 2 s fetch deadline, a 20 s overload ceiling."""
    pytest.importorskip("torch")
    settings = dict(w=1, max_tokens=131_072, kv_tokens=131_072, remote=False, fetch_timeout_s=FETCH_TIMEOUT_S)
    with own_engine(
        tmp_path_factory.mktemp("overload"), **settings, segment_bytes=None, overload_ceiling_s=CEILING_S
    ) as e:
        yield e.state_dir, e.url, e.token


@pytest.fixture
def overload(overload_engine: tuple[Path, str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A client of the engine, with BSR_* pointing at it; healthy and without markers before and after."""
    state, url, token = overload_engine
    for k, v in {"BSR_ENGINE": url, "BSR_TOKEN": token, "BSR_STATE_DIR": str(state)}.items():
        monkeypatch.setenv(k, v)
    from bsr_cli.client import AdminClient

    with AdminClient(url, token, timeout_s=120.0) as c:
        assert _wait_healthy(c).ok
        c.clear_markers()
        yield c
        c.clear_markers()


def _pid(state: Path, what: str) -> int:
    st = json.loads((state / "state.json").read_text())
    if what.startswith("rank"):
        return int(next(r["pid"] for r in st["ranks"] if r["rank"] == int(what[4:])))
    return int(st["services"][what]["pid"])


def _wait_healthy(client: Any, deadline_s: float = 120.0) -> Health:
    end = time.monotonic() + deadline_s
    h = client.health()
    while not h.ok and time.monotonic() < end:
        time.sleep(0.2)  # polls the engine's health
        h = client.health()
    return h


def _stored(client: Any, prompt: Prompt, n: int) -> None:
    """The prompt computed and stored to the tier (or restored from it), so that a restore has it all to fetch."""
    res = client.submit(prompt)
    assert res.computed_tokens + res.external_tokens == n and res.hash_ok is True


def _restore_in_background(client_of: Callable[[], Any], prompt: Prompt, on_event: Callable[[Event], None]) -> Any:
    """A W=1 restore on a thread of its own (the test thread stays free to stop and continue processes)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            with client_of() as c:
                out["result"] = c.restore(prompt, w=1, on_event=on_event)
        except Exception as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    t = threading.Thread(target=run, name="restore", daemon=True)
    t.start()
    return t, out


def _first_window_released(stop: Callable[[], None]) -> tuple[Callable[[Event], None], threading.Event]:
    """A progress listener that calls ``stop`` when the restore's first window is released (the restore is then in
    flight, with every later window still to go)."""
    fired = threading.Event()

    def on_event(ev: Event) -> None:
        if isinstance(ev, WindowReleased) and not fired.is_set():
            try:
                stop()
            finally:
                fired.set()  # after the stop: whoever waits on it reads what the stop recorded

    return on_event, fired


def _stopped_for(pid: int, overload_engine: tuple[Path, str, str]) -> tuple[dict[str, Any], float]:
    """A W=1 restore during which ``pid`` is stopped for STOP_S once its first window is released; what the restore
    answered (its ``result``, or the ``error`` it ended with) and how long the process stayed stopped."""
    _, url, token = overload_engine
    from bsr_cli.client import AdminClient

    stopped_at: list[float] = []

    def stop() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    on_event, fired = _first_window_released(stop)
    thread, out = _restore_in_background(lambda: AdminClient(url, token, timeout_s=120.0), STOPPED_PROMPT, on_event)
    held = 0.0
    try:
        assert fired.wait(120), "the restore never released a window"
        end = stopped_at[0] + STOP_S
        # The stop is the fault itself: it lasts STOP_S whatever the restore does meanwhile.
        while time.monotonic() < end:
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        held = time.monotonic() - stopped_at[0]
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(240)
    assert not thread.is_alive(), "the restore never answered"
    return out, held


def _coordinator_pid(overload_engine: tuple[Path, str, str]) -> int:
    return _pid(overload_engine[0], "engine")


def test_a_stopped_coordinator_blames_no_rank_for_the_time_it_did_not_run(overload, overload_engine, bsr) -> None:
    """The restore commits, or fails closed blaming no rank and no tier; or, on a host loaded so heavily that a rank
    then waits to run past the overload ceiling in a call after it (its hashes), it is refused as the host's
    (host_overloaded), again blaming no rank. In every case no marker is set and no tier is excluded."""
    _stored(overload, STOPPED_PROMPT, STOPPED_TOKENS)
    unresponsive_before = _unresponsive(overload)
    seq_before = overload.events(newest=True, limit=1).last_seq
    out, held = _stopped_for(_coordinator_pid(overload_engine), overload_engine)
    assert held >= STOP_S  # the coordinator really was stopped that long, in the middle of the restore
    failed = overload.events(since=seq_before, kinds=[EventKind.RESTORE_FAILED]).events
    assert not [e for e in failed if e["kind"] == FailureKind.RANK.value], failed  # no rank failed its own part
    if "error" in out:
        err = out["error"]
        assert isinstance(err, HostOverloaded) and err.exit_code == ExitCode.HOST_OVERLOADED, err
        assert err.message.startswith("the host is overloaded: "), err.message
        assert "not responding" not in err.message, err.message  # the wording of a rank blamed
    else:
        res: ManualRestoreResult = out["result"]
        report = res.report
        assert report is not None
        assert res.outcome in (Outcome.COMMITTED, Outcome.FAILED_CLOSED), res.outcome
        assert report.blamed_ranks == () and report.blamed_tiers == (), report.failures
        assert not [f for f in report.failures if f.kind is FailureKind.RANK], report.failures
        if res.outcome is Outcome.COMMITTED:
            assert res.committed_tokens == STOPPED_TOKENS and res.hashes is not None and res.hashes.hash_ok is True
        assert res.marker is None
    assert overload.markers() == []  # no marker: no tier excluded, no forced recompute
    assert _unresponsive(overload) == unresponsive_before  # no rank was counted as having missed its heartbeat
    h = _wait_healthy(overload)
    assert h.ok and all(r.last_fault is None for r in h.ranks), h
    status = bsr("status")
    assert status.code == 0 and "unhealthy" not in status.out, status.out


def test_control_a_stopped_rank_is_blamed_and_the_other_is_not(overload, overload_engine, bsr) -> None:
    """The same stop aimed at rank 1's process instead: rank 1 is blamed (its process is stopped), rank 0 is not.
    Rank 1 may have released its last window before the stop lands: the restore then commits and the call that
    follows it (its hashes) fails, naming rank 1."""
    _stored(overload, STOPPED_PROMPT, STOPPED_TOKENS)
    out, _ = _stopped_for(_pid(overload_engine[0], "rank1"), overload_engine)
    if "error" in out:
        err = out["error"]
        assert isinstance(err, ServerError) and err.exit_code == ExitCode.SERVER_ERROR, err
        assert "rank 1 is not responding: its process is stopped" in err.message and "rank 0" not in err.message
        assert _wait_healthy(overload).ok
        return
    res: ManualRestoreResult = out["result"]
    report = res.report
    assert report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and report.failure_kind is FailureKind.RANK
    assert report.blamed_ranks == (1,) and report.blamed_tiers == ()
    rank1 = next(f for f in report.failures if f.rank == 1)
    assert rank1.kind is FailureKind.RANK and "stopped" in rank1.reason, rank1
    assert all(f.kind is not FailureKind.RANK for f in report.failures if f.rank == 0)  # finished, or aborted
    assert _wait_healthy(overload).ok  # continued, it finishes its aborted call and is healthy again


def _unresponsive(client: Any) -> float:
    total = 0.0
    for line in client.metrics().splitlines():
        if line.startswith("bsr_rank_unresponsive_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- real starvation --------------------------------------------------------------------------------------------
def _set_policy(pid: int, policy: int) -> None:
    """Every thread of ``pid`` to ``policy`` (a thread started later inherits its creator's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (root may make groups there)
QUOTA_PERIOD_US, QUOTA_US = 1_000_000, 5_000  # the ranks together get 0.5% of one CPU


def _cpu_quota_group() -> Path | None:
    """A cgroup v1 cpu group with a CPU quota for the ranks, where the machine offers one (None: it does not)."""
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists() or not os.access(CPU_CGROUP, os.W_OK):
        return None
    group = CPU_CGROUP / f"bsr-overload-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


@contextlib.contextmanager
def _starving(pids: list[int]) -> Iterator[Callable[[], None]]:
    """A ``starve`` that moves the processes to SCHED_IDLE and, where cgroup v1's cpu controller is offered, into a
    group with a CPU quota of 0.5% of one CPU: the kernel then runs them for 5 ms a second whatever else the host
    does. Where no quota can be set, CPU-bound loops at normal priority (two per core) starve them instead (they run
    only when nothing else wants a CPU); with the quota there are none, so the tests beside this one keep the cores.
    Everything is given back on the way out."""
    group = _cpu_quota_group()
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        for _ in range(2 * (os.cpu_count() or 2) if group is None else 0)
    ]

    def starve() -> None:
        for pid in pids:
            _set_policy(pid, os.SCHED_IDLE)
            if group is not None:
                (group / "cgroup.procs").write_text(str(pid))  # every thread of it, and those it starts

    try:
        yield starve
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                if group is not None:
                    (CPU_CGROUP / "cgroup.procs").write_text(str(pid))
                _set_policy(pid, os.SCHED_OTHER)
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait(30)
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()


def test_starved_ranks_are_the_hosts_not_the_ranks(overload, overload_engine, bsr) -> None:
    state = overload_engine[0]
    if not hasattr(os, "SCHED_IDLE"):
        pytest.skip("this platform has no SCHED_IDLE")
    _stored(overload, STARVED_PROMPT, STARVED_TOKENS)
    pids = [_pid(state, "rank0"), _pid(state, "rank1")]
    _, url, token = overload_engine
    from bsr_cli.client import AdminClient

    seen: list[Health] = []
    with _starving(pids) as starve:
        # Both ranks are starved from the moment the restore's first window is released, to its end or for
        # STARVE_S: a rank that still gets a word out within the ceiling is rightly never given up on, and at 0.5%
        # of a CPU a restore (and its output-hash check) crawls on for as long as the starvation lasts.
        on_event, fired = _first_window_released(starve)
        thread, out = _restore_in_background(lambda: AdminClient(url, token, timeout_s=120.0), STARVED_PROMPT, on_event)
        assert fired.wait(240), "the restore never released a window"
        relieved = time.monotonic() + STARVE_S
        while thread.is_alive() and time.monotonic() < relieved:
            seen.append(overload.health())  # polls the engine while the ranks starve
            time.sleep(0.5)
    end = time.monotonic() + 300  # the host given back: the restore answers
    while thread.is_alive() and time.monotonic() < end:
        seen.append(overload.health())
        time.sleep(0.5)
    thread.join(max(0.0, end - time.monotonic()))
    assert not thread.is_alive(), "the restore never answered"
    if "error" in out:  # a call past its deadline after the restore (its hashes): it must name the host
        err = out["error"]
        assert isinstance(err, HostOverloaded) and err.exit_code == ExitCode.HOST_OVERLOADED, err
        assert "pressure" in err.message and "rank" in err.message, err.message
        assert _wait_healthy(overload).ok and overload.markers() == []
        return
    res: ManualRestoreResult = out["result"]
    report = res.report
    assert report is not None
    # Never a rank's fault: not in the result, and never in the health seen while they starved.
    assert report.blamed_ranks == () and report.blamed_tiers == (), report.failures
    assert not [h for h in seen if h.unhealthy_ranks], [h.unhealthy_ranks for h in seen]
    assert res.marker is None and overload.markers() == []
    if res.outcome is Outcome.FAILED_CLOSED:
        assert report.failure_kind is FailureKind.HOST_OVERLOADED, report.failures
        host = [f for f in report.failures if f.kind is FailureKind.HOST_OVERLOADED]
        load = host[0].load
        assert load is not None and load.cpu is not None  # the pressure figures ride on the failure
        assert any(r.run_delay_s for f in host if f.load for r in f.load.ranks), host
        explained = bsr("explain", res.request)
        assert explained.code == 0 and "host was overloaded" in explained.out and "pressure" in explained.out
        again = bsr("restore", "--synthetic", "1000", "--seed", "1")  # after: nothing left stuck
        assert again.code in (0, ExitCode.NOTHING_TO_RESTORE), again.err
    else:
        assert res.outcome is Outcome.COMMITTED and res.hashes is not None and res.hashes.hash_ok is True
    starved = [r for h in seen for r in h.ranks if r.state is RankState.STARVED]
    # Once the load is gone the engine is healthy and the prompt restores whole.
    assert _wait_healthy(overload).ok
    again_res = overload.restore(STARVED_PROMPT, w=1)
    assert again_res.outcome is Outcome.COMMITTED and again_res.hashes is not None and again_res.hashes.hash_ok
    print(f"outcome {res.outcome.value}; {len(seen)} health samples, {len(starved)} showing a rank starved")
    for f in report.failures:
        print(f"  rank {f.rank} {f.kind.value} at {f.stage.value if f.stage else 'none'}: {f.reason}")
