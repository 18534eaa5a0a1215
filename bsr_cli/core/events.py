"""The engine's events as types: one frozen dataclass per `EventKind`, or per set of kinds that carry the same
fields, told apart by a field written as the kind (``RestoreEnded``: the four ways a restore ends, by ``outcome``;
``WindowStepped``: a window waiting or installed, by ``step``; ``FaultEvent``: a fault armed or fired, by ``act``),
defined once and used by every writer (the runtime, the rank hosts, the plugins) and every reader (the event
store, the server, the client, the TUI, explain, metrics).

Each class stands alone: it declares its kind, ``seq`` and ``time``, then its own fields. ``Event`` is the union
of them all (a type for annotations, and for ``isinstance``). What every event answers lives in functions here:
``request_of``, ``rank_of``, ``stamped``.

The wire form is a flat JSON object: ``{"type": kind, "seq": …, "time": …, <fields>}``, the same shape the event
log has always served, so recordings and stores written earlier still read. ``to_wire()`` writes it (fields in
declared order, a few under an older wire name); ``parse_event()`` reads it back, refusing an unknown ``type`` and
a field of the wrong kind (enums are checked by value), ignoring fields it does not know (a newer writer) and
defaulting missing optional ones (an older writer).

``seq`` and ``time`` are stamped by the event log when the event is recorded; writers leave them at 0.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

from bsr_cli.core import wire
from bsr_cli.core.evidence import (
    CapacityCause,
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
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.overload import HostLoad
from bsr_cli.core.store_loss import SegmentLoss

E = TypeVar("E", bound="Event")
_D = TypeVar("_D", bound="Failure | Event")  # a dataclass of this module


# Every event's writer: its kind first, under ``type``, then its fields (a renamed one under its wire key).
_EVENT_WRITER = wire.writer(lead={"type": "kind"})


def _schema_of_kinds(cls: type, s: wire.Schemas) -> wire.JsonSchema:
    """The schema of a type that serves several kinds: its fields', its ``type`` one of the kinds it serves (its
    ``kind`` property's type is any kind)."""
    written = s.written(cls)
    kinds = [kind.value for kind, (told, _, _) in _TOLD_APART.items() if told is cls]
    properties = dict(written["properties"]) | {"type": {"type": "string", "enum": kinds}}
    return wire.object_schema(properties, written["required"], written["additionalProperties"])


# The ``wire_schema`` of each type that serves several kinds.
_SCHEMA_OF_KINDS: classmethod[Any, [wire.Schemas], wire.JsonSchema] = classmethod(_schema_of_kinds)


@dataclass(frozen=True, kw_only=True)
class Failure:
    """One rank's failure inside a restore: where it happened and who is blamed."""

    rank: int | None
    reason: str
    kind: FailureKind
    stage: Stage | None = None
    window: int | None = None  # 0-based, as every window index in bsr's events
    tier: str | None = None  # the tier blamed, for a tier failure only
    cause: CapacityCause | None = None  # for a capacity refusal: what did not fit
    chunks: tuple[int, int] | None = wire.field(default=None, omit_none=True)  # the failed window's [start, end)
    # For a host verdict (and a rank judged past a stretched deadline): the figures the judge read.
    load: HostLoad | None = wire.field(default=None, omit_none=True)

    @property
    def component(self) -> Component:
        return {
            FailureKind.TIER: Component.TIER,
            FailureKind.RANK: Component.RANK,
            FailureKind.CAPACITY: Component.CAPACITY,
            FailureKind.ABORTED: Component.OPERATOR,
            FailureKind.HOST_OVERLOADED: Component.HOST,
        }[self.kind]

    to_wire = wire.writer(computed=("component",))

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Failure:
        return _from_fields(cls, data)


# -- the engine's life -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EngineStarted:
    kind: ClassVar[EventKind] = EventKind.ENGINE_STARTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    version: str = ""
    pid: int = 0
    restart: bool = False  # an earlier run of this engine left evidence in the same state directory
    previous_stop: str = ""  # "clean" (it was shut down) or "crash" (it stopped without saying so); "" the first time
    markers_restored: int = 0
    faults_dropped: int = 0  # armed faults never survive a restart


