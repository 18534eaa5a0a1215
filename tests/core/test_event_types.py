"""The typed events: every kind has one class, the wire form round-trips, and malformed wire input is refused."""

from __future__ import annotations

import pytest

from bsr_cli.core.events import (
    EVENT_TYPES,
    FaultInjected,
    RestoreFailed,
    RestoreFailedClosed,
    WindowReleased,
    parse_event,
    restore_ended,
)
from bsr_cli.core.evidence import Component, EventKind, FailureKind, Outcome, Stage

pytestmark = pytest.mark.fast


def test_every_kind_has_one_class_and_every_outcome_an_end_event() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    for outcome in (Outcome.COMMITTED, Outcome.FAILED_CLOSED, Outcome.REFUSED, Outcome.ABORTED):
        assert restore_ended(outcome).outcome is outcome


def test_a_rank_failure_round_trips_with_its_stage_and_blame() -> None:
    part = RestoreFailed(
        request="r1", rank=1, reason="install failed", failure_kind=FailureKind.RANK, stage=Stage.INSTALL
    )
    ended = RestoreFailedClosed(request="r1", failures=(part.failure,), failure_kind=FailureKind.RANK).stamped(9, 2.0)
    wire = ended.to_wire()
    assert wire["type"] == "restore_failed_closed" and wire["seq"] == 9
    assert wire["failures"][0] == {
        "rank": 1,
        "reason": "install failed",
        "kind": "rank",
        "stage": "install",
        "window": None,
        "tier": None,
        "cause": None,
        "component": "rank",
    }
    assert parse_event(wire) == ended
    assert ended.failures[0].component is Component.RANK
    # The per-rank event keeps the wire's old spelling of its failure kind.
    assert part.to_wire()["kind"] == "rank" and parse_event(part.to_wire()) == part


def test_a_fault_event_keeps_the_faults_own_field_names() -> None:
    ev = FaultInjected(fault_id=4, fault="restore-fault", rank=1, window=2)
    wire = ev.to_wire()
    assert (wire["type"], wire["id"], wire["kind"]) == ("fault_injected", 4, "restore-fault")
    assert parse_event(wire) == ev


@pytest.mark.parametrize(
    "wire, message",
    [
        ({"type": "no_such_event"}, "unknown event type"),
        ({"type": "window_released", "request": "r", "rank": "1", "window": 0}, "'rank': expected an integer"),
        ({"type": "window_released", "request": "r", "rank": True, "window": 0}, "'rank': expected an integer"),
        ({"type": "window_released", "rank": 1, "window": 0}, "WindowReleased"),  # request missing
        ({"type": "restore_failed", "request": "r", "rank": 0, "reason": "x", "kind": "gremlins"}, "not a FailureKind"),
    ],
)
def test_malformed_wire_events_are_refused(wire: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_event(wire)


def test_an_older_or_newer_writer_still_reads() -> None:
    ev = parse_event({"type": "window_released", "request": "r", "rank": 0, "window": 3, "new_field": 1})
    assert isinstance(ev, WindowReleased) and ev.window == 3 and ev.bytes == 0
