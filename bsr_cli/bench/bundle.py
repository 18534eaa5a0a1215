"""Evidence bundles: their JSON Schema (published as docs/bench-schema.json), a small validator, and file I/O.

The schema lives here as data so an installed bsr can validate without the repository; docs/bench-schema.json is
this same object (`bsr bench schema` prints it, and a test keeps the two equal). The validator implements the
JSON Schema subset the schema uses (type, enum, const, pattern, minimum, minItems, properties, required,
additionalProperties, items, $ref into $defs, anyOf, if/then/else), so no jsonschema dependency is needed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bsr_cli.errors import InvalidInput

SCHEMA_ID = "bsr.bench/1"
EXPERIMENTS = ("ladder", "sweep", "wlaw", "fs-concurrency", "store", "failures", "peer", "cpu-bound")

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_NONNEG_INT = {"type": "integer", "minimum": 0}
_NONNEG_NUM = {"type": "number", "minimum": 0}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_OBJ = {"type": "object"}
_TIME = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$"}


def _row(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    """A row of one experiment: interrupted rows need only their reason; completed ones their evidence."""
    return {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"enum": ["pass", "fail", "interrupted"]}},
        "if": {"properties": {"status": {"const": "interrupted"}}},
        "then": {"required": ["reason"], "properties": {"reason": _STR}},
        "else": {
            "required": ["checks", *required],
            "properties": {"checks": {"$ref": "#/$defs/checks"}, **properties},
        },
    }


def _experiment(name: str, rows: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    then: dict[str, Any] = {"properties": {"rows": {"type": "array", "items": {"$ref": f"#/$defs/{rows}"}}}}
    if extra:
        then["properties"] |= extra
    return {"if": {"properties": {"experiment": {"const": name}}}, "then": then}


SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://bsr.invalid/schemas/bench-1.json",
    "title": "bsr bench evidence bundle",
    "description": "What `bsr bench <experiment>` writes: one experiment block with its provenance and rows. "
    "Rows with status 'interrupted' produced no evidence and are excluded from the summary.",
    "type": "object",
    "required": [
        "schema",
        "kind",
        "experiment",
        "run_id",
        "salt",
        "started_at",
        "finished_at",
        "elapsed_s",
        "registration",
        "engine",
        "machine",
        "params",
        "rows",
        "summary",
        "targets",
        "interrupted",
        "ok",
    ],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "kind": {"const": "bsr.bench"},
        "experiment": {"enum": list(EXPERIMENTS)},
        "run_id": {"type": "string", "pattern": r"^br-[a-z0-9]+-[0-9a-f]{12}$"},
        "salt": {"type": ["integer", "null"], "description": "seed of the synthetic prompts (null: none used)"},
        "bsr_version": _STR,
        "started_at": _TIME,
        "finished_at": _TIME,
        "elapsed_s": _NONNEG_NUM,
        "registration": {
            "type": "object",
            "required": ["identity", "model", "tp_size", "chunk_size", "bytes_per_chunk", "aux_bytes", "groups"],
            "properties": {
                "identity": {"type": "string", "pattern": r"^reg-[0-9a-f]{16}$"},
                "model": _STR,
                "tp_size": {"type": "integer", "minimum": 1},
                "chunk_size": {"type": "integer", "minimum": 1},
                "bytes_per_token": _NONNEG_INT,
                "bytes_per_chunk": {"type": "integer", "minimum": 1},
                "aux_bytes": _NONNEG_INT,
                "groups": {"type": "object", "additionalProperties": _NONNEG_INT},
            },
        },
        "engine": {
            "type": "object",
            "required": ["url", "info"],
            "properties": {
                "url": _STR,
                "info": {
                    "type": "object",
                    "required": ["api", "registration", "chunk_size", "tiers", "pool_bytes", "budget_bytes"],
                    "description": "the engine's GET /info at the start of the block",
                },
                "embedded": _BOOL,
                "startup_s": {"type": ["number", "null"]},
                "settings_restored": _BOOL,
                "restarted_per_rung": _BOOL,
                "rungs": {"type": "array", "items": _OBJ},
            },
        },
        "machine": {
            "type": "object",
            "required": ["cpu_count", "memory_bytes", "python", "torch"],
            "properties": {
                "cpu_count": _NONNEG_INT,
                "memory_bytes": _NONNEG_INT,
                "python": _STR,
                "torch": {"type": ["string", "null"]},
                "mooncake": {"type": ["string", "null"]},
                "platform": _STR,
                "loadavg": {"type": "array", "items": _NUM},
            },
        },
        "params": _OBJ,
        "rows": {"type": "array"},
        "repeat": {
            "type": "object",
            "required": ["run_id", "salt", "rows"],
            "properties": {
                "run_id": {"type": "string", "pattern": r"^br-[a-z0-9]+-[0-9a-f]{12}$"},
                "salt": _INT,
                "rows": {"type": "array", "items": {"$ref": "#/$defs/restore_row"}},
            },
        },
        "summary": _OBJ,
        "targets": {"type": "array", "items": {"$ref": "#/$defs/target"}},
        "interrupted": _BOOL,
        "interrupted_by": {"enum": ["operator", "error", None]},
        "ok": _BOOL,
    },
    "allOf": [
        _experiment("sweep", "restore_row"),
        _experiment("wlaw", "restore_row"),
        _experiment("fs-concurrency", "fs_row"),
        _experiment("store", "store_row"),
        _experiment("failures", "failure_row"),
        _experiment("ladder", "ladder_row"),
        _experiment("peer", "peer_row"),
    ],
    "$defs": {
        "checks": {"type": "object", "minProperties": 1, "additionalProperties": _BOOL},
        "target": {
            "type": "object",
            "required": ["name", "target", "measured", "met"],
            "properties": {"name": _STR, "target": _STR, "met": {"type": ["boolean", "null"]}, "note": _STR},
        },
        "rank": {
            "type": "object",
            "required": ["rank", "pool_peak_bytes", "bytes_restored", "seconds", "fetch_seconds", "install_seconds"],
            "properties": {
                "rank": _NONNEG_INT,
                "pool_peak_bytes": _NONNEG_INT,
                "peak_live_bytes": _NONNEG_INT,
                "bytes_restored": _NONNEG_INT,
                "seconds": _NONNEG_NUM,
                "fetch_seconds": _NONNEG_NUM,
                "install_seconds": _NONNEG_NUM,
                "gbps": _NONNEG_NUM,
            },
        },
        "restore": {
            "type": "object",
            "required": [
                "outcome",
                "committed_tokens",
                "chunks",
                "windows",
                "expected_windows",
                "seconds",
                "gbps",
                "peak_pool_bytes",
                "predicted_peak_bytes",
                "whole_plan_bytes",
                "ranks",
                "hash_ok",
                "healthy",
            ],
            "properties": {
                "outcome": {"enum": ["committed", "failed_closed", "nothing_to_restore", "unknown"]},
                "tiers": {"type": "array", "items": _STR},
                "committed_tokens": _NONNEG_INT,
                "chunks": _NONNEG_INT,
                "windows": _NONNEG_INT,
                "expected_windows": _NONNEG_INT,
                "seconds": _NONNEG_NUM,
                "gbps": _NONNEG_NUM,
                "gbps_per_rank": _NONNEG_NUM,
                "peak_pool_bytes": _NONNEG_INT,
                "predicted_peak_bytes": _NONNEG_INT,
                "rws_bytes": {"type": ["integer", "null"]},
                "whole_plan_bytes": _NONNEG_INT,
                "ranks": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/rank"}},
                "hash_ok": {"type": ["boolean", "null"]},
                "healthy": _BOOL,
            },
        },
        "restore_row": {
            "allOf": [
                _row(["tokens", "W"], {"tokens": {"type": "integer", "minimum": 1}, "W": {"type": "integer"}}),
                {
                    "if": {"properties": {"status": {"enum": ["pass", "fail"]}}},
                    "then": {"$ref": "#/$defs/restore"},
                },
            ]
        },
        "fs_row": {
            "allOf": [
                _row(["kind"], {"kind": {"enum": ["warm", "disk", "restore"]}}),
                {
                    # The disk alone (no bsr): the concurrency speedup the restore is judged against.
                    "if": {
                        "properties": {"status": {"enum": ["pass", "fail"]}, "kind": {"const": "disk"}},
                        "required": ["kind"],
                    },
                    "then": {
                        "required": ["concurrency", "threads", "trial", "files", "bytes", "seconds", "gbps"],
                        "properties": {
                            "concurrency": {"type": "integer", "minimum": 1},
                            "threads": {"type": "integer", "minimum": 1},
                            "trial": _NONNEG_INT,
                            "files": _NONNEG_INT,
                            "bytes": _NONNEG_INT,
                            "seconds": {"type": "number", "minimum": 0},
                            "gbps": {"type": "number", "minimum": 0},
                        },
                    },
                },
                {
                    "if": {
                        "properties": {"status": {"enum": ["pass", "fail"]}, "kind": {"const": "restore"}},
                        "required": ["kind"],
                    },
                    "then": {
                        "allOf": [
                            {"$ref": "#/$defs/restore"},
                            {
                                "required": ["concurrency", "cache", "trial"],
                                "properties": {
                                    "concurrency": {"type": "integer", "minimum": 1},
                                    "cache": {"enum": ["cold", "warm"]},
                                    "trial": _NONNEG_INT,
                                },
                            },
                        ]
                    },
                },
            ]
        },
        "store_row": {
            "allOf": [
                _row(["kind"], {"kind": {"enum": ["memcpy", "mooncake-set", "warm", "restore"]}}),
                {
                    "if": {
                        "properties": {"status": {"enum": ["pass", "fail"]}, "kind": {"const": "restore"}},
                        "required": ["kind"],
                    },
                    "then": {"allOf": [{"$ref": "#/$defs/restore"}, {"required": ["W", "budget_bytes", "trial"]}]},
                },
                {
                    "if": {
                        "properties": {
                            "status": {"enum": ["pass", "fail"]},
                            "kind": {"enum": ["memcpy", "mooncake-set"]},
                        },
                        "required": ["kind"],
                    },
                    "then": {"required": ["results"], "properties": {"results": {"type": "array", "items": _OBJ}}},
                },
            ]
        },
        "peer_row": _row(
            ["kind", "tokens", "l1_bytes", "trial", "outcome", "loaded_tokens", "seconds", "gbps_per_rank"],
            {
                "kind": {"enum": ["raw", "stock", "bsr", "store", "setup"]},
                "tokens": {"type": "integer", "minimum": 1},
                "l1_bytes": _NONNEG_INT,
                "trial": _NONNEG_INT,
                "W": {"type": ["integer", "null"]},
                "outcome": _STR,
                "loaded_tokens": _NONNEG_INT,
                "seconds": _NONNEG_NUM,
                "gbps_per_rank": _NONNEG_NUM,
                "l1_peak_bytes": _NONNEG_INT,
                "hash_ok": {"type": ["boolean", "null"]},
                "timed_out": _BOOL,
                "cpu_s_per_gb": {"type": "object", "additionalProperties": _NONNEG_NUM},
            },
        ),
        "failure_row": _row(
            ["scenario", "fallback", "expected_fallback", "output_hash", "canonical_hash"],
            {"scenario": _STR, "fallback": _STR, "expected_fallback": _STR},
        ),
        "ladder_row": {
            "allOf": [
                {
                    "required": ["tokens", "whole_plan_bytes", "predicted_rung", "first_passing_rung", "attempts"],
                    "properties": {
                        "tokens": {"type": "integer", "minimum": 1},
                        "whole_plan_bytes": _NONNEG_INT,
                        "predicted_rung": {"type": ["integer", "null"]},
                        "first_passing_rung": {"type": ["integer", "null"]},
                        "attempts": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["rung", "outcome", "passed", "peak_pool_bytes"],
                                "properties": {"rung": _NONNEG_INT, "passed": _BOOL, "peak_pool_bytes": _NONNEG_INT},
                            },
                        },
                    },
                },
                _row([], {}),
            ]
        },
    },
}


# -- the validator -----------------------------------------------------------------------------------------------

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $refs are supported, not {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    return dict(node)


def _errors(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str) -> Iterator[str]:
    if "$ref" in schema:
        yield from _errors(value, _resolve(root, schema["$ref"]), root, where)
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[k](value) for k in kinds):
            yield f"{where}: expected {' or '.join(kinds)}, got {type(value).__name__}"
            return
    if "const" in schema and value != schema["const"]:
        yield f"{where}: expected {schema['const']!r}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        yield f"{where}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        yield f"{where}: {value!r} does not match {schema['pattern']}"
    if _TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        yield f"{where}: {value} is below {schema['minimum']}"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{where}: needs at least {schema['minItems']} item(s)"
        if "items" in schema:
            for i, item in enumerate(value):
                yield from _errors(item, schema["items"], root, f"{where}[{i}]")
    if isinstance(value, dict):
        if len(value) < schema.get("minProperties", 0):
            yield f"{where}: needs at least {schema['minProperties']} propert(ies)"
        for key in schema.get("required", []):
            if key not in value:
                yield f"{where}: missing {key!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                yield from _errors(item, props[key], root, f"{where}.{key}")
            elif extra is False:
                yield f"{where}: unexpected property {key!r}"
            elif isinstance(extra, dict):
                yield from _errors(item, extra, root, f"{where}.{key}")
    for sub in schema.get("allOf", []):
        yield from _errors(value, sub, root, where)
    if "anyOf" in schema and not any(not list(_errors(value, s, root, where)) for s in schema["anyOf"]):
        yield f"{where}: matches none of the allowed forms"
    if "if" in schema:
        branch = "then" if not list(_errors(value, schema["if"], root, where)) else "else"
        if branch in schema:
            yield from _errors(value, schema[branch], root, where)


def validation_errors(bundle: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every way ``bundle`` departs from the schema (empty when it validates)."""
    root = schema or SCHEMA
    return list(_errors(bundle, root, root, "$"))


def validate(bundle: Any) -> None:
    errors = validation_errors(bundle)
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise InvalidInput("evidence bundle does not match the schema: " + "; ".join(errors[:5]) + more)


# -- files -------------------------------------------------------------------------------------------------------


def write(bundle: dict[str, Any], out_dir: Path) -> Path:
    """Validate and write ``<out_dir>/<run_id>.json``; returns the path."""
    validate(bundle)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bundle['run_id']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(bundle, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise InvalidInput(f"cannot read bundle {path}: not a text file (bundles are UTF-8 JSON)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidInput(f"cannot read bundle {path}: {e}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path} is not an evidence bundle")
    return data


def latest(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The most recent valid bundle of each experiment in ``out_dir`` (by finish time)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(out_dir.glob("br-*.json")):
        try:
            data = load(path)
        except InvalidInput:
            continue
        if validation_errors(data):
            continue
        exp = str(data["experiment"])
        if exp not in found or str(data["finished_at"]) > str(found[exp]["finished_at"]):
            found[exp] = data
    return found


def schema_json() -> str:
    return json.dumps(SCHEMA, indent=2) + "\n"
