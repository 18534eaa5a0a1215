"""The admin API's wire types: pydantic request bodies (strict, ``extra="forbid"``: an unknown field or a value of
the wrong JSON type is a 400) and typed response bodies (``extra="allow"``: the API only ever adds fields).

Request models check what a schema can say; what depends on the engine (its tiers, its prompt limit, the settings'
joint bounds) is checked by the routes, with the same one-line errors as the CLI's. The response models document
what the routes answer (docs/openapi.json is generated from them); the routes answer the runtime's dicts as they
are, and a test validates live answers against the document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from bsr_cli.core import faults

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
NonNegative = Annotated[StrictInt, Field(ge=0), _INTEGRAL]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Synthetic(_Request):
    n: Annotated[StrictInt, Field(ge=1), _INTEGRAL]
    seed: JsonInt = 0


# Exactly one of the two prompt forms, said in the schema too (so a schema-valid body is never refused for it).
_ONE_PROMPT: dict[str, Any] = {"oneOf": [{"required": ["tokens"]}, {"required": ["synthetic"]}]}


class PromptBody(_Request):
    """A prompt: exactly one of ``tokens`` or ``synthetic``."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_PROMPT)

    # Neither is nullable: a field is given with a value or left out.
    tokens: Annotated[list[TokenId], Field(min_length=1)] = None  # type: ignore[assignment]
    synthetic: Synthetic = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> PromptBody:
        if (self.tokens is None) == (self.synthetic is None):
            raise ValueError("give exactly one of 'tokens' or 'synthetic'")
        return self


class ProbeBody(PromptBody):
    exclude_tiers: list[Tier] | None = None


class SubmitBody(PromptBody):
    W: NonNegative | None = None
    verify: StrictBool = True
    store: StrictBool = True
    stream: StrictBool = False


class RestoreBody(PromptBody):
    W: NonNegative | None = None
    verify: StrictBool = True
    exclude_tiers: list[Tier] | None = None
    stream: StrictBool = True


class SettingsBody(_Request):
    budget_bytes: Annotated[StrictInt, Field(ge=1), _INTEGRAL] | None = None
    fs_concurrency: Annotated[StrictInt, Field(ge=1, le=256), _INTEGRAL] | None = None
    W: NonNegative | None = None


# Bounds that hold on every engine; an engine's own document (GET /openapi.json) narrows them to its ranks, KV
# groups and longest prompt.
MAX_RANK = 1023
MAX_WINDOW = (1 << 20) - 1


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


class ErrorBody(_Response):
    """Every error: ``error`` is one of unauthorized | version-mismatch | faults-disabled | bad-request |
    invalid-input | capacity | not-found | unknown-request | method-not-allowed | busy | server-error."""

    error: str
    message: str
    hint: str | None = None


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


class Health(_Response):
    ok: bool
    api: str
    ranks_alive: list[Any]
    ranks: list[dict[str, Any]]
    unhealthy_ranks: list[Any]
    tiers: dict[str, Any]
    degraded_tiers: list[str]


class Registration(_Response):
    schema_: int = Field(alias="schema")
    model: str
    tp_size: int
    chunk_size: int
    groups: list[dict[str, Any]]
    tensors: list[dict[str, Any]]


class Marker(_Response):
    excluded_tiers: list[str]


class Probe(_Response):
    kind: str
    bitmap: dict[str, Any]
    registration_spec: dict[str, Any]
    committable_chunks: int
    committable_tokens: int
    first_break: dict[str, Any] | None
    tier_errors: Any
    markers: list[Marker]


class RestoreResult(_Response):
    """A restore's or an admission's result (the fields the CLI shows; more may come)."""

    outcome: str | None = None
    committed_tokens: int | None = None
    windows: int | None = None
    failure_kind: str | None = None
    failures: list[dict[str, Any]] | None = None
    hash_ok: bool | None = None
    source: str | None = None
    external_tokens: int | None = None


class Aborting(_Response):
    request: str
    aborting: bool


class Pool(_Response):
    ranks: list[dict[str, Any]]


class Ok(_Response):
    ok: bool


class Snapshot(_Response):
    time: float
    info: Info
    ranks: list[dict[str, Any]]
    active: list[dict[str, Any]]
    recent: list[dict[str, Any]]
    admission: dict[str, Any]
    tiers: dict[str, Any]
    markers: list[Marker]
    faults: list[Fault]
    events: list[dict[str, Any]]
    seq: int


class Events(_Response):
    events: list[dict[str, Any]]
    last_seq: int
    durable: bool  # the engine keeps its events in a store that outlives its in-memory tail and a restart


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


class Markers(_Response):
    markers: list[Marker]


Snapshot.model_rebuild()
