"""What an engine says about itself, as types: its info, its health (ranks, tiers), each rank's pool, the
snapshot a monitor draws (`bsr top`, `bsr status`), its armed faults and its force-local markers.

The engine builds these, serializes each once (``to_wire``: the admin API's JSON, keys in the order
docs/openapi.json documents and the tests check) and the admin client reads them back (``from_wire``: tolerant of
fields a newer engine or a host adds). A host may add fields of its own (a vLLM worker adds ``serves_restores``,
``worker``, ``scheduler``, a marker's ``prefix_tokens``): the types that hosts extend keep them in ``host_fields``,
as they came, written after the standard ones. Each type's wire form is the one codec's (``bsr_cli.core.wire``);
those whose JSON carries computed keys, or whose reader derives one field from another, say so. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bsr_cli.core import wire
from bsr_cli.core.events import Event
from bsr_cli.core.evidence import FailureKind, Outcome, RankState, Stage, TierCondition
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.markers import Marker
from bsr_cli.core.scrub import QuarantinedFile, ScrubProgress
from bsr_cli.core.store_loss import SegmentLoss


# -- the engine's info ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegistrationSummary:
    """The registered KV layout, in short (``bsr engine registration`` shows it whole)."""

    identity: str
    model: str
    tensors: int
    bytes_per_chunk: int
    groups: tuple[str, ...]

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineInfo:
    """What ``GET /info`` answers: the engine's identity, layout and settings now."""

    api: str
    version: str
    engine: str | None  # its name, when it was given one
    started_at: float
    ranks: int
    registration: RegistrationSummary
    chunk_size: int
    tiers: tuple[str, ...]
    w: int = field(metadata=wire.meta(name="W"))  # the default window W, in chunks (0: the whole plan at once)
    rws_bytes: int | None  # the restore working set of one window of W chunks (None when W is 0)
    pool_bytes: int
    budget_bytes: int
    max_tokens: int
    kv_tokens: int
    fetch_timeout_s: float = field(metadata=wire.meta(absent=0))  # as sent: an integral timeout prints as one
    faults_enabled: bool
    fs_concurrency: int
    tokenizer: str | None
    # The longest a rank's deadline stretches while the host starves it (None: a host that does not judge so).
    overload_ceiling_s: float | None = wire.field(default=None, omit_none=True)
    # What a host adds (a vLLM worker's limits).
    host_fields: wire.JsonObject = wire.field(extra=True)

    to_wire = wire.writer()
    from_wire = wire.reader()

    def with_host_fields(self, **fields: wire.JsonValue) -> EngineInfo:
        """This info with fields a host adds (after the standard ones, in the order given)."""
        return replace(self, host_fields={**self.host_fields, **fields})


# -- health --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankFault:
    """A rank's last fault: it stopped answering (``stage`` None), or it failed at its own stage."""

    reason: str
    request: str | None
    at: float  # when (Unix time)
    stage: Stage | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()


def _state_of(d: Mapping[str, Any]) -> RankState:
    """An older engine's rank names no state: live when healthy, else hung (dead when it does not run)."""
    if d.get("healthy", True):
        return RankState.LIVE
    return RankState.HUNG if d.get("alive", True) else RankState.DEAD


@dataclass(frozen=True)
class RankHealth:
    """One rank: healthy when its process runs, it beats, and no call of it is stuck past its deadline through its
    own fault. A rank the host starves stays healthy, in state ``starved`` (its deadlines stretch)."""

    rank: int
    healthy: bool = field(metadata=wire.meta(absent=True))
    alive: bool = field(metadata=wire.meta(absent=True))
    heartbeat_age_s: float | None  # None: the rank does not beat (an in-process rank)
    reason: str | None  # why it is unhealthy, or starved (None when it is neither)
    last_fault: RankFault | None
    # What the coordinator's judge says of it (runtime/judge.py): live, starved, stopped, hung, dead, unknown.
    state: RankState = wire.field(default=RankState.LIVE, absent_from=_state_of)

    to_wire = wire.writer()
    from_wire = wire.reader()


def _ok_or_unavailable(d: Mapping[str, Any]) -> TierCondition:
    return TierCondition.OK if d.get("ok") else TierCondition.UNAVAILABLE


def _first_condition(d: Mapping[str, Any]) -> TierCondition:
    conditions = d.get("conditions")
    return TierCondition(conditions[0]) if isinstance(conditions, list) and conditions else TierCondition.OK


