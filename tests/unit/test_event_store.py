"""The durable event store (SQLite, WAL) behind the event log: evidence past the in-memory tail and across a
restart, sequence numbers that continue, a crash told apart from a clean stop, filters that combine, retention by
age and by size (the clock and the cap driven by the test, no sleeps), and the structured failure log."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from bsr_cli.core.events import (
    Failure,
    FaultEvent,
    MarkerCleared,
    RequestAdmitted,
    RestoreEnded,
    RestoreFailed,
    RestoreStarted,
    WindowReleased,
    request_of,
)
from bsr_cli.core.evidence import EventKind, FailureKind, FaultAct, Outcome, Stage
from bsr_cli.core.when import parse_duration, parse_since
from bsr_cli.errors import InvalidInput
from bsr_cli.runtime import failure_log
from bsr_cli.runtime.event_store import EventStore, Query
from bsr_cli.runtime.events import EventLog

DAY = 86400.0


def _restore(log: EventLog, request: str, windows: int, ranks: int = 2) -> None:
    """One restore's events as the engine writes them: started, every window released on every rank, committed."""
    log.append(RestoreStarted(request=request, prompt=f"p-{request}", W=1, windows=windows, tiers=("mooncake",)))
    for w in range(windows):
        for r in range(ranks):
            log.append(WindowReleased(request=request, rank=r, window=w, windows=windows, bytes=4096))


def test_evidence_outlives_the_in_memory_tail_and_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    log = EventLog(capacity=100, store=EventStore(path))
    _restore(log, "req-00001", windows=60)  # 121 events: the tail of 100 has lost the start already
    for i in range(2, 12):
        _restore(log, f"req-{i:05d}", windows=60)
    assert log.last_seq == 11 * 121
    assert log.recent(1000)[0].seq > 121  # the tail no longer holds the first restore
    first = log.query(Query(request="req-00001", limit=10_000))
    assert len(first) == 121 and first[0].kind == EventKind.RESTORE_STARTED
    assert [e.seq for e in log.since(0, limit=5)] == [1, 2, 3, 4, 5]  # a cursor older than the tail: the store
    log.close()

    again = EventStore(path)
    assert again.previous.existed and again.previous.clean and again.last_seq == 11 * 121
    log2 = EventLog(capacity=100, store=again)
    assert log2.append(RequestAdmitted(request="req-00012")).seq == 11 * 121 + 1  # seq continues
    assert len(log2.query(Query(request="req-00001", limit=10_000))) == 121
    log2.close()


def test_a_store_left_open_reads_as_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    first = EventStore(path)
    log = EventLog(store=first)
    log.append(RequestAdmitted(request="req-00001"))
    assert first.flush()
    try:
        second = EventStore(path)  # the first never closed: it died
        assert second.previous.existed and not second.previous.clean and second.last_seq == 1
        second.close()
    finally:
        first.close()
    for where, existed in ((path, True), (tmp_path / "other.sqlite", False)):  # a fresh file is not a restart
        store = EventStore(where)
        assert store.previous.existed is existed
        store.close()


@pytest.mark.parametrize("durable", [True, False], ids=["store", "memory"])
def test_filters_combine(tmp_path: Path, durable: bool) -> None:
    log = EventLog(store=EventStore(tmp_path / "e.sqlite") if durable else None)
    _restore(log, "req-00001", windows=3)
    _restore(log, "req-00002", windows=4)
    log.append(
        RestoreFailed(request="req-00002", rank=1, reason="boom", failure_kind=FailureKind.TIER, stage=Stage.FETCH)
    )
    everything = log.query(Query(limit=1000))
    mid = everything[8].time
    released = EventKind.WINDOW_RELEASED.value
    got = log.query(Query(request="req-00002", kinds=(released,), limit=1000))
    assert len(got) == 8 and {(request_of(e), e.kind) for e in got} == {("req-00002", released)}
    got = log.query(Query(kinds=(EventKind.RESTORE_STARTED.value, EventKind.RESTORE_FAILED.value), limit=1000))
    assert [e.kind for e in got] == ["restore_started", "restore_started", "restore_failed"]
    assert [request_of(e) for e in log.query(Query(prompt="p-req-00002", limit=10))] == ["req-00002"]
    since = log.query(Query(since_time=mid, limit=1000))
    assert since and all(e.time >= mid for e in since) and since[-1].kind == "restore_failed"
    newest = log.query(Query(request="req-00001", limit=2, newest=True))
    assert [e.seq for e in newest] == [6, 7]  # the last two, oldest first
    assert log.query(Query(after_seq=16, limit=1000))[0].seq == 17
    log.close()


