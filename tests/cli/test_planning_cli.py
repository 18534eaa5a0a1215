from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_cli.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]


def test_rws_reproduces_the_paper(bsr) -> None:
    r = bsr("rws", "-r", "paper-mtp-off", "--W", "32", "--tokens", "262144", "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["bytes_per_chunk"] == 16_408_576
    assert d["rws_bytes"] == 525_074_432
    assert d["whole_plan_bytes"] == 16_802_381_824
    assert d["whole_plan_ladder_rung"] == 16 * 1024**3
    assert [s["W"] for s in d["sweep"]] == [8, 16, 32, 64]


def test_rws_table_for_people(bsr) -> None:
    r = bsr("rws", "-r", "paper-mtp-off", "--W", "32", "--l1", "1GiB")
    assert r.code == 0
    assert "525,074,432 (500.75 MiB)" in r.out
    assert "layers.*.attn.kv_latent" in r.out
    assert "holds W ≤ 65" in r.out


def test_plan_largest_prompt(bsr) -> None:
    r = bsr("--json", "plan", "--W", "32", "--tokens", "524032", "-r", "paper-mtp-off")
    d = r.json()
    assert (d["committable_chunks"], d["windows_count"]) == (2047, 64)
    assert d["peak_bytes_per_rank"] == 525_074_432
    assert r.err == ""  # stdout is data, nothing else in --json mode


def test_plan_from_probe_file(bsr, tmp_path: Path) -> None:
    probe = {
        "tiers": ["mooncake", "fs"],
        "ranks": 2,
        "groups": ["full", "swa"],
        "tokens": 1280,
        "chunk_size": 256,
        "rows": [
            {"rank": 0, "group": "full", "cells": "33333"},
            {"rank": 0, "group": "swa", "cells": "33333"},
            {"rank": 1, "group": "full", "cells": "33330"},
            {"rank": 1, "group": "swa", "cells": "33333"},
        ],
    }
    f = tmp_path / "probe.json"
    f.write_text(json.dumps(probe))
    r = bsr("plan", "--W", "2", "--probe", str(f), "-r", "demo", "--json")
    d = r.json()
    assert d["committable_chunks"] == 4
    assert d["first_break"] == {
        "chunk": 4,
        "rank": 1,
        "group": "full",
        "held_by": [],
        "reason": "missing in every tier",
    }
    text = bsr("plan", "--W", "2", "--probe", str(f), "-r", "demo")
    assert "first break" in text.out and "rank 1 group full" in text.out


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (("plan", "--W", "32"), ExitCode.INVALID_INPUT, "exactly one of"),
        (("plan", "--W", "-1", "--tokens", "5"), ExitCode.INVALID_INPUT, ""),
        (("rws", "-r", "nope.json"), ExitCode.INVALID_INPUT, "registration not found"),
        (("rws", "-r", "demo", "--l1", "lots"), ExitCode.INVALID_INPUT, "cannot read a size"),
        (("plan", "--probe", "/nonexistent.json"), ExitCode.INVALID_INPUT, "file not found"),
    ],
)
def test_bad_input_is_one_line_and_distinct_code(bsr, args, code, needle) -> None:
    r = bsr(*args)
    assert r.code == code
    assert needle in r.err
    assert "Traceback" not in r.err


def test_malformed_registration_file(bsr, tmp_path: Path) -> None:
    f = tmp_path / "reg.json"
    f.write_text("{not json")
    r = bsr("registration", "show", str(f))
    assert r.code == ExitCode.INVALID_INPUT
    assert r.err.startswith("bsr: error: ") and "invalid JSON" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_traceback_flag_shows_the_stack(bsr, tmp_path: Path) -> None:
    r = bsr("--traceback", "rws", "-r", str(tmp_path / "missing.json"))
    assert r.code == ExitCode.INVALID_INPUT and "Traceback" in r.err


def test_yaml_registration_and_hf_config(bsr, tmp_path: Path) -> None:
    y = tmp_path / "r.yaml"
    y.write_text(
        "model: tiny\ntp_size: 1\ngroups: [{name: g, block_size: 16}]\n"
        "tensors:\n  - {name: l0, dtype: fp16, shape: [2, 2, 64], group: g}\n"
    )
    assert bsr("rws", "-r", str(y), "--json").json()["bytes_per_chunk"] == 2 * 2 * 64 * 2 * 256
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "torch_dtype": "bfloat16",
            }
        )
    )
    d = bsr("rws", "--hf-config", str(cfg), "--tp", "2", "--json").json()
    assert d["bytes_per_chunk"] == 2 * 2 * 64 * 2 * 256 * 2


def test_registration_diff(bsr) -> None:
    d = bsr("registration", "diff", "paper-mtp-off", "paper-mtp-on", "--json").json()
    assert len(d["added"]) == 3 and d["bytes_per_chunk"]["delta"] > 0


def test_config_precedence(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('engine = "from-file"\ntimeout = 5\n[profiles.prod]\nurl = "http://127.0.0.1:1"\n')
    monkeypatch.setenv("BSR_CONFIG", str(cfg))
    d = bsr("config", "show", "--json").json()
    assert d["engine"] == {"value": "from-file", "source": f"config {cfg}"}
    monkeypatch.setenv("BSR_ENGINE", "from-env")
    assert bsr("config", "show", "--json").json()["engine"]["source"] == "env BSR_ENGINE"
    d = bsr("--engine", "from-flag", "config", "show", "--json").json()
    assert d["engine"] == {"value": "from-flag", "source": "flag"}
    assert d["profiles"] == ["prod"]


def test_version(bsr) -> None:
    r = bsr("--version")
    assert r.code == 0 and r.out.startswith("bsr ")


def test_completions_do_not_drift() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "completions" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
