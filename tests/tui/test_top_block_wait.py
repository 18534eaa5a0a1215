"""`bsr top` shows requests waiting for destination KV blocks where the admission panel shows its queue: a real
recorded snapshot, its admission's `waiting_for_blocks` set, replayed into the real app through Textual's pilot."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.incident_bundle import recording_bytes
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.model import Frame
from bsr_cli.tui.source import ReplaySource, read_recording

SIZES = [(120, 36), (80, 24)]
SHOWN = {(120, 36): "blocks    2 requests waiting for destination KV blocks", (80, 24): "blocks  2 requests waiting"}


def _recording_waiting(incident: Path, tmp_path: Path, waiting: int) -> Path:
    """The fixture's last snapshot, with ``waiting`` requests waiting for destination KV blocks."""
    _, items = read_recording(incident)
    frame = [i for i in items if isinstance(i, Frame)][-1]
    snap = frame.snapshot.to_wire()
    snap["admission"]["waiting_for_blocks"] = waiting
    path = tmp_path / f"waiting-{waiting}.jsonl.gz"
    path.write_bytes(recording_bytes(snap, frame.received_at, frame.latency_s, "test"))
    return path


async def _shown(path: Path, size: tuple[int, int], settled: Callable[[Any], Awaitable[str]]) -> str:
    app = TopApp(ReplaySource.load(path), paused=True)
    async with app.run_test(size=size) as pilot:
        return await settled(pilot)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_the_admission_panel_shows_requests_waiting_for_kv_blocks(
    size: tuple[int, int], incident: Path, tmp_path: Path, settled: Callable[[Any], Awaitable[str]]
) -> None:
    shown = await _shown(_recording_waiting(incident, tmp_path, 2), size, settled)
    lines = shown.splitlines()
    queue = next(n for n, line in enumerate(lines) if "queued" in line)
    assert SHOWN[size] in lines[queue + 1], shown  # right under the admission queue


@pytest.mark.timeout(60)
async def test_no_request_waiting_for_blocks_draws_no_such_count(
    incident: Path, tmp_path: Path, settled: Callable[[Any], Awaitable[str]]
) -> None:
    """The negative control: the same snapshot with nobody waiting says nothing of KV blocks."""
    shown = await _shown(_recording_waiting(incident, tmp_path, 0), (120, 36), settled)
    assert "queued" in shown and "requests waiting" not in shown and "blocks  " not in shown, shown
