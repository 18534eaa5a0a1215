"""Helpers for driving the real `bsr top` app with Textual's pilot."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

FIXTURE = Path(__file__).parent / "data" / "incident.jsonl.gz"


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch):
    """Event times are drawn as local clock times; pin the zone so recorded frames render the same anywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def screen_text(app: Any) -> str:
    """The app's screen as plain text, one line per terminal row padded to the width, read back from Textual's
    public `App.export_screenshot()` (an SVG whose text runs carry their cell position), so the tests depend on
    no private attribute of Textual."""
    from rich.cells import cell_len

    width, height = app.size
    grid = [[" "] * width for _ in range(height)]
    runs = _SVG_TEXT.findall(app.export_screenshot())
    cell_w = next((float(n) / cell_len(html.unescape(t)) for _, n, _, t in runs if html.unescape(t).strip()), 0.0)
    for x, _, row, text in runs:
        text = html.unescape(text).replace("\n", "").replace("\xa0", " ")  # the SVG writes spaces as &#160;
        if not text or cell_w <= 0:
            continue
        col, r = round(float(x) / cell_w), int(row)
        if r >= height:
            continue
        for ch in text:
            if col >= width:
                break
            grid[r][col] = ch
            if cell_len(ch) == 2 and col + 1 < width:
                grid[r][col + 1] = ""  # the second cell of a wide character
            col += cell_len(ch) or 1
    return "\n".join("".join(line) for line in grid)


# One run of styled text in Textual's SVG screenshot: its x, its width in pixels, its row, and its characters.
_SVG_TEXT = re.compile(
    r'<text class="[^"]*" x="([0-9.]+)" y="[0-9.]+" textLength="([0-9.]+)" '
    r'clip-path="url\(#[^)]*-line-([0-9]+)\)">([^<]*)</text>'
)


WaitUntil = Callable[..., Awaitable[None]]


@pytest.fixture
def wait_until() -> WaitUntil:
    """Let the app run until ``cond()`` holds; fail (never hang) after ``timeout`` seconds. Asserts no timing."""

    async def wait(pilot: Any, cond: Callable[[], object], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                shown = screen_text(pilot.app)
                pytest.fail(f"gave up after {timeout:.0f}s waiting for {what}\n--- screen ---\n{shown}")
            await pilot.pause(0.05)

    return wait


async def settled_screen(pilot: Any, rounds: int = 50) -> str:
    """The screen once drawing has come to rest: read the same across one more pause. A pause returns after the
    queued messages are handled, but the layout it then runs sends each resized pane a Resize that it draws on only
    at the next turn; on a busy host that turn comes late, and a screen read at once shows the pane drawn for its
    old size. Fails (never hangs) when the screen keeps changing for ``rounds`` pauses."""
    shown = screen_text(pilot.app)
    for _ in range(rounds):
        await pilot.pause()
        again = screen_text(pilot.app)
        if again == shown:
            return shown
        shown = again
    pytest.fail(f"the screen kept changing for {rounds} pauses\n--- screen ---\n{shown}")


@pytest.fixture
def settled() -> Callable[[Any], Awaitable[str]]:
    return settled_screen


@pytest.fixture
def incident() -> Path:
    """A real recording (tests/tui/record_fixture.py): a committed restore, an injected restore-fault on rank 1,
    a restore that failed closed and left a force-local marker."""
    return FIXTURE


@pytest.fixture
def screen() -> Callable[[Any], str]:
    return screen_text