@pytest.mark.parametrize("durable", [True, False], ids=["store", "memory"])
def test_pages_back_from_the_newest_and_says_how_much_it_holds(tmp_path: Path, durable: bool) -> None:
    """A reader pages from the newest back (newest=1, then before=<the oldest seq it holds>) to the oldest event
    held, each page once; the log says how many events it holds and from which seq (the store: every one; the
    in-memory tail: its last 50)."""
    log = EventLog(capacity=50, store=EventStore(tmp_path / "e.sqlite") if durable else None)
    _restore(log, "req-00001", windows=40)  # 81 events
    held, oldest = log.extent()
    assert (held, oldest) == ((81, 1) if durable else (50, 32))
    pages: list[list[int]] = []
    before: int | None = None
    for _ in range(10):  # three pages hold it all; a cursor that did not move would loop
        page = [e.seq for e in log.query(Query(limit=30, newest=True, before_seq=before))]
        if not page:
            break
        pages.append(page)
        before = page[0]
    assert pages[0] == list(range(52, 82)) and pages[1] == list(range(max(22, oldest), 52))  # each oldest first
    assert sorted(s for p in pages for s in p) == list(range(oldest, 82))  # all of it, nothing twice
    kinds = (EventKind.RESTORE_STARTED.value,)
    assert [e.seq for e in log.query(Query(kinds=kinds, newest=True, before_seq=52, limit=5))] == (
        [1] if durable else []
    )
    log.close()


def _wire(seq: int, at: float, request: str = "req-00001") -> WindowReleased:
    return WindowReleased(request=request, rank=seq % 2, window=seq, bytes=4096, seq=seq, time=at)


def test_retention_by_age(tmp_path: Path) -> None:
    now = [100 * DAY]
    store = EventStore(tmp_path / "e.sqlite", max_age_s=7 * DAY, clock=lambda: now[0])
    for i in range(1, 101):  # one event every 2 hours, the oldest 99 * 2 h = 8.25 days before the last
        store.put(_wire(i, now[0] - (100 - i) * 7200.0))
    assert store.flush()
    kept = store.query(Query(limit=1000))
    # The writer pruned after its commit: everything older than 7 days is gone, the rest kept.
    assert kept and min(e.time for e in kept) >= now[0] - 7 * DAY
    assert [e.seq for e in kept] == list(range(100 - 84, 101))
    now[0] += 3 * DAY  # three days later nothing new came: retention still applies
    assert store.prune() > 0
    assert [e.seq for e in store.query(Query(limit=1000))] == list(range(100 - 48, 101))
    assert store.extent() == (49, 52)  # what it holds, counted off as retention deleted
    store.close()
    again = EventStore(tmp_path / "e.sqlite")
    assert again.last_seq == 100  # seq survives even what retention removed
    assert again.extent() == (49, 52)  # counted again on opening
    again.close()


def test_retention_by_size_keeps_the_newest(tmp_path: Path) -> None:
    cap = 256 << 10
    store = EventStore(tmp_path / "e.sqlite", max_bytes=cap, clock=lambda: 0.0)
    for i in range(1, 5001):  # ~1.5 MB of events into a 256 KiB store
        store.put(_wire(i, 0.0, request=f"req-{i // 100:05d}"))
    assert store.flush()
    store.prune()
    stats = store.stats()
    assert stats.used_bytes <= cap and 0 < stats.events < 5000
    kept = [e.seq for e in store.query(Query(limit=10_000))]
    assert kept[-1] == 5000 and kept == list(range(kept[0], 5001))  # the oldest went first, nothing in between
    assert store.extent() == (stats.events, kept[0])
    store.close()


def test_a_write_error_is_reported_not_raised(tmp_path: Path) -> None:
    errors: list[str] = []
    store = EventStore(tmp_path / "e.sqlite", on_error=errors.append)
    store.put(_wire(1, 1.0))
    store.put({"seq": "not a number"})  # a bug in a writer must not stop the engine or lose the batch silently
    assert store.flush()
    assert errors and "not written" in errors[0] and store.write_errors == 1
    store.close()


