"""The embedded engine's life across failures and restarts, on a real engine of its own: a killed rank comes back
(and says so), markers and run-time settings survive `engine down` + `engine up` while armed faults are dropped
(and the start says so), and `POST /shutdown` leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from bsr_cli.client import AdminClient, local_engine
from bsr_cli.core.events import RankRestarted
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.loaders import builtin_registration

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
REG = builtin_registration("demo")
PROMPT = Prompt.synthetic_of(600, 77)


def _options():
    from bsr_cli.engine import supervisor

    return supervisor.EngineOptions(REG, w=2, max_tokens=2048, faults_enabled=True, fetch_timeout_s=2.0)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from bsr_cli.engine import supervisor

    state = tmp_path_factory.mktemp("lifecycle-engine")
    try:
        supervisor.up(state, _options())
        yield state
    finally:
        supervisor.down(state)


def _client(state: Path) -> AdminClient:
    conn = local_engine.connection(state)
    assert conn is not None
    return AdminClient(conn[0], conn[1], timeout_s=60)


def _until(cond: Callable[[], bool], what: str, limit_s: float = 240.0) -> None:
    """Wait for ``cond`` (polled; bounded), failing with ``what``."""
    pause = threading.Event()
    for _ in range(int(limit_s / 0.25)):
        if cond():
            return
        pause.wait(0.25)
    assert cond(), what


def test_a_killed_rank_is_restarted_and_reported(own: Path, bsr, monkeypatch: pytest.MonkeyPatch) -> None:
    from bsr_cli.engine import supervisor

    before = {p.name: p.pid for p in supervisor.status(own).processes}
    os.kill(before["rank1"], signal.SIGKILL)
    with _client(own) as c:
        _, seq = c.held_events()

        def restarted() -> bool:
            got, _ = c.held_events(since=seq)
            return any(isinstance(e, RankRestarted) and e.rank == 1 for e in got)

        _until(restarted, "no rank_restarted event for rank 1")
        event = next(e for e in c.held_events(since=seq)[0] if isinstance(e, RankRestarted))
        assert event.restarts == 1 and event.pid != before["rank1"]
        assert event.reason == "killed by SIGKILL", event  # the reason the fleet shows beside the restart
        _until(lambda: bool(c.health().ok), "the engine did not turn healthy after the restart")
        done = c.submit(PROMPT)
        assert done.hash_ok is True
    st = supervisor.status(own)
    rank1 = next(p for p in st.processes if p.name == "rank1")
    assert rank1.alive and rank1.pid == event.pid and rank1.restarts == 1
    assert st.healthy
    monkeypatch.setenv("BSR_STATE_DIR", str(own))
    out = bsr("engine", "status")
    assert out.code == 0 and "restarted 1×" in out.out, out.out


def test_markers_and_settings_survive_a_restart_and_faults_do_not(own: Path) -> None:
    from bsr_cli.engine import supervisor

    with _client(own) as c:
        c.submit(PROMPT)  # both tiers hold it now
        c.inject_fault(FaultRequest("corrupt", count=1))
        failed = c.restore(PROMPT)
        assert failed.outcome is Outcome.FAILED_CLOSED
        markers = c.markers()
        assert [m.excluded_tiers for m in markers] == [("mooncake",)]
        c.update_settings(fs_concurrency=3)
        c.inject_fault(FaultRequest("timeout", rank=0, count=0))  # armed until cleared: must not survive
    supervisor.down(own)
    started = supervisor.up(own, _options())
    lines = started.restored or ()
    assert "restored 1 force-local marker(s) from the previous run" in lines, lines
    assert "restored the settings changed at run time: fs_concurrency 3" in lines, lines
    assert any(line.startswith("dropped 1 armed fault(s)") for line in lines), lines
    with _client(own) as c:
        assert [(m.prompt, m.excluded_tiers) for m in c.markers()] == [(m.prompt, m.excluded_tiers) for m in markers]
        assert c.info().fs_concurrency == 3
        assert c.faults().faults == ()
    log = (own / "logs" / "engine.log").read_text()
    assert "bsr engine: dropped 1 armed fault(s)" in log


def test_shutdown_leaves_nothing_running(own: Path) -> None:
    from bsr_cli.engine import supervisor

    conn = local_engine.connection(own)
    assert conn is not None
    names = {p.name for p in supervisor.status(own).processes}
    assert names >= {"engine", "rank0", "rank1", "mooncake_master", "segment_holder"}
    r = httpx.post(conn[0] + "/bsr/v1/shutdown", headers={"Authorization": f"Bearer {conn[1]}"}, timeout=10)
    assert r.status_code == 200
    _until(
        lambda: not any(p.alive for p in supervisor.status(own).processes),
        f"still running after /shutdown: {[p for p in supervisor.status(own).processes if p.alive]}",
        limit_s=60,
    )