@dataclass(frozen=True, kw_only=True)
class EngineStopped:
    kind: ClassVar[EventKind] = EventKind.ENGINE_STOPPED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class SettingsChanged:
    kind: ClassVar[EventKind] = EventKind.SETTINGS_CHANGED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    # setting -> new value, as the admin API spells them
    changes: dict[str, int | float | str | bool | None] = field(default_factory=dict)


# -- a request and its restore ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RequestAdmitted:
    kind: ClassVar[EventKind] = EventKind.REQUEST_ADMITTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    prompt: str = ""
    tokens: int = 0
    queued_s: float = 0.0  # how long it waited for destination KV blocks (it arrived that long before this event)
    # One id per 512-token block of the prompt (core.trace.block_ids): what `bsr events export --trace` writes.
    block_ids: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RequestFinished:
    kind: ClassVar[EventKind] = EventKind.REQUEST_FINISHED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    external_tokens: int = 0
    computed_tokens: int = 0
    source: str = ""
    hash_ok: bool | None = None


@dataclass(frozen=True, kw_only=True)
class RestoreStarted:
    kind: ClassVar[EventKind] = EventKind.RESTORE_STARTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    prompt: str = ""
    prefix_tokens: int = 0  # a restore of a prefix of the prompt (a vLLM worker's load): ``prompt`` hashes that many
    W: int = 0
    windows: int = 0
    tokens: int = 0
    tiers: tuple[str, ...] = ()
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)


# The steps of a window that carry no figures, the kind each is written as (its ``type``), and one type for them.
BareStep: TypeAlias = Literal[WindowStep.WAITING, WindowStep.INSTALLED]
BARE_STEPS: dict[BareStep, EventKind] = {
    WindowStep.WAITING: EventKind.WINDOW_WAITING,
    WindowStep.INSTALLED: EventKind.WINDOW_INSTALLED,
}


@dataclass(frozen=True, kw_only=True)
class WindowStepped:
    """A window reached a step that carries no figures of its own (``step``: waiting for room under the budget, or
    installed); its fetch and its release are events of their own, with what they moved. On the wire the step is
    its ``type`` (``window_waiting``, ``window_installed``), as it has always been written."""

    to_wire = _EVENT_WRITER
    wire_schema = _SCHEMA_OF_KINDS
    seq: int = 0
    time: float = 0.0
    step: BareStep = field(metadata=wire.meta(skip=True))  # written as the kind, under ``type``
    request: str
    rank: int
    window: int
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)

    @property
    def kind(self) -> EventKind:
        return BARE_STEPS[self.step]


@dataclass(frozen=True, kw_only=True)
class WindowFetched:
    kind: ClassVar[EventKind] = EventKind.WINDOW_FETCHED
    step: ClassVar[WindowStep] = WindowStep.FETCHED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    rank: int
    window: int
    bytes: int = 0
    seconds: float = 0.0
    tiers: tuple[str, ...] = ()
    pool: dict[str, int] = field(default_factory=dict)  # the rank's pool right after the fetch (PoolStats' wire form)
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)


@dataclass(frozen=True, kw_only=True)
class WindowReleased:
    kind: ClassVar[EventKind] = EventKind.WINDOW_RELEASED
    step: ClassVar[WindowStep] = WindowStep.RELEASED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    rank: int
    window: int
    windows: int = 0
    bytes: int = 0
    pool: dict[str, int] = field(default_factory=dict)
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)


@dataclass(frozen=True, kw_only=True)
class RestoreFailed:
    """One rank's part of a restore failed (the request's outcome follows as its own event)."""

    kind: ClassVar[EventKind] = EventKind.RESTORE_FAILED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    rank: int
    reason: str
    stage: Stage | None = None
    window: int | None = None
    tier: str | None = None
    cause: CapacityCause | None = None
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)
    chunks: tuple[int, int] | None = wire.field(default=None, omit_none=True)  # the failed window's [start, end)
    load: HostLoad | None = wire.field(default=None, omit_none=True)  # a host verdict's figures
    failure_kind: FailureKind = field(metadata=wire.meta(name="kind"))  # last, as it has always been written
    injected: bool = wire.field(default=False, omit_false=True)  # an injected fault fired on this rank in it

    @classmethod
    def of(cls, request: str, rank: int, f: Failure) -> RestoreFailed:
        """The event of one rank's failure in ``request``'s restore."""
        return cls(
            request=request,
            rank=rank,
            reason=f.reason,
            failure_kind=f.kind,
            stage=f.stage,
            window=f.window,
            tier=f.tier,
            cause=f.cause,
            chunks=f.chunks,
            load=f.load,
        )

    @property
    def failure(self) -> Failure:
        return Failure(
            rank=self.rank,
            reason=self.reason,
            kind=self.failure_kind,
            stage=self.stage,
            window=self.window,
            tier=self.tier,
            cause=self.cause,
            chunks=self.chunks,
            load=self.load,
        )


