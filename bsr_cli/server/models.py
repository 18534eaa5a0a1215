"""The admin API's wire types: pydantic request bodies (strict, ``extra="forbid"``: an unknown field or a value of
the wrong JSON type is a 400) and typed response bodies (``extra="allow"``: the API only ever adds fields).

Request models check what a schema can say; what depends on the engine (its tiers, its prompt limit, the settings'
joint bounds) is checked by the routes, with the same one-line errors as the CLI's. The response models document
what the routes answer (docs/openapi.json is generated from them); the routes answer the runtime's dicts as they
are, and a test validates live answers against the document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from bsr_cli.core import faults, scrub

Tier = Literal["mooncake", "fs"]


def _json_integer(value: Any) -> Any:
    """A JSON integer as JSON Schema defines it: ``3`` or ``3.0``, never ``3.5``, ``"3"`` or ``true``. (What
    the document calls an integer must be accepted as one; pydantic's strict int would refuse ``3.0``.)"""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value  # anything else goes on to the strict int check, which names what is wrong


# Every integer of a request body: strict (no strings, no booleans, no fractions), integral floats included. The
# validator comes after the bounds in each Annotated, or pydantic leaves the bounds out of the JSON schema.
_INTEGRAL = BeforeValidator(_json_integer)
JsonInt = Annotated[StrictInt, _INTEGRAL]
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 32) - 1), _INTEGRAL]
# Bounds that hold on every engine; an engine's own document (GET /openapi.json) narrows them to its ranks, KV
# groups, longest prompt and pool.
MAX_RANK = 1023
MAX_WINDOW = (1 << 20) - 1
MAX_W = MAX_WINDOW + 1  # chunks in one window: never more than the windows of any prompt at W=1
# W, in chunks (0: the whole plan at once); an engine refuses more than the chunks of its longest prompt.
WindowChunks = Annotated[
    StrictInt, Field(ge=0, le=MAX_W, description="chunks per window (0: the whole plan at once)"), _INTEGRAL
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Synthetic(_Request):
    n: Annotated[StrictInt, Field(ge=1), _INTEGRAL]
    seed: JsonInt = 0


# Exactly one of the two prompt forms, said in the schema too (so a schema-valid body is never refused for it).
_ONE_PROMPT: dict[str, Any] = {"oneOf": [{"required": ["tokens"]}, {"required": ["synthetic"]}]}


# A prompt: exactly one of ``tokens`` or ``synthetic``. Neither is nullable: a field is given with a value or left
# out. Each body that carries a prompt declares the two fields itself and checks them with `_exactly_one_prompt`.
_PROMPT_CONFIG = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_PROMPT)
PromptTokens = Annotated[list[TokenId], Field(min_length=1)]


def _exactly_one_prompt(body: _P) -> _P:
    if (body.tokens is None) == (body.synthetic is None):
        raise ValueError("give exactly one of 'tokens' or 'synthetic'")
    return body


class ProbeBody(_Request):
    model_config = _PROMPT_CONFIG
    tokens: PromptTokens = None  # type: ignore[assignment]
    synthetic: Synthetic = None  # type: ignore[assignment]
    exclude_tiers: list[Tier] | None = None

    _one_prompt = model_validator(mode="after")(_exactly_one_prompt)


class SubmitBody(_Request):
    model_config = _PROMPT_CONFIG
    tokens: PromptTokens = None  # type: ignore[assignment]
    synthetic: Synthetic = None  # type: ignore[assignment]
    W: WindowChunks | None = None
    verify: StrictBool = True
    store: StrictBool = True
    stream: StrictBool = False

    _one_prompt = model_validator(mode="after")(_exactly_one_prompt)


class RestoreBody(_Request):
    model_config = _PROMPT_CONFIG
    tokens: PromptTokens = None  # type: ignore[assignment]
    synthetic: Synthetic = None  # type: ignore[assignment]
    W: WindowChunks | None = None
    verify: StrictBool = True
    exclude_tiers: list[Tier] | None = None
    stream: StrictBool = True

    _one_prompt = model_validator(mode="after")(_exactly_one_prompt)


# Exactly one of a prompt's two forms or every object, said in the schema too.
_ONE_SCOPE: dict[str, Any] = {
    "oneOf": [*_ONE_PROMPT["oneOf"], {"required": ["all"], "properties": {"all": {"const": True}}}]
}