@dataclass(frozen=True)
class RankTierStatus:
    """One tier as one rank sees it (a pool entry's ``tiers`` when asked for health)."""

    ok: bool
    detail: str
    # A rank whose answer names no condition (an older one) is ok or unavailable, as its ``ok`` says.
    condition: TierCondition = wire.field(default=TierCondition.OK, absent_from=_ok_or_unavailable)
    quarantined: tuple[QuarantinedFile, ...] = ()  # the newest objects it moved aside
    quarantined_total: int = 0  # how many lie in its quarantine directory
    scrubs: tuple[ScrubProgress, ...] = wire.field(default=(), omit_empty=True)  # running, then the last ended

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class TierHealth:
    """One tier across the engine: what each rank sees of it joined with what the coordinator knows (recent
    failures, armed faults). ``condition`` is the first reason it is unhealthy (``ok`` when none); ``injected``: an
    injected fault caused every one of them (a drill's failure); ``faults_armed``: faults armed against it, shown
    but never a reason it is unhealthy (arming alone changes no health)."""

    ok: bool
    detail: tuple[str, ...]  # one line per reason, each naming who saw it
    conditions: tuple[TierCondition, ...]  # every reason it is unhealthy
    quarantined: tuple[QuarantinedFile, ...]  # newest first
    quarantined_total: int
    # A tier whose answer names no condition (an older engine's) is in the first of its conditions (ok: none).
    condition: TierCondition = field(metadata=wire.meta(absent_from=_first_condition))
    # When the restore from it that failed (``restore_failed``) failed: evidence is dated, so a later restore's
    # can be told apart from it. Absent without such a failure.
    failed_at: float | None = wire.field(default=None, omit_none=True)
    injected: bool = wire.field(default=False, omit_false=True)
    faults_armed: tuple[str, ...] = wire.field(default=(), omit_empty=True)
    # The segments the store lost that keep it unhealthy (segment_lost): oldest first; absent when none.
    lost_segments: tuple[SegmentLoss, ...] = wire.field(omit_empty=True, default=())
    scrubs: tuple[ScrubProgress, ...] = wire.field(default=(), omit_empty=True)  # every rank's, running first

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Health:
    """What ``GET /health`` answers: ``ok`` when every rank is healthy (the engine can serve); the degraded tiers
    are those that are not (the engine still serves, from a lower tier or by recomputing)."""

    ranks: tuple[RankHealth, ...]
    tiers: dict[str, TierHealth]
    # the admin API version; the server adds it
    api: str | None = wire.field(default=None, omit_none=True)

    @property
    def ok(self) -> bool:
        return all(r.healthy for r in self.ranks)

    @property
    def ranks_alive(self) -> list[bool]:
        return [r.alive for r in self.ranks]

    @property
    def unhealthy_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if not r.healthy]

    @property
    def starved_ranks(self) -> list[int]:
        """Ranks the host keeps from running (healthy: the host's doing, not theirs)."""
        return [r.rank for r in self.ranks if r.state is RankState.STARVED]

    @property
    def degraded_tiers(self) -> list[str]:
        return sorted(name for name, t in self.tiers.items() if not t.ok)

    # The fields with what they imply beside them, in the order docs/openapi.json documents.
    to_wire = wire.writer(
        order=("ok", "ranks_alive", "ranks", "unhealthy_ranks", "starved_ranks", "tiers", "degraded_tiers", "api")
    )
    from_wire = wire.reader()


# -- pool ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolEntry:
    """One rank's entry of ``GET /pool`` (and of a snapshot's ``ranks``): its health and, when it answered, its
    restore pool (live, peak, capacity, budget bytes, windows in flight, whether it drains...) and, asked for
    health, its tiers."""

    rank: int
    alive: bool = field(metadata=wire.meta(absent=False))  # a rank whose entry does not say is not known to run
    healthy: bool = field(metadata=wire.meta(absent=True))
    reason: str | None
    heartbeat_age_s: float | None
    last_fault: RankFault | None
    # None: the rank was not asked (silent) or did not answer. Byte counts, and ``draining`` (``with_draining``).
    pool: dict[str, int | bool] | None = wire.field(default=None, omit_none=True)
    # Only when asked for health.
    tiers: dict[str, RankTierStatus] | None = wire.field(default=None, omit_none=True)
    # A vLLM worker's real TP rank (its coordinator calls it rank 0).
    tp_rank: int | None = wire.field(default=None, omit_none=True)
    error: str | None = wire.field(default=None, omit_none=True)  # why the rank did not answer
    restore_bps: float = 0.0  # bytes released per second over the last 5 s
    state: RankState = wire.field(default=RankState.LIVE, absent_from=_state_of)  # as RankHealth's

    to_wire = wire.writer()
    from_wire = wire.reader()

    @property
    def live_bytes(self) -> int:
        return int((self.pool or {}).get("live_bytes", 0))

    @property
    def waiters(self) -> int:
        return int((self.pool or {}).get("waiters", 0))

    def with_draining(self) -> PoolEntry:
        """The pool marked ``draining`` while its live bytes are above B: after a budget cut, windows already in
        flight finish (new ones are admitted only within the new B at once), and the pool says so until live ≤ B."""
        if self.pool is None or "live_bytes" not in self.pool or "budget_bytes" not in self.pool:
            return self
        pool = dict(self.pool)
        pool["draining"] = pool["live_bytes"] > pool["budget_bytes"]
        return replace(self, pool=pool)