# How a restore ended, and the event kind that says so on the wire (its ``type``).
ENDINGS: dict[Outcome, EventKind] = {
    Outcome.COMMITTED: EventKind.RESTORE_COMMITTED,
    Outcome.FAILED_CLOSED: EventKind.RESTORE_FAILED_CLOSED,
    Outcome.REFUSED: EventKind.RESTORE_REFUSED,
    Outcome.ABORTED: EventKind.RESTORE_ABORTED,
}


@dataclass(frozen=True, kw_only=True)
class RestoreEnded:
    """A restore ended, and how (``outcome``: committed, failed closed, refused or aborted). One type for the four
    endings: on the wire the ending is its ``type`` (``restore_committed``, ...), as it has always been written,
    and that is where a reader takes ``outcome`` from; the outcome has no key of its own."""

    to_wire = _EVENT_WRITER
    wire_schema = _SCHEMA_OF_KINDS
    seq: int = 0
    time: float = 0.0
    outcome: Outcome = field(metadata=wire.meta(skip=True))  # written as the kind, under ``type``
    request: str
    advertised_tokens: int = 0
    committed_tokens: int = 0
    seconds: float = 0.0
    failures: tuple[Failure, ...] = ()
    failure_kind: FailureKind | None = None
    # The admission pass this restore is (1, then 2 after a fallback; absent where a host has none).
    pass_no: int | None = wire.field(name="pass", default=None, omit_none=True)
    injected: bool = wire.field(default=False, omit_false=True)  # an injected fault fired in it (a drill's)

    def __post_init__(self) -> None:
        if self.outcome not in ENDINGS:  # nothing to restore is an answer, never an event
            raise ValueError(f"no restore event for outcome {self.outcome.value!r}")

    @property
    def kind(self) -> EventKind:
        return ENDINGS[self.outcome]


@dataclass(frozen=True, kw_only=True)
class StoreFailed:
    kind: ClassVar[EventKind] = EventKind.STORE_FAILED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    tier: str
    error: str
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class OutputMismatch:
    """A request's KV hashed differently from the canonical KV of its prompt (after its restore committed, or its
    compute finished): its destination blocks were invalidated, nothing of it was stored, and when part of it came
    from a tier a force-local marker makes the next admission of the prompt recompute it."""

    kind: ClassVar[EventKind] = EventKind.OUTPUT_MISMATCH
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str
    prompt: str = ""
    tokens: int = 0  # the tokens hashed (and invalidated)
    external_tokens: int = 0  # of them, restored from a tier
    source: str = ""  # the tiers they came from ("fs+mooncake"), or "recompute"
    output_hash: str = ""
    canonical_hash: str = ""
    marker: bool = False  # a force-local marker was set on the prompt


@dataclass(frozen=True, kw_only=True)
class ObjectQuarantined:
    """A rank re-read a stored object after a failed restore, found it damaged on the tier (its bytes, its length,
    or the chunk its checksum is bound to), and set it apart: moved under the fs tier's ``quarantine/``, removed
    from Mooncake; the tier no longer holds the chunk, so the next store rewrites it."""

    kind: ClassVar[EventKind] = EventKind.OBJECT_QUARANTINED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    tier: str
    key: str
    file: str  # where the damaged object now lies; "" when the tier removed it (Mooncake)
    reason: str
    request: str | None = None
    chunk: int | None = None  # which chunk and group of the prompt: None when a scrub of a whole tier found it
    group: str | None = None
    scrub: str | None = None  # the scrub that found it (None: the re-read of a failed window)


@dataclass(frozen=True, kw_only=True)
class ScrubStarted:
    """A rank began reading a tier's objects back to check them: the rest of a prompt after a restore from the tier
    failed (``request``), or an operator's `bsr scrub` (a prompt, or every object)."""

    kind: ClassVar[EventKind] = EventKind.SCRUB_STARTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    tier: str
    scrub: str
    scope: ScrubScope
    prompt: str = ""
    request: str | None = None
    objects: int = 0  # in scope, when known up front (a prompt's)


