"""`bsr top --record` over a fleet and its replay, through Textual's pilot: a real engine (the shared embedded one)
and an address where nothing listens, recorded round by round, then played back in the fleet view."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.fleet import Target
from bsr_cli.tui.fleet_app import (
    EnginePolled,
    EngineScreen,
    FleetApp,
    FleetPolled,
    FleetRecorder,
    is_fleet_recording,
    read_fleet_recording,
)

NOWHERE = "http://127.0.0.1:9"


@pytest.mark.timeout(120)
async def test_a_fleet_is_recorded_and_replayed(
    live_engine: Any, tmp_path: Path, incident: Path, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    path = tmp_path / "fleet.jsonl.gz"
    targets = [Target("real", live_engine.url, live_engine.token), Target("gone", NOWHERE, None)]
    app = FleetApp(targets, interval=0.1, timeout_s=2, recorder=FleetRecorder(path, len(targets)))
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.rounds >= 3, "three rounds")
        assert "REC fleet.jsonl.gz" in screen(app)
    assert is_fleet_recording(path) and not is_fleet_recording(incident)
    rounds = read_fleet_recording(path)
    assert len(rounds) >= 3
    assert all([e.engine for e in r.engines] == ["gone", "real"] for _, r in rounds), "worst first"
    assert all(r.engines[0].state == "down" for _, r in rounds)
    assert [t for t, _ in rounds] == sorted(t for t, _ in rounds)

    replay = FleetApp([], replay=rounds)
    async with replay.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: replay.rounds >= len(rounds), "every recorded round played")
        shown = screen(replay)
        assert f"replay · round {len(rounds)}/{len(rounds)}" in shown
        assert "gone" in shown and "real" in shown and "down" in shown
        await pilot.press("enter")  # a replay has no live engine to open
        await pilot.pause()
        assert not isinstance(replay.screen, EngineScreen)


@pytest.mark.timeout(60)
async def test_a_round_that_lands_while_the_app_is_taken_down_is_dropped(wait_until: Any) -> None:
    """An exiting app's widgets are removed one by one, and a round's message can land in between (the header gone,
    the table still there): it is dropped, never drawn into a half-removed screen (that crashed the app on quit)."""
    app = FleetApp([Target("gone", NOWHERE, None)], interval=0.05, timeout_s=1)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.result is not None, "the first round")
        assert app.result is not None
        await app.query_one("#header").remove()  # where teardown was when the round landed
        rounds = app.rounds
        app.post_message(FleetPolled(app.result, 0.0))
        await pilot.pause()
        assert app.rounds == rounds, "nothing drawn, and no next round armed, once the app is going"


@pytest.mark.timeout(60)
async def test_an_engine_view_going_away_drops_its_last_poll(wait_until: Any) -> None:
    """The same for one engine's own view (Enter on a row): its last poll may land while the view is removed."""
    app = FleetApp([Target("gone", NOWHERE, None)], interval=0.05, timeout_s=1)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: app.result is not None, "the first round")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EngineScreen), "the engine view")
        view = app.screen
        assert isinstance(view, EngineScreen)
        await wait_until(pilot, lambda: view.polls >= 1, "the engine view's first poll")
        await view.query_one("#engine-header").remove()
        polls = view.polls
        view.post_message(EnginePolled(None, None))
        await pilot.pause()
        assert view.polls == polls
