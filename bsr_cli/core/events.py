"""The engine's events as types: one frozen dataclass per `EventKind`, defined once and used by every writer (the
runtime, the rank hosts, the plugins) and every reader (the event store, the server, the client, the TUI, explain,
metrics).

The wire form is a flat JSON object: ``{"type": kind, "seq": …, "time": …, <fields>}``, the same shape the event
log has always served, so recordings and stores written earlier still read. ``to_wire()`` writes it;
``parse_event()`` reads it back, refusing an unknown ``type`` and a field of the wrong kind (enums are checked by
value), ignoring fields it does not know (a newer writer) and defaulting missing optional ones (an older writer).

``seq`` and ``time`` are stamped by the event log when the event is recorded; writers leave them at 0.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from bsr_cli.core.evidence import CapacityCause, Component, EventKind, FailureKind, Outcome, Stage

E = TypeVar("E", bound="Event")
_D = TypeVar("_D", bound="Failure | Event")  # a dataclass of this module


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

    @property
    def component(self) -> Component:
        return {
            FailureKind.TIER: Component.TIER,
            FailureKind.RANK: Component.RANK,
            FailureKind.CAPACITY: Component.CAPACITY,
            FailureKind.ABORTED: Component.OPERATOR,
        }[self.kind]

    def to_wire(self) -> dict[str, Any]:
        return {**_wire_fields(self), "component": self.component.value}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Failure:
        return _from_fields(cls, data)


@dataclass(frozen=True, kw_only=True)
class Event:
    """The fields every event has. Subclasses add theirs and name their kind."""

    kind: ClassVar[EventKind]
    seq: int = 0
    time: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        fields = _wire_fields(self)
        for wire_name, name in self._wire_aliases().items():
            fields[wire_name] = fields.pop(name)
        return {"type": self.kind.value, **fields}

    def stamped(self: E, seq: int, at: float) -> E:
        return dataclasses.replace(self, seq=seq, time=at)

    @classmethod
    def _wire_aliases(cls) -> dict[str, str]:
        """Wire names that differ from the field names (read and written): wire name -> field name."""
        return {}

    @property
    def request_id(self) -> str | None:
        """The request the event belongs to, if any (the event store indexes it)."""
        value = getattr(self, "request", None)
        return value if isinstance(value, str) and value else None

    @property
    def rank_id(self) -> int | None:
        value = getattr(self, "rank", None)
        return value if isinstance(value, int) else None


# -- the engine's life -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EngineStarted(Event):
    kind = EventKind.ENGINE_STARTED
    version: str = ""
    pid: int = 0
    restart: bool = False  # an earlier run of this engine left evidence in the same state directory
    previous_stop: str = ""  # "clean" (it was shut down) or "crash" (it stopped without saying so); "" the first time
    markers_restored: int = 0
    faults_dropped: int = 0  # armed faults never survive a restart


@dataclass(frozen=True, kw_only=True)
class EngineStopped(Event):
    kind = EventKind.ENGINE_STOPPED
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class SettingsChanged(Event):
    kind = EventKind.SETTINGS_CHANGED
    # setting -> new value, as the admin API spells them
    changes: dict[str, int | float | str | bool | None] = field(default_factory=dict)


# -- a request and its restore ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RequestAdmitted(Event):
    kind = EventKind.REQUEST_ADMITTED
    request: str
    prompt: str = ""
    tokens: int = 0
    queued_s: float = 0.0  # how long it waited for destination KV blocks (it arrived that long before this event)
    # One id per 512-token block of the prompt (core.trace.block_ids): what `bsr events export --trace` writes.
    block_ids: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RequestFinished(Event):
    kind = EventKind.REQUEST_FINISHED
    request: str
    external_tokens: int = 0
    computed_tokens: int = 0
    source: str = ""
    hash_ok: bool | None = None


@dataclass(frozen=True, kw_only=True)
class RestoreStarted(Event):
    kind = EventKind.RESTORE_STARTED
    request: str
    prompt: str = ""
    prefix_tokens: int = 0  # a restore of a prefix of the prompt (a vLLM worker's load): ``prompt`` hashes that many
    W: int = 0
    windows: int = 0
    tokens: int = 0
    tiers: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class WindowWaiting(Event):
    kind = EventKind.WINDOW_WAITING
    request: str
    rank: int
    window: int


@dataclass(frozen=True, kw_only=True)
class WindowFetched(Event):
    kind = EventKind.WINDOW_FETCHED
    request: str
    rank: int
    window: int
    bytes: int = 0
    seconds: float = 0.0
    tiers: tuple[str, ...] = ()
    pool: dict[str, int] = field(default_factory=dict)  # the rank's pool right after the fetch (PoolStats' wire form)


@dataclass(frozen=True, kw_only=True)
class WindowInstalled(Event):
    kind = EventKind.WINDOW_INSTALLED
    request: str
    rank: int
    window: int


@dataclass(frozen=True, kw_only=True)
class WindowReleased(Event):
    kind = EventKind.WINDOW_RELEASED
    request: str
    rank: int
    window: int
    windows: int = 0
    bytes: int = 0
    pool: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RestoreFailed(Event):
    """One rank's part of a restore failed (the request's outcome follows as its own event)."""

    kind = EventKind.RESTORE_FAILED
    request: str
    rank: int
    reason: str
    failure_kind: FailureKind
    stage: Stage | None = None
    window: int | None = None
    tier: str | None = None
    cause: CapacityCause | None = None

    @classmethod
    def _wire_aliases(cls) -> dict[str, str]:
        return {"kind": "failure_kind"}  # the wire has always spelled it ``kind``

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
        )


@dataclass(frozen=True, kw_only=True)
class RestoreEnded(Event):
    """How a restore ended; one subclass per outcome."""

    outcome: ClassVar[Outcome]
    request: str
    advertised_tokens: int = 0
    committed_tokens: int = 0
    seconds: float = 0.0
    failures: tuple[Failure, ...] = ()
    failure_kind: FailureKind | None = None


@dataclass(frozen=True, kw_only=True)
class RestoreCommitted(RestoreEnded):
    kind = EventKind.RESTORE_COMMITTED
    outcome = Outcome.COMMITTED


@dataclass(frozen=True, kw_only=True)
class RestoreFailedClosed(RestoreEnded):
    kind = EventKind.RESTORE_FAILED_CLOSED
    outcome = Outcome.FAILED_CLOSED


@dataclass(frozen=True, kw_only=True)
class RestoreRefused(RestoreEnded):
    kind = EventKind.RESTORE_REFUSED
    outcome = Outcome.REFUSED


@dataclass(frozen=True, kw_only=True)
class RestoreAborted(RestoreEnded):
    kind = EventKind.RESTORE_ABORTED
    outcome = Outcome.ABORTED


def restore_ended(outcome: Outcome) -> type[RestoreEnded]:
    """The event class of a restore that ended with ``outcome``."""
    for cls in (RestoreCommitted, RestoreFailedClosed, RestoreRefused, RestoreAborted):
        if cls.outcome is outcome:
            return cls
    raise ValueError(f"no restore event for outcome {outcome.value!r}")


@dataclass(frozen=True, kw_only=True)
class StoreFailed(Event):
    kind = EventKind.STORE_FAILED
    rank: int
    tier: str
    error: str
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class ObjectQuarantined(Event):
    """A rank re-read a stored object after a failed restore, found its bytes damaged on the tier, and moved it
    aside (under the tier's ``quarantine/``); the tier no longer holds the chunk, so the next store rewrites it."""

    kind = EventKind.OBJECT_QUARANTINED
    rank: int
    tier: str
    chunk: int
    group: str
    key: str
    file: str  # where the damaged object now lies
    reason: str
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class AbortRequested(Event):
    kind = EventKind.ABORT_REQUESTED
    request: str


# -- markers and faults -----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MarkerSet(Event):
    kind = EventKind.MARKER_SET
    prompt: str
    request: str | None = None
    excluded_tiers: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class MarkerCleared(Event):
    kind = EventKind.MARKER_CLEARED
    prompt: str
    why: str = ""  # a MarkerClearCause's value: a later admission succeeded, or an operator cleared it
    request: str | None = None
    scope: str = ""  # an operator's clear: "all", "prompt" or "tier" (core.markers.ScopeKind); "" otherwise
    tier: str | None = None  # the tier a tier-scoped clear took out
    excluded_tiers: tuple[str, ...] | None = None  # what the marker still excludes when only a tier was taken out


@dataclass(frozen=True, kw_only=True)
class FaultEvent(Event):
    """A fault's own fields travel flat beside the event's, spelled as the fault's own wire form (``id``, and
    ``kind`` for the fault's kind)."""

    fault_id: int = 0
    fault: str = ""  # the fault's kind (remote-unavailable, restore-fault, ...)
    rank: int | None = None
    window: int | None = None
    group: str | None = None
    count: int = 1
    fired: int = 0

    @classmethod
    def _wire_aliases(cls) -> dict[str, str]:
        return {"id": "fault_id", "kind": "fault"}


@dataclass(frozen=True, kw_only=True)
class FaultInjected(FaultEvent):
    kind = EventKind.FAULT_INJECTED


@dataclass(frozen=True, kw_only=True)
class FaultFired(FaultEvent):
    kind = EventKind.FAULT_FIRED
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class FaultsCleared(Event):
    kind = EventKind.FAULTS_CLEARED
    count: int = 0


# -- ranks ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RankUnresponsive(Event):
    kind = EventKind.RANK_UNRESPONSIVE
    rank: int
    reason: str
    request: str | None = None


@dataclass(frozen=True, kw_only=True)
class RankRestarted(Event):
    kind = EventKind.RANK_RESTARTED
    rank: int
    pid: int = 0
    restarts: int = 1  # how many times this rank has been restarted since the engine started
    reason: str = ""


EVENT_TYPES: dict[EventKind, type[Event]] = {
    cls.kind: cls
    for cls in (
        EngineStarted,
        EngineStopped,
        SettingsChanged,
        RequestAdmitted,
        RequestFinished,
        RestoreStarted,
        WindowWaiting,
        WindowFetched,
        WindowInstalled,
        WindowReleased,
        RestoreFailed,
        RestoreCommitted,
        RestoreFailedClosed,
        RestoreRefused,
        RestoreAborted,
        StoreFailed,
        ObjectQuarantined,
        AbortRequested,
        MarkerSet,
        MarkerCleared,
        FaultInjected,
        FaultFired,
        FaultsCleared,
        RankUnresponsive,
        RankRestarted,
    )
}
assert set(EVENT_TYPES) == set(EventKind), "every EventKind has exactly one event class"

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
    aliases = cls._wire_aliases()
    return _from_fields(cls, {aliases.get(k, k): v for k, v in wire.items() if k != "type"})


# -- the one wire codec for these dataclasses --------------------------------------------------------------------
def _wire_value(value: Any) -> Any:
    if isinstance(value, Failure):
        return value.to_wire()
    if isinstance(value, (EventKind, FailureKind, Outcome, Stage, Component, CapacityCause)):
        return value.value
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _wire_value(v) for k, v in value.items()}
    return value


def _wire_fields(obj: Any) -> dict[str, Any]:
    return {f.name: _wire_value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


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


_ENUMS = (FailureKind, Stage, Outcome, Component, EventKind, CapacityCause)


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
    if hint is Failure:
        if not isinstance(value, Mapping):
            raise ValueError(f"field {name!r}: expected an object")
        return Failure.from_wire(value)
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
    "EVENT_TYPES",
    "PROGRESS",
    "AbortRequested",
    "EngineStarted",
    "EngineStopped",
    "Event",
    "Failure",
    "FaultEvent",
    "FaultFired",
    "FaultInjected",
    "FaultsCleared",
    "MarkerCleared",
    "MarkerSet",
    "ObjectQuarantined",
    "RankRestarted",
    "RankUnresponsive",
    "RequestAdmitted",
    "RequestFinished",
    "RestoreAborted",
    "RestoreCommitted",
    "RestoreEnded",
    "RestoreFailed",
    "RestoreFailedClosed",
    "RestoreRefused",
    "RestoreStarted",
    "SettingsChanged",
    "StoreFailed",
    "WindowFetched",
    "WindowInstalled",
    "WindowReleased",
    "WindowWaiting",
    "parse_event",
    "restore_ended",
]
