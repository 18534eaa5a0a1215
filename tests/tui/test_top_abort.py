"""Aborting from `bsr top` against the real embedded engine, where it races the restore: a restore that finished
while the question was open is not aborted and the operator is told how it finished; an abort that was sent is
followed to its outcome (failed closed, or committed first), never left at "abort requested"."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.results import AbortAnswer
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.screens import ChooseScreen, ConfirmScreen
from bsr_cli.tui.source import LiveSource

PROMPT = Prompt.synthetic_of(30000, 26)


def _restore(engine: Any, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        with engine.client() as c:
            out["result"] = c.restore(PROMPT, w=2)

    return threading.Thread(target=run, daemon=True)


def _spy(source: LiveSource) -> list[str]:
    calls: list[str] = []
    real = source.abort

    def abort(request: str) -> AbortAnswer:  # the real call, counted
        calls.append(request)
        return real(request)

    source.abort = abort  # type: ignore[method-assign]
    return calls


def _notes(app: TopApp) -> list[str]:
    """What the app tells the operator (its notifications), as it tells it: a spy on the real `notify`."""
    notes: list[str] = []
    real = app.notify

    def notify(message: str, **kw: Any) -> None:
        notes.append(message)
        real(message, **kw)

    app.notify = notify  # type: ignore[method-assign]
    return notes


async def _ask_to_abort(app: TopApp, pilot: Any, wait_until: Any) -> str:
    await wait_until(pilot, lambda: bool(app.view and app.view.active), "the restore in flight")
    assert app.view is not None
    request = app.view.active[0].request
    await pilot.press("a")
    if isinstance(app.screen, ChooseScreen):
        await pilot.press("enter")
    assert isinstance(app.screen, ConfirmScreen)
    return request


@pytest.mark.timeout(180)
async def test_a_restore_that_finished_under_the_question_is_not_aborted(
    engine_that_stalls: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    engine = engine_that_stalls
    with engine.client() as c:
        c.submit(PROMPT)
        # The stall holds the restore in flight until an abort ends it, so the app sees it running however busy the
        # machine is (a restore left to run on its own can be over before any poll catches it).
        c.inject_fault(FaultRequest("timeout", rank=1, window=1, count=1))
    out: dict[str, Any] = {}
    worker = _restore(engine, out)
    source = LiveSource.for_url(engine.url, engine.token)
    calls = _spy(source)
    app = TopApp(source, interval=0.05)
    notes = _notes(app)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        worker.start()
        request = await _ask_to_abort(app, pilot, wait_until)
        # The operator hesitates; meanwhile a second operator ends the restore from the CLI (polls go on under the
        # dialog), so by the time this one answers there is nothing left to abort.
        with engine.client() as c:
            assert c.abort(request).aborting
        await wait_until(
            pilot,
            lambda: app.view is not None and any(o.request == request for o in app.view.recent),
            "the restore's outcome in a snapshot",
            timeout=120,
        )
        await pilot.press("y")
        await wait_until(pilot, lambda: any("had already finished" in n for n in notes), "the operator told")
        assert any(f"{request} had already finished: aborted" in n for n in notes), notes
    assert calls == [], "nothing sent for a restore that is over"
    worker.join(60)  # the engine published the outcome just before its HTTP answer reached the worker
    assert out["result"].outcome is Outcome.ABORTED and out["result"].committed_tokens == 0


@pytest.mark.timeout(180)
async def test_an_abort_sent_is_followed_to_its_outcome(
    engine_that_stalls: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    engine = engine_that_stalls
    with engine.client() as c:
        c.submit(PROMPT)
        # The stall holds the restore in flight until the abort ends it: this engine's fetch deadline is far away.
        c.inject_fault(FaultRequest("timeout", rank=1, window=1, count=1))
    out: dict[str, Any] = {}
    worker = _restore(engine, out)
    source = LiveSource.for_url(engine.url, engine.token)
    calls = _spy(source)
    app = TopApp(source, interval=0.1)
    notes = _notes(app)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        worker.start()
        request = await _ask_to_abort(app, pilot, wait_until)
        await pilot.press("y")
        await wait_until(pilot, lambda: not worker.is_alive(), "the restore to end", timeout=120)
        await wait_until(pilot, lambda: any(f"{request} aborted:" in n for n in notes), "the abort's outcome told")
        assert not app.aborts_pending
    assert calls == [request]
    worker.join(60)
    assert out["result"].outcome is Outcome.ABORTED and out["result"].committed_tokens == 0
    assert any(f"abort requested for {request}" in n for n in notes), notes
    assert any(f"{request} aborted: failed closed, nothing committed" in n for n in notes), notes
    assert not any("before the abort reached it" in n for n in notes), notes
