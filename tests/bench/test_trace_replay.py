"""`bsr bench trace`: a written trace replayed against a real embedded engine (Mooncake master and segment, rank
processes), the planner's prediction printed beside the measurement; a slice of the shared conversation trace at 4×
its pace queued, not refused, by an engine with fewer serving slots than requests in flight; and the slice's sizing
refused when it cannot fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bsr_cli import loaders
from bsr_cli.bench import trace as bt
from bsr_cli.bench.lifecycle import embedded_engine
from bsr_cli.core.registration import Registration
from bsr_cli.core.trace import TraceRequest, build_trace
from bsr_cli.errors import CapacityError, ExitCode, InvalidInput

# The Mooncake FAST'25 conversation trace, kept beside the repository (beside the worktrees' folder for a worktree).
ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = next(
    (
        p
        for p in (d / "shared" / "traces" / "conversation_trace.jsonl" for d in (ROOT.parent, ROOT.parent.parent))
        if p.exists()
    ),
    None,
)

REPORT_KEYS = (
    "kind",
    "trace",
    "requests",
    "speedup",
    "block_tokens",
    "token_scale",
    "registration",
    "model",
    "bytes_per_chunk",
    "W",
    "budget_rws",
    "budget_bytes",
    "bandwidth_bytes_per_s",
    "calibration",
    "predicted",
    "measured",
    "committed",
    "checks",
    "latency_ratio",
)


def _conversations(n_conv: int = 6, turns: int = 4) -> list[dict]:
    """``n_conv`` conversations of ``turns`` turns, interleaved: each turn repeats its conversation's earlier blocks
    and adds two, one second after the previous request."""
    rows = []
    history: dict[int, list[int]] = {c: [1000 * (c + 1)] for c in range(n_conv)}
    t = 0
    for turn in range(turns):
        for c in range(n_conv):
            ids = history[c] + [1000 * (c + 1) + 10 * turn + k for k in (1, 2)]
            history[c] = ids
            rows.append({"timestamp": t, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids})
            t += 1000
    return rows


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_replay_against_the_embedded_engine(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _conversations()))
    # No LMCache here: the stock side says so in one line and the engine's side is still reported.
    monkeypatch.setenv("BSR_LMCACHE_PYTHON", str(tmp_path / "no-such-python"))
    r = bsr("bench", "trace", str(f), "-n", "24", "--speedup", "4", "--W", "2", "--budget-rws", "2", "--json")
    assert r.code == 0, r.err
    d = r.report()
    assert d["stock"]["run"] is False and "no Python with LMCache 0.5.6" in d["stock"]["reason"]
    warned = "bsr: warning: stock LMCache: not run (no Python with LMCache"
    assert [x for x in r.err.splitlines() if x.startswith(warned)], r.err
    assert (d["requests"], d["block_tokens"], d["W"], d["budget_rws"]) == (24, 64, 2, 2)
    m, p = d["measured"], d["predicted"]
    # Pool within B on every rank, nothing failed, never more committed than the prefix the trace shares.
    assert set(m["pool_peak_by_rank"]) == {"0", "1"}
    assert all(0 < v <= d["budget_bytes"] for v in m["pool_peak_by_rank"].values())
    assert m["failed"] == 0 and d["checks"] == {
        "pool_within_budget": True,
        "no_failures": True,
        "no_more_than_predicted": True,
    }
    # Every turn after the first restores its conversation's earlier blocks: 18 restores are predicted. A turn whose
    # previous turn is still being stored commits less (counted apart), never more.
    assert p["restores"] == 18
    assert d["committed"]["exact"] + d["committed"]["fewer"] == 24 and d["committed"]["more"] == 0
    assert 0 < m["hit_tokens"] <= p["hit_tokens"]
    assert p["latency_s"]["p99"] > 0 and m["latency_s"]["p99"] > 0
    assert d["bandwidth_bytes_per_s"] > 0  # measured by one restore alone first


def _peak_in_flight(measured: list[bt.Measured]) -> int:
    """The most requests the engine held at once: each from when its client sent it for as long as it took."""
    spans = [(m.started_s, m.started_s + m.seconds) for m in measured if not m.error]
    return max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)


@pytest.mark.engine
@pytest.mark.timeout(420)
@pytest.mark.skipif(SHARED_TRACE is None, reason="the shared conversation trace is not beside the repository")
def test_a_replay_at_four_times_its_pace_is_queued_not_refused(tmp_path: Path) -> None:
    """The conversation trace's first 40 requests at 4× their pace, each sent at its arrival, against an engine with
    4 serving slots and destination KV for two of the slice's longest prompts: more submits are in flight than the
    engine has slots (or KV) for, and every one waits its turn within its deadline instead of being refused (from
    the fifth in flight on, they used to be refused at once: 503 busy)."""
    assert SHARED_TRACE is not None
    reg = bt.replay_registration()
    sliced = loaders.load_trace(SHARED_TRACE).head(40).scale_tokens(16)
    size = bt.sizing(sliced, reg)
    opts = replace(
        bt.engine_options(reg, 2, 2, size), kv_tokens=2 * size.max_tokens, admin_limits={"max_connections": 4}
    )
    with embedded_engine(tmp_path / "engine", opts) as client:
        measured = bt.replay(client, sliced, w=2, speedup=4.0, salt=11)
    refused = [m.error for m in measured if m.error]
    assert len(measured) == 40 and refused == [], refused[:3]
    assert _peak_in_flight(measured) > 4  # the slots alone would have refused some


def test_a_slice_too_large_for_the_segment_is_refused() -> None:
    big = build_trace((f"line {i}", TraceRequest(i, 500_000, 1, ())) for i in range(40))
    with pytest.raises(InvalidInput, match="capped at"):
        bt.sizing(big.scale_tokens(512), bt.replay_registration())


def test_bad_replay_options_are_refused_before_any_engine_starts(bsr, tmp_path: Path) -> None:
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _conversations(1, 2)))
    for args, needle in (
        (("--speedup", "0"), "speed-up must be"),
        (("--skip", "5"), "leaves nothing"),
        (("--block-tokens", "600"), "tokens per block"),
        (("--bandwidth", "slow"), "cannot read a positive rate"),
        (("--stock-l1", "lots"), "--stock-l1: cannot read a size"),
        (("--no-stock", "--stock-serial"), "drop --no-stock"),
    ):
        r = bsr("bench", "trace", str(f), *args)
        assert r.code == ExitCode.INVALID_INPUT, (args, r.err)
        assert needle in r.err and "Traceback" not in r.err


def _stock_run(trace_rows: list[dict], loaded: list[int], **by_index: dict) -> tuple:
    """A stock replay's report as the plugin process writes it (LMCache itself runs in tests/plugins)."""
    trace = build_trace(
        (f"line {i}", TraceRequest(r["timestamp"], r["input_length"], 8, tuple(r["hash_ids"])))
        for i, r in enumerate(trace_rows)
    ).scale_tokens(64)
    reqs = [
        {"index": i, "loaded_tokens": n, "loaded_by_rank": [n, n], "restore_seconds": 0.01 * (i + 1)}
        | by_index.get(f"r{i}", {})
        for i, n in enumerate(loaded)
    ]
    requests = tuple(bt.StockRequest.from_wire(r) for r in reqs)
    run = bt.StockRun(requests, {0: 3 << 20, 1: 2 << 20}, 64 << 20, 1.0, 1.0, "0.5.6")
    return trace, run


