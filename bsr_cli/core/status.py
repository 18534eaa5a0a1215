"""What an engine says about itself, as types: its info, its health (ranks, tiers), each rank's pool, the
snapshot a monitor draws (`bsr top`, `bsr status`), its armed faults and its force-local markers.

The engine builds these, serializes each once (``to_wire``: the admin API's JSON, keys in the order
docs/openapi.json documents and the tests check) and the admin client reads them back (``from_wire``: tolerant of
fields a newer engine or a host adds). A host may add fields of its own (a vLLM worker adds ``serves_restores``,
``worker``, ``scheduler``, a marker's ``prefix_tokens``): the types that hosts extend keep them in ``host_fields``,
as they came, written after the standard ones. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from bsr_cli.core.evidence import Stage, TierCondition
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.markers import Marker


def _host_fields(d: dict[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    """The fields of a wire object that its type does not name, in their order (what a host added)."""
    return {k: v for k, v in d.items() if k not in known}


def _objects(v: Any) -> list[dict[str, Any]]:
    """The JSON objects of a wire list (anything else in it, which no engine sends, is passed over)."""
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


# -- the engine's info ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RegistrationSummary:
    """The registered KV layout, in short (``bsr engine registration`` shows it whole)."""

    identity: str
    model: str
    tensors: int
    bytes_per_chunk: int
    groups: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "identity": self.identity,
            "model": self.model,
            "tensors": self.tensors,
            "bytes_per_chunk": self.bytes_per_chunk,
            "groups": list(self.groups),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RegistrationSummary:
        return cls(
            identity=str(d.get("identity") or ""),
            model=str(d.get("model") or ""),
            tensors=int(d.get("tensors") or 0),
            bytes_per_chunk=int(d.get("bytes_per_chunk") or 0),
            groups=tuple(d.get("groups") or ()),
        )


_INFO_FIELDS = (
    "api",
    "version",
    "engine",
    "started_at",
    "ranks",
    "registration",
    "chunk_size",
    "tiers",
    "W",
    "rws_bytes",
    "pool_bytes",
    "budget_bytes",
    "max_tokens",
    "kv_tokens",
    "fetch_timeout_s",
    "faults_enabled",
    "fs_concurrency",
    "tokenizer",
)


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
    w: int  # the default window W, in chunks (0: the whole plan at once)
    rws_bytes: int | None  # the restore working set of one window of W chunks (None when W is 0)
    pool_bytes: int
    budget_bytes: int
    max_tokens: int
    kv_tokens: int
    fetch_timeout_s: float
    faults_enabled: bool
    fs_concurrency: int
    tokenizer: str | None
    host_fields: dict[str, Any] = field(default_factory=dict)  # what a host adds (a vLLM worker's limits)

    def to_wire(self) -> dict[str, Any]:
        return {
            "api": self.api,
            "version": self.version,
            "engine": self.engine,
            "started_at": self.started_at,
            "ranks": self.ranks,
            "registration": self.registration.to_wire(),
            "chunk_size": self.chunk_size,
            "tiers": list(self.tiers),
            "W": self.w,
            "rws_bytes": self.rws_bytes,
            "pool_bytes": self.pool_bytes,
            "budget_bytes": self.budget_bytes,
            "max_tokens": self.max_tokens,
            "kv_tokens": self.kv_tokens,
            "fetch_timeout_s": self.fetch_timeout_s,
            "faults_enabled": self.faults_enabled,
            "fs_concurrency": self.fs_concurrency,
            "tokenizer": self.tokenizer,
            **self.host_fields,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> EngineInfo:
        return cls(
            api=str(d.get("api") or ""),
            version=str(d.get("version") or ""),
            engine=d.get("engine"),
            started_at=float(d.get("started_at") or 0.0),
            ranks=int(d.get("ranks") or 0),
            registration=RegistrationSummary.from_wire(d.get("registration") or {}),
            chunk_size=int(d.get("chunk_size") or 0),
            tiers=tuple(d.get("tiers") or ()),
            w=int(d.get("W") or 0),
            rws_bytes=_opt_int(d.get("rws_bytes")),
            pool_bytes=int(d.get("pool_bytes") or 0),
            budget_bytes=int(d.get("budget_bytes") or 0),
            max_tokens=int(d.get("max_tokens") or 0),
            kv_tokens=int(d.get("kv_tokens") or 0),
            fetch_timeout_s=d.get("fetch_timeout_s") or 0,  # as sent: an integral timeout prints as one
            faults_enabled=bool(d.get("faults_enabled")),
            fs_concurrency=int(d.get("fs_concurrency") or 0),
            tokenizer=d.get("tokenizer"),
            host_fields=_host_fields(d, _INFO_FIELDS),
        )

    def with_host_fields(self, **fields: Any) -> EngineInfo:
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

    def to_wire(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "request": self.request,
            "at": self.at,
            "stage": self.stage.value if self.stage is not None else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankFault:
        stage = d.get("stage")
        return cls(
            reason=str(d.get("reason") or ""),
            request=d.get("request"),
            at=float(d.get("at") or 0.0),
            stage=Stage(stage) if stage else None,
        )


@dataclass(frozen=True)
class RankHealth:
    """One rank: healthy when its process runs, it beats, and no call of it is stuck past its deadline."""

    rank: int
    healthy: bool
    alive: bool
    heartbeat_age_s: float | None  # None: the rank does not beat (an in-process rank)
    reason: str | None  # why it is unhealthy (None when it is not)
    last_fault: RankFault | None

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "healthy": self.healthy,
            "alive": self.alive,
            "heartbeat_age_s": self.heartbeat_age_s,
            "reason": self.reason,
            "last_fault": self.last_fault.to_wire() if self.last_fault is not None else None,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankHealth:
        last = d.get("last_fault")
        return cls(
            rank=int(d.get("rank") or 0),
            healthy=bool(d.get("healthy", True)),
            alive=bool(d.get("alive", True)),
            heartbeat_age_s=_opt_float(d.get("heartbeat_age_s")),
            reason=d.get("reason"),
            last_fault=RankFault.from_wire(last) if isinstance(last, dict) else None,
        )


@dataclass(frozen=True)
class QuarantinedFile:
    """A stored object a tier moved aside after its bytes failed their checksum."""

    key: str
    file: str  # where it lies now, under the tier's quarantine directory
    reason: str
    at: float  # when it was moved aside (Unix time)
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "file": self.file, "reason": self.reason, "at": self.at, "bytes": self.bytes}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> QuarantinedFile:
        return cls(
            key=str(d.get("key") or ""),
            file=str(d.get("file") or ""),
            reason=str(d.get("reason") or ""),
            at=float(d.get("at") or 0.0),
            bytes=int(d.get("bytes") or 0),
        )


@dataclass(frozen=True)
class RankTierStatus:
    """One tier as one rank sees it (a pool entry's ``tiers`` when asked for health)."""

    ok: bool
    detail: str
    condition: TierCondition = TierCondition.OK
    quarantined: tuple[QuarantinedFile, ...] = ()  # the newest objects it moved aside
    quarantined_total: int = 0  # how many lie in its quarantine directory

    def to_wire(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "detail": self.detail,
            "condition": self.condition.value,
            "quarantined": [q.to_wire() for q in self.quarantined],
            "quarantined_total": self.quarantined_total,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankTierStatus:
        ok = bool(d.get("ok"))
        cond = d.get("condition") or (TierCondition.OK if ok else TierCondition.UNAVAILABLE)
        return cls(
            ok=ok,
            detail=str(d.get("detail") or ""),
            condition=TierCondition(cond),
            quarantined=tuple(QuarantinedFile.from_wire(q) for q in d.get("quarantined") or ()),
            quarantined_total=int(d.get("quarantined_total") or 0),
        )


@dataclass(frozen=True)
class TierHealth:
    """One tier across the engine: what each rank sees of it joined with what the coordinator knows (armed faults,
    recent real failures). ``condition`` is the first reason it is unhealthy (``ok`` when none)."""

    ok: bool
    detail: tuple[str, ...]  # one line per reason, each naming who saw it
    conditions: tuple[TierCondition, ...]  # every reason it is unhealthy
    quarantined: tuple[QuarantinedFile, ...]  # newest first
    quarantined_total: int
    condition: TierCondition

    def to_wire(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "detail": list(self.detail),
            "conditions": [c.value for c in self.conditions],
            "quarantined": [q.to_wire() for q in self.quarantined],
            "quarantined_total": self.quarantined_total,
            "condition": self.condition.value,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> TierHealth:
        conditions = tuple(TierCondition(c) for c in d.get("conditions") or ())
        return cls(
            ok=bool(d.get("ok", False)),
            detail=tuple(str(x) for x in d.get("detail") or ()),
            conditions=conditions,
            quarantined=tuple(QuarantinedFile.from_wire(q) for q in d.get("quarantined") or ()),
            quarantined_total=int(d.get("quarantined_total") or 0),
            condition=TierCondition(d.get("condition") or (conditions[0] if conditions else TierCondition.OK)),
        )


def tiers_to_wire(tiers: dict[str, TierHealth]) -> dict[str, Any]:
    return {name: t.to_wire() for name, t in tiers.items()}


def tiers_from_wire(d: Any) -> dict[str, TierHealth]:
    tiers = d if isinstance(d, dict) else {}
    return {str(name): TierHealth.from_wire(t) for name, t in tiers.items() if isinstance(t, dict)}


@dataclass(frozen=True)
class Health:
    """What ``GET /health`` answers: ``ok`` when every rank is healthy (the engine can serve); the degraded tiers
    are those that are not (the engine still serves, from a lower tier or by recomputing)."""

    ranks: tuple[RankHealth, ...]
    tiers: dict[str, TierHealth]
    api: str | None = None  # the admin API version; the server adds it (the coordinator's own answer has none)

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
    def degraded_tiers(self) -> list[str]:
        return sorted(name for name, t in self.tiers.items() if not t.ok)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": self.ok,
            "ranks_alive": self.ranks_alive,
            "ranks": [r.to_wire() for r in self.ranks],
            "unhealthy_ranks": self.unhealthy_ranks,
            "tiers": tiers_to_wire(self.tiers),
            "degraded_tiers": self.degraded_tiers,
        }
        if self.api is not None:
            out["api"] = self.api
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Health:
        return cls(
            ranks=tuple(RankHealth.from_wire(r) for r in d.get("ranks") or ()),
            tiers=tiers_from_wire(d.get("tiers")),
            api=d.get("api"),
        )


# -- pool ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolEntry:
    """One rank's entry of ``GET /pool`` (and of a snapshot's ``ranks``): its health and, when it answered, its
    restore pool (live, peak, capacity, budget bytes, windows in flight...) and, asked for health, its tiers."""

    rank: int
    alive: bool
    healthy: bool
    reason: str | None
    heartbeat_age_s: float | None
    last_fault: RankFault | None
    pool: dict[str, int] | None = None  # None: the rank was not asked (silent) or did not answer
    tiers: dict[str, RankTierStatus] | None = None  # only when asked for health
    tp_rank: int | None = None  # a vLLM worker's real TP rank (its coordinator calls it rank 0)
    error: str | None = None  # why the rank did not answer
    restore_bps: float = 0.0  # bytes released per second over the last 5 s

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
        pool: dict[str, int] = dict(self.pool)
        pool["draining"] = pool["live_bytes"] > pool["budget_bytes"]
        return replace(self, pool=pool)

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank,
            "alive": self.alive,
            "healthy": self.healthy,
            "reason": self.reason,
            "heartbeat_age_s": self.heartbeat_age_s,
            "last_fault": self.last_fault.to_wire() if self.last_fault is not None else None,
        }
        if self.pool is not None:
            out["pool"] = dict(self.pool)
        if self.tiers is not None:
            out["tiers"] = {name: t.to_wire() for name, t in self.tiers.items()}
        if self.tp_rank is not None:
            out["tp_rank"] = self.tp_rank
        if self.error is not None:
            out["error"] = self.error
        out["restore_bps"] = self.restore_bps
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PoolEntry:
        last, pool, tiers = d.get("last_fault"), d.get("pool"), d.get("tiers")
        return cls(
            rank=int(d.get("rank") or 0),
            alive=bool(d.get("alive", False)),  # a rank whose entry does not say is not known to run
            healthy=bool(d.get("healthy", True)),
            reason=d.get("reason"),
            heartbeat_age_s=_opt_float(d.get("heartbeat_age_s")),
            last_fault=RankFault.from_wire(last) if isinstance(last, dict) else None,
            pool=dict(pool) if isinstance(pool, dict) else None,
            tiers={k: RankTierStatus.from_wire(v) for k, v in tiers.items()} if isinstance(tiers, dict) else None,
            tp_rank=_opt_int(d.get("tp_rank")),
            error=d.get("error"),
            restore_bps=d.get("restore_bps") or 0.0,
        )


# -- what a monitor draws ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActiveRestore:
    """A restore running now, as a monitor draws it: per rank, the windows it released and their bytes."""

    request: str
    w: int
    windows: int
    tokens: int
    tiers: tuple[str, ...]
    started: float  # Unix time
    done: dict[int, int]  # per rank, windows released
    bytes: dict[int, int]  # per rank, bytes released

    def to_wire(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "W": self.w,
            "windows": self.windows,
            "tokens": self.tokens,
            "tiers": list(self.tiers),
            "started": self.started,
            "done": {str(k): v for k, v in self.done.items()},
            "bytes": {str(k): v for k, v in self.bytes.items()},
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ActiveRestore:
        return cls(
            request=str(d.get("request") or ""),
            w=int(d.get("W") or 0),
            windows=int(d.get("windows") or 0),
            tokens=int(d.get("tokens") or 0),
            tiers=tuple(d.get("tiers") or ()),
            started=float(d.get("started") or 0.0),
            done={int(k): int(v) for k, v in (d.get("done") or {}).items()},
            bytes={int(k): int(v) for k, v in (d.get("bytes") or {}).items()},
        )


@dataclass(frozen=True)
class BlockWait:
    """A request in the queue for destination blocks."""

    request: str
    tokens: int
    blocks: dict[str, int]  # per KV group, what it needs
    since: float  # Unix time
    waited_s: float

    def to_wire(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "tokens": self.tokens,
            "blocks": dict(self.blocks),
            "since": self.since,
            "waited_s": self.waited_s,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> BlockWait:
        return cls(
            request=str(d.get("request") or ""),
            tokens=int(d.get("tokens") or 0),
            blocks={str(k): int(v) for k, v in (d.get("blocks") or {}).items()},
            since=float(d.get("since") or 0.0),
            waited_s=d.get("waited_s") or 0.0,
        )


@dataclass(frozen=True)
class Admission:
    """The admission budget B and who waits on it, summed over the ranks, and the queue for destination blocks."""

    budget_bytes: int
    live_bytes: int
    queued: int  # windows waiting for budget
    waiting_for_blocks: int = 0
    kv_wait_s: float = 0.0  # how long a request waits for destination blocks before it is refused
    blocks_waiting: tuple[BlockWait, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "live_bytes": self.live_bytes,
            "queued": self.queued,
            "waiting_for_blocks": self.waiting_for_blocks,
            "kv_wait_s": self.kv_wait_s,
            "blocks_waiting": [b.to_wire() for b in self.blocks_waiting],
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Admission:
        return cls(
            budget_bytes=int(d.get("budget_bytes") or 0),
            live_bytes=int(d.get("live_bytes") or 0),
            queued=int(d.get("queued") or 0),
            waiting_for_blocks=int(d.get("waiting_for_blocks") or 0),
            kv_wait_s=d.get("kv_wait_s") or 0.0,
            blocks_waiting=tuple(BlockWait.from_wire(b) for b in d.get("blocks_waiting") or ()),
        )


_MARKER_FIELDS = ("prompt", "excluded_tiers", "reason", "request", "set_at")


@dataclass(frozen=True)
class MarkerView:
    """A standing force-local marker as an engine lists it: the next admission of ``prompt`` skips
    ``excluded_tiers`` (every tier: it computes locally)."""

    prompt: str
    excluded_tiers: tuple[str, ...]
    reason: str
    request: str  # the request whose restore failed
    set_at: float  # Unix time
    host_fields: dict[str, Any] = field(default_factory=dict)  # what a host adds (vLLM's prefix_tokens, ...)

    def to_wire(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "excluded_tiers": list(self.excluded_tiers),
            "reason": self.reason,
            "request": self.request,
            "set_at": self.set_at,
            **self.host_fields,
        }

    @classmethod
    def of(cls, marker: Marker) -> MarkerView:
        return cls(
            prompt=marker.prompt,
            excluded_tiers=tuple(sorted(marker.excluded)),
            reason=marker.reason,
            request=marker.request,
            set_at=marker.set_at,
        )

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> MarkerView:
        return cls(
            prompt=str(d.get("prompt") or ""),
            excluded_tiers=tuple(d.get("excluded_tiers") or ()),
            reason=str(d.get("reason") or ""),
            request=str(d.get("request") or ""),
            set_at=float(d.get("set_at") or 0.0),
            host_fields=_host_fields(d, _MARKER_FIELDS),
        )


@dataclass(frozen=True)
class MarkerList:
    """What ``GET /markers`` answers (and `bsr markers list --json` prints): the standing force-local markers."""

    markers: tuple[MarkerView, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"markers": [m.to_wire() for m in self.markers]}


@dataclass(frozen=True)
class FaultListing:
    """What ``GET /faults`` answers: whether the engine allows faults, and the armed ones."""

    enabled: bool
    faults: tuple[FaultSpec, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "faults": [f.to_dict() for f in self.faults]}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> FaultListing:
        return cls(enabled=bool(d.get("enabled")), faults=tuple(fault_from_wire(f) for f in _objects(d.get("faults"))))


def fault_from_wire(d: dict[str, Any]) -> FaultSpec:
    """An armed fault as an engine lists it (fields it adds are ignored)."""
    return FaultSpec(
        kind=str(d.get("kind") or ""),
        rank=_opt_int(d.get("rank")),
        window=_opt_int(d.get("window")),
        group=d.get("group"),
        count=int(d.get("count", 1)),
        id=int(d.get("id") or 0),
        fired=int(d.get("fired") or 0),
        expires_at=_opt_float(d.get("expires_at")),
    )


_SNAPSHOT_FIELDS = (
    "time",
    "info",
    "ranks",
    "active",
    "recent",
    "admission",
    "tiers",
    "events",
    "seq",
    "markers",
    "faults",
)


@dataclass(frozen=True)
class Snapshot:
    """Everything a monitor draws at once (``GET /snapshot``, what `bsr top` polls): the engine's info, each
    rank's pool and health, the running and the recent restores, admission, tier health, the events since the
    poller's cursor, the markers and the armed faults."""

    time: float
    info: EngineInfo
    ranks: tuple[PoolEntry, ...]
    active: tuple[ActiveRestore, ...]
    # The recent restores, newest first, as the engine records them (their wire form: a restore's own type is
    # the restore results').
    recent: list[dict[str, Any]]
    admission: Admission
    tiers: dict[str, TierHealth]
    events: list[dict[str, Any]]  # the events' wire form (bsr_cli.core.events.parse_event reads one)
    seq: int  # the last event's sequence number: the next poll's cursor
    markers: tuple[MarkerView, ...] = ()
    faults: tuple[FaultSpec, ...] = ()
    host_fields: dict[str, Any] = field(default_factory=dict)  # what a host adds (a vLLM worker's scheduler)

    def to_wire(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "info": self.info.to_wire(),
            "ranks": [r.to_wire() for r in self.ranks],
            "active": [a.to_wire() for a in self.active],
            "recent": list(self.recent),
            "admission": self.admission.to_wire(),
            "tiers": tiers_to_wire(self.tiers),
            "events": list(self.events),
            "seq": self.seq,
            "markers": [m.to_wire() for m in self.markers],
            "faults": [f.to_dict() for f in self.faults],
            **self.host_fields,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Snapshot:
        return cls(
            time=float(d.get("time") or 0.0),
            info=EngineInfo.from_wire(d.get("info") or {}),
            ranks=tuple(PoolEntry.from_wire(r) for r in _objects(d.get("ranks"))),
            active=tuple(ActiveRestore.from_wire(a) for a in _objects(d.get("active"))),
            recent=_objects(d.get("recent")),
            admission=Admission.from_wire(d.get("admission") or {}),
            tiers=tiers_from_wire(d.get("tiers")),
            events=_objects(d.get("events")),
            seq=int(d.get("seq") or 0),
            markers=tuple(MarkerView.from_wire(m) for m in _objects(d.get("markers"))),
            faults=tuple(fault_from_wire(f) for f in _objects(d.get("faults"))),
            host_fields=_host_fields(d, _SNAPSHOT_FIELDS),
        )


@dataclass(frozen=True)
class EngineStatus:
    """What `bsr status` reports of one engine: where it is, its health, and its snapshot."""

    url: str
    health: Health
    snapshot: Snapshot

    def to_wire(self) -> dict[str, Any]:
        return {"url": self.url, "health": self.health.to_wire(), **self.snapshot.to_wire()}


__all__ = [
    "ActiveRestore",
    "Admission",
    "BlockWait",
    "EngineInfo",
    "EngineStatus",
    "FaultListing",
    "Health",
    "MarkerList",
    "MarkerView",
    "PoolEntry",
    "QuarantinedFile",
    "RankFault",
    "RankHealth",
    "RankTierStatus",
    "RegistrationSummary",
    "Snapshot",
    "TierHealth",
    "fault_from_wire",
    "tiers_from_wire",
    "tiers_to_wire",
]
