"""The event log: sequence numbers, the bounded ring, long polls, per-request listeners and observers."""

from __future__ import annotations

import threading

from bsr_cli.runtime.events import EventLog


def test_sequence_numbers_and_since() -> None:
    log = EventLog()
    a = log.append({"type": "x"})
    b = log.append({"type": "y", "request": "r1"})
    assert (a["seq"], b["seq"]) == (1, 2) and log.last_seq == 2
    assert [e["type"] for e in log.since(0)] == ["x", "y"]
    assert [e["seq"] for e in log.since(1)] == [2]
    assert log.since(2) == []  # nothing newer, no wait
    assert [e["seq"] for e in log.since(0, limit=1)] == [1]


def test_the_ring_is_bounded_and_keeps_the_newest() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.append({"type": "t", "i": i})
    assert [e["i"] for e in log.recent(10)] == [2, 3, 4]
    assert [e["seq"] for e in log.since(0)] == [3, 4, 5]


def test_long_poll_wakes_on_append() -> None:
    log = EventLog()
    got: list[list[dict]] = []
    t = threading.Thread(target=lambda: got.append(log.since(0, wait_s=20)))
    t.start()
    log.append({"type": "late"})
    t.join(10)
    assert not t.is_alive() and got[0][0]["type"] == "late"


def test_listeners_see_only_their_request_and_stop() -> None:
    log = EventLog()
    seen: list[str] = []
    every: list[str] = []
    stop = log.listen("r1", lambda e: seen.append(e["type"]))
    log.append({"type": "before"})
    held = log.observe(lambda e: every.append(e["type"]))
    assert [e["type"] for e in held] == ["before"]
    log.append({"type": "mine", "request": "r1"})
    log.append({"type": "other", "request": "r2"})
    stop()
    log.append({"type": "after", "request": "r1"})
    assert seen == ["mine"]
    assert every == ["mine", "other", "after"]
