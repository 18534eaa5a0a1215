"""`bsr top --record` over a fleet and its replay, through Textual's pilot: a real engine (the shared embedded one)
and an address where nothing listens, recorded round by round, then played back in the fleet view."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.fleet import Target
from bsr_cli.tui.fleet_app import EngineScreen, FleetApp, FleetRecorder, is_fleet_recording, read_fleet_recording

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