def test_the_store_is_sqlite_in_wal_mode_with_its_indexes(tmp_path: Path) -> None:
    store = EventStore(tmp_path / "e.sqlite")
    store.close()
    db = sqlite3.connect(tmp_path / "e.sqlite")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"events_by_time", "events_by_request"} <= names
    db.close()


def test_failures_are_logged_as_json_lines_with_their_reason(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "bsr-engine.log"
    log = failure_log.open_log(path, "test")
    events = EventLog()
    events.observe(lambda ev: failure_log.log_failure_event(log, ev))
    events.append(WindowReleased(request="req-00001", rank=0, window=0))  # not a failure: not logged
    fail = Failure(rank=1, reason="checksum mismatch", kind=FailureKind.TIER, stage=Stage.VERIFY, window=2)
    events.append(
        RestoreFailed(
            request="req-00001",
            rank=1,
            reason="checksum mismatch",
            failure_kind=FailureKind.TIER,
            stage=Stage.VERIFY,
            window=2,
            tier="mooncake",
        )
    )
    events.append(
        RestoreEnded(
            outcome=Outcome.FAILED_CLOSED, request="req-00001", failures=(fail,), failure_kind=FailureKind.TIER
        )
    )
    failure_log.log_failure(log, "event store: 3 event(s) not written", component="event-store")
    failure_log.close_log(log)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["event"] for x in lines[:2]] == ["restore_failed", "restore_failed_closed"]
    for x in lines[:2]:
        assert (x["level"], x["request"], x["rank"], x["window"], x["stage"], x["reason"]) == (
            "error",
            "req-00001",
            1,
            2,
            "verify",
            "checksum mismatch",
        )
        assert x["time"].endswith("Z")
    assert lines[2]["component"] == "event-store" and lines[2]["reason"].startswith("event store")
    assert logging.getLogger("bsr.failures.test").handlers == []


def test_durations_and_times_an_operator_types() -> None:
    assert [parse_duration(t) for t in ("30s", "15m", "2h", "1d", "1h30m")] == [30, 900, 7200, 86400, 5400]
    assert parse_since("2h", now=10_000.0) == 2_800.0
    assert parse_since("2026-12-01T14:00:00Z", now=0.0) == 1_796_133_600.0
    for bad in ("", "2", "2x", "yesterday", "-1h"):
        with pytest.raises(InvalidInput):
            parse_since(bad, now=0.0)


def test_events_read_back_from_the_store_parse_as_types(tmp_path: Path) -> None:
    log = EventLog(store=EventStore(tmp_path / "e.sqlite"))
    _restore(log, "req-00001", windows=2)
    typed = log.query(Query(limit=100))  # read back from the rows as types
    assert isinstance(typed[0], RestoreStarted) and all(isinstance(e, WindowReleased) for e in typed[1:])
    log.close()


def test_the_store_reads_back_what_the_tail_holds_byte_for_byte(tmp_path: Path) -> None:
    """The admin API writes an event's wire form from whichever the log reads it from (the tail or the store's
    rows): both must give the same JSON, enums, optional fields, nested failures and pool maps included."""
    log = EventLog(store=EventStore(tmp_path / "e.sqlite"))
    _restore(log, "req-00001", windows=2)
    fail = Failure(rank=1, reason="timeout", kind=FailureKind.TIER, stage=Stage.FETCH, window=0, tier="mooncake")
    log.append(
        RestoreEnded(
            outcome=Outcome.FAILED_CLOSED,
            request="req-00001",
            failures=(fail,),
            failure_kind=FailureKind.TIER,
            seconds=1.5,
        )
    )
    log.append(
        FaultEvent(act=FaultAct.INJECTED, fault_id=3, fault="timeout", rank=1, window=None, group="full", count=2)
    )
    log.append(MarkerCleared(prompt="p", why="operator", scope="tier", tier="fs", excluded_tiers=("mooncake",)))
    held = [json.dumps(e.to_wire()) for e in log.recent(100)]
    assert [json.dumps(e.to_wire()) for e in log.query(Query(limit=100))] == held
    assert [json.dumps(e.to_wire()) for e in log.store.query(Query(limit=100))] == held  # type: ignore[union-attr]
    log.close()
