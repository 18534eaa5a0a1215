"""The evidence bundle's rules (bsr_cli.bench.models): every committed bundle passes them, and breaking any one rule
in a committed bundle fails with a line naming the path. No engine: the bundles are docs/evidence/*.json."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.bench import bundle as bundles
from bsr_cli.bench.evidence import Row, RowStatus, SentRecord, SentRow
from bsr_cli.bench.fs_concurrency import fs_row_from_wire
from bsr_cli.bench.ladder import LadderRow
from bsr_cli.bench.sweep import SweepRow
from bsr_cli.bench.wlaw import WLawRow
from bsr_cli.core import wire
from bsr_cli.core.evidence import Outcome
from bsr_cli.errors import ExitCode, InvalidInput

EVIDENCE = Path(__file__).resolve().parents[2] / "docs" / "evidence"


def _first(experiment: str) -> dict[str, Any]:
    for path in sorted(EVIDENCE.glob("br-*.json")):
        data = json.loads(path.read_text())
        if data["experiment"] == experiment:
            return copy.deepcopy(data)
    raise AssertionError(f"no committed {experiment} bundle")


def _row(data: dict[str, Any], status: str = "pass", kind: str | None = None) -> tuple[int, dict[str, Any]]:
    for i, row in enumerate(data["rows"]):
        if row["status"] == status and (kind is None or row.get("kind") == kind):
            return i, row
    raise AssertionError(f"no {status} {kind or ''} row in {data['run_id']}")


@pytest.mark.timeout(60)
def test_every_committed_bundle_validates() -> None:
    paths = sorted(EVIDENCE.glob("br-*.json"))
    assert paths
    for path in paths:
        assert bundles.validation_errors(bundles.load(path)) == [], path.name


@pytest.mark.timeout(60)
def test_every_committed_bundle_reads_back_as_it_was_written() -> None:
    """`bsr bench show` and `bsr bench plot` read a bundle as a `Bundle`: its wire form is the file's, every key
    present or absent as there, in the same order (bsr_version, the sweep's repeat, each target's note)."""
    paths = sorted(EVIDENCE.glob("br-*.json"))
    assert paths
    for path in paths:
        data = bundles.load(path)
        assert json.dumps(bundles.from_wire(data).to_wire(), indent=1) == json.dumps(data, indent=1), path.name


@pytest.mark.timeout(60)
def test_every_committed_bundle_is_written_again_byte_for_byte(tmp_path: Path) -> None:
    """A committed bundle read back (`bundle.read`: by its experiment's types) and written again (`bundle.write`) is
    its file, byte for byte: a bundle of every experiment. Rows come back as their experiment's row type where bsr
    has one, else as sent."""
    row_types: dict[str, set[str]] = {}
    for path in sorted(EVIDENCE.glob("br-*.json")):
        b = bundles.read(path)
        assert bundles.write(b, tmp_path / path.stem).read_bytes() == path.read_bytes(), path.name
        row_types.setdefault(b.experiment, set()).update(type(r).__name__ for r in b.every_row())
    assert set(row_types) == set(bundles.EXPERIMENTS)
    assert {e for e, types in row_types.items() if types == {"SentRow"}} == {
        "store",
        "failures",
        "peer",
        "cpu-bound",
    }
    assert row_types["trace"] == {"BudgetRun"}
    # The check can fail: a sweep row's keys in another order are written back in its type's order, not the file's.
    data = _first("sweep")
    data["rows"][0] = dict(reversed(data["rows"][0].items()))
    assert json.dumps(bundles.from_wire(data).to_wire()) != json.dumps(data)


@pytest.mark.timeout(60)
def test_rows_read_back_as_they_were_written() -> None:
    """Tables and plots read the rows of these experiments as their row types: each row's wire form is the file's."""
    row_type: dict[str, Callable[[dict[str, Any]], Row]] = {
        "sweep": SweepRow.from_wire,
        "wlaw": WLawRow.from_wire,
        "ladder": LadderRow.from_wire,
        "fs-concurrency": fs_row_from_wire,
    }
    seen = 0
    for path in sorted(EVIDENCE.glob("br-*.json")):
        data = bundles.load(path)
        if data["experiment"] in row_type:
            for row in data["rows"] + data.get("repeat", {}).get("rows", []):
                back = row_type[data["experiment"]](row).to_wire()
                assert json.dumps(back) == json.dumps(row), path.name
                seen += 1
    assert seen


@pytest.mark.timeout(60)
def test_a_bundle_reads_its_rows_by_its_experiment() -> None:
    """A sweep bundle's rows (and its repeat's) come back as sweep rows; the rows of an experiment bsr reads no
    row type for come back as sent, their status still read."""
    data = _first("sweep")
    data["repeat"] = {"run_id": "br-e1-000000000000", "salt": 1, "rows": [data["rows"][0]]}
    b = bundles.from_wire(data)
    assert all(isinstance(r, SweepRow) for r in b.every_row()) and len(b.every_row()) == len(data["rows"]) + 1
    data["experiment"] = "a-newer-experiment"
    b = bundles.from_wire(data)
    assert [type(r) for r in b.every_row()] == [SentRow] * (len(data["rows"]) + 1)
    assert [r.meta.status for r in b.rows] == [RowStatus(r["status"]) for r in data["rows"]]
    assert json.dumps(b.to_wire()) == json.dumps({"schema": "bsr.bench/1", "kind": "bsr.bench", **data})


@pytest.mark.timeout(60)
def test_a_bundle_reads_its_params_and_summary_by_its_experiment() -> None:
    """Each committed bundle's params and summary come back as its experiment's types where bsr has them, and
    written back as the file had them; an experiment without them keeps its records as sent."""
    seen = set()
    for path in sorted(EVIDENCE.glob("br-*.json")):
        data = bundles.load(path)
        b = bundles.from_wire(data)
        types = bundles.types_of(data["experiment"])
        for key, cls in (("params", types.params), ("summary", types.summary)):
            record = getattr(b, key)
            assert isinstance(record, cls or SentRecord), (path.name, key)
            assert json.dumps(wire.value_to_wire(record)) == json.dumps(data[key]), (path.name, key)
            seen.add(type(record).__name__)
    assert {"SweepParams", "SweepSummary", "WLawSummary", "LadderSummary", "FailuresParams", "SentRecord"} <= seen


@pytest.mark.timeout(60)
def test_bsr_bench_validate_accepts_the_evidence_and_rejects_a_broken_bundle(bsr, tmp_path: Path) -> None:
    paths = [str(p) for p in sorted(EVIDENCE.glob("br-*.json"))]
    res = bsr("bench", "validate", *paths, "--json")
    assert res.code == 0, res.err
    assert res.report() == {p: [] for p in paths}

    data = _first("sweep")
    data["elapsed_s"] = -1.5
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    res = bsr("bench", "validate", str(broken))
    assert res.code == ExitCode.INVALID_INPUT
    assert "$.elapsed_s: input should be greater than or equal to 0, got -1.5" in res.out
    assert "Traceback" not in res.err


@pytest.mark.timeout(30)
def test_a_negative_number_is_refused() -> None:
    data = _first("sweep")
    i, row = _row(data)
    row["ranks"][0]["fetch_seconds"] = -0.25
    row["peak_pool_bytes"] = -1
    errors = bundles.validation_errors(data)
    assert f"$.rows[{i}].ranks[0].fetch_seconds: input should be greater than or equal to 0, got -0.25" in errors
    assert f"$.rows[{i}].peak_pool_bytes: input should be greater than or equal to 0, got -1" in errors
    assert len(errors) == 2


@pytest.mark.timeout(30)
def test_an_unknown_outcome_names_every_outcome_by_its_value() -> None:
    """The schema's outcomes are the Outcome enum's: the error line names them as a bundle spells them."""
    data = _first("sweep")
    i, row = _row(data)
    row["outcome"] = "partly"
    wanted = ", ".join(f"'{o.value}'" for o in Outcome) + " or 'unknown'"
    assert bundles.validation_errors(data) == [f"$.rows[{i}].outcome: input should be {wanted}, got 'partly'"]
    row["outcome"] = "unknown"  # a restore answer without an outcome
    assert bundles.validation_errors(data) == []


@pytest.mark.timeout(30)
def test_an_interrupted_row_needs_its_reason_and_nothing_else() -> None:
    data = _first("peer")
    i, _ = _row(data)
    data["rows"][i] = {"status": "interrupted", "reason": "operator"}
    assert bundles.validation_errors(data) == []  # no evidence needed
    del data["rows"][i]["reason"]
    assert bundles.validation_errors(data) == [f"$.rows[{i}]: missing 'reason'"]
    data["rows"][i]["reason"] = 3
    assert bundles.validation_errors(data) == [f"$.rows[{i}].reason: input should be a valid string, got 3"]


@pytest.mark.timeout(30)
def test_an_unknown_experiment_or_status_or_kind_is_refused() -> None:
    data = _first("store")
    data["experiment"] = "throughput"
    (error,) = bundles.validation_errors(data)
    assert error == f"$.experiment: 'throughput' is not one of {list(bundles.EXPERIMENTS)}"

    data = _first("store")
    i, row = _row(data, kind="restore")
    row["kind"] = "copy"
    assert bundles.validation_errors(data) == [
        f"$.rows[{i}].kind: 'copy' is not one of ['memcpy', 'mooncake-set', 'warm', 'restore']"
    ]
    row["kind"] = "restore"
    row["status"] = "skipped"
    assert bundles.validation_errors(data) == [
        f"$.rows[{i}].status: 'skipped' is not one of ['interrupted', 'pass', 'fail']"
    ]
    with pytest.raises(InvalidInput, match=r"\$\.rows\[\d+\]\.status: 'skipped'"):
        bundles.validate(data)


@pytest.mark.parametrize(
    ("experiment", "kind", "field"),
    [
        ("sweep", None, "windows"),
        ("sweep", None, "checks"),
        ("fs-concurrency", "disk", "threads"),
        ("fs-concurrency", "restore", "cache"),
        ("store", "restore", "budget_bytes"),
        ("store", "memcpy", "results"),
        ("peer", None, "loaded_tokens"),
        ("failures", None, "canonical_hash"),
        ("ladder", None, "attempts"),
    ],
)
@pytest.mark.timeout(30)
def test_a_completed_row_needs_its_evidence(experiment: str, kind: str | None, field: str) -> None:
    data = _first(experiment)
    i, row = _row(data, kind=kind)
    del row[field]
    assert bundles.validation_errors(data) == [f"$.rows[{i}]: missing {field!r}"]
    # the same row, interrupted, needs only its reason (a ladder row keeps what it measured)
    row |= {"status": "interrupted", "reason": "error"}
    assert bundles.validation_errors(data) == ([] if field != "attempts" else [f"$.rows[{i}]: missing 'attempts'"])


@pytest.mark.timeout(30)
def test_strict_types_and_the_time_pattern() -> None:
    data = _first("wlaw")
    data["finished_at"] = "2026-12-01 08:00:00"
    data["machine"]["cpu_count"] = 2.0
    data["interrupted"] = 0
    data["registration"]["groups"] = {"kv": True}
    errors = bundles.validation_errors(data)
    assert errors[0].startswith("$.finished_at: string should match pattern")
    assert "$.machine.cpu_count: input should be a valid integer, got 2.0" in errors
    assert "$.interrupted: input should be a valid boolean, got 0" in errors
    assert "$.registration.groups.kv: input should be a valid integer, got True" in errors
    assert len(errors) == 4


@pytest.mark.timeout(30)
def test_extra_fields_are_allowed_where_the_schema_allows_them() -> None:
    data = _first("sweep")
    data["future"] = {"anything": 1}
    data["engine"]["info"]["new_field"] = "x"
    i, row = _row(data)
    row["new_evidence"] = [1, 2]
    row["ranks"][0]["numa"] = 0
    assert bundles.validation_errors(data) == []
    row["checks"]["bound"] = "yes"  # checks are booleans, whatever their names
    assert bundles.validation_errors(data) == [f"$.rows[{i}].checks.bound: input should be a valid boolean, got 'yes'"]
    row["checks"] = {}
    assert bundles.validation_errors(data) == [
        f"$.rows[{i}].checks: dictionary should have at least 1 item after validation, not 0"
    ]


@pytest.mark.timeout(30)
def test_a_bundle_without_an_experiment_or_not_an_object_is_one_error() -> None:
    assert bundles.validation_errors({"rows": []}) == ["$: missing 'experiment'"]
    assert bundles.validation_errors([1, 2]) == [
        "$: input should be a valid dictionary or object to extract fields from"
    ]


@pytest.mark.timeout(60)
def test_bsr_help_builds_no_bundle_models() -> None:
    """The models are built when a bench command needs them, never for `bsr --help`."""
    code = (
        "import io, contextlib, sys, json\n"
        "from bsr_cli.cli.main import run\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert run(['--help']) == 0\n"
        "    assert run(['bench', '--help']) == 0\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('bsr_cli.bench'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.timeout(30)
def test_the_schema_picks_a_model_for_every_experiment() -> None:
    schema = bundles.schema()
    assert schema["discriminator"]["propertyName"] == "experiment"
    assert sorted(schema["discriminator"]["mapping"]) == sorted(bundles.EXPERIMENTS)
    assert all(d.get("additionalProperties") is True for d in schema["$defs"].values())
