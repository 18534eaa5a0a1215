"""`bsr top` in an incident, driven by Textual's pilot: the event log opened in full (scroll, filter, sort,
details), replay speed and jump-to-failure on a real recording, and against the real engine a fault dialog that sets
window/count/group and an abort that asks first and fails the restore closed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input, OptionList, Static

from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.results import AbortAnswer
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.screens import ChooseScreen, ConfirmScreen, EventLogScreen, FaultScreen
from bsr_cli.tui.source import LiveSource, ReplaySource


@pytest.mark.timeout(60)
async def test_event_log_opens_whole_filters_sorts_and_details(incident: Path, screen: Callable[[Any], str]) -> None:
    source = ReplaySource.load(incident)
    source.position = len(source) - 1
    app = TopApp(source, paused=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert app.shown is not None
        total = len(app.shown.events)
        await pilot.press("e")
        log = app.screen
        assert isinstance(log, EventLogScreen)
        lines = log.query_one("#lines", OptionList)
        assert lines.option_count == total
        # Newest first, and each line whole: the failure's full reason is there, not cut with "…".
        newest = log.shown()[0]
        assert newest.seq == max(e.seq for e in app.shown.events)
        failed = [e for e in app.shown.events if e.type == "restore_failed_closed"]
        assert failed and any(failed[0].text in str(lines.get_option_at_index(i).prompt) for i in range(total))
        await pilot.press("s")
        assert log.shown()[0].seq == min(e.seq for e in app.shown.events)
        await pilot.press("slash")
        await pilot.press(*"FAILED")
        assert 0 < lines.option_count < total and all("failed" in e.text.lower() for e in log.shown())
        await pilot.press("enter")  # back to the list
        await pilot.press("enter")  # details of the highlighted event
        detail = str(log.query_one("#detail", Static).render())
        assert "restore_failed" in detail and "request req-" in detail and "seq " in detail
        await pilot.press("escape")
        assert not isinstance(app.screen, EventLogScreen)


@pytest.mark.timeout(60)
async def test_replay_speed_and_jump_to_the_next_failure(incident: Path, screen: Callable[[Any], str]) -> None:
    source = ReplaySource.load(incident)
    app = TopApp(source, paused=True)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.pause()
        await pilot.press("plus", "plus")
        assert app.speed == 4.0 and "×4" in screen(app)
        await pilot.press("minus")
        assert app.speed == 2.0
        start = source.position
        await pilot.press("n")
        jumped = source.position
        assert jumped > start
        # The frame it stopped at is the first one showing a failure that the previous frame did not.
        assert app.view is not None
        fails = [e for e in app.view.events if e.type in ("restore_failed_closed", "restore_failed")]
        before = source.frame(jumped - 1).view
        kinds = ("restore_failed_closed", "restore_failed")
        fails_before = [e for e in before.events if e.type in kinds] if before else []
        assert len(fails) > len(fails_before) or "ENGINE UNREACHABLE" in screen(app)
        # Jumping on from the last failure with none after it stays put.
        while (nxt := source.next_failure()) is not None:
            await pilot.press("n")
            assert source.position == nxt
        here = source.position
        await pilot.press("n")
        assert source.position == here


PROMPT = Prompt.synthetic_of(30000, 9)


@pytest.mark.timeout(180)
async def test_fault_dialog_sets_window_count_and_group(engine: Any, wait_until: Any) -> None:
    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.1)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        await pilot.press("f")
        dialog = app.screen
        assert isinstance(dialog, FaultScreen)
        dialog.query_one("#window", Input).value = "3"
        dialog.query_one("#count", Input).value = "0"
        dialog.query_one("#group", Input).value = "nope"
        await pilot.pause()
        assert "group must be one of" in str(dialog.query_one("#summary").render())
        await pilot.press("y")  # refused: nothing is sent while a field is wrong
        assert isinstance(app.screen, FaultScreen)
        dialog.query_one("#group", Input).value = app.view.info.groups[0]
        await pilot.pause()
        assert "window 3" in str(dialog.query_one("#summary").render())
        await pilot.click("#inject")
        await wait_until(pilot, lambda: bool(app.view and app.view.faults), "the fault on screen")
    with engine.client() as c:
        faults = c.faults().faults
    assert len(faults) == 1
    f = faults[0]
    assert f.window == 2 and f.count == 0 and f.group == app.view.info.groups[0]


@pytest.mark.timeout(180)
async def test_abort_from_top_asks_first_and_fails_the_restore_closed(engine_that_stalls: Any, wait_until: Any) -> None:
    engine = engine_that_stalls
    with engine.client() as c:
        c.submit(PROMPT)
        # The stall holds the restore in flight until the abort ends it: this engine's fetch deadline is far away.
        c.inject_fault(FaultRequest("timeout", rank=1, window=1, count=1))
    out: dict[str, Any] = {}

    def run() -> None:
        with engine.client() as c:
            out["result"] = c.restore(PROMPT, w=2)

    worker = threading.Thread(target=run, daemon=True)
    source = LiveSource.for_url(engine.url, engine.token)
    answers: list[AbortAnswer] = []
    real_abort = source.abort

    def abort(request: str) -> AbortAnswer:  # the real call, with its answer kept for the asserts below
        answers.append(real_abort(request))
        return answers[-1]

    source.abort = abort  # type: ignore[method-assign]
    app = TopApp(source, interval=0.1)
    told: list[str] = []
    notify = app.notify

    def spy(message: str, **kw: Any) -> None:  # the real notification, its text kept for the asserts below
        told.append(message)
        notify(message, **kw)

    app.notify = spy  # type: ignore[method-assign]
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        await pilot.press("a")
        assert not isinstance(app.screen, ConfirmScreen)  # nothing in flight: nothing to ask
        worker.start()
        await wait_until(pilot, lambda: bool(app.view and app.view.active), "the restore in flight")
        await pilot.press("a")
        if isinstance(app.screen, ChooseScreen):
            await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")  # declined: nothing is sent
        assert answers == []
        await pilot.press("a")
        if isinstance(app.screen, ChooseScreen):
            await pilot.press("enter")
        await pilot.press("y")
        await wait_until(pilot, lambda: not worker.is_alive(), "the restore to end", timeout=120)
    worker.join(60)
    res = out["result"]
    assert res.outcome is Outcome.ABORTED and res.committed_tokens == 0
    assert len(answers) == 1 and answers[0] == AbortAnswer(request=res.request, aborting=True)
    assert res.report is not None
    assert any("abort" in f.reason for f in res.report.failures), res.report.failures
