"""`bsr pool` and `bsr top` through the real CLI entry point (same error boundary, same output layer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.cli.main import run


def _bsr(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = run(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.timeout(60)
def test_pool_once_renders_the_snapshot_as_text(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bsr(capsys, "pool", "--once")
    assert code == 0, err
    for needle in ("bsr top", "Restore pool per rank", "RWS(W=4)", "r0", "r1", "Admission", "Events", "poll"):
        assert needle in out, needle


@pytest.mark.timeout(60)
def test_pool_json_is_the_view_model(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bsr(capsys, "pool", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["info"]["faults_enabled"] is True and data["info"]["w"] == 4
    assert [g["rank"] for g in data["gauges"]] == [0, 1]
    g = data["gauges"][0]
    assert g["capacity_bytes"] >= g["budget_bytes"] > 0 and g["rws_bytes"] == data["info"]["rws_bytes"]
    assert g["state"] in ("ok", "above-rws")
    assert {"active", "recent", "admission", "tiers", "markers", "faults", "events"} <= set(data)


@pytest.mark.timeout(60)
def test_pool_against_nothing_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _bsr(capsys, "--engine", "http://127.0.0.1:9", "--timeout", "2", "pool", "--once")
    assert code == 3, err
    assert err.startswith("bsr: error: cannot reach the engine") and "Traceback" not in err


@pytest.mark.timeout(60)
def test_top_refuses_what_it_cannot_do(capsys: pytest.CaptureFixture[str], tmp_path: Path, incident: Path) -> None:
    code, _, err = _bsr(capsys, "top", "--replay", str(tmp_path / "missing.gz"))
    assert code == 2 and "no recording at" in err
    (tmp_path / "not.gz").write_text("hello")
    code, _, err = _bsr(capsys, "top", "--replay", str(tmp_path / "not.gz"))
    assert code == 2 and "not a bsr top recording" in err
    code, _, err = _bsr(capsys, "top", "--record", str(tmp_path / "r.gz"), "--replay", str(incident))
    assert code == 2 and "not both" in err
    # Under pytest stdout is not a terminal: top says so and points at the non-TTY command.
    code, _, err = _bsr(capsys, "top", "--replay", str(incident))
    assert code == 2 and "interactive terminal" in err and "bsr pool --once" in err
