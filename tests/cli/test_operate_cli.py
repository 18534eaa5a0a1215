"""Every operator command against the real embedded engine, including the failures an on-call engineer meets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bsr_cli.core.evidence import Outcome
from bsr_cli.errors import ExitCode

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(240)]


def test_submit_probe_restore_walkthrough(bsr, engine, tmp_path: Path) -> None:
    r = bsr("submit", "--synthetic", "3000", "--seed", "11", "--json")
    assert r.code == 0, r.err
    assert r.json()["computed_tokens"] == 3000 and r.json()["hash_ok"] is True
    p = bsr("probe", "--synthetic", "3000", "--seed", "11", "--json")
    probe = p.json()
    assert probe["committable_tokens"] == 3000 and probe["first_break"] is None
    saved = tmp_path / "probe.json"
    saved.write_text(p.out)
    plan = bsr("plan", "--W", "4", "--probe", str(saved), "--json").json()  # registration embedded in the probe
    assert plan["committable_chunks"] == 12 and plan["windows_count"] == 3
    text = bsr("probe", "--synthetic", "3000", "--seed", "11")
    assert "no break" in text.out and "BBBB" in text.out  # every chunk in Mooncake and fs
    res = bsr("restore", "--synthetic", "3000", "--seed", "11")
    assert res.code == 0, res.err
    assert "committed 3,000 tokens" in res.out and "= canonical" in res.out
    dry = bsr("restore", "--synthetic", "3000", "--seed", "11", "--dry-run", "--json").report()
    assert dry["kind"] == "bsr.plan" and dry["committable_tokens"] == 3000


def test_restore_says_what_its_hash_check_costs_and_how_to_skip_it(bsr, engine) -> None:
    """After the commit the engine checks the output hash (recomputing the canonical KV on every rank) before it
    answers: `bsr restore` says so when the engine reports the commit, then how long that took and that
    --no-verify skips it. With --no-verify only the output hash is taken. The JSON stays the engine's answer."""
    import re

    assert bsr("submit", "--synthetic", "3000", "--seed", "21").code == 0
    checked = bsr("restore", "--synthetic", "3000", "--seed", "21")
    assert checked.code == 0, checked.err
    assert "= canonical" in checked.out
    cost = r"output-hash check: \d+\.\d\d s after the commit \(canonical KV recomputed; --no-verify skips it\)"
    assert re.search(cost, checked.out), checked.out
    assert "committed; output-hash check: the canonical KV is recomputed on every rank (--no-verify skips it)" in (
        checked.err
    )
    skipped = bsr("restore", "--synthetic", "3000", "--seed", "21", "--no-verify")
    assert skipped.code == 0 and "canonical" not in skipped.out, skipped.out
    assert re.search(r"output hash: \d+\.\d\d s after the commit", skipped.out), skipped.out
    assert "the canonical check is skipped: --no-verify" in skipped.err
    as_json = bsr("restore", "--synthetic", "3000", "--seed", "21", "--json")
    assert as_json.code == 0 and as_json.json()["hash_ok"] is True
    assert not [k for k in as_json.json() if "check" in k] and as_json.err == ""


def test_prompt_and_token_files(bsr, engine, tmp_path: Path) -> None:
    text = tmp_path / "prompt.txt"
    text.write_text("the quick brown fox " * 40)
    r = bsr("submit", "--prompt-file", str(text), "--json")
    assert r.code == 0 and r.json()["tokens"] == 800  # the engine tokenizes bytes
    toks = tmp_path / "tokens.json"
    toks.write_text(json.dumps(list(range(600))))
    assert bsr("submit", "--tokens-file", str(toks), "--json").json()["tokens"] == 600
    bad = tmp_path / "bad.json"
    bad.write_text('["a", 2]')
    r = bsr("probe", "--tokens-file", str(bad))
    assert r.code == ExitCode.INVALID_INPUT and "integers" in r.err