def test_stock_is_held_to_the_simulated_hits_in_full_chunks() -> None:
    reg = bt.replay_registration()
    # Two turns of one conversation, then the second turn again with a partial last block: its whole input is a hit.
    again = {"timestamp": 9000, "input_length": 1500, "output_length": 8, "hash_ids": [1000, 1001, 1002]}
    rows = [*_conversations(1, 2), again]
    trace, run = _stock_run(rows, [0, 192, 128])
    want = bt.expected_hits(trace, reg)
    assert want == [0, 192, 188]  # the planner counts the partial chunk of a whole-input hit
    s = bt.stock_summary(trace, reg, run)
    assert (s.expected_hit_tokens, s.hit_tokens, s.partial_chunk_tokens) == (320, 320, 60)
    assert s.committed == bt.CommittedCounts(3, 0, 0) and s.failed == 0 and s.first_failure == ""
    assert s.restores == 2 and s.to_wire()["peak_bytes_per_rank"] == 3 << 20

    # The negative control: one request short, one that ran into LMCache's blocking timeout, one that raised.
    trace, run = _stock_run(rows, [0, 64, 0], r2={"restore_seconds": bt.STOCK_DEADLINE_S})
    s = bt.stock_summary(trace, reg, run)
    assert s.committed == bt.CommittedCounts(1, 1, 0) and s.failed == 1
    assert "no L1 for its whole plan" in s.first_failure
    trace, run = _stock_run(rows, [0, 192, 128], r0={"error": "RuntimeError: store: boom"})
    s = bt.stock_summary(trace, reg, run)
    assert s.failed == 1 and s.first_failure == "RuntimeError: store: boom"


def test_the_report_puts_stock_beside_the_engine_in_text_and_json() -> None:
    import io

    from rich.console import Console

    from bsr_cli.cli.render import planning as render

    reg = bt.replay_registration()
    rows = _conversations(1, 2)
    trace, run = _stock_run(rows, [0, 192])
    measured = [bt.Measured(0, 0.0, 0.0), bt.Measured(1, 1.0, 1.0, 192, 0.02, 0.05)]
    d = bt.compare(trace, reg, measured, w=2, budget_rws=2, bandwidth=1e8, speedup=1.0, pool_peaks={0: 1, 1: 1})
    d = replace(d, skip=0, salt=1)
    for stock, needles in (
        (
            bt.stock_summary(trace, reg, run),
            ("stock LMCache 0.5.6", "3.00 MiB", "whole-plan peak per rank", "the hit's full chunks: 2 of 2"),
        ),
        (bt.StockNotRun("skipped with --no-stock"), ("stock LMCache: not run (skipped with --no-stock)",)),
    ):
        report = replace(d, stock=stock)
        wire = report.to_wire()
        buf = io.StringIO()
        render.trace_replay(Console(file=buf, width=200, color_system=None), report)
        text = buf.getvalue()
        for needle in needles:
            assert needle in text, text
        assert "None" not in text and "?" not in text
        # The --json side of the same result: the report's keys, in order, stock last.
        assert list(json.loads(json.dumps(wire))) == [*REPORT_KEYS, "skip", "salt", "stock"]


def test_stock_needs_one_paged_kv_layout() -> None:
    reg = bt.replay_registration()
    assert bt.stock_model(reg) == {
        "name": "bsr-trace-replay",
        "layers": 2,
        "kv_heads": 1,
        "head_size": 128,
        "dtype": "bf16",
        "block_size": 16,
        "chunk_size": 64,
        "tp_size": 2,
    }
    two = bt.REPLAY_REGISTRATION.to_dict()
    two["groups"] = [{"name": "kv", "block_size": 16}, {"name": "win", "block_size": 16}]
    two["tensors"] = [dict(t) for t in two["tensors"]]
    two["tensors"][1]["group"] = "win"
    with pytest.raises(CapacityError, match="one KV layout"):
        bt.stock_model(Registration.from_dict(two, source="test"))
