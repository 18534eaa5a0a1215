"""Recording and replay: a live session recorded from the real engine replays to the same frames every time."""

from __future__ import annotations

import gzip
import itertools
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.prompt import Prompt
from bsr_cli.errors import EngineUnreachable, InvalidInput
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.model import Frame
from bsr_cli.tui.source import LiveSource, PollFailure, Recorder, ReplaySource, read_recording

PROMPT = Prompt.synthetic_of(30000, 7)


def _record_live(engine: Any, path: Path) -> int:
    """Poll the real engine around a restore, and once where nothing listens, recording every poll."""
    with engine.client() as c:
        c.submit(PROMPT)
    source = LiveSource.for_url(engine.url, engine.token)
    rec = Recorder.open(path, source=engine.url)
    rec.write(source.poll())

    def restore() -> None:
        with engine.client() as c:
            c.restore(PROMPT, w=4)

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    while t.is_alive():
        rec.write(source.poll())
        t.join(0.05)
    rec.write(source.poll())
    down = LiveSource.for_url("http://127.0.0.1:9", timeout_s=1.0)
    with pytest.raises(EngineUnreachable) as e:
        down.poll()
    rec.write(PollFailure.from_error(e.value, 0.0, 0.001))
    rec.write(source.poll())
    rec.close()
    source.close()
    return rec.lines - 1


async def _frames_through_the_app(path: Path, settled: Callable[[Any], Awaitable[str]]) -> list[str]:
    source = ReplaySource.load(path)
    app = TopApp(source, paused=True)
    shots = []
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(len(source)):
            shots.append(await settled(pilot))
            await pilot.press("right")
        await pilot.press("shift+left")
        assert source.position == len(source) - 11
    return shots


@pytest.mark.timeout(180)
async def test_replay_is_deterministic(engine: Any, tmp_path: Path, settled: Callable[[Any], Awaitable[str]]) -> None:
    path = tmp_path / "incident.jsonl.gz"
    polls = _record_live(engine, path)
    _, items = read_recording(path)
    assert len(items) == polls >= 4
    assert sum(isinstance(i, PollFailure) for i in items) == 1

    first = await _frames_through_the_app(path, settled)
    second = await _frames_through_the_app(path, settled)
    assert len(first) == polls
    assert first == second
    assert len(set(first)) > 1, "the frames differ from one another (the replay moved)"
    outage = [s for s in first if "ENGINE UNREACHABLE" in s]
    assert len(outage) == 1, "the recorded outage replays as the banner, on its frame only"

    # Seeking lands on the same view however it is reached.
    replay = ReplaySource.load(path)
    last = len(replay) - 1
    direct = replay.frame(last).view
    replay.seek(+last)
    replay.seek(-last)
    for _ in range(last):
        replay.advance()
    assert replay.advance() is None and replay.frame().view == direct


@pytest.mark.timeout(30)
def test_recording_is_compact_and_survives_a_killed_recorder(incident: Path, tmp_path: Path) -> None:
    _, items = read_recording(incident)
    frames = [i for i in items if isinstance(i, Frame)]
    # Events already on file are not written again: each is stored once across the whole recording.
    seqs = [e["seq"] for f in frames for e in f.snapshot.events]
    assert len(seqs) == len(set(seqs))
    # A recorder killed mid-line leaves a truncated gzip stream: every complete line before it still replays.
    raw = gzip.decompress(incident.read_bytes())
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(raw)[: len(gzip.compress(raw)) * 2 // 3])
    _, kept = read_recording(cut)
    assert 0 < len(kept) < len(items)
    assert ReplaySource(kept).frame(len(kept) - 1).view is not None


@pytest.mark.timeout(30)
def test_replay_pacing_and_bad_input(incident: Path, tmp_path: Path) -> None:
    replay = ReplaySource.load(incident)
    assert all(0.05 <= replay.delay_after(i) <= 5.0 for i in range(len(replay)))
    assert replay.seek(-100).index == 0 and replay.seek(10_000).index == len(replay) - 1
    with pytest.raises(InvalidInput):
        ReplaySource([])
    other = tmp_path / "other.gz"
    other.write_bytes(gzip.compress(b'{"format": "something-else"}\n'))
    with pytest.raises(InvalidInput, match="not a bsr top recording"):
        read_recording(other)


@pytest.mark.timeout(60)
def test_a_recording_closed_while_a_poll_is_written_still_reads(incident: Path, tmp_path: Path) -> None:
    """The app writes from its poll thread and closes the recorder on quit from its own: the close may land while a
    write is under way, and the recording must still read back whole (every line written before the close)."""
    _, items = read_recording(incident)
    frames = [i for i in items if isinstance(i, Frame)]
    for attempt in range(20):
        path = tmp_path / f"quit-{attempt}.jsonl.gz"
        rec = Recorder.open(path, source="test")
        written = threading.Event()
        refused: list[Exception] = []

        def poll_thread(
            rec: Recorder = rec, written: threading.Event = written, refused: list[Exception] = refused
        ) -> None:
            for n in itertools.count():  # until the close refuses a write: no count a starved quit could outrun
                try:
                    rec.write(frames[n % len(frames)])
                except ValueError as e:  # the file closed as the app quits: what the app's poll thread catches
                    refused.append(e)
                    return
                if n == 20:
                    written.set()

        t = threading.Thread(target=poll_thread, daemon=True)
        t.start()
        assert written.wait(30), "the poll thread wrote its first frames"
        rec.close()  # the app quitting, mid-poll
        t.join(30)
        assert not t.is_alive() and refused, "a write after the close is refused, not lost in a closed file"
        _, kept = read_recording(path)
        assert len(kept) == rec.lines - 1 >= 21, (len(kept), rec.lines)
