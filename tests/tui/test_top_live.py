"""The real `bsr top` app, driven by Textual's pilot, against the real embedded engine: a restore moves the gauges
and lands in the event log; a fault injected through the confirmation screen is shown as injected, fails the next
restore closed and leaves a marker; an unreachable engine raises a banner that clears itself on reconnect."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.client import AdminClient
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.model import Frame, View
from bsr_cli.tui.screens import ConfirmScreen, FaultScreen
from bsr_cli.tui.source import LiveSource, Recorder, ReplaySource, read_recording

PROMPT = Prompt.synthetic_of(30000, 7)


def _restore_in_background(engine: Any, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        with engine.client() as c:
            out["result"] = c.restore(PROMPT, w=4)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _seen(app: TopApp, request: str, kind: str) -> bool:
    return app.view is not None and any(e.request == request and e.type == kind for e in app.view.events)


@pytest.mark.timeout(180)
async def test_gauges_history_and_events_follow_a_restore(
    engine: Any, wait_until: Any, screen: Callable[[Any], str], tmp_path: Path
) -> None:
    with engine.client() as c:
        c.submit(PROMPT)  # warm the tiers so the restore has something to fetch
    recorder = Recorder.open(tmp_path / "live.jsonl.gz", source=engine.url)
    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.05, recorder=recorder)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        assert app.view is not None
        first_frame = app.view.frames
        out: dict[str, Any] = {}
        worker = _restore_in_background(engine, out)

        await wait_until(pilot, lambda: not worker.is_alive(), "the restore to finish", timeout=120)
        request = out["result"].request
        assert out["result"].outcome is Outcome.COMMITTED
        await wait_until(pilot, lambda: _seen(app, request, "restore_committed"), "restore_committed in the log")
        await wait_until(pilot, lambda: app.shown is not None and any(o.request == request for o in app.shown.recent),
                         "the outcome on screen")  # fmt: skip
        view: View = app.view  # type: ignore[assignment]
        assert all(g.peak_bytes > 0 for g in view.gauges)
        text = screen(app)
        assert request in text and "committed" in text
        assert "Restore pool per rank" in text and "RWS(W=4)" in text
        assert "snapshot" in text and " ms" in text, "the status bar shows age and poll latency"
        await pilot.press("k")  # restores only
        assert app.kind == "restores"
        assert "window 1 fetched" not in screen(app)
        await pilot.press("r", "r")
        assert app.rank == 1
        assert "Events · rank 1 · restores" in screen(app)
        await pilot.press("question_mark")
        assert "cycle the rank / event-kind filter" in screen(app)
        seen = app.polls
        # Snapshots keep arriving under a dialog and are drawn on the main screen behind it.
        await wait_until(pilot, lambda: app.polls >= seen + 3, "polls while the help is open")
        await pilot.press("escape")
        assert "cycle the rank / event-kind filter" not in screen(app)
        polls = app.polls
    # Everything polled was recorded, and replays.
    _, items = read_recording(tmp_path / "live.jsonl.gz")
    assert len(items) >= polls >= 2
    replay = ReplaySource.load(tmp_path / "live.jsonl.gz")
    last = replay.frame(len(replay) - 1).view
    assert last is not None and any(e.request == request for e in last.events)
    # The restore's life, read from every poll the recording kept (the screen's history keeps only the last 120,
    # fewer than a loaded machine can poll while the outcome reaches the screen).
    views = [v for v in (replay.frame(i).view for i in range(first_frame, len(replay))) if v is not None]
    # The gauges moved: a poll's high water reached the restore's windows while they were in flight.
    assert any(g.high_water_bytes > 0 for v in views for g in v.gauges), "no poll saw the pool hold a window"
    # Each poll that caught the restore in flight showed its window progress. Whether any poll catches it is up to
    # the host (a loaded one can leave this app unscheduled for the whole restore); a restore held in flight until
    # the app has seen it is test_top_abort's and test_top_incident's (an injected stall).
    actives = [a.progress_text for v in views for a in v.active if a.request == request]
    assert all(r.startswith("window ") and " of " in r for r in actives), actives


@pytest.mark.timeout(180)
async def test_fault_injected_through_the_ui_then_a_restore_fails_closed(
    engine: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    with engine.client() as c:
        c.submit(PROMPT)
    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None and not app.view.faults, "a snapshot without faults")
        # f opens the picker; nothing is sent until it is confirmed.
        await pilot.press("f")
        assert isinstance(app.screen, FaultScreen)
        picker = app.screen
        await pilot.press("f")  # app keys still arrive under a dialog: no second dialog on top
        assert app.screen is picker and len(app.screen_stack) == 2
        await pilot.press("tab", "down", "down")  # to the rank list: every rank → rank 0 → rank 1
        assert picker.spec() == FaultRequest("restore-fault", rank=1, count=1)
        assert "restore-fault on rank 1" in screen(app)
        await pilot.press("y")
        await wait_until(pilot, lambda: app.shown is not None and app.shown.faults, "the injected fault on screen")
        assert [(f.kind, f.rank) for f in app.shown.faults] == [("restore-fault", 1)]  # type: ignore[union-attr]
        text = screen(app)
        assert "INJECTED FAULT" in text and "INJECTED" in text and "restore-fault · rank 1" in text

        # The next restore fails closed; the outcome, the failure event and the marker all show.
        out: dict[str, Any] = {}
        worker = _restore_in_background(engine, out)
        await wait_until(pilot, lambda: not worker.is_alive(), "the restore to finish", timeout=120)
        request = out["result"].request
        assert out["result"].outcome is Outcome.FAILED_CLOSED
        await wait_until(pilot, lambda: _seen(app, request, "marker_set"), "the marker event")
        await wait_until(pilot, lambda: app.shown is not None and app.shown.markers, "the marker on screen")
        text = screen(app)
        assert "failed closed" in text and "FAILED CLOSED" in text
        assert "recompute locally" in text  # an install fault is the rank's: the marker excludes no tier

        # c asks first; n keeps the faults, y clears them.
        with engine.client() as c:
            c.inject_fault(FaultRequest("timeout", rank=0, count=0))
        await wait_until(pilot, lambda: app.shown is not None and app.shown.faults, "a second fault")
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        with engine.client() as c:
            assert c.faults().faults, "cancel must not clear"
        await pilot.press("c", "y")
        await wait_until(pilot, lambda: app.shown is not None and not app.shown.faults, "the faults cleared")
        assert "none injected" in screen(app)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
async def test_unreachable_banner_clears_on_reconnect(
    engine: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    target = {"url": f"http://127.0.0.1:{_free_port()}"}  # nothing listens there
    source = LiveSource(lambda: AdminClient(target["url"], engine.token, timeout_s=2.0), timeout_s=2.0)
    app = TopApp(source, interval=0.05)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.failure is not None and app.polls >= 2, "failed polls")
        banner = app.query_one("#banner")
        assert banner.has_class("-shown")
        assert "ENGINE UNREACHABLE" in screen(app)
        assert app.view is None
        await pilot.press("f")  # nothing to act on: refused, no screen pushed
        assert not isinstance(app.screen, FaultScreen)

        target["url"] = engine.url  # the engine "comes back"
        await wait_until(pilot, lambda: app.view is not None and app.failure is None, "a snapshot after reconnect")
        await pilot.pause()
        assert not banner.has_class("-shown")
        text = screen(app)
        assert "ENGINE UNREACHABLE" not in text and "Restore pool per rank" in text
        assert engine.url in text  # the status bar names the engine it reached


class _CannedSource(LiveSource):
    """A live source whose engine says faults are disabled (the shared test engine allows them)."""

    def __init__(self, frame: Frame) -> None:
        super().__init__(lambda: None, label="canned")  # type: ignore[arg-type, return-value]
        self._frame = frame

    def poll(self) -> Frame:
        return self._frame


@pytest.mark.timeout(60)
async def test_fault_keys_respect_a_disabled_engine_and_a_replay(incident: Path) -> None:
    item = read_recording(incident)[1][-1]
    assert isinstance(item, Frame)
    snap = replace(item.snapshot, info=replace(item.snapshot.info, faults_enabled=False))
    app = TopApp(_CannedSource(Frame(snap, item.received_at, 0.01)), interval=0.05)
    notified: list[str] = []
    notify = app.notify

    def record(message: str, *args: Any, **kwargs: Any) -> None:  # App.notify is public; its store is not
        notified.append(message)
        notify(message, *args, **kwargs)

    app.notify = record  # type: ignore[method-assign]
    async with app.run_test(size=(100, 30)) as pilot:
        while app.view is None:
            await pilot.pause(0.05)
        await pilot.press("f")
        assert not isinstance(app.screen, FaultScreen)
        assert any("does not allow fault injection" in m for m in notified), notified
    replay = TopApp(ReplaySource.load(incident), paused=True)
    async with replay.run_test(size=(100, 30)) as pilot:
        await pilot.press("f", "c")
        assert not isinstance(replay.screen, FaultScreen | ConfirmScreen)
