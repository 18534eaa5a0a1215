"""The layout, pinned: frames of a real recording replayed at fixed terminal sizes, compared line by line with the
expected screens committed next to this file. Textual upgrades or deliberate layout changes: regenerate with

    BSR_REGEN_LAYOUT=1 .venv/bin/python -m pytest tests/tui/test_top_layout.py

and review the diff of tests/tui/data/layout-*.txt like any other change.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.tui.app import TopApp
from bsr_cli.tui.source import ReplaySource

DATA = Path(__file__).parent / "data"
REGEN = "BSR_REGEN_LAYOUT=1 .venv/bin/python -m pytest tests/tui/test_top_layout.py"

CASES = [
    # (frame, size): a restore in flight; an injected fault with a failing restore at 80x24; the aftermath.
    (6, (120, 36)),
    (30, (80, 24)),
    (33, (120, 36)),
    (33, (80, 24)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("frame", "size"), CASES, ids=[f"frame{f}-{w}x{h}" for f, (w, h) in CASES])
async def test_layout_is_pinned(
    frame: int, size: tuple[int, int], incident: Path, settled: Callable[[Any], Awaitable[str]]
) -> None:
    source = ReplaySource.load(incident)
    source.position = frame
    app = TopApp(source, paused=True)
    async with app.run_test(size=size) as pilot:
        got = await settled(pilot)
    expected_file = DATA / f"layout-frame{frame}-{size[0]}x{size[1]}.txt"
    if os.environ.get("BSR_REGEN_LAYOUT"):
        expected_file.write_text(got)
    assert expected_file.exists(), f"no expected layout {expected_file.name}; create it with: {REGEN}"
    expected = expected_file.read_text()
    if got != expected:
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), got.splitlines(), "expected", "got", lineterm=""))
        pytest.fail(f"the {size[0]}x{size[1]} layout of frame {frame} changed; if intended, run: {REGEN}\n{diff}")