class ScrubBody(_Request):
    """A scrub of one tier: one prompt's objects (``tokens`` or ``synthetic``), or every object (``all``)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_SCOPE)
    tier: Tier  # every tier of the embedded engine checks its own objects (runtime.tiers.RepairableTier)
    tokens: PromptTokens = None  # type: ignore[assignment]
    synthetic: Synthetic = None  # type: ignore[assignment]
    all: StrictBool = False
    max_objects: Annotated[StrictInt, Field(ge=1, le=scrub.MAX_OBJECTS), _INTEGRAL] = scrub.MAX_OBJECTS
    max_bytes: Annotated[StrictInt, Field(ge=1, le=scrub.MAX_BYTES), _INTEGRAL] = scrub.MAX_BYTES


PromptBody = ProbeBody | SubmitBody | RestoreBody | ScrubBody  # every body that carries a prompt
_P = TypeVar("_P", ProbeBody, SubmitBody, RestoreBody)


class SettingsBody(_Request):
    """At least one setting; a setting is given with a value or left out (none is nullable)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"minProperties": 1})
    budget_bytes: Annotated[StrictInt, Field(ge=1), _INTEGRAL] = None  # type: ignore[assignment]
    fs_concurrency: Annotated[StrictInt, Field(ge=1, le=256), _INTEGRAL] = None  # type: ignore[assignment]
    W: WindowChunks = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _something_to_set(self) -> SettingsBody:
        if self.budget_bytes is None and self.fs_concurrency is None and self.W is None:
            raise ValueError("give at least one of 'budget_bytes', 'fs_concurrency' or 'W'")
        return self


class FaultBody(_Request):
    # The kinds are listed in the document; an unknown kind is refused by FaultSpec.parse with its own message.
    kind: Annotated[StrictStr, Field(json_schema_extra={"enum": list(faults.KINDS)})]
    rank: Annotated[StrictInt, Field(ge=0, le=MAX_RANK), _INTEGRAL] | None = None
    window: Annotated[StrictInt, Field(ge=0, le=MAX_WINDOW, description="0-based (G1 = 0)"), _INTEGRAL] | None = None
    group: StrictStr | None = None
    count: Annotated[
        StrictInt, Field(ge=0, le=faults.MAX_COUNT, description="0: until cleared or expired"), _INTEGRAL
    ] = 1
    ttl_s: Annotated[StrictInt, Field(ge=1, le=faults.MAX_TTL_S, description="seconds until it expires"), _INTEGRAL] = (
        faults.TTL_S
    )


# -- responses ---------------------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# The parts of the answers, as the engine writes them (bsr_cli.core.status, core.results, core.bitmap,
# core.registration, core.events). A host may add fields (``extra="allow"``).
class RankFault(_Response):
    reason: str
    request: str | None
    at: float
    stage: str | None = Field(None, description="the stage the rank failed at; null: it stopped answering")


class RankHealth(_Response):
    rank: int
    healthy: bool
    alive: bool
    heartbeat_age_s: float | None = Field(description="null: the rank does not beat (an in-process rank)")
    reason: str | None = Field(description="why it is unhealthy, or why it is starved")
    last_fault: RankFault | None
    state: str = Field(
        description="the coordinator's judgement: live, starved (the host keeps it from running: its deadlines "
        "stretch, it is not blamed), stopped, hung, dead, or unknown (starved or hung cannot be told)"
    )


class QuarantinedFile(_Response):
    key: str
    file: str
    reason: str
    at: float
    bytes: int


class ScrubProgress(_Response):
    """One rank's scrub of a tier: running, or how it ended."""

    scrub: str
    rank: int
    tier: str
    scope: Literal["prompt", "all"]
    state: Literal["running", "complete", "cut", "failed", "skipped"]
    started_at: float
    prompt: str
    request: str | None = Field(None, description="the failed restore that started it; null: an operator's")
    objects: int = Field(description="objects in scope when known up front (a prompt's); 0 otherwise")
    checked: int
    bytes: int
    missing: int
    damaged: int
    quarantined: int
    seconds: float
    reason: str


class LostSegment(_Response):
    """A segment the tier's store lost with every object on it (``cause``: holder_gone, unmounted,
    remounted_empty); ``objects_lost`` and ``bytes_lost`` are null where the master did not say."""

    segment: str
    client_id: str
    cause: str
    lost_at: float
    last_seen_at: float | None
    objects_lost: int | None
    bytes_lost: int | None
    holder: str | None = Field(None, description="the holder process, where the engine knows it")
    remounted_at: float | None = Field(None, description="absent until the segment is mounted again (empty)")


