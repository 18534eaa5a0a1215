"""`bsr top` at the smallest and a large terminal (80x24 and 160x45), through Textual's pilot on a real recording:
the recent outcomes (with their "why") stay on screen, the help is whole, the fault dialog's field hints are whole,
and the event pane scrolls (down/j, up, PageDown/PageUp, Home)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.tui.app import TopApp
from bsr_cli.tui.screens import FaultScreen, HelpScreen
from bsr_cli.tui.source import ReplaySource

SIZES = [(80, 24), (160, 45)]
FAILED_FRAME = 33  # after the restore that failed closed under the injected fault


def _app(incident: Path, frame: int = FAILED_FRAME) -> TopApp:
    source = ReplaySource.load(incident)
    source.position = frame
    return TopApp(source, paused=True)


def _event_rows(shown: str) -> list[str]:
    """The event pane's rows, top to bottom (the pane is the one whose title starts with "Events")."""
    lines = shown.splitlines()
    top = next(i for i, ln in enumerate(lines) if "─ Events ·" in ln)
    col = lines[top].index("╭─ Events")
    rows = []
    for ln in lines[top + 1 :]:
        cell = ln[col + 1 :].split("│")[0] if len(ln) > col else ""
        if ln[col : col + 1] == "╰":
            break
        rows.append(cell.strip())
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_recent_outcomes_and_their_why_stay_on_screen(
    size: tuple[int, int], incident: Path, settled: Callable[[Any], Awaitable[str]]
) -> None:
    app = _app(incident)
    async with app.run_test(size=size) as pilot:
        shown = await settled(pilot)
    assert "Recent" in shown and "req-00003 failed closed" in shown
    assert "injected restore fault" in shown, "the why of the failed restore"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_help_is_whole(size: tuple[int, int], incident: Path, screen: Callable[[Any], str]) -> None:
    app = _app(incident)
    async with app.run_test(size=size) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        shown = screen(app)
    for line in ("restore-pool occupancy per rank", "inject a fault", "only on engines started with faults",
                 "the next failure", "any key closes this"):  # fmt: skip
        assert line in shown, f"{line!r} cut at {size}:\n{shown}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_fault_dialog_hints_are_whole(
    size: tuple[int, int], incident: Path, screen: Callable[[Any], str]
) -> None:
    app = _app(incident)
    async with app.run_test(size=size) as pilot:
        app.push_screen(FaultScreen("http://127.0.0.1:8470", 2, ("full",)))
        await pilot.pause()
        shown = screen(app)
    compact = " ".join(shown.split())  # a hint may wrap inside its narrow column at 80 columns
    for hint in ("window (1-based; blank = first)", "count (0 = until cleared)", "group (full)"):
        words = hint.split()
        assert all(w in compact for w in words), f"{hint!r} cut at {size}:\n{shown}"
    if size == (160, 45):
        assert all(h in shown for h in ("window (1-based; blank = first)", "count (0 = until cleared)"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_event_pane_scrolls(size: tuple[int, int], incident: Path, screen: Callable[[Any], str]) -> None:
    app = _app(incident)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        newest = _event_rows(screen(app))
        assert len(newest) >= 3 and newest[0]
        await pilot.press("j")
        await pilot.pause()
        one = _event_rows(screen(app))
        assert one[0] == newest[1], "j shows one older event"
        assert app.events_back == 1 and ("1 newer above" in screen(app) or "↑1 newer" in screen(app))
        await pilot.press("down")
        await pilot.pause()
        assert _event_rows(screen(app))[0] == newest[2]
        await pilot.press("up")
        await pilot.pause()
        assert _event_rows(screen(app))[0] == newest[1]
        await pilot.press("pagedown")
        await pilot.pause()
        page = _event_rows(screen(app))
        assert page[0] not in newest[:2] and app.events_back > 2
        await pilot.press("home")
        await pilot.pause()
        assert _event_rows(screen(app)) == newest and app.events_back == 0
