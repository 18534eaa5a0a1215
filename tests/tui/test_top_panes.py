"""`bsr top` as a k9s user drives it, through Textual's pilot: Tab moves between panes and the one in focus scrolls;
at 80x24 the failed restores buried under newer ones are reached with the keyboard and their whole "why" opens
(Enter) and closes (Esc); the header keeps every key fact at 80 columns; the full event log (`e`) pages back
through the engine's durable store (or a recording) to its oldest event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.tui.app import TopApp
from bsr_cli.tui.panes import RecentList
from bsr_cli.tui.screens import EventLogScreen, WhyScreen
from bsr_cli.tui.source import LOG_PAGE, LiveSource, ReplaySource

SMALL = 4096  # tokens per restore: 4 windows of W=4 on the test engine, quick to restore


def _squeeze(text: str) -> str:
    """The screen's text with every run of blanks and box edges as one space: a reason wrapped over several lines
    of a box reads as one line again."""
    return " ".join(text.replace("│", " ").split())


def _restore(engine: Any, seed: int) -> Any:
    prompt = Prompt.synthetic_of(SMALL, seed)
    with engine.client() as c:
        c.submit(prompt)  # stored in the tiers, so the restore has something to fetch
        return c.restore(prompt, w=4)


async def _press_until(pilot: Any, key: str, cond: Callable[[], bool], most: int) -> int:
    """Press ``key`` until ``cond()`` holds (each press handled before the next); how many presses it took."""
    for n in range(most + 1):
        if cond():
            return n
        await pilot.press(key)
        await pilot.pause()
    pytest.fail(f"{key} pressed {most} times and the condition never held")


@pytest.mark.timeout(300)
async def test_at_80x24_a_buried_failure_is_reached_by_keys_and_its_why_opens_whole(
    engine: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    # Two restores fail closed (an install fault on rank 1), then ten commit on top of them: newest first, the
    # failures sit below what an 80x24 Recent pane shows (at most 9 rows, however short the panes above it are).
    with engine.client() as c:
        c.inject_fault(FaultRequest("restore-fault", rank=1, count=2))
    failed = [_restore(engine, seed) for seed in (9101, 9102)]
    assert all(r.outcome is Outcome.FAILED_CLOSED for r in failed)
    committed = [_restore(engine, seed) for seed in range(9201, 9211)]
    assert all(r.outcome is Outcome.COMMITTED for r in committed)
    target = failed[-1].request
    reason = failed[-1].report.failures[0].reason

    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        recent = app.query_one("#recent", RecentList)
        await wait_until(pilot, lambda: any(o.request == target for o in recent.outcomes), "the failure listed")
        # Laid out: the pane says how many restores are below what it shows.
        await wait_until(pilot, lambda: "↓" in str(recent.border_subtitle) and "tiers   ●" in screen(app), "layout")
        shown = screen(app)
        assert "tiers mooncake,fs" in shown, "the header keeps the tiers at 80 columns"
        assert f"{target} failed closed" not in shown, f"the failure must start out of sight:\n{shown}"
        # Tab to the Recent pane (shift+Tab: it is the one before the events, which have the focus), then down.
        await pilot.press("shift+tab")
        assert app.focused is recent
        presses = await _press_until(pilot, "down", lambda: getattr(recent.chosen(), "request", "") == target, 60)
        assert presses >= len(committed)
        assert f"{target} failed closed" in screen(app), "the row under the cursor is on screen"
        await pilot.press("enter")
        assert isinstance(app.screen, WhyScreen)
        why = app.screen
        await wait_until(pilot, lambda: why.ending is not None, "the restore's end event read from the engine")
        whole = _squeeze(screen(app))
        assert _squeeze(reason) in whole, f"the reason, whole:\n{screen(app)}"
        assert "FAILED CLOSED" in whole and "kind rank · stage install · rank 1 · window G1" in whole
        await pilot.press("escape")
        assert not isinstance(app.screen, WhyScreen) and app.focused is recent

        # `o` lists only the restores that failed closed: the failure is at the top, whatever came after it.
        await pilot.press("o")
        assert app.failed_only and all(o.failed for o in recent.outcomes) and recent.outcomes[0].request == target
        assert "failed only" in screen(app) and f"{target} failed closed" in screen(app)
        await pilot.press("o")
        assert not app.failed_only and recent.outcomes[0].request == committed[-1].request


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [(80, 24), (160, 45)], ids=["80x24", "160x45"])
async def test_the_why_of_a_recorded_failure_opens_whole_and_esc_goes_back(
    size: tuple[int, int], incident: Path, screen: Callable[[Any], str]
) -> None:
    source = ReplaySource.load(incident)
    source.position = len(source) - 1
    app = TopApp(source, paused=True)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        failure = next(o for o in app.shown.recent if o.failed)  # type: ignore[union-attr]
        await pilot.press("shift+tab", "d")  # d: as k9s's describe
        assert isinstance(app.screen, WhyScreen)
        whole = _squeeze(screen(app))
        assert _squeeze(f"why {failure.reason}") in whole
        assert "kind tier · rank 1 · window G1" in whole, "the recording's end event names the failure"
        await pilot.press("escape")
        assert not isinstance(app.screen, WhyScreen)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [(80, 24), (100, 30), (160, 45)], ids=["80x24", "100x30", "160x45"])
async def test_the_header_keeps_its_key_facts(
    size: tuple[int, int], incident: Path, settled: Callable[[Any], Awaitable[str]]
) -> None:
    source = ReplaySource.load(incident)
    source.position = 33  # with an injected fault: its badge takes room first
    app = TopApp(source, paused=True)
    async with app.run_test(size=size) as pilot:
        top = "\n".join((await settled(pilot)).splitlines()[:3])
    for fact in ("INJECTED FAULT", "embedded 0.1.0", "bsr-demo", "2 ranks", "W=4", "faults on", "tiers mooncake,fs"):
        assert fact in top, f"{fact!r} cut from the header at {size}:\n{top}"


@pytest.mark.timeout(120)
async def test_every_pane_takes_the_focus_and_the_one_in_focus_scrolls(
    engine: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    # Seven armed faults: the health pane holds more lines than its 80x24 share.
    kinds = ("timeout", "corrupt", "restore-fault", "remote-unavailable")
    with engine.client() as c:
        for n in range(7):
            c.inject_fault(FaultRequest(kinds[n % len(kinds)], rank=n % 2, window=n + 1, count=0))
    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.shown is not None and len(app.shown.faults) == 7, "the faults shown")
        assert app.focused is not None and app.focused.id == "events", "the events have the focus first"
        order = []
        for _ in range(5):
            await pilot.press("tab")
            order.append(app.focused.id if app.focused is not None else None)
        assert order == ["gauges-pane", "active-pane", "health-pane", "recent", "events"]
        health = app.query_one("#health-pane")
        await pilot.press("tab", "tab", "tab")
        assert app.focused is health
        await wait_until(pilot, lambda: health.max_scroll_y > 0, "the health pane to overflow")
        newest = app.shown.faults[-1]  # type: ignore[union-attr]
        last_fault = f"INJECTED #{newest.id} {newest.kind}"  # as the health pane lists it
        assert "admit " in screen(app) and last_fault not in screen(app), "the last fault starts below the fold"
        await pilot.press("end")
        await pilot.pause()
        assert health.scroll_y == health.max_scroll_y and last_fault in screen(app) and "admit " not in screen(app)
        await pilot.press("home")
        await pilot.pause()
        assert health.scroll_y == 0 and "admit " in screen(app)
        await pilot.press("pagedown")
        await pilot.pause()
        assert health.scroll_y > 0


@pytest.mark.timeout(60)
async def test_left_and_right_still_step_a_replay_whichever_pane_has_the_focus(incident: Path) -> None:
    source = ReplaySource.load(incident)
    source.position = 20
    app = TopApp(source, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        for _ in range(4):  # the gauges, the restores in flight, the health, the recent restores
            await pilot.press("tab")
            at = source.position
            await pilot.press("left")
            assert source.position == at - 1, f"← in {app.focused}"
            await pilot.press("right")
            assert source.position == at, f"→ in {app.focused}"


@pytest.mark.timeout(60)
async def test_the_event_log_pages_through_a_recording(incident: Path, screen: Callable[[Any], str]) -> None:
    source = ReplaySource.load(incident)
    source.position = len(source) - 1
    app = TopApp(source, paused=True, log_page=100)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("e")
        log = app.screen
        assert isinstance(log, EventLogScreen)
        assert log.held == 280 and len(log.events) == 100 and log.events[-1].seq == 280
        assert log.events[0].seq > 1, "the first page is the newest"
        await _press_until(pilot, "end", lambda: log.complete and getattr(log.current(), "seq", 0) == 1, 10)
        assert [e.seq for e in log.events] == list(range(1, 281)), "every recorded event once, oldest first"
        await pilot.pause()
        title = _squeeze(screen(app))
        assert "280 loaded of 280 events held" in title and "at seq 1 " in title, screen(app)


@pytest.mark.timeout(300)
async def test_the_event_log_pages_back_through_the_engine_store_to_its_oldest_event(
    engine: Any, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    with engine.client() as c:
        held = c.events(newest=True, limit=1).held
    seed = 9300
    while (held or 0) < 3 * LOG_PAGE:  # at least three pages, whatever ran on this engine before
        _restore(engine, seed)
        seed += 1
        with engine.client() as c:
            held = c.events(newest=True, limit=1).held
    with engine.client() as c:
        oldest = c.events(newest=True, limit=1).oldest_seq
    assert oldest is not None

    app = TopApp(LiveSource.for_url(engine.url, engine.token), interval=0.5)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.view is not None, "the first snapshot")
        assert app.view is not None and all(e.seq != oldest for e in app.view.events), "the view holds the newest"
        await pilot.press("e")
        log = app.screen
        assert isinstance(log, EventLogScreen)
        await wait_until(pilot, lambda: log.pages == 1 and not log.reading, "the newest page")
        assert len(log.events) == LOG_PAGE and log.older is not None and log.events[0].seq > oldest
        assert f"{log.held:,} events held" in screen(app)
        pages = (log.held or 0) // LOG_PAGE + 2
        for _ in range(pages):  # End: to the oldest loaded event, which reads the page before it
            if log.complete:
                break
            read = log.pages
            await pilot.press("end")
            await wait_until(pilot, lambda: log.pages > read and not log.reading, "an older page")  # noqa: B023
        await pilot.press("end")
        await pilot.pause()
        assert log.complete and getattr(log.current(), "seq", 0) == oldest and log.pages >= 3
        assert f"at seq {oldest:,}" in screen(app) and "oldest loaded" in screen(app)
        seqs = [e.seq for e in log.events]
        assert seqs == sorted(set(seqs)), "each event once, in order"