class TierHealth(_Response):
    ok: bool
    detail: list[str]
    conditions: list[str]
    quarantined: list[QuarantinedFile]
    quarantined_total: int
    condition: str
    failed_at: float | None = Field(
        None, description="restore_failed: when the restore from this tier failed (Unix time); absent otherwise"
    )
    injected: bool = Field(
        default=False, description="true when injected faults caused every reason it is unhealthy (absent: false)"
    )
    faults_armed: list[str] = Field(
        default=[], description="faults armed against it (absent when none): shown, never a reason it is unhealthy"
    )
    lost_segments: list[LostSegment] | None = Field(None, description="absent unless segment_lost is a condition")
    scrubs: list[ScrubProgress] = []


class RankTier(_Response):
    ok: bool
    detail: str
    condition: str
    quarantined: list[QuarantinedFile]
    quarantined_total: int
    scrubs: list[ScrubProgress] = []


class PoolStats(_Response):
    capacity_bytes: int
    budget_bytes: int
    slot_bytes: int
    live_bytes: int
    peak_bytes: int
    windows_live: int
    waiters: int
    draining: bool | None = Field(None, description="live bytes above the budget after a cut, windows finishing")


class PoolRank(_Response):
    rank: int
    alive: bool
    healthy: bool
    reason: str | None
    heartbeat_age_s: float | None
    last_fault: RankFault | None
    pool: PoolStats | None = Field(None, description="absent when the rank did not answer")
    tiers: dict[str, RankTier] | None = Field(None, description="only when asked for health")
    tp_rank: int | None = None
    error: str | None = Field(None, description="why the rank did not answer")
    restore_bps: float
    state: str = Field(
        description="the coordinator's judgement: live, starved (the host keeps it from running: its deadlines "
        "stretch, it is not blamed), stopped, hung, dead, or unknown (starved or hung cannot be told)"
    )


class ActiveRestore(_Response):
    request: str
    W: int
    windows: int
    tokens: int
    tiers: list[str]
    started: float
    done: dict[str, int] = Field(description="per rank, windows released")
    bytes: dict[str, int] = Field(description="per rank, bytes released")


class BlockWait(_Response):
    request: str
    tokens: int
    blocks: dict[str, int]
    since: float
    waited_s: float


class Admission(_Response):
    budget_bytes: int
    live_bytes: int
    queued: int
    waiting_for_blocks: int
    kv_wait_s: float
    blocks_waiting: list[BlockWait]


class Event(_Response):
    """One event of the engine's log: its kind (``type``), its place in the log and its own fields."""

    type: str
    seq: int
    time: float


class Failure(_Response):
    rank: int | None
    reason: str
    kind: str
    stage: str | None
    window: int | None
    tier: str | None
    cause: str | None
    chunks: list[int] | None = Field(None, description="the failed window's chunks [start, end)")
    component: str


class KVGroup(_Response):
    name: str
    block_size: int


class Tensor(_Response):
    name: str
    dtype: str
    shape: list[int]
    group: str


class RegistrationSpec(_Response):
    schema_: int = Field(alias="schema")
    model: str
    tp_size: int
    chunk_size: int
    aux_bytes: int
    groups: list[KVGroup]
    tensors: list[Tensor]


class BitmapRow(_Response):
    rank: int
    group: str
    cells: str = Field(description="one character per chunk: the tiers that hold it")


class HitBitmap(_Response):
    kind: str
    model: str
    registration: str
    tokens: int
    chunk_size: int
    chunks: int
    tiers: list[str]
    ranks: int
    groups: list[str]
    rows: list[BitmapRow]


class Break(_Response):
    chunk: int
    rank: int
    group: str
    held_by: list[str]
    reason: str


class ErrorBody(_Response):
    """Every error: ``error`` is one of unauthorized | version-mismatch | faults-disabled | bad-request |
    invalid-input | capacity | aborted | already-ended | not-found | unknown-request | method-not-allowed | busy |
    rank-restarting | rank-unresponsive | server-error."""

    error: str
    message: str
    hint: str | None = None
    rank: int | None = Field(None, description="rank-restarting, rank-unresponsive: the rank that cannot answer")
    retry_after_s: int | None = Field(
        None, description="rank-restarting: seconds until the engine next tries to start the rank (Retry-After)"
    )
    outcome: str | None = Field(
        None, description="already-ended: how the request had ended when the abort came (committed, failed_closed, ...)"
    )


