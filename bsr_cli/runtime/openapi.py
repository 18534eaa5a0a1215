"""The admin API's OpenAPI document, generated from the routing table and the descriptions below.

``python -m bsr_cli.runtime.openapi > docs/openapi.json`` writes docs/openapi.json; a test fails when the file and
this generator disagree, another checks every operation against a live engine's real responses.

Each operation lists the statuses the server can answer with: its success status (201 for POST /faults), 400 for
any malformed body or query, 401 where a token is needed, 411/413 for a chunked or oversized body, 503 when the
server is at its connection cap, plus what the route itself can say (403, 404, 409). 500 is documented because the
server reports a handler bug as JSON rather than dropping the connection; a test run treats it as a failure.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bsr_cli import API_VERSION

JSON = "application/json"
NDJSON = "application/x-ndjson"

_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": (1 << 32) - 1}}
_SYNTHETIC = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1}, "seed": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}
_TIERS = {"type": "array", "items": {"type": "string", "enum": ["mooncake", "fs"]}}


def _prompt_body(**extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "description": "exactly one of tokens or synthetic",
        "properties": {"tokens": _TOKENS, "synthetic": _SYNTHETIC, **extra},
        "additionalProperties": False,
    }


def _obj(*required: str, **props: Any) -> dict[str, Any]:
    """An object with these required keys (more may come: the API only ever adds fields)."""
    return {"type": "object", "required": list(required), "properties": props}


_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_ARR = {"type": "array"}
_OBJ = {"type": "object"}
_INFO = _obj(
    "api",
    "version",
    "ranks",
    "registration",
    "chunk_size",
    "tiers",
    api=_STR,
    ranks=_INT,
    registration=_OBJ,
    tiers=_ARR,
)
_FAULT = _obj("id", "kind", "rank", "window", "group", "count", "fired", id=_INT, kind=_STR, count=_INT, fired=_INT)
_STREAM_NOTE = (
    " As NDJSON: {type: accepted, request}, {type: event, event}..., then {type: result, result} or {type: error}."
)

# handler name -> what the document says about it. Keys: summary, body (request schema), body_required, params,
# ok (success status), ok_schema, media (success media types), errors (route-specific statuses).
OPERATIONS: dict[str, dict[str, Any]] = {
    "health": {
        "summary": "Health of every rank from its heartbeat (503 when a rank is down or silent: unhealthy_ranks names "
        "it), and of every tier as the ranks see it with armed faults and recent failures (degraded_tiers).",
        "ok_schema": _obj(
            "ok",
            "ranks_alive",
            "api",
            "ranks",
            "unhealthy_ranks",
            "tiers",
            "degraded_tiers",
            ok=_BOOL,
            ranks_alive=_ARR,
            api=_STR,
            ranks=_ARR,
            unhealthy_ranks=_ARR,
            tiers=_OBJ,
            degraded_tiers=_ARR,
        ),
        "errors": [503],
    },
    "info": {
        "summary": "Engine identity: API version, ranks, registration identity, chunk size, tiers, W, RWS, pool, "
        "budget B, limits, faults_enabled, tokenizer.",
        "ok_schema": _INFO,
    },
    "registration": {
        "summary": "The registration the engine serves (docs/registration.md schema).",
        "ok_schema": _obj("schema", "model", "tp_size", "chunk_size", "groups", "tensors", groups=_ARR, tensors=_ARR),
    },
    "probe": {
        "summary": "Probe-only lookup: the complete hit bitmap (rank x group x chunk x tier), committable prefix, "
        "first break. Moves no object bytes; leaves nothing pinned.",
        "body": _prompt_body(exclude_tiers=_TIERS),
        "body_required": True,
        "ok_schema": _obj(
            "kind",
            "bitmap",
            "committable_chunks",
            "committable_tokens",
            "first_break",
            "tier_errors",
            "markers",
            kind=_STR,
            committable_chunks=_INT,
            committable_tokens=_INT,
            markers=_ARR,
        ),
        "errors": [409],
    },
    "submit": {
        "summary": "Submit a prompt for admission as the scheduler would: restore the external prefix in windows "
        "(fail-closed, force-local marker, fallback to a lower tier or recompute), compute the rest, store it, hash "
        "it. JSON by default; with stream=true the answer is NDJSON progress." + _STREAM_NOTE,
        "body": _prompt_body(W={"type": "integer", "minimum": 0}, verify=_BOOL, store=_BOOL, stream=_BOOL),
        "body_required": True,
        "ok_schema": _OBJ,
        "media": [JSON, NDJSON],
        "errors": [409],
    },
    "restore": {
        "summary": "A manual windowed restore of a prompt's external prefix (no fallback). NDJSON by default, JSON "
        "with stream=false. A client that disconnects aborts the restore (it ends fail-closed)." + _STREAM_NOTE,
        "body": _prompt_body(W={"type": "integer", "minimum": 0}, verify=_BOOL, exclude_tiers=_TIERS, stream=_BOOL),
        "body_required": True,
        "ok_schema": _OBJ,
        "media": [NDJSON, JSON],
        "errors": [409],
    },
    "abort": {
        "summary": "Abort a running restore; it ends fail-closed (404 when no such request is open).",
        "params": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}],
        "ok_schema": _obj("request", "aborting", request=_STR, aborting=_BOOL),
        "errors": [404],
    },
    "pool": {
        "summary": "Live, peak, capacity, budget and windows in flight of every rank's restore pool (?health=1 adds "
        "tier health).",
        "params": [{"name": "health", "in": "query", "schema": {"type": "string", "enum": ["0", "1"]}}],
        "ok_schema": _obj("ranks", ranks=_ARR),
    },
    "reset_peak": {
        "summary": "Reset every rank's peak counter to its live bytes.",
        "ok_schema": _obj("ok", ok=_BOOL),
    },
    "settings": {
        "summary": "Change the admission budget B, filesystem load concurrency or default W at run time. The "
        "resulting set is checked as `bsr engine up` checks it (one chunk slot <= B <= pool, RWS(W) <= pool, "
        "fs_concurrency <= 256) and applied whole or not at all. Answers the engine's info.",
        "body": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "budget_bytes": {"type": "integer", "minimum": 1},
                "fs_concurrency": {"type": "integer", "minimum": 1, "maximum": 256},
                "W": {"type": "integer", "minimum": 0},
            },
        },
        "body_required": False,
        "ok_schema": _INFO,
    },
    "snapshot": {
        "summary": "Everything a monitor draws at once: info, ranks and pools, active and recent restores, "
        "admission, tiers, markers, faults, recent events.",
        "params": [
            {"name": "health", "in": "query", "schema": {"type": "string", "enum": ["0", "1"]}},
            {
                "name": "events_since",
                "in": "query",
                "description": "every event after this sequence number (up to 2,000) instead of the last 50",
                "schema": {"type": "integer", "minimum": 0},
            },
        ],
        "ok_schema": _OBJ,
    },
    "events": {
        "summary": "The event log after ?since=SEQ, long-polling up to ?wait=SECONDS (max 30).",
        "params": [
            {"name": "since", "in": "query", "schema": {"type": "integer", "minimum": 0}},
            {
                "name": "wait",
                "in": "query",
                "description": "seconds to wait for a new event; more than 30 waits 30",
                "schema": {"type": "number", "minimum": 0},
            },
        ],
        "ok_schema": _obj("events", "last_seq", events=_ARR, last_seq=_INT),
    },
    "faults_list": {
        "summary": "The armed faults.",
        "ok_schema": _obj("enabled", "faults", enabled=_BOOL, faults={"type": "array", "items": _FAULT}),
    },
    "faults_inject": {
        "summary": "Arm a fault ({kind, rank?, window?, group?, count?}); 403 faults-disabled unless the engine "
        "allows faults. Answers 201 with the armed fault.",
        "body": {
            "type": "object",
            "additionalProperties": False,
            "required": ["kind"],
            "properties": {
                "kind": {
                    "enum": ["remote-unavailable", "remote-and-ssd-absent", "restore-fault", "timeout", "corrupt"]
                },
                "rank": {"type": "integer", "minimum": 0},
                "window": {"type": "integer", "minimum": 0},
                "group": {"type": "string"},
                "count": {"type": "integer", "minimum": 0},
            },
        },
        "body_required": True,
        "ok": 201,
        "ok_schema": _FAULT,
        "errors": [403],
    },
    "faults_clear": {"summary": "Clear every armed fault.", "ok_schema": _obj("cleared", cleared=_INT)},
    "markers_list": {
        "summary": "The force-local markers.",
        "ok_schema": _obj("markers", markers=_ARR),
    },
    "markers_clear": {
        "summary": "Clear the force-local markers (as a request teardown would).",
        "ok_schema": _obj("cleared", cleared=_INT),
    },
    "shutdown": {"summary": "Stop the engine.", "ok_schema": _obj("ok", ok=_BOOL)},
}

_ERROR_TEXT = {
    400: "malformed body or query, or a value out of bounds",
    401: "missing or wrong bearer token (checked before the body is read)",
    403: "fault injection is disabled on this engine",
    404: "no such request",
    409: "the request does not fit this engine's capacity",
    411: "a chunked body (send Content-Length)",
    413: "a body over the cap that follows from the prompt limit",
    500: "a server bug, reported rather than dropped",
    503: "unavailable (a rank is down, or the connection cap is reached)",
}


def _error(status: int) -> dict[str, Any]:
    return {"description": _ERROR_TEXT[status], "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _operation(name: str, auth: bool) -> dict[str, Any]:
    meta = OPERATIONS[name]
    ok = meta.get("ok", 200)
    media = meta.get("media", [JSON])
    content = {m: ({"schema": meta["ok_schema"]} if m == JSON else {}) for m in media}
    statuses = {400, 411, 413, 500, 503, *meta.get("errors", [])} | ({401} if auth else set())
    responses: dict[str, Any] = {str(ok): {"description": "ok", "content": content}}
    responses |= {str(s): _error(s) for s in sorted(statuses)}
    op: dict[str, Any] = {"summary": meta["summary"], "operationId": name}
    if meta.get("params"):
        op["parameters"] = meta["params"]
    if "body" in meta:
        op["requestBody"] = {"required": meta["body_required"], "content": {JSON: {"schema": meta["body"]}}}
    op["responses"] = responses
    if auth:
        op["security"] = [{"bearer": []}]
    return op


def build() -> dict[str, Any]:
    from bsr_cli.runtime.admin import ROUTES

    paths: dict[str, dict[str, Any]] = {}
    for (method, path), (name, auth) in ROUTES.items():
        paths.setdefault(f"/bsr/{API_VERSION}{path}", {})[method.lower()] = _operation(name, auth)
    paths["/metrics"] = {
        "get": {
            "summary": "Prometheus metrics: pool live/peak/capacity/budget per rank, rank up, restores by outcome, "
            "markers, faults.",
            "operationId": "metrics",
            "responses": {"200": {"description": "text exposition format", "content": {"text/plain": {}}}}
            | {str(s): _error(s) for s in (400, 503)},
        }
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "bsr engine admin API",
            "version": API_VERSION,
            "description": "Served by every host of the BSR runtime (the embedded engine, the LMCache plugin). "
            "Loopback by default; state-changing routes need a bearer token. Every error is a JSON object "
            "(Error); a method a path does not serve gets 405 with an Allow header. Generated by "
            "bsr_cli/runtime/openapi.py.",
        },
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error", "message"],
                    "properties": {
                        "error": {
                            "type": "string",
                            "description": "unauthorized | version-mismatch | faults-disabled | bad-request | "
                            "invalid-input | capacity | not-found | method-not-allowed | busy | server-error",
                        },
                        "message": {"type": "string"},
                        "hint": {"type": "string", "nullable": True},
                    },
                }
            },
        },
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
