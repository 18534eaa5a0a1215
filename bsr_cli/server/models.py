"""The admin API's request bodies: pydantic models (strict, ``extra="forbid"``: an unknown field or a value of the
wrong JSON type is a 400), the one declaration of each body, which docs/openapi.json gives.

Request models check what a schema can say; what depends on the engine (its tiers, its prompt limit, the settings'
joint bounds) is checked by the routes, with the same one-line errors as the CLI's. The answers are the runtime's
result types (``bsr_cli.core``), each written by the one codec (``core.wire``), which also gives the document their
schemas; the engine's own document is the one answer that is the server's (``OpenAPIDocument``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic.config import JsonDict

from bsr_cli.core import faults, scrub, wire

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
_PROMPT_FORMS: list[JsonDict] = [{"required": ["tokens"]}, {"required": ["synthetic"]}]
_ONE_PROMPT: JsonDict = {"oneOf": [*_PROMPT_FORMS]}


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
_ONE_SCOPE: JsonDict = {"oneOf": [*_PROMPT_FORMS, {"required": ["all"], "properties": {"all": {"const": True}}}]}


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


# -- the document's own answer -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpenAPIDocument:
    """This engine's OpenAPI document: docs/openapi.json with the engine's own bounds (prompt length, ranks, KV
    groups, tiers, windows, budget and W against its pool)."""

    openapi: str
    info: wire.JsonObject
    paths: wire.JsonObject
    components: wire.JsonObject
    others: wire.JsonObject = wire.field(extra=True)  # any other part of the document, as FastAPI writes it

    to_wire = wire.writer()
    from_wire = wire.reader()
