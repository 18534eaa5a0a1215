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


def test_plan_without_a_prompt_plans_a_ladder_of_prompt_lengths(bsr) -> None:
    """`bsr plan --W 32` as the design writes it: no prompt flag, so the default registration over prompt lengths
    from 8K to 1M tokens, every chunk a hit, saying so in one line on stderr. The bound shows: BSR's peak is
    RWS(W) at every length while the whole-plan staging grows with the prompt."""
    r = bsr("plan", "--W", "32", "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["kind"] == "bsr.plan.ladder" and d["W"] == 32 and d["rws_bytes"] == 525_074_432
    rows = d["rows"]
    assert [x["tokens"] for x in rows] == [8_192, 32_768, 131_072, 262_144, 524_288, 1_048_576]
    assert {x["peak_bytes_per_rank"] for x in rows} == {d["rws_bytes"]}
    assert [x["windows"] for x in rows] == [1, 4, 16, 32, 64, 128]
    chunk, aux = 16_408_576, d["rws_bytes"] - 32 * 16_408_576  # Σc_i and aux of paper-mtp-off
    assert rows[-1]["whole_plan_bytes"] == 4096 * chunk + aux  # the whole 1M-token prefix at once
    text = bsr("plan", "--W", "32")
    assert text.code == 0 and "no prompt given: planning the built-in registration paper-mtp-off" in text.err
    assert len(text.err.strip().splitlines()) == 1, text.err  # what it assumed, in one line
    assert "128.0× less" in text.out and "the same (one window)" in text.out
    mixed = bsr("plan", "--W", "32", "--all-windows")
    assert mixed.code == 2 and "add --tokens N or --probe FILE" in mixed.err and "bsr: hint:" in mixed.err


def test_a_prompt_that_fits_in_one_window_stages_the_same_either_way(bsr) -> None:
    r = bsr("plan", "--W", "32", "--tokens", "8192", "-r", "paper-mtp-off")
    assert r.code == 0 and "fits in one window of W=32: BSR and the whole-plan path stage the same" in r.out
    assert "1.0×" not in r.out


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
        (("plan", "--tokens", "5", "--probe", "p.json"), ExitCode.INVALID_INPUT, "not --tokens and --probe"),
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
    _, hint = r.err.strip().splitlines()  # one line, and what to do
    assert hint.startswith("bsr: hint: ") and "json.tool" in hint


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


# -- bsr plan --trace -------------------------------------------------------------------------------------------------

# Kept beside the repository (beside the worktrees' folder for a worktree).
REAL_TRACE = next(
    (
        p
        for d in (ROOT.parent, ROOT.parent.parent)
        if (p := d / "shared" / "traces" / "conversation_trace.jsonl").exists()
    ),
    ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl",
)
# Two restores that overlap (hand-computed in tests/core/test_trace_sim.py): with the demo registration (1 MiB per
# chunk per rank) at 1 MiB/s, the whole plan holds 10 chunks; W=2 with B = 1·RWS holds 2 and r2 waits 3 s.
TINY = [
    {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
    {"timestamp": 0, "input_length": 1536, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 2048, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
]
TINY_ARGS = ("-r", "demo", "--W", "2", "--bandwidth", "1MiB/s")
BW = ("--bandwidth", "1GB/s")


def _write_trace(path: Path, rows: list[dict] | list[str]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_plan_trace_json(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    r = bsr("plan", "--trace", str(f), *TINY_ARGS, "--p99", "9.5", "--json")
    assert r.code == 0, r.err
    d = r.json()
    mib = 1 << 20
    assert (d["kind"], d["requests"], d["restores"], d["hit_tokens"]) == ("bsr.plan.trace", 3, 2, 2560)
    assert d["largest_hit"] == {"request": 2, "tokens": 1536, "chunks": 6, "bytes_per_rank": 6 * mib}
    assert d["whole_plan"]["peak_bytes_per_rank"] == 10 * mib
    assert d["whole_plan"]["latency_s"]["p99"] == pytest.approx(9.0)
    rows = {row["budget_rws"]: row for row in d["bsr"]}
    assert sorted(rows) == [1, 2, 4, 8]
    assert [rows[k]["peak_bytes_per_rank"] // mib for k in (1, 2, 4, 8)] == [2, 4, 6, 10]
    assert rows[1]["wait_s"]["p99"] == pytest.approx(3.0)
    assert d["smallest_budget_meeting_p99"] == {"budget_rws": 1, "budget_bytes": 2 * mib}
    assert r.err == ""


def test_plan_trace_text_agrees_with_json(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    r = bsr("plan", "--trace", str(f), *TINY_ARGS, "--p99", "8")
    assert r.code == 0, r.err
    assert "3 requests over 1.0 s at its own pace; 2 restore a hit" in r.out
    assert "largest single hit: 1,536 tokens = 6 chunks = 6,291,456 (6.00 MiB) per rank" in r.out
    cells = [[c.strip() for c in ln.split("│")[1:-1]] for ln in r.out.splitlines() if "│" in ln]
    rows = {row[0]: row[1:] for row in cells}
    assert rows["whole plan (W=0)"][:5] == ["unbounded", "10.00 MiB", "7.00 s", "9.00 s", "9.00 s"]
    bsr1 = ["2.00 MiB", "2.00 MiB", "4.00 s", "9.00 s", "9.00 s", "0 ms", "3.00 s", "3.00 s"]
    assert rows["BSR, B = 1·RWS"][:8] == bsr1
    # No budget meets 8 s at p99 (r2 always needs 9 s); neither does the whole plan: bandwidth-bound.
    assert "no budget B (1·RWS, 2·RWS, 4·RWS, 8·RWS) meets p99 ≤ 8.00 s" in r.out
    assert "neither does the whole plan" in r.out
    assert "None" not in r.out and "?" not in r.out


def test_plan_trace_speedup_store_capacity_and_budgets(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    d = bsr("plan", "--trace", str(f), *TINY_ARGS, "--speedup", "1000", "--budgets", "2,1", "--json").json()
    assert [row["budget_rws"] for row in d["bsr"]] == [1, 2]
    assert d["span_s"] == pytest.approx(0.001)
    d = bsr("plan", "--trace", str(f), *TINY_ARGS, "--store-capacity", "1", "--json").json()
    assert (d["store_capacity_blocks"], d["hit_tokens"], d["restores"]) == (1, 512 + 512, 2)


def test_plan_trace_plots(bsr, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="PNG plots need the bench extra (matplotlib)")
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    d = bsr("plan", "--trace", str(f), *TINY_ARGS, "--plot", str(tmp_path / "plots"), "--json").json()
    assert [Path(p).name for p in d["plots"]] == ["trace-l1-over-time.png", "trace-latency-cdf.png"]
    for p in d["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_trace_imports_no_plotting_or_bench_unless_asked(tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    code = (
        "import io, contextlib, sys, json\n"
        "from bsr_cli.cli.main import run\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert run(['plan', '--trace', {str(f)!r}, *{list(TINY_ARGS)!r}]) == 0\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "bsr_cli.core.trace_sim" in loaded  # the command did run
    heavy = {m for m in loaded if m.split(".")[0] in ("matplotlib", "numpy", "torch") or m.startswith("bsr_cli.bench")}
    assert not heavy, heavy


@pytest.mark.parametrize(
    ("lines", "args", "needle"),
    [
        (["{not json"], BW, "t.jsonl:1: not a JSON object"),
        ([json.dumps(TINY[0]), "[1, 2]"], BW, "t.jsonl:2: expected a JSON object"),
        ([json.dumps(TINY[1]), json.dumps(TINY[0] | {"timestamp": -5})], BW, "timestamp must be >= 0"),
        ([json.dumps(TINY[2]), json.dumps(TINY[0])], BW, "t.jsonl:2: arrival 0 ms is before the previous"),
        ([json.dumps(TINY[0] | {"input_length": 2.5})], BW, "input_length must be an integer"),
        ([json.dumps(TINY[0] | {"hash_ids": [1, 2, 3]})], BW, "3 hash_ids for 1024 input tokens"),
        (["", "  "], BW, "no requests"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "fast"), "cannot read a positive rate from 'fast'"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "0GB/s"), "cannot read a positive rate"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "-3GB/s"), "cannot read a positive rate"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--speedup", "0"), "speed-up must be"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--budgets", "1,x"), "--budgets takes"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--budgets", "0"), "at least 1"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--p99", "-1"), "p99 target"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--W", "0"), "W ≥ 1"),
        ([json.dumps(r) for r in TINY], (), "--trace needs --bandwidth"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--tokens", "5"), "not --tokens and --trace"),
        ([json.dumps(r) for r in TINY], ("--bandwidth", "1GB/s", "--all-windows"), "plan one prompt, not a trace"),
    ],
)
def test_plan_trace_bad_input_is_one_line_exit_2(bsr, tmp_path: Path, lines, args, needle) -> None:
    f = _write_trace(tmp_path / "t.jsonl", lines)
    r = bsr("plan", "--trace", str(f), "-r", "demo", *args)
    assert r.code == ExitCode.INVALID_INPUT, (r.code, r.err)
    assert needle in r.err, r.err
    assert r.err.startswith("bsr: error: ") and "Traceback" not in r.err
    assert r.out == ""


def test_plan_trace_missing_file_and_trace_flags_without_trace(bsr, tmp_path: Path) -> None:
    r = bsr("plan", "--trace", str(tmp_path / "nope.jsonl"), "-r", "demo", "--bandwidth", "1GB/s")
    assert r.code == ExitCode.INVALID_INPUT and "trace not found" in r.err
    r = bsr("plan", "--tokens", "512", "--bandwidth", "1GB/s", "--p99", "1")
    assert r.code == ExitCode.INVALID_INPUT and "--bandwidth, --p99 plan a trace: add --trace FILE" in r.err


# A host on which a chunk (1 MiB) needs 2 CPU seconds: at 1 MiB/s its bytes take 1 s, so TINY's restores are
# CPU-bound. On one core: r1 alone for 1 s (1 of its 8 CPU s), then both at half a core: r1's other 7 CPU s end at
# 15 s, when r2 has 5 of its 12 left, alone: 20 s. Latencies 15 s and 19 s.
CPU_PER_GB = str(2 / ((1 << 20) / 1e9))


def _calibration(tmp_path: Path, **host: object) -> Path:
    from bsr_cli.core.host_model import HostCalibration, HostModel, HostState

    model = {"cores": 1.0, "job_cores": 1.0, "restore_cpu_s": 0.0, "restore_cpu_s_per_gb": float(CPU_PER_GB)} | host
    cal = HostCalibration(
        measured_at="2025-01-01T00:00:00.000Z",
        registration="reg-0000000000000000",
        chunk_size=256,
        bytes_per_chunk=1 << 20,
        tp_size=1,
        w=2,
        bandwidth=float(1 << 20),
        host=HostModel(**model),  # type: ignore[arg-type]
        burst_stretch=1.0,
        host_state=HostState(2, (1.0, 1.0, 1.0), 0.0, 0.0, 1.0),
        samples=(),
    )
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal.to_wire()))
    return path


def test_plan_trace_on_a_host_model(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    d = bsr("plan", "--trace", str(f), *TINY_ARGS, "--cores", "1", "--cpu-per-gb", CPU_PER_GB, "--json").json()
    assert d["whole_plan"]["latency_s"]["p50"] == pytest.approx(15.0)
    assert d["whole_plan"]["latency_s"]["p99"] == pytest.approx(19.0)
    assert d["whole_plan"]["bound_by"] == {"cpu": 2}
    assert d["host"] == {
        "cores": 1.0,
        "job_cores": 1.0,
        "restore_cpu_s": 0.0,
        "restore_cpu_s_per_gb": pytest.approx(float(CPU_PER_GB)),
        "compute_cpu_s_per_gb": 0.0,
    }
    # 10 chunks restored at 2 CPU s each, over the trace's 1 s, on one core: it needs 20 times the cores it has.
    assert d["cpu_load"] == pytest.approx(20.0)
    r = bsr("plan", "--trace", str(f), *TINY_ARGS, "--cores", "1", "--cpu-per-gb", CPU_PER_GB)
    text = " ".join(r.out.split())
    assert "host: cores available to bsr 1, at most 1 per restore" in text and "1907.35 s/GB of CPU" in text
    # The negative control: the bandwidth alone (no host) gives 7 s and 9 s.
    d = bsr("plan", "--trace", str(f), *TINY_ARGS, "--json").json()
    assert d["whole_plan"]["latency_s"]["p50"] == pytest.approx(7.0) and "bound_by" not in d["whole_plan"]


def test_plan_trace_from_a_saved_calibration(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    cal = _calibration(tmp_path)
    # Its bandwidth (1 MiB/s) and host model: no --bandwidth needed. It measured another registration: a warning.
    r = bsr("plan", "--trace", str(f), "-r", "demo", "--W", "2", "--calibration", str(cal), "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["bandwidth_bytes_per_s"] == 1 << 20
    assert (d["whole_plan"]["latency_s"]["p50"], d["whole_plan"]["latency_s"]["p99"]) == pytest.approx((15.0, 19.0))
    assert "bsr: warning: the calibration measured registration reg-0000000000000000" in r.err
    # --cores puts the host's state in the calibration's place: two cores, one restore at most one: 8 s and 12 s.
    d = bsr(
        "plan", "--trace", str(f), "-r", "demo", "--W", "2", "--calibration", str(cal), "--cores", "2", "--json"
    ).json()
    assert (d["whole_plan"]["latency_s"]["p50"], d["whole_plan"]["latency_s"]["p99"]) == pytest.approx((8.0, 12.0))
    assert d["host"]["cores"] == 2.0


def test_plan_trace_host_flags_refused_in_one_line(bsr, tmp_path: Path) -> None:
    f = _write_trace(tmp_path / "t.jsonl", TINY)
    not_one = tmp_path / "other.json"
    not_one.write_text(json.dumps({"kind": "bsr.plan.trace"}))
    for args, needle in (
        (("--cores", "1"), "--cores and --cpu-per-gb model the host together"),
        (("--cores", "0", "--cpu-per-gb", "1"), "cores must be positive"),
        (("--cores", "1", "--cpu-per-gb", "-1"), "restore_cpu_s_per_gb must be at least 0"),
        (("--calibration", str(not_one)), "not a calibration"),
        (("--calibration", str(_calibration(tmp_path, cores=0.0))), "cores must be positive"),
        (("--calibration", str(tmp_path / "missing.json")), "file not found"),
    ):
        r = bsr("plan", "--trace", str(f), "-r", "demo", "--W", "2", *args)
        assert r.code == ExitCode.INVALID_INPUT, (args, r.err)
        assert needle in r.err and r.err.startswith("bsr: error: ") and "Traceback" not in r.err, r.err
    r = bsr("plan", "--tokens", "512", "--cores", "2")
    assert r.code == ExitCode.INVALID_INPUT and "--cores plan a trace: add --trace FILE" in r.err


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"the conversation trace is not at {REAL_TRACE}")
def test_plan_the_conversation_trace(bsr) -> None:
    """The issue's figures on the real trace (their derivation is in docs/capacity-planning.md)."""
    r = bsr(
        "plan", "--trace", str(REAL_TRACE), "-r", "paper-mtp-off", "--W", "32", "--bandwidth", "10.31GB/s", "--json"
    )
    assert r.code == 0, r.err
    d = r.json()
    gib = 1 << 30
    assert (d["requests"], d["restores"], d["largest_hit"]["tokens"]) == (12_031, 12_030, 122_880)
    assert d["largest_hit"]["bytes_per_rank"] == 480 * 16_408_576  # 7.34 GiB
    assert 13 * gib < d["whole_plan"]["peak_bytes_per_rank"] < 15 * gib
    for row in d["bsr"]:
        assert row["peak_bytes_per_rank"] <= row["budget_bytes"]
    assert d["bsr"][0]["peak_bytes_per_rank"] < 0.6 * gib


def test_a_dry_run_says_why_only_when_the_plan_does_not_fit() -> None:
    """`bsr restore --dry-run`'s capacity: message and hint are keys only when the windows cannot be admitted."""
    from bsr_cli.cli.render.planning import CapacityFit, PlanReport
    from bsr_cli.core.plan import plan_restore
    from bsr_cli.loaders import load_registration

    reg = load_registration("demo")
    plan = plan_restore(reg, 2, tokens=1024)
    report = {"plan": plan, "bytes_per_chunk": reg.bytes_per_chunk, "model": reg.model, "show_all_windows": False}
    fits = PlanReport(**report, capacity=CapacityFit(True, 2, 4, 8)).to_wire()
    assert list(fits)[-1] == "capacity"
    assert fits["capacity"] == {"fits": True, "window_bytes": 2, "budget_bytes": 4, "pool_bytes": 8}
    refused = CapacityFit(False, 8, 4, 8, message="W=2: too big", hint="raise --budget")
    capacity = PlanReport(**report, capacity=refused).to_wire()["capacity"]
    assert list(capacity) == ["fits", "window_bytes", "budget_bytes", "pool_bytes", "message", "hint"]
    assert "capacity" not in PlanReport(**report).to_wire()
