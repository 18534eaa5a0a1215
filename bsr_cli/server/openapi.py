"""The admin API's OpenAPI document: FastAPI's from the app's routes and request bodies (pydantic), with the schema
of every answer made from the result type the route declares it sends (``core.wire.Schemas``: the schema of what
its writer emits), one component per type, by class name.

``python -m bsr_cli.server.openapi > docs/openapi.json`` writes docs/openapi.json; a test fails when the file and
this generator disagree, another checks every operation against a live engine's real answers, and a fuzz test
sends generated requests to every operation (tests/engine/test_admin_hardening.py).

FastAPI documents a 422 for every route with a body or parameters; this API answers 400 for those (as every other
malformed request), so the 422s are left out, and the bearer scheme is added for the routes that need the token.
This module reads the app; the app never imports it (the server that hosts the app builds the engine's document).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from bsr_cli.core import wire
from bsr_cli.runtime.coordinator import Coordinator
from bsr_cli.server.app import AnsweredRoute, create_app


@dataclass(frozen=True)
class EngineLimits:
    """What one engine accepts beyond what holds for every engine: its document (``GET /bsr/v1/openapi.json``)
    says these too, so that a request valid against it is accepted (capacity still depends on what runs: 409)."""

    max_tokens: int
    ranks: int
    groups: tuple[str, ...]
    tiers: tuple[str, ...]
    chunk_size: int
    slot_bytes: int  # one chunk of every KV group on one rank: the pool's unit
    aux_bytes: int
    pool_bytes: int

    @property
    def max_window(self) -> int:
        """The last window (0-based) of the longest prompt at W=1."""
        return max(1, -(-self.max_tokens // self.chunk_size)) - 1

    @property
    def max_chunks(self) -> int:
        """The chunks of the longest prompt: the largest W a request may give."""
        return self.max_window + 1

    @property
    def max_w(self) -> int:
        """The largest default W: its RWS fits the pool, and it holds no more than the longest prompt."""
        return min(self.max_chunks, max(0, (self.pool_bytes - self.aux_bytes) // self.slot_bytes))


def limits_of(c: Coordinator) -> EngineLimits:
    """What the engine that ``c`` coordinates accepts."""
    return EngineLimits(
        max_tokens=c.settings.max_tokens,
        ranks=len(c.ranks),
        groups=tuple(c.reg.group_names),
        tiers=tuple(c.settings.tiers),
        chunk_size=c.reg.chunk_size,
        slot_bytes=c.reg.bytes_per_chunk,
        aux_bytes=c.reg.aux_bytes,
        pool_bytes=c.settings.pool_bytes,
    )


def build(app: FastAPI | None = None) -> wire.JsonObject:
    """The document of ``app`` (by default one built only for this)."""
    app = app or create_app(None)
    doc: wire.JsonObject = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    for ops in _at(doc, "paths").values():
        for op in _at(ops).values():
            _at(op, "responses").pop("422", None)
    components = _at(doc.setdefault("components", {}))
    schemas = _at(components.setdefault("schemas", {}))
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    answers = _answer_schemas(app, doc)
    clash = sorted(set(schemas) & set(answers))
    if clash:
        raise TypeError(f"a request body and an answer are both named {', '.join(clash)}")
    components["schemas"] = dict(sorted({**schemas, **answers}.items()))
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _at(node: wire.JsonValue, *path: str) -> wire.JsonObject:
    """The JSON object at ``path`` under ``node`` (a TypeError where the document holds anything else there: the
    generator and the document it reads disagree)."""
    for key in path:
        node = _at(node)[key]
    if not isinstance(node, dict):
        raise TypeError(f"the document holds no object at {'/'.join(path)}")
    return node


def _answer_schemas(app: FastAPI, doc: wire.JsonObject) -> dict[str, wire.JsonSchema]:
    """Give each operation's answers the schemas of the result types its route declares (a JSON body each, beside
    any other media it has); the components they refer to."""
    found = wire.Schemas()
    for route in app.routes:
        if not isinstance(route, AnsweredRoute):
            continue
        for method in route.methods or ():
            responses = _at(doc, "paths", route.path, method.lower(), "responses")
            for status, types in route.answers.items():
                media = _at(_at(responses, str(status)).setdefault("content", {}))
                media["application/json"] = {"schema": wire.any_of([found.ref(t) for t in types])}
    return found.components


def _value(prop: wire.JsonObject) -> wire.JsonObject:
    """The non-null branch of an optional property's schema (pydantic writes ``anyOf: [X, null]``)."""
    branches = prop.get("anyOf")
    for branch in branches if isinstance(branches, list) else ():
        if isinstance(branch, dict) and branch.get("type") != "null":
            return branch  # the schema itself, narrowed in place
    return prop


def narrow(doc: wire.JsonObject, limits: EngineLimits) -> wire.JsonObject:
    """A copy of ``doc`` with this engine's own bounds on prompts, ranks, groups, tiers, windows and settings."""
    doc = copy.deepcopy(doc)
    schemas = _at(doc, "components", "schemas")
    _at(schemas, "Synthetic", "properties", "n")["maximum"] = limits.max_tokens
    for name, schema in schemas.items():
        props = _at(_at(schema).get("properties", {}))
        if name.endswith("Body") and "tokens" in props:
            _at(props, "tokens")["maxItems"] = limits.max_tokens
        if "exclude_tiers" in props:
            _at(_value(_at(props, "exclude_tiers")), "items")["enum"] = [*limits.tiers]
        if name in ("SubmitBody", "RestoreBody"):
            _value(_at(props, "W"))["maximum"] = limits.max_chunks
    fault = _at(schemas, "FaultBody", "properties")
    _value(_at(fault, "rank"))["maximum"] = limits.ranks - 1
    _value(_at(fault, "window"))["maximum"] = limits.max_window
    _value(_at(fault, "group"))["enum"] = [*limits.groups]
    settings = _at(schemas, "SettingsBody", "properties")
    _value(_at(settings, "budget_bytes")).update(minimum=limits.slot_bytes, maximum=limits.pool_bytes)
    _value(_at(settings, "W"))["maximum"] = limits.max_w
    for ops in _at(doc, "paths").values():
        for op in _at(ops).values():
            parameters = _at(op).get("parameters")
            for param in map(_at, parameters if isinstance(parameters, list) else ()):
                if (param.get("name"), param.get("in")) == ("tier", "path"):
                    _at(param, "schema")["enum"] = [*limits.tiers]
    return doc


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
