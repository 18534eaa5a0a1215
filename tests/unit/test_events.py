"""The event log: sequence numbers, the bounded ring, long polls, per-request listeners and observers."""

from __future__ import annotations

import threading

from bsr_cli.core.events import AbortRequested, Event, FaultsCleared
from bsr_cli.core.evidence import EventKind
from bsr_cli.runtime.events import EventLog


def _ev(kind: str, request: str | None = None, **extra: int) -> Event:
    """A small real event: an abort when it names a request, else a faults-cleared (its ``count`` carries i)."""
    if request is not None:
        return AbortRequested(request=request)
    return FaultsCleared(count=extra.get("i", 0))


def test_sequence_numbers_and_since() -> None:
    log = EventLog()
    a = log.append(_ev("x"))
    b = log.append(_ev("y", "r1"))
    assert (a.seq, b.seq) == (1, 2) and log.last_seq == 2
    assert [e.kind for e in log.since(0)] == [EventKind.FAULTS_CLEARED, EventKind.ABORT_REQUESTED]
    assert [e.seq for e in log.since(1)] == [2]
    assert log.since(2) == []  # nothing newer, no wait
    assert [e.seq for e in log.since(0, limit=1)] == [1]


def test_the_ring_is_bounded_and_keeps_the_newest() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.append(_ev("t", i=i))
    assert [e.count for e in log.recent(10) if isinstance(e, FaultsCleared)] == [2, 3, 4]
    assert [e.seq for e in log.since(0)] == [3, 4, 5]


def test_long_poll_wakes_on_append() -> None:
    log = EventLog()
    got: list[list[Event]] = []
    t = threading.Thread(target=lambda: got.append(log.since(0, wait_s=20)))
    t.start()
    log.append(_ev("late"))
    t.join(10)
    assert not t.is_alive() and got[0][0].kind is EventKind.FAULTS_CLEARED


def test_listeners_see_only_their_request_and_stop() -> None:
    log = EventLog()
    seen: list[str] = []
    every: list[str] = []
    stop = log.listen("r1", lambda e: seen.append(e.request if isinstance(e, AbortRequested) else "-"))
    log.append(_ev("before", i=7))
    held = log.observe(lambda e: every.append(e.request if isinstance(e, AbortRequested) else "-"))
    assert [e.count for e in held if isinstance(e, FaultsCleared)] == [7]
    log.append(_ev("mine", "r1"))
    log.append(_ev("other", "r2"))
    stop()
    log.append(_ev("after", "r3"))
    log.append(_ev("after", "r1"))
    assert seen == ["r1"]
    assert every == ["r1", "r2", "r3", "r1"]