@dataclass(frozen=True, kw_only=True)
class ScrubFinished:
    """A rank's scrub ended: what it read back and set apart, and whether it covered its whole scope."""

    kind: ClassVar[EventKind] = EventKind.SCRUB_FINISHED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    tier: str
    scrub: str
    scope: ScrubScope
    state: ScrubState
    prompt: str = ""
    request: str | None = None
    objects: int = 0
    checked: int = 0
    bytes: int = 0
    missing: int = 0
    damaged: int = 0
    quarantined: int = 0
    seconds: float = 0.0
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class SegmentLost:
    """The store lost a holder's segment, and with it every object on it (the engine's store watch saw it): whose,
    when, how, and how many objects and bytes, where the master said."""

    kind: ClassVar[EventKind] = EventKind.SEGMENT_LOST
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    tier: str
    segment: str
    client_id: str = ""
    cause: SegmentLossCause
    lost_at: float = 0.0
    last_seen_at: float | None = None
    objects_lost: int | None = None
    bytes_lost: int | None = None
    holder: str = ""

    @classmethod
    def of(cls, tier: str, loss: SegmentLoss) -> SegmentLost:
        return cls(tier=tier, **{name: getattr(loss, name) for name in _LOSS_FIELDS})

    @property
    def loss(self) -> SegmentLoss:
        said = {name: getattr(self, name) for name in _LOSS_FIELDS}
        return SegmentLoss(**said | {"lost_at": self.lost_at or self.time})


# What a segment_lost event says of the loss: every field of it but when it was mounted again (a later fact).
_LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(SegmentLoss) if f.name != "remounted_at")


@dataclass(frozen=True, kw_only=True)
class AbortRequested:
    kind: ClassVar[EventKind] = EventKind.ABORT_REQUESTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    request: str


# -- markers and faults -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MarkerSet:
    kind: ClassVar[EventKind] = EventKind.MARKER_SET
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    prompt: str
    request: str | None = None
    excluded_tiers: tuple[str, ...] = ()
    reason: str = ""
    injected: bool = wire.field(default=False, omit_false=True)  # an injected fault failed the restore


@dataclass(frozen=True, kw_only=True)
class MarkerCleared:
    kind: ClassVar[EventKind] = EventKind.MARKER_CLEARED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    prompt: str
    why: str = ""  # a MarkerClearCause's value: a later admission succeeded, or an operator cleared it
    request: str | None = None
    scope: str = ""  # an operator's clear: "all", "prompt" or "tier" (core.markers.ScopeKind); "" otherwise
    tier: str | None = None  # the tier a tier-scoped clear took out
    excluded_tiers: tuple[str, ...] | None = None  # what the marker still excludes when only a tier was taken out


# What befell an armed fault, and the kind that says so on the wire (its ``type``).
FAULT_ACTS = {FaultAct.INJECTED: EventKind.FAULT_INJECTED, FaultAct.FIRED: EventKind.FAULT_FIRED}


@dataclass(frozen=True, kw_only=True)
class FaultEvent:
    """A fault was armed (``act``: injected), or it fired in ``request``'s restore (fired). The fault's fields travel
    flat beside the event's; on the wire the act is the event's ``type`` (``fault_injected``, ``fault_fired``), as
    it has always been written, and only a fired fault names a request."""

    to_wire = _EVENT_WRITER
    wire_schema = _SCHEMA_OF_KINDS
    seq: int = 0
    time: float = 0.0
    act: FaultAct = field(metadata=wire.meta(skip=True))  # written as the kind, under ``type``
    rank: int | None = None
    window: int | None = None
    group: str | None = None
    count: int = 1
    fired: int = 0
    request: str | None = wire.field(default=None, omit_none=True)  # the restore a fired fault acted on
    # The fault's own id and kind, last and spelled as the fault's wire form spells them (``id``, ``kind``).
    fault_id: int = wire.field(name="id", default=0)
    fault: str = wire.field(name="kind", default="")  # the fault's kind (remote-unavailable, restore-fault, ...)

    @classmethod
    def of(cls, act: FaultAct, f: FaultSpec, request: str | None = None) -> FaultEvent:
        """The event of fault ``f`` as it stands: just armed, or just fired in ``request``'s restore."""
        shared = {name: getattr(f, name) for name in ("rank", "window", "group", "count", "fired")}  # same names
        return cls(act=act, fault_id=f.id, fault=f.kind, request=request, **shared)

    @property
    def kind(self) -> EventKind:
        return FAULT_ACTS[self.act]


