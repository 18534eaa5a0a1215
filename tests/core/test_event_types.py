"""The typed events: every kind has one class, the wire form round-trips, and malformed wire input is refused."""

from __future__ import annotations

import dataclasses

import pytest

from bsr_cli.core.events import (
    EVENT_TYPES,
    AbortRequested,
    EngineStarted,
    Event,
    FaultEvent,
    FaultFired,
    FaultInjected,
    RankRestarted,
    RankStarved,
    RestoreAborted,
    RestoreCommitted,
    RestoreEnded,
    RestoreFailed,
    RestoreFailedClosed,
    RestoreRefused,
    WindowReleased,
    parse_event,
    rank_of,
    request_of,
    restore_ended,
    stamped,
)
from bsr_cli.core.evidence import Component, EventKind, FailureKind, Outcome, RankState, Stage
from bsr_cli.core.overload import HostLoad, Psi, RankDelay

pytestmark = pytest.mark.fast


def test_every_kind_has_one_class_and_every_outcome_an_end_event() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    for outcome in (Outcome.COMMITTED, Outcome.FAILED_CLOSED, Outcome.REFUSED, Outcome.ABORTED):
        assert restore_ended(outcome).outcome is outcome


def _fields(cls: type) -> list[tuple[str, object, object]]:
    return [(f.name, f.type, f.default) for f in dataclasses.fields(cls)]


def test_every_event_class_stands_alone_and_the_shared_names_are_unions() -> None:
    # No event class inherits another's fields: each declares seq and time first (the wire's key order), then its own.
    for cls in EVENT_TYPES.values():
        assert cls.__bases__ == (object,), cls
        assert [f.name for f in dataclasses.fields(cls)][:2] == ["seq", "time"], cls
        assert issubclass(cls, Event)
    # The four ways a restore ends carry the same fields, and the two fault events the same, the fired one with its
    # request besides; ``RestoreEnded`` and ``FaultEvent`` name them in isinstance checks.
    endings = (RestoreCommitted, RestoreFailedClosed, RestoreRefused, RestoreAborted)
    assert all(_fields(cls) == _fields(RestoreCommitted) for cls in endings)
    assert {cls for cls in EVENT_TYPES.values() if issubclass(cls, RestoreEnded)} == set(endings)
    assert [f for f in _fields(FaultFired) if f[0] != "request"] == _fields(FaultInjected)
    assert {cls for cls in EVENT_TYPES.values() if issubclass(cls, FaultEvent)} == {FaultInjected, FaultFired}
    assert not isinstance({"type": "restore_committed"}, Event)


def test_stamping_and_the_request_and_rank_an_event_belongs_to() -> None:
    released = WindowReleased(request="r1", rank=1, window=0)
    assert stamped(released, 5, 3.5) == dataclasses.replace(released, seq=5, time=3.5)
    assert (released.seq, released.time) == (0, 0.0)  # events are frozen: stamping makes a new one
    assert (request_of(released), rank_of(released)) == ("r1", 1)
    assert (request_of(AbortRequested(request="r2")), rank_of(AbortRequested(request="r2"))) == ("r2", None)
    assert (request_of(RankRestarted(rank=0)), rank_of(RankRestarted(rank=0))) == (None, 0)
    assert (request_of(EngineStarted()), request_of(FaultFired(request=""))) == (None, None)


def test_a_rank_failure_round_trips_with_its_stage_and_blame() -> None:
    part = RestoreFailed(
        request="r1", rank=1, reason="install failed", failure_kind=FailureKind.RANK, stage=Stage.INSTALL
    )
    ended = stamped(RestoreFailedClosed(request="r1", failures=(part.failure,), failure_kind=FailureKind.RANK), 9, 2.0)
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


def test_a_host_verdict_round_trips_with_its_figures_and_blames_the_host() -> None:
    load = HostLoad(
        span_s=5.0,
        coordinator_lag_s=0.2,
        ranks=(RankDelay(1, RankState.STARVED, 4.6),),
        cpu=Psi(91.0, 30.5),
        memory=Psi(0.0, 0.0),
        io=None,  # unknown here: stays unknown on the way back, never 0
    )
    part = RestoreFailed(
        request="r2", rank=1, reason="starved", failure_kind=FailureKind.HOST_OVERLOADED, stage=Stage.FETCH, load=load
    )
    ended = RestoreFailedClosed(request="r2", failures=(part.failure,), failure_kind=FailureKind.HOST_OVERLOADED)
    wire = ended.to_wire()
    assert wire["failures"][0]["load"]["ranks"] == [{"rank": 1, "state": "starved", "run_delay_s": 4.6, "ran_s": None}]
    assert wire["failures"][0]["load"]["io"] is None and wire["failures"][0]["component"] == "host"
    assert parse_event(wire) == ended and parse_event(part.to_wire()) == part
    starved = RankStarved(rank=1, reason="waited to run", request="r2", load=load)
    assert parse_event(starved.to_wire()) == starved and starved.to_wire()["type"] == "rank_starved"
    # A failure without figures writes none (older readers see the shape they know).
    assert "load" not in RestoreFailed(request="r", rank=0, reason="x", failure_kind=FailureKind.TIER).to_wire()


def test_a_fault_event_keeps_the_faults_own_field_names() -> None:
    ev = FaultInjected(fault_id=4, fault="restore-fault", rank=1, window=2)
    wire = ev.to_wire()
    assert (wire["type"], wire["id"], wire["kind"]) == ("fault_injected", 4, "restore-fault")
    assert parse_event(wire) == ev
    # The fault's id and kind are the last keys, as they have always been written.
    fired = FaultFired(fault_id=4, fault="restore-fault", rank=1, request="r1")
    assert list(fired.to_wire()) == [
        "type",
        "seq",
        "time",
        "rank",
        "window",
        "group",
        "count",
        "fired",
        "request",
        "id",
        "kind",
    ]
    assert parse_event(fired.to_wire()) == fired


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