def test_fault_restore_marker_status_and_fallback(bsr, engine) -> None:
    assert bsr("submit", "--synthetic", "2048", "--seed", "12").code == 0
    armed = bsr("inject-fault", "--rank", "1", "--kind", "restore-fault", "--window", "2")
    assert armed.code == 0 and "rank 1, window G2" in armed.out
    listed = bsr("faults", "list", "--json").json()
    assert [f["kind"] for f in listed["faults"]] == ["restore-fault"]
    r = bsr("restore", "--synthetic", "2048", "--seed", "12")
    assert r.code == ExitCode.FAILED_CLOSED
    assert "failed closed" in r.out and "force-local marker set" in r.out
    assert r.err.startswith("bsr: error: restore failed closed: rank 1 failed at install")
    assert "no tier blamed" in r.err
    # The fault is in rank 1's install: its marker excludes no tier (recompute locally), no tier is unhealthy.
    status = bsr("status", "--json").report()
    assert len(status["markers"]) == 1 and status["markers"][0]["excluded_tiers"] == []
    assert all(t["ok"] for t in status["tiers"].values())
    text = bsr("status")
    assert "force-local marker" in text.out and "recompute locally" in text.out and "healthy" in text.out
    nxt = bsr("submit", "--synthetic", "2048", "--seed", "12", "--json").json()
    assert nxt["source"] == "recompute" and nxt["hash_ok"] is True and nxt["force_local"]["cleared"] is True
    assert bsr("faults", "clear", "--json").json() == {"cleared": 0}


def test_drill_passes(bsr, engine) -> None:
    r = bsr("drill", "--tokens", "2048", "--yes", "--json")
    assert r.code == 0, r.err
    d = r.report()
    assert d["ok"] is True and [s["scenario"] for s in d["scenarios"]] == [
        "remote-unavailable",
        "remote-and-ssd-absent",
        "one-rank-restore-fault",
    ]
    assert bsr("faults", "list", "--json").json()["faults"] == []  # always cleared afterwards


@pytest.mark.parametrize(
    ("env", "args", "code", "needle"),
    [
        ({"BSR_ENGINE": "http://127.0.0.1:9"}, ("status",), ExitCode.ENGINE_UNREACHABLE, "cannot reach the engine"),
        ({"BSR_TOKEN": "wrong"}, ("faults", "clear"), ExitCode.UNAUTHORIZED, "token"),
        ({}, ("probe", "--synthetic", "100000"), ExitCode.BAD_REQUEST, "exceeds this engine's limit"),
        ({}, ("probe",), ExitCode.INVALID_INPUT, "exactly one of"),
        ({}, ("inject-fault", "--kind", "meteor"), ExitCode.BAD_REQUEST, "unknown fault kind"),
        ({"BSR_ENGINE": "nonsense"}, ("status",), ExitCode.INVALID_INPUT, "neither a URL nor a profile"),
    ],
)
def test_bad_conditions_give_one_line_and_a_distinct_code(bsr, engine, monkeypatch, env, args, code, needle) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = bsr(*args)
    assert r.code == code, r.err
    assert needle in r.err and "Traceback" not in r.err


def test_no_engine_at_all(bsr, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    r = bsr("status")
    assert r.code == ExitCode.ENGINE_UNREACHABLE and "bsr engine up" in r.err
    assert bsr("engine", "status").code == ExitCode.ENGINE_UNREACHABLE


def test_ctrl_c_during_restore_aborts_it_fail_closed(engine, bsr) -> None:
    assert bsr("submit", "--synthetic", "30000", "--seed", "13").code == 0
    bsr("inject-fault", "--kind", "timeout", "--rank", "0", "--window", "3")  # stalls rank 0 until aborted
    env = dict(os.environ, **engine.env(), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bsr_cli", "restore", "--synthetic", "30000", "--seed", "13"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        started = False
        with engine.client() as c:
            while time.monotonic() < deadline and proc.poll() is None:
                if c.snapshot(health=False).active:
                    started = True
                    break
                time.sleep(0.1)
        if not started:
            gone = proc.poll()
            pytest.fail(
                f"the restore never became active (exit {gone}): {proc.stderr.read() if gone is not None else ''}"
            )
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert "aborted: outcome aborted" in err, err
    with engine.client() as c:
        recent = c.snapshot(health=False).recent[0]
        assert recent.outcome is Outcome.ABORTED
        assert all(p.pool["live_bytes"] == 0 for p in c.pool())


def test_a_server_that_is_not_a_bsr_engine_is_a_version_mismatch(bsr, engine, monkeypatch) -> None:
    """Point bsr at a real HTTP server that does not speak /bsr/v1 (the store's own admin port)."""
    state = json.loads((engine.state_dir / "state.json").read_text())
    monkeypatch.setenv("BSR_ENGINE", state["services"]["mooncake_master"]["urls"]["admin_url"])
    r = bsr("status")
    assert r.code == ExitCode.VERSION_MISMATCH, r.err
    assert "does not serve the bsr v1 admin API" in r.err