@dataclass(frozen=True, kw_only=True)
class FaultsCleared:
    kind: ClassVar[EventKind] = EventKind.FAULTS_CLEARED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    count: int = 0


# -- ranks ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankUnresponsive:
    kind: ClassVar[EventKind] = EventKind.RANK_UNRESPONSIVE
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    reason: str
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class RankStarved:
    """A rank's deadline ran out while it (or the coordinator) waited to run: the deadline is stretched, up to the
    engine's overload ceiling, and the rank is not blamed. ``load`` holds the figures the judge read."""

    kind: ClassVar[EventKind] = EventKind.RANK_STARVED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    reason: str
    request: str | None = None
    state: RankState = RankState.STARVED
    load: HostLoad | None = None


@dataclass(frozen=True, kw_only=True)
class RankRestarted:
    kind: ClassVar[EventKind] = EventKind.RANK_RESTARTED
    to_wire = _EVENT_WRITER
    seq: int = 0
    time: float = 0.0
    rank: int
    pid: int = 0
    restarts: int = 1  # how many times this rank has been restarted since the engine started
    reason: str = ""


Event: TypeAlias = (
    EngineStarted
    | EngineStopped
    | SettingsChanged
    | RequestAdmitted
    | RequestFinished
    | RestoreStarted
    | WindowStepped
    | WindowFetched
    | WindowReleased
    | RestoreFailed
    | RestoreEnded
    | StoreFailed
    | OutputMismatch
    | ObjectQuarantined
    | ScrubStarted
    | ScrubFinished
    | SegmentLost
    | AbortRequested
    | MarkerSet
    | MarkerCleared
    | FaultEvent
    | FaultsCleared
    | RankUnresponsive
    | RankStarved
    | RankRestarted
)
_EVENT_CLASSES: tuple[type[Event], ...] = typing.get_args(Event)  # every event type: the union's members
# The types that serve several kinds, told apart by a field: each such kind's type, and the field and value a
# reader gives it (from the ``type`` it was written under; a key of the field's name is not it).
_TOLD_APART: dict[EventKind, tuple[type[Event], str, Outcome | WindowStep | FaultAct]] = {
    **{kind: (RestoreEnded, "outcome", outcome) for outcome, kind in ENDINGS.items()},
    **{kind: (WindowStepped, "step", step) for step, kind in BARE_STEPS.items()},
    **{kind: (FaultEvent, "act", act) for act, kind in FAULT_ACTS.items()},
}
_SERVE_SEVERAL = {cls for cls, _, _ in _TOLD_APART.values()}


def _kind_of(cls: type[Event]) -> EventKind:
    kind = cls.kind
    assert isinstance(kind, EventKind), f"{cls.__name__} has no kind of its own"
    return kind


# Each kind's type: one that serves it alone (its ``kind`` a constant of the class), or one of those above.
EVENT_TYPES: dict[EventKind, type[Event]] = {
    **{_kind_of(cls): cls for cls in _EVENT_CLASSES if cls not in _SERVE_SEVERAL},
    **{kind: cls for kind, (cls, _, _) in _TOLD_APART.items()},
}
assert set(EVENT_TYPES) == set(EventKind) and set(EVENT_TYPES.values()) == set(_EVENT_CLASSES), (
    "every EventKind has exactly one event type"
)

# Fields written and read under another wire name than their own (wire key -> field): the wire has always spelled
# a failed rank's failure kind ``kind``, and a fault's id and kind as the fault's own wire form does.
_WIRE_KEYS: dict[type[Event], dict[str, str]] = {cls: wire.keys(cls) for cls in _EVENT_CLASSES}

# The events that show a rank making progress through a restore (the liveness watch and the TUI read them).
PROGRESS = frozenset(
    {EventKind.WINDOW_WAITING, EventKind.WINDOW_FETCHED, EventKind.WINDOW_INSTALLED, EventKind.WINDOW_RELEASED}
)


