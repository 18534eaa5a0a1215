"""Helpers for driving the real `bsr top` app with Textual's pilot."""

from __future__ import annotations

import io
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
    """The app's screen as plain text, composed exactly as `App.export_screenshot()` composes its SVG."""
    from rich.console import Console

    width, height = app.size
    console = Console(
        width=width,
        height=height,
        file=io.StringIO(),
        force_terminal=True,
        color_system="truecolor",
        record=True,
        legacy_windows=False,
        safe_box=False,
    )
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


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


@pytest.fixture
def incident() -> Path:
    """A real recording (tests/tui/record_fixture.py): a committed restore, an injected restore-fault on rank 1,
    a restore that failed closed and left a force-local marker."""
    return FIXTURE


@pytest.fixture
def screen() -> Callable[[Any], str]:
    return screen_text