class RegistrationSummary(_Response):
    identity: str
    model: str
    tensors: int
    bytes_per_chunk: int
    groups: list[str]


class Info(_Response):
    api: str
    version: str
    engine: str | None = None
    started_at: float
    ranks: int
    registration: RegistrationSummary
    chunk_size: int
    tiers: list[str]
    W: int
    rws_bytes: int | None
    pool_bytes: int
    budget_bytes: int
    max_tokens: int
    kv_tokens: int
    fetch_timeout_s: float
    faults_enabled: bool
    fs_concurrency: int
    tokenizer: str | None = None
    overload_ceiling_s: float | None = Field(
        default=None,
        description="the longest a rank's deadline stretches while the host starves it (absent: a host that does "
        "not judge starvation)",
    )


class Health(_Response):
    ok: bool
    api: str
    ranks_alive: list[Any]
    ranks: list[RankHealth]
    unhealthy_ranks: list[Any]
    starved_ranks: list[int] = Field(description="ranks the host keeps from running: healthy, their deadlines stretch")
    tiers: dict[str, TierHealth]
    degraded_tiers: list[str]


class HealthUnavailable(RootModel[Health | ErrorBody]):
    """GET /health's 503: the engine's health with ``ok`` false (a rank is unhealthy), or ``busy`` when every serving
    slot for requests without the token is in use."""


class Registration(_Response):
    schema_: int = Field(alias="schema")
    model: str
    tp_size: int
    chunk_size: int
    groups: list[KVGroup]
    tensors: list[Tensor]


class Marker(_Response):
    excluded_tiers: list[str]


class Probe(_Response):
    kind: str
    bitmap: HitBitmap
    registration_spec: RegistrationSpec
    committable_chunks: int
    committable_tokens: int
    first_break: Break | None
    tier_errors: Any
    markers: list[Marker]


class RestoreResult(_Response):
    """A restore's or an admission's result (the fields the CLI shows; more may come)."""

    outcome: str | None = None
    committed_tokens: int | None = None
    windows: int | None = None
    failure_kind: str | None = None
    failures: list[Failure] | None = None
    hash_ok: bool | None = None  # false: the output hash is not the canonical one, and the request failed
    restored_tokens: int | None = None  # a restore whose output hash was not canonical: what it had committed
    source: str | None = None
    external_tokens: int | None = None


class Aborting(_Response):
    request: str
    aborting: bool


class Pool(_Response):
    ranks: list[PoolRank]


class Ok(_Response):
    ok: bool


class Snapshot(_Response):
    time: float
    info: Info
    ranks: list[PoolRank]
    active: list[ActiveRestore]
    recent: list[RestoreResult]
    admission: Admission
    tiers: dict[str, TierHealth]
    markers: list[Marker]
    faults: list[Fault]
    events: list[Event]
    seq: int


class Events(_Response):
    events: list[Event]
    last_seq: int
    durable: bool  # the engine keeps its events in a store that outlives its in-memory tail and a restart
    held: int  # how many events the engine holds (its store, or its in-memory tail without one)
    oldest_seq: int  # the sequence number of the oldest event it holds (0: none)


class Fault(_Response):
    id: int
    kind: str
    rank: int | None
    window: int | None
    group: str | None
    count: int
    fired: int
    expires_at: float | None


class Faults(_Response):
    enabled: bool
    faults: list[Fault]


class OpenAPIDocument(_Response):
    """This engine's OpenAPI document: docs/openapi.json with the engine's own bounds (prompt length, ranks, KV
    groups, tiers, windows, budget and W against its pool)."""

    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]
    components: dict[str, Any]


class Cleared(_Response):
    cleared: int


class ScrubReport(_Response):
    """Every rank's scrub of the tier, and what they set apart."""

    tier: str
    scope: Literal["prompt", "all"]
    ranks: list[ScrubProgress]
    prompt: str | None = None
    quarantined: list[QuarantinedFile]
    checked: int
    damaged: int
    missing: int
    complete: bool


class Markers(_Response):
    markers: list[Marker]


Snapshot.model_rebuild()