def parse_event(wire: Mapping[str, Any]) -> Event:
    """The typed event of a wire object. Raises ValueError for an unknown ``type`` or a field of the wrong kind."""
    try:
        kind = EventKind(str(wire.get("type")))
    except ValueError:
        raise ValueError(f"unknown event type {wire.get('type')!r}") from None
    cls = EVENT_TYPES[kind]
    keys = _WIRE_KEYS.get(cls, {})
    fields = {keys.get(k, k): v for k, v in wire.items() if k != "type"}
    if kind in _TOLD_APART:  # a type of several kinds: which one is the type it was written under
        _, name, value = _TOLD_APART[kind]
        fields[name] = value
    return _from_fields(cls, fields)


# -- what every event answers ------------------------------------------------------------------------------------
def in_pass(event: E, pass_no: int | None) -> E:
    """``event`` stamped with the admission pass of the restore it belongs to (unchanged when it is no restore's
    event, or the pass is not known)."""
    if pass_no is None or "pass_no" not in _field_names(type(event)):
        return event
    passed: E = dataclasses.replace(typing.cast(Any, event), pass_no=pass_no)
    return passed


def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def stamped(event: E, seq: int, at: float) -> E:
    """``event`` as the event log records it: numbered ``seq``, at time ``at``."""
    return dataclasses.replace(event, seq=seq, time=at)


def known_event(wire: object) -> Event | None:
    """The typed event of a wire object, or None for one this bsr cannot read (a newer engine's kind)."""
    if not isinstance(wire, Mapping):
        return None
    try:
        return parse_event(wire)
    except ValueError:
        return None


def request_of(event: Event) -> str | None:
    """The request the event belongs to, if any (the event store indexes it)."""
    value = getattr(event, "request", None)
    return value if isinstance(value, str) and value else None


def rank_of(event: Event) -> int | None:
    """The rank the event happened on, if any."""
    value = getattr(event, "rank", None)
    return value if isinstance(value, int) else None


# -- the wire form: written by core.wire (under the wire keys above), read strictly here -----------------------
_FIELD_HINTS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field of a dataclass of this module with its resolved type hint, worked out once per class."""
    if cls not in _FIELD_HINTS:
        hints = typing.get_type_hints(cls)
        _FIELD_HINTS[cls] = tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))
    return _FIELD_HINTS[cls]


def _from_fields(cls: type[_D], data: Mapping[str, Any]) -> _D:
    # A field the data lacks (an older writer) takes its default; a required one fails below.
    kwargs = {name: _coerce(name, hint, data[name]) for name, hint in _field_hints(cls) if name in data}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ValueError(f"{cls.__name__}: {e}") from None


_ENUMS = (
    FailureKind,
    Stage,
    Outcome,
    Component,
    EventKind,
    CapacityCause,
    RankState,
    ScrubScope,
    ScrubState,
    SegmentLossCause,
)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(name, args[0], value)
    if hint in _ENUMS:
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"field {name!r}: {value!r} is not a {hint.__name__}") from None
    if hint is Failure or hint is HostLoad:
        if not isinstance(value, Mapping):
            raise ValueError(f"field {name!r}: expected an object")
        return hint.from_wire(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"field {name!r}: expected a list")
        (item,) = typing.get_args(hint)[:1]
        return tuple(_coerce(name, item, v) for v in value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"field {name!r}: expected an object")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"field {name!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"field {name!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"field {name!r}: expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"field {name!r}: expected a string")
        return value
    return value


__all__ = [
    "BARE_STEPS",
    "ENDINGS",
    "EVENT_TYPES",
    "FAULT_ACTS",
    "PROGRESS",
    "AbortRequested",
    "EngineStarted",
    "EngineStopped",
    "Event",
    "Failure",
    "FaultEvent",
    "FaultsCleared",
    "MarkerCleared",
    "MarkerSet",
    "ObjectQuarantined",
    "RankRestarted",
    "RankStarved",
    "RankUnresponsive",
    "RequestAdmitted",
    "RequestFinished",
    "RestoreEnded",
    "RestoreFailed",
    "RestoreStarted",
    "ScrubFinished",
    "ScrubStarted",
    "SegmentLost",
    "SettingsChanged",
    "StoreFailed",
    "WindowFetched",
    "WindowReleased",
    "WindowStepped",
    "in_pass",
    "known_event",
    "parse_event",
    "rank_of",
    "request_of",
    "stamped",
]
