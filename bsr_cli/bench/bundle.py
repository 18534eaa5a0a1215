"""Evidence bundles: validation, their JSON Schema (published as docs/bench-schema.json), reading one back as its
experiment's types, and file I/O.

The rules are the pydantic models of :mod:`bsr_cli.bench.models`; they validate a bundle, and the JSON Schema is
generated from them, so an installed bsr needs neither the repository nor a jsonschema dependency.
docs/bench-schema.json is that generated object (`bsr bench schema` prints it, and a test keeps the two equal).
Errors come back one line each, naming the JSON path (``$.rows[2].seconds: ...``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue

from bsr_cli.bench.evidence import KEPT_AS_SENT, Bundle, ExperimentTypes
from bsr_cli.bench.models import BUNDLE, EXPERIMENTS
from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

__all__ = [
    "EXPERIMENTS",
    "from_wire",
    "latest",
    "load",
    "read",
    "schema",
    "schema_json",
    "types_of",
    "validate",
    "validation_errors",
    "write",
]


_ENUM_REPR = re.compile(r"<\w+\.\w+: ('[^']*')>")


class _Generator(GenerateJsonSchema):
    """The models' JSON Schema without their defaults: an optional field's default only stands for "absent"."""

    def default_schema(self, schema: Any) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])


def schema() -> dict[str, Any]:
    """The bundle's JSON Schema, generated from the models (docs/bench-schema.json is this object)."""
    body = BUNDLE.json_schema(schema_generator=_Generator)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://bsr.invalid/schemas/bench-1.json",
        "title": "bsr bench evidence bundle",
        "description": "What `bsr bench <experiment>` writes: one experiment block with its provenance and rows. "
        "Rows with status 'interrupted' produced no evidence and are excluded from the summary.",
        **body,
    }


def _where(loc: tuple[Any, ...], bundle: Any) -> tuple[str, Any]:
    """The JSON path of an error's location, and the value there. A location also names the union member that
    was tried (an experiment, a row's status or kind); those steps are not in the data and are left out."""
    where, node = "$", bundle
    for part in loc:
        if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            where, node = f"{where}[{part}]", node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part in node:
            where, node = f"{where}.{part}", node[part]
    return where, node


def _line(error: Any, bundle: Any) -> str:
    loc = tuple(error["loc"])
    if error["type"] == "missing":
        where, _ = _where(loc[:-1], bundle)
        return f"{where}: missing {loc[-1]!r}"
    where, value = _where(loc, bundle)
    if error["type"] == "union_tag_not_found":
        return f"{where}: missing {error['ctx']['discriminator'].strip(chr(39))!r}"
    if error["type"] == "union_tag_invalid":
        key = error["ctx"]["discriminator"].strip(chr(39))
        allowed = [t.strip().strip(chr(39)) for t in str(error["ctx"]["expected_tags"]).split(",")]
        return f"{where}.{key}: {error['ctx']['tag']!r} is not one of {allowed}"
    got = "" if isinstance(value, dict | list) else f", got {value!r}"
    # pydantic names an enum member of a Literal by its repr (<Outcome.COMMITTED: 'committed'>): name its value,
    # which is what a bundle holds.
    msg = _ENUM_REPR.sub(r"\1", error["msg"])
    return f"{where}: {msg[0].lower()}{msg[1:]}{got}"


def validation_errors(bundle: Any) -> list[str]:
    """Every way ``bundle`` departs from the models, one line each naming its path (empty when it validates)."""
    try:
        BUNDLE.validate_python(bundle)
    except ValidationError as e:
        return list(dict.fromkeys(_line(err, bundle) for err in e.errors(include_url=False)))
    return []


def validate(bundle: Any) -> None:
    errors = validation_errors(bundle)
    if errors:
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise InvalidInput(
            "evidence bundle does not match the schema: " + "; ".join(errors[:5]) + more,
            hint="`bsr bench schema` prints the schema; a bundle written by another bsr version may not match it",
        )


# -- reading a bundle back as its experiment's types -----------------------------------------------------------------


def types_of(experiment: str) -> ExperimentTypes:
    """The types a bundle of ``experiment`` is read back as: its own where bsr has types that read every committed
    bundle of it back as written (tests/bench/test_schema.py), else kept as sent. A new experiment adds its types
    here. Imported when a bundle is read, not for validating one: the experiments bring the admin client along."""
    from bsr_cli.bench.failures import FailuresParams, FailuresSummary
    from bsr_cli.bench.fs_concurrency import FsParams, fs_row_from_wire
    from bsr_cli.bench.ladder import LadderParams, LadderRow, LadderSummary
    from bsr_cli.bench.sweep import SweepParams, SweepRow, SweepSummary
    from bsr_cli.bench.trace import BudgetRun
    from bsr_cli.bench.trace_bundle import TraceParams, TraceSummary
    from bsr_cli.bench.wlaw import WLawParams, WLawRow, WLawSummary

    types = {
        "sweep": ExperimentTypes(params=SweepParams, summary=SweepSummary, read_row=SweepRow.from_wire),
        "wlaw": ExperimentTypes(params=WLawParams, summary=WLawSummary, read_row=WLawRow.from_wire),
        "ladder": ExperimentTypes(params=LadderParams, summary=LadderSummary, read_row=LadderRow.from_wire),
        "failures": ExperimentTypes(params=FailuresParams, summary=FailuresSummary),
        "fs-concurrency": ExperimentTypes(params=FsParams, read_row=fs_row_from_wire),
        "trace": ExperimentTypes(params=TraceParams, summary=TraceSummary, read_row=BudgetRun.from_wire),
    }
    return types.get(experiment, KEPT_AS_SENT)


def from_wire(data: Mapping[str, Any]) -> Bundle:
    """A bundle's JSON (validated against the schema first) as a `Bundle`, read by its experiment's types."""
    return Bundle.from_wire(data, types_of(str(data.get("experiment", ""))))


# -- files -------------------------------------------------------------------------------------------------------


def write(bundle: Bundle, out_dir: Path) -> Path:
    """Validate and write ``<out_dir>/<run_id>.json``; returns the path."""
    wire = bundle.to_wire()
    validate(wire)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bundle.run_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(wire, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def load(path: Path) -> wire.JsonObject:
    """The JSON object in ``path`` (InvalidInput when it cannot be read or holds anything else)."""
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise InvalidInput(
            f"cannot read bundle {path}: not a text file (bundles are UTF-8 JSON)",
            hint="give a bundle written by `bsr bench ... -o DIR` (br-*.json)",
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidInput(
            f"cannot read bundle {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}",
            hint="give a bundle written by `bsr bench ... -o DIR` (br-*.json)",
        ) from None
    if not isinstance(data, dict):
        raise InvalidInput(
            f"{path} is not an evidence bundle", hint="give a bundle written by `bsr bench ... -o DIR` (br-*.json)"
        )
    return data


def read(path: Path) -> Bundle:
    """The bundle in ``path``, validated against the schema first (InvalidInput when it is not one)."""
    data = load(path)
    validate(data)
    return from_wire(data)


def latest(out_dir: Path) -> dict[str, Bundle]:
    """The most recent valid bundle of each experiment in ``out_dir`` (by finish time)."""
    found: dict[str, Bundle] = {}
    for path in sorted(out_dir.glob("br-*.json")):
        try:
            data = load(path)
        except InvalidInput:
            continue
        if validation_errors(data):
            continue
        b = from_wire(data)
        if b.experiment not in found or b.finished_at > found[b.experiment].finished_at:
            found[b.experiment] = b
    return found


def schema_json() -> str:
    return json.dumps(schema(), indent=2) + "\n"