@dataclass(frozen=True)
class PoolListing:
    """What ``GET /pool`` answers: every rank's entry."""

    ranks: tuple[PoolEntry, ...]

    to_wire = wire.writer()
    from_wire = wire.reader()


# -- what a monitor draws ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActiveRestore:
    """A restore running now, as a monitor draws it: per rank, the windows it released and their bytes."""

    request: str
    w: int = field(metadata=wire.meta(name="W"))
    windows: int
    tokens: int
    tiers: tuple[str, ...]
    started: float  # Unix time
    done: dict[int, int]  # per rank, windows released
    bytes: dict[int, int]  # per rank, bytes released

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class BlockWait:
    """A request in the queue for destination blocks."""

    request: str
    tokens: int
    blocks: dict[str, int]  # per KV group, what it needs
    since: float  # Unix time
    waited_s: float

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Admission:
    """The admission budget B and who waits on it, summed over the ranks, and the queue for destination blocks."""

    budget_bytes: int
    live_bytes: int
    queued: int  # windows waiting for budget
    waiting_for_blocks: int = 0
    kv_wait_s: float = 0.0  # how long a request waits for destination blocks before it is refused
    blocks_waiting: tuple[BlockWait, ...] = ()

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class MarkerView:
    """A standing force-local marker as an engine lists it: the next admission of ``prompt`` skips
    ``excluded_tiers`` (every tier: it computes locally)."""

    prompt: str
    excluded_tiers: tuple[str, ...]
    reason: str
    request: str  # the request whose restore failed
    set_at: float  # Unix time
    # what a host adds (vLLM's prefix_tokens, ...)
    host_fields: wire.JsonObject = wire.field(extra=True)

    to_wire = wire.writer()
    from_wire = wire.reader()

    @classmethod
    def of(cls, marker: Marker) -> MarkerView:
        return cls(
            prompt=marker.prompt,
            excluded_tiers=tuple(sorted(marker.excluded)),
            reason=marker.reason,
            request=marker.request,
            set_at=marker.set_at,
        )


@dataclass(frozen=True)
class MarkerList:
    """What ``GET /markers`` answers (and `bsr markers list --json` prints): the standing force-local markers."""

    markers: tuple[MarkerView, ...]

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class FaultListing:
    """What ``GET /faults`` answers: whether the engine allows faults, and the armed ones."""

    enabled: bool
    faults: tuple[FaultSpec, ...]

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class RecentRestore:
    """One ended restore among the snapshot's recent ones: what it restored, how it ended and why. A host that runs
    restores itself (a vLLM worker's loads) writes its own entries, with keys of its own (``host_fields``) in an
    order of its own; such an entry keeps the keys it came with, in their order, so it is written back as it came."""

    request: str
    outcome: Outcome | None  # None only in an entry that came without one (a writer of its own may leave it out)
    tokens: int = 0
    w: int = wire.field(name="W", default=0)
    tiers: tuple[str, ...] = ()
    seconds: float = 0.0
    finished: float = 0.0
    reason: str = ""
    failure_kind: FailureKind | None = None
    failure_stage: Stage | None = None
    host_fields: wire.JsonObject = wire.field(extra=True)
    # The keys of the JSON object it was read from, in their order (None: built here, written in field order).
    sent_keys: tuple[str, ...] | None = wire.field(skip=True, default=None)

    def to_wire(self) -> wire.JsonObject:
        # Hand-written: which keys an entry read from a host carries, and their order, are not a function of the
        # fields (a vLLM worker leaves out failure_stage and puts its own keys between the standard ones).
        written = wire.write(self)
        if self.sent_keys is None:
            return written
        return {key: written[key] for key in self.sent_keys if key in written}

    @classmethod
    def wire_schema(cls, s: wire.Schemas) -> wire.JsonSchema:
        """Its fields' schema with every key optional (an entry a host wrote keeps the keys it came with), and an
        outcome, failure kind or stage this bsr does not know kept as sent (any string)."""
        written = s.written(cls)
        properties = dict(written["properties"])
        for key in _RECENT_ENUMS:
            properties[key] = wire.any_of([properties[key], {"type": "string"}])
        return wire.object_schema(properties, (), written["additionalProperties"])

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> RecentRestore:
        # A value a newer engine has and this bsr does not know (an outcome, a failure kind or stage) reads as
        # unknown (None) and is kept as sent, so the snapshot still reads and is written back whole.
        unknown = {
            k: d[k] for k, kind in _RECENT_ENUMS.items() if d.get(k) is not None and not _known_value(d[k], kind)
        }
        known = wire.read(cls, {k: v for k, v in d.items() if k not in unknown})
        return replace(known, host_fields={**known.host_fields, **unknown}, sent_keys=tuple(d))


