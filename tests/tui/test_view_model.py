"""The view model, pure: folding real recorded snapshots, filters, and the one-shot text renderer."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from bsr_cli.cli.render import ops
from bsr_cli.core.evidence import EventKind
from bsr_cli.core.status import EngineStatus, Health, Snapshot
from bsr_cli.tui import model, panels
from bsr_cli.tui.model import Frame
from bsr_cli.tui.source import PollFailure, read_recording


def _frames(path: Path) -> list[Frame]:
    return [i for i in read_recording(path)[1] if isinstance(i, Frame)]


def _text(renderable: object, width: int = 120) -> str:
    console = Console(width=width, record=True, file=io.StringIO(), no_color=True)
    console.print(renderable)
    return console.export_text()


@pytest.mark.timeout(30)
def test_fold_tracks_windows_history_outcomes_faults_and_markers(incident: Path) -> None:
    views = list(model.fold_all(_frames(incident)))
    actives = [a for v in views for a in v.active]
    assert actives, "the recording holds restores in flight"
    for a in actives:
        assert a.progress_text == f"window {a.current_window} of {a.windows}"
        assert 1 <= a.current_window <= a.windows
    # The pool filled to RWS(W) while windows were in flight, and the history kept it after the pool drained.
    last = views[-1]
    rws = last.info.rws_bytes
    assert rws and any(max(g.history) == rws for g in last.gauges)
    assert all(len(g.history) == len(views) for g in last.gauges)
    assert all(g.state in ("ok", "above-rws") for v in views for g in v.gauges)
    assert [o.outcome for o in last.recent] == ["failed_closed", "committed"]
    assert [(f.kind, f.rank) for f in last.faults] == [("restore-fault", 1)]
    assert last.markers and last.markers[0].excluded
    kinds = [e.type for e in last.events]
    assert "restore_committed" in kinds and "restore_failed_closed" in kinds and "marker_set" in kinds
    assert [e.seq for e in last.events] == sorted({e.seq for e in last.events}), "no event twice, none reordered"


@pytest.mark.timeout(30)
def test_filters_cycle_and_select(incident: Path) -> None:
    last = list(model.fold_all(_frames(incident)))[-1]
    assert [model.next_rank(r, [0, 1]) for r in (None, 0, 1)] == [0, 1, None]
    assert model.next_kind("faults") == "all" and model.next_kind("all") == "restores"
    only1 = last.filtered_events(rank=1)
    assert only1 and all(1 in e.ranks for e in only1)
    assert {e.category for e in last.filtered_events(kind="faults")} == {"faults"}
    failed = last.filtered_events(rank=1, kind="restores")
    assert any(e.type == "restore_failed_closed" for e in failed), "a failure on rank 1 belongs to rank 1"


@pytest.mark.timeout(30)
def test_high_water_sees_windows_between_polls_and_gaps_are_counted(incident: Path) -> None:
    frames = _frames(incident)
    i = next(k for k, f in enumerate(frames) if f.snapshot.active)
    prev = model.fold(None, frames[i - 1])
    drained = frames[i].snapshot.to_wire()
    for r in drained["ranks"]:
        r["pool"]["live_bytes"] = 0  # the poll landed between two windows
    view = model.fold(prev, _frame(drained, frames[i].received_at))
    assert all(g.live_bytes == 0 for g in view.gauges)
    assert max(g.high_water_bytes for g in view.gauges) > 0, "window events since the last poll still count"
    # Events the engine already dropped before this poll are reported as missed, not silently lost.
    gap = frames[i].snapshot.to_wire()
    gap["events"] = gap["events"][-5:]
    missed = model.fold(prev, _frame(gap, frames[i].received_at))
    assert missed.events_missed == gap["events"][0]["seq"] - prev.seq - 1 > 0


@pytest.mark.timeout(30)
def test_restarted_engine_starts_a_new_event_stream(incident: Path) -> None:
    frames = _frames(incident)
    before = list(model.fold_all(frames))[-1]
    restarted = frames[0].snapshot.to_wire()
    restarted["info"]["started_at"] += 1000
    after = model.fold(before, _frame(restarted, frames[-1].received_at + 1))
    assert after.seq < before.seq and after.events_missed == before.events_missed
    assert after.gauges[0].history[:-1] == before.gauges[0].history[-(model.HISTORY - 1) :]


@pytest.mark.timeout(30)
def test_render_text_reads_at_80_and_120_columns(incident: Path) -> None:
    last = list(model.fold_all(_frames(incident)))[-1]
    for width in (80, 120):
        text = _text(panels.render_text(last), width)
        assert max(len(line) for line in text.splitlines()) <= width
        for needle in ("Restore pool per rank", "RWS(W=4)", "INJECTED", "restore-fault", "failed closed", "r1"):
            assert needle in text, f"{needle!r} missing at {width} columns"
    json_view = last.to_dict()
    assert json_view["gauges"][0]["state"] in ("ok", "above-rws")
    assert json_view["faults"][0]["kind"] == "restore-fault"


@pytest.mark.timeout(30)
def test_a_broken_snapshot_still_folds() -> None:
    broken = {"ranks": [{"rank": 0, "alive": False, "error": "pipe closed"}, "junk"]}
    view = model.fold(None, Frame(Snapshot.from_wire(broken), 1.0, 0.0))
    assert view.gauges[0].state == "down"
    assert "DOWN" in _text(panels.render_text(view))
    assert PollFailure.from_error(ValueError("x"), 0.0, 0.0).kind == "internal"


@pytest.mark.timeout(30)
def test_a_restart_is_marked_in_the_event_log(incident: Path) -> None:
    frames = _frames(incident)
    before = list(model.fold_all(frames))[-1]
    assert not any(e.type == EventKind.ENGINE_STARTED for e in before.events)
    restarted = frames[0].snapshot.to_wire()
    restarted["info"]["started_at"] += 1000
    after = model.fold(before, _frame(restarted, frames[-1].received_at + 1))
    marks = [e for e in after.events if e.type == EventKind.ENGINE_STARTED]
    assert len(marks) == 1 and "engine restarted" in marks[0].text
    # The separator stands between the old engine's events and the new one's.
    i = after.events.index(marks[0])
    assert i > 0 and after.events[i - 1] == before.events[-1]
    assert "engine restarted" in _text(panels.render_text(after), 160)


def _snap(t: float, done: dict[str, int], events: list[dict] | None = None, seq: int = 1) -> Frame:
    snap = {
        "info": {"started_at": 100.0, "W": 2},
        "time": t,
        "seq": seq,
        "ranks": [{"rank": 0, "alive": True}, {"rank": 1, "alive": True}],
        "active": [{"request": "req-7", "W": 2, "windows": 8, "tokens": 4096, "started": 100.0, "done": done}],
        "events": events or [],
    }
    return _frame(snap, t)


def _frame(snap: dict, t: float) -> Frame:
    """A frame of a snapshot as an engine would answer it (``snap``, its wire form)."""
    return Frame(Snapshot.from_wire(snap), t, 0.01)


@pytest.mark.timeout(30)
def test_a_rank_that_stops_releasing_windows_is_marked_stalled() -> None:
    v = model.fold(None, _snap(101.0, {"0": 1, "1": 1}))
    assert v.active[0].stalled == ()
    v = model.fold(v, _snap(102.0, {"0": 3, "1": 1}, seq=2))
    assert v.active[0].stalled == ()  # rank 1 behind, but only for a second
    v = model.fold(v, _snap(101.0 + model.STALL_S + 0.5, {"0": 6, "1": 1}, seq=3))
    assert v.active[0].stalled == (1,)
    assert "STALLED r1" in _text(panels.active(v), 120)
    v = model.fold(v, _snap(108.0, {"0": 6, "1": 2}, seq=4))
    assert v.active[0].stalled == ()  # it moved again


@pytest.mark.timeout(30)
def test_a_rank_that_failed_is_not_shown_in_progress() -> None:
    failed = {"seq": 2, "time": 102.0, "type": "restore_failed", "request": "req-7", "rank": 1, "window": 1}
    v = model.fold(None, _snap(101.0, {"0": 1, "1": 1}))
    v = model.fold(v, _snap(102.5, {"0": 2, "1": 1}, [failed], seq=2))
    a = v.active[0]
    assert a.failed == (1,) and a.stalled == ()
    text = _text(panels.active(v), 120)
    assert "✖ r1 failed" in text and "r1:1✖" in text


@pytest.mark.timeout(30)
def test_lmcaches_own_l1_is_shown_and_not_judged_against_b(incident: Path) -> None:
    """An LMCache host reports its whole L1 (``l1_live_bytes``: its own staging too) beside the restore windows'
    bytes that B bounds: the gauge shows it, and an L1 above B with no window live is not a pool over B."""
    frames = _frames(incident)
    last = frames[-1].snapshot.to_wire()
    for r in last["ranks"]:
        budget = r["pool"]["budget_bytes"]
        r["pool"].update(live_bytes=0, windows_live=0, l1_live_bytes=3 * budget, l1_peak_bytes=3 * budget)
    view = model.fold(None, _frame(last, frames[-1].received_at))
    assert all(g.l1_live_bytes and g.l1_live_bytes > g.budget_bytes for g in view.gauges)
    assert all(g.state in ("ok", "above-rws") for g in view.gauges)
    text = _text(panels.render_text(view))
    assert "L1 " in text and "OVER B" not in text
    # `bsr status` says what the L1 holds beside the windows.
    console = Console(width=120, record=True, file=io.StringIO(), no_color=True)
    ops.status(console, EngineStatus("http://engine", Health((), {}), Snapshot.from_wire(last)))
    assert "rank 0 LMCache L1: " in console.export_text()
    # Control: the same L1 read as the pool's live bytes (what the LMCache host reported before) is over B.
    for r in last["ranks"]:
        r["pool"]["live_bytes"] = r["pool"]["l1_live_bytes"]
    over = model.fold(None, _frame(last, frames[-1].received_at))
    assert all(g.state == "over-budget" for g in over.gauges)
