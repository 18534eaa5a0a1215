"""The typed events: every kind has one class, the wire form round-trips, and malformed wire input is refused."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from bsr_cli.core.events import (
    BARE_STEPS,
    ENDINGS,
    EVENT_TYPES,
    FAULT_ACTS,
    AbortRequested,
    BareStep,
    EngineStarted,
    Event,
    Failure,
    FaultEvent,
    ObjectQuarantined,
    OutputMismatch,
    RankRestarted,
    RankStarved,
    RestoreEnded,
    RestoreFailed,
    ScrubFinished,
    ScrubStarted,
    SegmentLost,
    WindowFetched,
    WindowReleased,
    WindowStepped,
    parse_event,
    rank_of,
    request_of,
    stamped,
)
from bsr_cli.core.evidence import (
    Component,
    EventKind,
    FailureKind,
    FaultAct,
    Outcome,
    RankState,
    ScrubScope,
    ScrubState,
    SegmentLossCause,
    Stage,
    WindowStep,
)
from bsr_cli.core.overload import HostLoad, Psi, RankDelay
from bsr_cli.core.store_loss import SegmentLoss

pytestmark = pytest.mark.fast


def test_every_kind_has_one_class_and_every_outcome_an_end_event() -> None:
    assert set(EVENT_TYPES) == set(EventKind)
    for outcome in (Outcome.COMMITTED, Outcome.FAILED_CLOSED, Outcome.REFUSED, Outcome.ABORTED):
        ended = RestoreEnded(outcome=outcome, request="r")
        assert ended.kind is ENDINGS[outcome] and EVENT_TYPES[ended.kind] is RestoreEnded
    with pytest.raises(ValueError, match="no restore event"):
        RestoreEnded(outcome=Outcome.NOTHING_TO_RESTORE, request="r")
    for step in (WindowStep.WAITING, WindowStep.INSTALLED):
        stepped = WindowStepped(step=step, request="r", rank=0, window=0)
        assert stepped.kind is BARE_STEPS[step] and EVENT_TYPES[stepped.kind] is WindowStepped
    # A fetch and a release say what they moved: each is its own type, its step a constant of the class (the
    # bare type's ``step`` admits the other two alone).
    assert (WindowFetched.step, WindowReleased.step) == (WindowStep.FETCHED, WindowStep.RELEASED)
    assert (
        set(typing.get_args(BareStep)) == set(BARE_STEPS) == set(WindowStep) - {WindowFetched.step, WindowReleased.step}
    )


def _fields(cls: type) -> list[tuple[str, object, object]]:
    return [(f.name, f.type, f.default) for f in dataclasses.fields(cls)]


def test_every_event_class_stands_alone_and_the_shared_names_are_unions() -> None:
    # No event class inherits another's fields: each declares seq and time first (the wire's key order), then its own.
    for cls in EVENT_TYPES.values():
        assert cls.__bases__ == (object,), cls
        assert [f.name for f in dataclasses.fields(cls)][:2] == ["seq", "time"], cls
        assert issubclass(cls, Event)
    # One type serves the four ways a restore ends, one a window's steps without figures, one a fault armed or fired.
    assert {kind for kind, cls in EVENT_TYPES.items() if cls is RestoreEnded} == set(ENDINGS.values())
    assert {kind for kind, cls in EVENT_TYPES.items() if cls is WindowStepped} == set(BARE_STEPS.values())
    assert {kind for kind, cls in EVENT_TYPES.items() if cls is FaultEvent} == set(FAULT_ACTS.values())
    assert not isinstance({"type": "restore_committed"}, Event)


def test_stamping_and_the_request_and_rank_an_event_belongs_to() -> None:
    released = WindowReleased(request="r1", rank=1, window=0)
    assert stamped(released, 5, 3.5) == dataclasses.replace(released, seq=5, time=3.5)
    assert (released.seq, released.time) == (0, 0.0)  # events are frozen: stamping makes a new one
    assert (request_of(released), rank_of(released)) == ("r1", 1)
    assert (request_of(AbortRequested(request="r2")), rank_of(AbortRequested(request="r2"))) == ("r2", None)
    assert (request_of(RankRestarted(rank=0)), rank_of(RankRestarted(rank=0))) == (None, 0)
    assert (request_of(EngineStarted()), request_of(FaultEvent(act=FaultAct.FIRED, request=""))) == (None, None)


def test_a_rank_failure_round_trips_with_its_stage_and_blame() -> None:
    part = RestoreFailed(
        request="r1", rank=1, reason="install failed", failure_kind=FailureKind.RANK, stage=Stage.INSTALL
    )
    closed = RestoreEnded(
        outcome=Outcome.FAILED_CLOSED, request="r1", failures=(part.failure,), failure_kind=FailureKind.RANK
    )
    ended = stamped(closed, 9, 2.0)
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
    ended = RestoreEnded(
        outcome=Outcome.FAILED_CLOSED, request="r2", failures=(part.failure,), failure_kind=FailureKind.HOST_OVERLOADED
    )
    wire = ended.to_wire()
    assert wire["failures"][0]["load"]["ranks"] == [{"rank": 1, "state": "starved", "run_delay_s": 4.6, "ran_s": None}]
    assert wire["failures"][0]["load"]["io"] is None and wire["failures"][0]["component"] == "host"
    assert parse_event(wire) == ended and parse_event(part.to_wire()) == part
    starved = RankStarved(rank=1, reason="waited to run", request="r2", load=load)
    assert parse_event(starved.to_wire()) == starved and starved.to_wire()["type"] == "rank_starved"
    # A failure without figures writes none (older readers see the shape they know).
    assert "load" not in RestoreFailed(request="r", rank=0, reason="x", failure_kind=FailureKind.TIER).to_wire()


def test_an_output_mismatch_round_trips_naming_the_request_and_its_hashes() -> None:
    ev = stamped(
        OutputMismatch(
            request="req-7",
            prompt="p7",
            tokens=4096,
            external_tokens=4096,
            source="mooncake",
            output_hash="ab",
            canonical_hash="cd",
            marker=True,
        ),
        9,
        1.5,
    )
    wire = ev.to_wire()
    assert wire["type"] == "output_mismatch" and list(wire)[:3] == ["type", "seq", "time"]
    assert parse_event(wire) == ev and request_of(ev) == "req-7"


def test_a_fault_event_keeps_the_faults_own_field_names() -> None:
    ev = FaultEvent(act=FaultAct.INJECTED, fault_id=4, fault="restore-fault", rank=1, window=2)
    wire = ev.to_wire()
    assert (wire["type"], wire["id"], wire["kind"]) == ("fault_injected", 4, "restore-fault")
    assert parse_event(wire) == ev
    # An armed fault has no request: the key is not written (and a newer writer's act key is not the act).
    assert "request" not in wire and "act" not in wire
    assert parse_event(wire | {"act": "fired"}) == ev
    # The fault's id and kind are the last keys, as they have always been written; the fired one names its request.
    fired = FaultEvent(act=FaultAct.FIRED, fault_id=4, fault="restore-fault", rank=1, request="r1")
    assert fired.kind is EventKind.FAULT_FIRED and fired.to_wire()["type"] == "fault_fired"
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


def test_a_lost_segment_round_trips_with_its_holder_cause_and_what_went() -> None:
    loss = SegmentLoss(
        segment="127.0.0.1:12655",
        client_id="1-2",
        cause=SegmentLossCause.UNMOUNTED,
        lost_at=1_800_000_000.0,
        last_seen_at=1_799_999_999.0,
        objects_lost=20,
        bytes_lost=82_240,
        holder="segment_holder pid 42",
    )
    ev = stamped(SegmentLost.of("mooncake", loss), 7, 1_800_000_000.5)
    wire = ev.to_wire()
    assert list(wire)[:5] == ["type", "seq", "time", "tier", "segment"]
    assert (wire["type"], wire["cause"], wire["objects_lost"], wire["bytes_lost"]) == (
        "segment_lost",
        "unmounted",
        20,
        82_240,
    )
    back = parse_event(wire)
    assert back == ev and isinstance(back, SegmentLost) and back.loss == loss
    # Where the master did not say how many objects went, the event says so (null), never a guessed 0.
    unknown = dataclasses.replace(ev, objects_lost=None, bytes_lost=None)
    assert parse_event(unknown.to_wire()) == unknown and unknown.to_wire()["objects_lost"] is None


@pytest.mark.parametrize(
    "wire, message",
    [
        ({"type": "no_such_event"}, "unknown event type"),
        ({"type": "segment_lost", "tier": "mooncake", "segment": "s", "cause": "gremlins"}, "not a SegmentLossCause"),
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


def test_a_scrub_and_what_it_set_apart_round_trip() -> None:
    started = ScrubStarted(rank=1, tier="fs", scrub="scrub-1-1", scope=ScrubScope.PROMPT, prompt="p", request="r1")
    ended = ScrubFinished(
        rank=1,
        tier="fs",
        scrub="scrub-1-1",
        scope=ScrubScope.PROMPT,
        state=ScrubState.COMPLETE,
        prompt="p",
        request="r1",
        objects=12,
        checked=10,
        bytes=4096,
        missing=2,
        damaged=3,
        quarantined=3,
    )
    for ev in (started, ended):
        assert parse_event(ev.to_wire()) == ev and request_of(ev) == "r1"
    assert ended.to_wire()["state"] == "complete" and started.to_wire()["scope"] == "prompt"
    # What a scrub of a whole tier finds names no chunk: its chunk and group are left out as None, and read back.
    found = ObjectQuarantined(rank=0, tier="fs", key="k", file="/q/x.bsr", reason="payload", scrub="scrub-0-1")
    assert found.to_wire()["chunk"] is None and parse_event(found.to_wire()) == found
    with pytest.raises(ValueError, match="not a ScrubState"):
        parse_event(ended.to_wire() | {"state": "half-done"})


def test_a_failure_names_its_windows_chunks_only_when_known() -> None:
    bare = Failure(rank=0, reason="x", kind=FailureKind.TIER, stage=Stage.VERIFY, window=1, tier="fs")
    assert "chunks" not in bare.to_wire()
    spanned = dataclasses.replace(bare, chunks=(4, 8))
    assert spanned.to_wire()["chunks"] == [4, 8] and Failure.from_wire(spanned.to_wire()) == spanned


def test_a_restore_ending_is_one_type_whose_wire_type_names_its_outcome() -> None:
    fail = Failure(rank=0, reason="x", kind=FailureKind.TIER, stage=Stage.VERIFY, window=1, tier="fs")
    # The types the four endings have always been written under (spelled out: the wire's, not the code's).
    written_as = {
        Outcome.COMMITTED: "restore_committed",
        Outcome.FAILED_CLOSED: "restore_failed_closed",
        Outcome.REFUSED: "restore_refused",
        Outcome.ABORTED: "restore_aborted",
    }
    assert set(written_as) == set(ENDINGS)
    for outcome, kind in written_as.items():
        ended = stamped(RestoreEnded(outcome=outcome, request="r1", failures=(fail,), pass_no=2), 4, 1.0)
        wire = ended.to_wire()
        # The outcome travels as the type and nowhere else: the keys are the ones the four endings always wrote.
        assert wire["type"] == kind and "outcome" not in wire
        assert list(wire) == [
            "type",
            "seq",
            "time",
            "request",
            "advertised_tokens",
            "committed_tokens",
            "seconds",
            "failures",
            "failure_kind",
            "pass",
        ]
        assert parse_event(wire) == ended
    assert RestoreEnded(outcome=Outcome.ABORTED, request="r", injected=True).to_wire()["injected"] is True


def test_a_restore_ending_reads_what_an_older_or_newer_engine_writes_and_refuses_what_it_acts_on() -> None:
    older = parse_event({"type": "restore_committed", "request": "r", "committed_tokens": 7, "seconds": 1})
    assert isinstance(older, RestoreEnded) and older.outcome is Outcome.COMMITTED and older.seconds == 1.0
    assert older.failures == () and older.failure_kind is None and not older.injected and older.pass_no is None
    # A key a newer engine adds is passed over, even one named like the field the type reads from ``type``.
    newer = parse_event({"type": "restore_refused", "request": "r", "outcome": "committed", "new": {"a": 1}})
    assert isinstance(newer, RestoreEnded) and newer.outcome is Outcome.REFUSED
    refused = [
        ({"type": "restore_aborted", "request": "r", "failure_kind": "gremlins"}, "gremlins"),
        ({"type": "restore_committed", "request": "r", "committed_tokens": True}, "expected an integer"),
        ({"type": "restore_committed", "committed_tokens": 1}, "request"),
    ]
    for sent, message in refused:
        with pytest.raises(ValueError, match=message):
            parse_event(sent)


def test_a_bare_window_step_is_one_type_whose_wire_type_names_its_step() -> None:
    # The types the two steps have always been written under (spelled out: the wire's, not the code's).
    written_as = {WindowStep.WAITING: "window_waiting", WindowStep.INSTALLED: "window_installed"}
    assert set(written_as) == set(BARE_STEPS)
    for step, kind in written_as.items():
        stepped = stamped(WindowStepped(step=step, request="r1", rank=1, window=2, pass_no=2), 4, 1.0)
        wire = stepped.to_wire()
        # The step travels as the type and nowhere else: the keys are the ones the two steps always wrote.
        assert wire == {"type": kind, "seq": 4, "time": 1.0, "request": "r1", "rank": 1, "window": 2, "pass": 2}
        assert list(wire) == ["type", "seq", "time", "request", "rank", "window", "pass"]
        assert parse_event(wire) == stepped
        assert "pass" not in WindowStepped(step=step, request="r1", rank=1, window=2).to_wire()
    # A key a newer engine adds is passed over, even one named like the field the type reads from ``type``.
    newer = parse_event({"type": "window_waiting", "request": "r", "rank": 0, "window": 0, "step": "installed"})
    assert isinstance(newer, WindowStepped) and newer.step is WindowStep.WAITING
    with pytest.raises(ValueError, match="request"):
        parse_event({"type": "window_installed", "rank": 0, "window": 0})