def _known_value(value: wire.JsonValue, kind: frozenset[str]) -> bool:
    return value is None or (isinstance(value, str) and value in kind)


_RECENT_ENUMS: dict[str, frozenset[str]] = {
    "outcome": frozenset(o.value for o in Outcome),
    "failure_kind": frozenset(k.value for k in FailureKind),
    "failure_stage": frozenset(s.value for s in Stage),
}


@dataclass(frozen=True)
class Snapshot:
    """Everything a monitor draws at once (``GET /snapshot``, what `bsr top` polls): the engine's info, each
    rank's pool and health, the running and the recent restores, admission, tier health, the events since the
    poller's cursor, the markers and the armed faults."""

    time: float
    info: EngineInfo
    ranks: tuple[PoolEntry, ...]
    active: tuple[ActiveRestore, ...]
    recent: tuple[RecentRestore, ...]  # newest first
    admission: Admission
    tiers: dict[str, TierHealth]
    # The events as the engine sent them, kept as JSON objects (bsr_cli.core.events.known_event types one): a kind
    # a newer engine adds, or an event of an older recording, has no type here, yet `bsr top` shows it and
    # `bsr status --json` writes it back whole.
    events: list[wire.JsonObject] = field(metadata=wire.meta(shape=list[Event]))
    seq: int  # the last event's sequence number: the next poll's cursor
    markers: tuple[MarkerView, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    # what a host adds (a vLLM worker's scheduler)
    host_fields: wire.JsonObject = wire.field(extra=True)

    to_wire = wire.writer()
    from_wire = wire.reader()


def event_seq(event: Mapping[str, wire.JsonValue], default: int = 0) -> int:
    """The sequence number of an event as the engine sent it (``default`` when it carries none)."""
    seq = event.get("seq", default)
    return int(seq) if isinstance(seq, int | float | str) else default


@dataclass(frozen=True)
class EventPage:
    """One ``GET /events`` answer: its events as the engine sent them (kept as JSON objects: a newer engine's
    kinds are printed and exported whole, and ``known_event`` types those this bsr knows), the engine's last
    sequence number, whether it keeps its events in a durable store, and how many it holds from which sequence
    number on (None from an engine that does not say)."""

    events: list[wire.JsonObject] = field(metadata=wire.meta(shape=list[Event]))
    last_seq: int = 0
    durable: bool = False
    held: int | None = None
    oldest_seq: int | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineStatus:
    """What `bsr status` reports of one engine: where it is, its health, and its snapshot (its keys beside the
    url's and the health's, not nested)."""

    url: str
    health: Health
    snapshot: Snapshot = field(metadata=wire.meta(flatten=True))

    to_wire = wire.writer()


__all__ = [
    "ActiveRestore",
    "Admission",
    "BlockWait",
    "EngineInfo",
    "EngineStatus",
    "EventPage",
    "FaultListing",
    "Health",
    "MarkerList",
    "MarkerView",
    "PoolEntry",
    "PoolListing",
    "QuarantinedFile",
    "RankFault",
    "RankHealth",
    "RankTierStatus",
    "RecentRestore",
    "RegistrationSummary",
    "Snapshot",
    "TierHealth",
    "event_seq",
]
