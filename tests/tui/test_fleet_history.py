"""What happens to a real embedded engine, as its fleet shows it: a rank killed is shown with its reason while it
is down and kept in the fleet's timeline once respawned (the `rank_restarted` event carries the reason); a clean
`bsr engine down` between two `bsr status` runs is a clean stop (the fleet never saw the stop announced: the
engine's own record on this machine says so); and after the engine restarts, its view in `bsr top`'s fleet lists
the restores of its durable history (its own list starts empty at every start)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prometheus_server
import pytest
from own_engine import OwnEngine, own_engine

from bsr_cli import fleet
from bsr_cli.client import AdminClient
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.engine import supervisor
from bsr_cli.settings import SettingFlags, load_settings
from bsr_cli.tui.fleet_app import EngineScreen, FleetApp

pytestmark = pytest.mark.timeout(300)
PROMPT = Prompt.synthetic_of(2048, 61)


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnEngine]:
    """An engine of this module's own (it loses a rank and is stopped and started), on a fixed port so that its
    URL stays the same across its restart."""
    with own_engine(tmp_path_factory.mktemp("history-engine"), port=prometheus_server.free_port()) as eng:
        yield eng


def _row(bsr: Any, urls: Path) -> tuple[int, dict[str, Any]]:
    r = bsr("status", "--engines-from", str(urls), "--json")
    (row,) = r.report()["engines"]  # an unhealthy fleet: in the error object
    return r.code, row


def _until(cond: Callable[[], Any], what: str, timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"gave up after {timeout:.0f}s waiting for {what}"
        time.sleep(0.3)
    return got


async def test_the_fleet_keeps_a_rank_restart_a_clean_stop_and_the_engines_history(
    own: OwnEngine,
    bsr: Any,
    tmp_path: Path,
    wait_until: Any,
    screen: Callable[[Any], str],
) -> None:
    state, url, token = own.state_dir, own.url, own.token
    urls = tmp_path / "engines.txt"
    urls.write_text(f"{url}\n")
    with AdminClient(url, token) as c:  # history: one restore committed, one failed closed by a rank's install
        c.submit(PROMPT)
        assert c.restore(PROMPT, w=4).outcome is Outcome.COMMITTED
        c.inject_fault(FaultRequest("restore-fault", rank=1, count=1))
        assert c.restore(PROMPT, w=4).outcome is Outcome.FAILED_CLOSED
    assert _row(bsr, urls)[0] == 0

    # A rank killed: the fleet names why, and once the engine respawned it keeps the restart and its reason.
    pid = int(next(r["pid"] for r in json.loads((state / "state.json").read_text())["ranks"] if r["rank"] == 1))
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        code, row = _row(bsr, urls)
        if row["state"] == "unhealthy":  # caught while it is down: the rank's row says why
            assert code == 9 and any(r["rank"] == 1 and r["reason"] for r in row["ranks"]), row
        return row if any(i["kind"] == "rank_restarted" for i in row.get("incidents", [])) else None

    row = _until(restarted, "the rank's restart in the fleet")
    restart = next(i for i in row["incidents"] if i["kind"] == "rank_restarted")
    assert restart["rank"] == 1 and "killed by SIGKILL" in restart["text"], restart
    code, row = _until(lambda: (got := _row(bsr, urls))[1]["ranks_up"] == 2 and got, "rank 1 back")
    assert code == 0 and row["state"] == "attention", row
    assert any(p.startswith("rank 1 restarted (killed by SIGKILL") for p in row["problems"]), row["problems"]
    text = bsr("status", "--engines-from", str(urls))
    assert "timeline (newest first):" in text.out and "rank 1 restarted (killed by SIGKILL" in text.out, text.out

    # A clean stop between two runs of `bsr status`: never seen announced, read from the engine's own record.
    assert bsr("engine", "down", "--state-dir", str(state)).code == 0
    code, row = _row(bsr, urls)
    assert code == 3 and row["departure"] == "clean" and row["clean_stop"] is True, row
    assert row["incidents"][0]["kind"] == "went_down" and row["incidents"][0]["text"] == "stopped cleanly"

    # Up again (same state directory, same port): the engine's own list is empty, its history is not.
    supervisor.up(state, own.options)
    code, row = _row(bsr, urls)
    assert code == 0 and row["came_back"] == "clean", row
    settings = load_settings(SettingFlags())
    app = FleetApp(  # as `bsr top` runs it: with what the fleet remembers from the runs of `bsr status` above
        fleet.discover(str(urls), settings=settings),
        interval=0.3,
        timeout_s=5,
        memory=fleet.Memory.for_settings(settings),
    )
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_until(pilot, lambda: app.result is not None, "the first round", timeout=60)
        # The round's result is drawn on the next refresh: the screen is read once it has been drawn.
        history = ("rank 1 restarted (killed by SIGKILL", "stopped cleanly", "engine restarted after a clean stop")
        await wait_until(pilot, lambda: all(line in screen(app) for line in history), "the engine's history drawn")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EngineScreen), "the engine's view")
        view = app.screen
        assert isinstance(view, EngineScreen)
        await wait_until(pilot, lambda: view.view is not None, "the engine's first snapshot", timeout=60)
        outcomes = "Recent outcomes (2, 1 failed closed)"
        await wait_until(pilot, lambda: outcomes in screen(app), "the engine's outcomes drawn")
