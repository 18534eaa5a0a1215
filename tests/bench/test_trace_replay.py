"""`bsr bench trace`: a written trace replayed against a real embedded engine (Mooncake master and segment, rank
processes) after a calibration of the host model, the planner's prediction printed beside the measurement per budget
with what bound each restore on both sides, and its bundle; what bound each restore worked out from the engine's
recorded numbers; a slice of the shared conversation trace at 4× its pace queued, not refused, by an engine with
fewer serving slots than requests in flight; and the slice's sizing refused when it cannot fit."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest

from bsr_cli import loaders
from bsr_cli.bench import bundle as bundles
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
    "bandwidth_bytes_per_s",
    "calibration",
    "calibration_file",
    "runs",
    "checks",
)
RUN_KEYS = (
    "status",
    "kind",
    "budget_rws",
    "budget_bytes",
    "salt",
    "started_at",
    "loadavg",
    "run_queue_beside",
    "pressure",
    "predicted",
    "measured",
    "committed",
    "latency_ratio",
    "agrees",
    "checks",
    "elapsed_s",
)
BOUNDS = {"bandwidth", "cpu", "budget", "destination_kv"}


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
@pytest.mark.timeout(600)
def test_replay_against_the_embedded_engine(bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _conversations()))
    # No LMCache here: the stock side says so in one line and the engine's side is still reported.
    monkeypatch.setenv("BSR_LMCACHE_PYTHON", str(tmp_path / "no-such-python"))
    out = tmp_path / "out"
    args = ("-n", "24", "--speedup", "4", "--W", "2", "--budget-rws", "1,2", "-o", str(out), "--json")
    r = bsr("bench", "trace", str(f), *args)
    assert r.code == 0, r.err
    d = r.report()
    assert d["stock"]["run"] is False and "no Python with LMCache 0.5.6" in d["stock"]["reason"]
    warned = "bsr: warning: stock LMCache: not run (no Python with LMCache"
    assert [x for x in r.err.splitlines() if x.startswith(warned)], r.err
    assert [k for k in d if k in REPORT_KEYS] == list(REPORT_KEYS)
    assert (d["requests"], d["block_tokens"], d["W"]) == (24, 64, 2)
    # The calibration ran first, was saved, and is the planner's: its host model and the host's state.
    cal = d["calibration"]
    assert cal["kind"] == "bsr.calibration" and Path(d["calibration_file"]).is_file()
    assert json.loads(Path(d["calibration_file"]).read_text()) == cal
    assert cal["host"]["cores"] > 0 and cal["host_state"]["cpu_count"] >= 1 and cal["bandwidth_bytes_per_s"] > 0
    assert {s["what"] for s in cal["samples"]} == {"restore", "work", "work_done", "burst"}
    # The steady work had six clients on this host's cores: the cores it got, read as a replay reads them, are there
    # (absent only where the engine never waited for a CPU, which a host with more cores than the work allows).
    contended = cal["host_state"].get("cores_contended")
    assert contended is None or 0 < contended <= cal["host_state"]["cpu_count"]
    assert d["bandwidth_bytes_per_s"] == cal["bandwidth_bytes_per_s"]
    # One run per budget, each with predicted and measured side by side and what bound its restores.
    assert [run["budget_rws"] for run in d["runs"]] == [1, 2]
    for run in d["runs"]:
        assert [k for k in run if k != "at_replay_cores"] == list(RUN_KEYS)
        p, m = run["predicted"], run["measured"]
        # Every turn after the first restores its conversation's earlier blocks: 18 restores are predicted. A turn
        # whose previous turn is still being stored commits less (counted apart), never more.
        assert p["restores"] == 18 and 0 < m["restores"] <= 18
        assert run["committed"]["exact"] + run["committed"]["fewer"] == 24 and run["committed"]["more"] == 0
        assert set(p["bound_by"]) <= BOUNDS and sum(p["bound_by"].values()) == p["restores"]
        assert set(m["bound_by"]) <= BOUNDS and sum(m["bound_by"].values()) == m["restores"]
        assert p["latency_s"]["p99"] > 0 and m["latency_s"]["p99"] > 0 and p["bandwidth_only_latency_s"]["p99"] > 0
        assert set(m["pool_peak_by_rank"]) == {"0", "1"}
        assert all(0 < v <= run["budget_bytes"] for v in m["pool_peak_by_rank"].values())
        assert run["checks"] == {"pool_within_budget": True, "no_failures": True, "no_more_than_stored": True}
        assert set(run["latency_ratio"]) == set(run["agrees"]) == {"p50", "p99"}
        assert len(run["loadavg"]) == 2
        at = run.get("at_replay_cores")  # present when the engine was short of cores while it replayed
        assert at is None or (at["cores"] > 0 and at["latency_s"]["p99"] > 0 and set(at["agrees"]) == {"p50", "p99"})
    # The bundle: written, valid, one row per budget.
    bundle = bundles.load(Path(d["bundle"]))
    assert bundles.validation_errors(bundle) == []
    assert bundle["experiment"] == "trace" and [row["budget_rws"] for row in bundle["rows"]] == [1, 2]
    assert bundle["summary"]["calibration"] == cal
    assert len(bundle["targets"]) == 4


@pytest.mark.engine
@pytest.mark.timeout(420)
def test_what_bound_each_restore_follows_from_the_engine_s_numbers(tmp_path: Path) -> None:
    """Against the real engine at B = 1·RWS with W = 2 (a restore of 4 chunks or more holds all of B): each
    measured restore's waits for destination KV and for B come from its events, and its bound is the longest of those
    waits and its service split at the bandwidth, worked out here again from the recorded numbers."""
    reg = bt.replay_registration()
    # Four conversations' first turns a second apart, then their next two turns in one burst.
    rows = _conversations(4, 3)
    trace = build_trace(
        (f"line {i}", TraceRequest(r["timestamp"] if i < 4 else 5000, r["input_length"], 8, tuple(r["hash_ids"])))
        for i, r in enumerate(rows)
    ).scale_tokens(64)
    size = bt.sizing(trace, reg)
    with embedded_engine(tmp_path / "engine", bt.engine_options(reg, 2, 1, size)) as client:
        since = time.time()
        measured = bt.replay(client, trace, w=2, speedup=1.0, salt=5)
        bt.read_waits(client, measured, since - 1)
    restored = [m for m in measured if m.restore_seconds is not None]
    assert restored and all(m.request for m in measured)
    bandwidth = 50e6
    for m in restored:
        assert 0 <= m.budget_wait_s <= (m.restore_seconds or 0) and m.kv_wait_s >= 0
        size_bytes = -(-m.committed_tokens // reg.chunk_size) * reg.bytes_per_chunk
        service = (m.restore_seconds or 0) - m.budget_wait_s
        by_bytes = min(service, size_bytes / bandwidth)
        parts = {
            "bandwidth": by_bytes,
            "cpu": service - by_bytes,
            "budget": m.budget_wait_s,
            "destination_kv": m.kv_wait_s,
        }
        assert bt.measured_bound(m, reg, bandwidth).value == max(parts, key=lambda k: parts[k])
    replayed = bt.BudgetReplayed(1, 5, measured, {0: 1, 1: 1}, (1.0, 1.0), "2025-01-01T00:00:00.000Z", 1.0)
    run = bt.compare(trace, reg, replayed, w=2, bandwidth=bandwidth, speedup=1.0)
    counted = {b.value: n for b, n in run.measured.bound_by.items()}
    assert sum(counted.values()) == len(restored)
    assert counted == {
        k: n for k in BOUNDS if (n := sum(1 for m in restored if bt.measured_bound(m, reg, bandwidth).value == k))
    }


def test_waits_for_b_are_read_from_window_events() -> None:
    """A window waits from its window_waiting event until its fetch began (window_fetched less its seconds); a rank's
    waits add up, and a request's is its slowest rank's. The negative control: a fetch that was never waited for
    adds nothing, and a wait whose fetch never came is not counted."""
    events = [
        {"type": "window_waiting", "request": "a", "rank": 0, "window": 0, "time": 10.0},
        {"type": "window_fetched", "request": "a", "rank": 0, "window": 0, "time": 10.5, "seconds": 0.1},
        {"type": "window_waiting", "request": "a", "rank": 0, "window": 1, "time": 11.0},
        {"type": "window_fetched", "request": "a", "rank": 0, "window": 1, "time": 11.3, "seconds": 0.1},
        {"type": "window_waiting", "request": "a", "rank": 1, "window": 0, "time": 10.0},
        {"type": "window_fetched", "request": "a", "rank": 1, "window": 0, "time": 10.2, "seconds": 0.1},
        {"type": "window_fetched", "request": "b", "rank": 0, "window": 0, "time": 12.0, "seconds": 0.1},
        {"type": "window_waiting", "request": "c", "rank": 0, "window": 0, "time": 12.0},
    ]
    waits = bt.budget_waits(events)
    assert waits == pytest.approx({"a": 0.6})  # rank 0: 0.4 + 0.2; rank 1: 0.1
    assert "b" not in waits and "c" not in waits


def test_a_measured_restore_s_bound_is_the_longest_part_of_its_time() -> None:
    reg = bt.replay_registration()  # 64 KiB per chunk per rank
    m = bt.Measured(0, 0.0, 0.0, committed_tokens=128, restore_seconds=1.0, request="r", kv_wait_s=0.0)
    # 2 chunks = 128 KiB: at 1 MB/s 0.131 s of bytes, the rest of its 1 s is CPU.
    assert bt.measured_bound(m, reg, 1e6).value == "cpu"
    assert bt.measured_bound(m, reg, 1e5).value == "bandwidth"  # 1.31 s of bytes: all of its service
    assert bt.measured_bound(replace(m, budget_wait_s=0.6), reg, 1e6).value == "budget"
    assert bt.measured_bound(replace(m, kv_wait_s=2.0), reg, 1e6).value == "destination_kv"


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


def _two_turns(r0_commits: int, r0_seconds: float) -> bt.BudgetRun:
    """A conversation's turn (three blocks) then, a second later, a request holding its first two blocks: the
    first turn restores ``r0_commits`` tokens and ends ``r0_seconds`` after it was sent; the second one restores
    the two blocks the first stored."""
    reg = bt.replay_registration()
    rows = [
        {"timestamp": 0, "input_length": 512 * 3, "output_length": 8, "hash_ids": [6000, 6001, 6002]},
        {"timestamp": 1000, "input_length": 512 * 2, "output_length": 8, "hash_ids": [6000, 6001]},
    ]
    trace, _ = _stock_run(rows, [0, 0])
    assert bt.expected_hits(trace, reg) == [0, 128]
    measured = [bt.Measured(0, 0.0, 0.0, r0_commits, 0.02, r0_seconds), bt.Measured(1, 1.0, 1.0, 128, 0.02, 0.05)]
    replayed = bt.BudgetReplayed(2, 1, measured, {0: 1, 1: 1}, (3.0, 4.0), "2025-01-01T00:00:00.000Z", 2.0, 9.5)
    return bt.compare(trace, reg, replayed, w=2, bandwidth=1e8, speedup=1.0)


def test_a_restore_may_find_a_later_turns_store_done_first_but_never_what_none_stored() -> None:
    # Under load the engine stored the second request (sent at 1 s) before it looked the first up (ended at 3 s):
    # the first committed the two blocks the plan gave it none of. More than planned, all of it stored.
    run = _two_turns(128, 3.0)
    assert run.committed == bt.CommittedCounts(exact=1, fewer=0, more=1, unstored=0)
    assert run.to_wire()["checks"]["no_more_than_stored"] is True
    # The negative controls: the second request was sent after the first ended, so nothing it stored was there to
    # find; or the first committed its third block, which no request stored.
    for commits, ended in ((128, 0.5), (192, 3.0)):
        run = _two_turns(commits, ended)
        assert run.committed == bt.CommittedCounts(exact=1, fewer=0, more=1, unstored=1)
        assert run.to_wire()["checks"]["no_more_than_stored"] is False


def _report(trace, reg, run) -> bt.TraceReplay:  # type: ignore[no-untyped-def]
    return bt.TraceReplay(
        trace=trace.source,
        requests=len(trace),
        speedup=1.0,
        block_tokens=trace.block_tokens,
        registration=reg.identity,
        model=reg.model,
        bytes_per_chunk=reg.bytes_per_chunk,
        w=2,
        bandwidth_bytes_per_s=1e8,
        calibration=None,
        calibration_file=None,
        runs=(run,),
        skip=0,
    )


def _budget_run(trace, reg) -> bt.BudgetRun:  # type: ignore[no-untyped-def]
    """One budget's replay of two requests: the second restores 192 tokens after waiting 0.01 s for B."""
    from bsr_cli.core.host_model import HostModel

    measured = [bt.Measured(0, 0.0, 0.0), bt.Measured(1, 1.0, 1.0, 192, 0.02, 0.05, request="r1", budget_wait_s=0.01)]
    replayed = bt.BudgetReplayed(2, 1, measured, {0: 1, 1: 1}, (3.0, 4.0), "2025-01-01T00:00:00.000Z", 2.0, 9.5)
    host = HostModel(cores=0.5, job_cores=0.5, restore_cpu_s=0.01, restore_cpu_s_per_gb=50.0, restore_slots=2)
    return bt.compare(trace, reg, replayed, w=2, bandwidth=1e8, speedup=1.0, host=host)


def test_the_report_puts_prediction_engine_and_stock_side_by_side_in_text_and_json() -> None:
    import io

    from rich.console import Console

    from bsr_cli.cli.render import planning as render

    reg = bt.replay_registration()
    rows = _conversations(1, 2)
    trace, stock_run = _stock_run(rows, [0, 192])
    run = _budget_run(trace, reg)
    assert run.predicted.bound_by is not None and run.predicted.bandwidth_only_latency_s is not None
    assert run.run_queue_beside == 9.5
    # The restore's 0.02 s: 0.01 s waiting for B, and 0.01 s of service of which its 3 chunks (192 KiB) at 100 MB/s
    # take 0.002 s and CPU the other 0.008 s: B is the longest part.
    assert {b.value: n for b, n in run.measured.bound_by.items()} == {"budget": 1}
    for stock, needles in (
        (
            bt.stock_summary(trace, reg, stock_run),
            ("stock LMCache 0.5.6", "3.00 MiB", "whole-plan peak", "the hit's full chunks: 2 of 2"),
        ),
        (bt.StockNotRun("skipped with --no-stock"), ("stock LMCache: not run (skipped with --no-stock)",)),
    ):
        report = replace(_report(trace, reg, run), stock=stock)
        wire = report.to_wire()
        buf = io.StringIO()
        render.trace_replay(Console(file=buf, width=240, color_system=None), report)
        text = buf.getvalue()
        for needle in (
            *needles,
            "predicted p50",
            "measured p99",
            "bound (measured)",
            "budget 1",
            "3.0→4.0",
            "9.5",
        ):
            assert needle in text, text
        assert "None" not in text and "?" not in text
        # The --json side of the same result: the report's keys, in order, stock last.
        assert list(json.loads(json.dumps(wire))) == [*REPORT_KEYS, "skip", "stock"]
        assert list(wire["runs"][0]) == list(RUN_KEYS)
        assert wire["runs"][0]["measured"]["bound_by"] == {"budget": 1}


def test_a_trace_bundle_reads_back_as_its_types_and_shows_the_report_again(
    bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace bundle made of a replay's report (stock's side included) validates, reads back as the replay's own
    types, is written again byte for byte, and `bsr bench show` prints the report the replay printed."""
    import io

    from rich.console import Console

    from bsr_cli.bench.evidence import machine_info, now
    from bsr_cli.bench.trace_bundle import TraceParams, TraceSummary, new_trace_run_id, trace_bundle
    from bsr_cli.cli.render import planning as render

    reg = bt.replay_registration()
    trace, stock_run = _stock_run(_conversations(1, 2), [0, 192])
    sweep = next(p for p in sorted((ROOT / "docs" / "evidence").glob("br-e1-*.json")))
    engine = {"url": "http://127.0.0.1:8600", "embedded": True, "startup_s": None}
    engine["info"] = json.loads(sweep.read_text())["engine"]["info"]  # a real engine's /info
    report = replace(_report(trace, reg, _budget_run(trace, reg)), stock=bt.stock_summary(trace, reg, stock_run))
    made = trace_bundle(
        report,
        reg,
        run_id=new_trace_run_id(),
        started_at=now(),
        elapsed_s=2.5,
        engine=engine,
        machine=machine_info(),
        salt=7,
    )
    first = bundles.write(made, tmp_path / "first")  # validates it first
    back = bundles.read(first)
    assert isinstance(back.params, TraceParams) and isinstance(back.summary, TraceSummary)
    assert [type(r) for r in back.rows] == [bt.BudgetRun] and back.rows == list(report.runs)
    assert bt.read_stock(back.summary.stock) == report.stock
    assert bundles.write(back, tmp_path / "again").read_bytes() == first.read_bytes()

    buf = io.StringIO()
    render.trace_replay(Console(file=buf, width=240, color_system=None), replace(report, bundle=str(first)))
    monkeypatch.setenv("COLUMNS", "240")
    shown = bsr("bench", "show", str(first))
    assert shown.code == 0, shown.err
    assert "stock LMCache 0.5.6" in shown.out and "predicted p50" in shown.out
    assert shown.out.split() == buf.getvalue().split()
    # The check can fail: a bundle from before stock's side was kept says so where the report had stock's lines.
    older = json.loads(first.read_text())
    del older["summary"]["stock"]
    (tmp_path / "older.json").write_text(json.dumps(older))
    again = bsr("bench", "show", str(tmp_path / "older.json"))
    assert again.code == 0 and "stock LMCache: not run (not recorded)" in again.out
    assert again.out.split() != buf.getvalue().split()


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


def test_the_report_says_when_the_host_changed_between_calibration_and_replay() -> None:
    import io

    from rich.console import Console

    from bsr_cli.cli.render import planning as render
    from bsr_cli.core.host_model import HostCalibration, HostModel, HostState

    reg = bt.replay_registration()
    trace, _ = _stock_run(_conversations(1, 2), [0, 192])
    measured = [bt.Measured(0, 0.0, 0.0), bt.Measured(1, 1.0, 1.0, 192, 0.02, 0.05, request="r1")]
    host = HostModel(cores=0.5, job_cores=0.5, restore_cpu_s=0.01, restore_cpu_s_per_gb=50.0, restore_slots=2)
    replayed = bt.BudgetReplayed(2, 1, measured, {0: 1, 1: 1}, (3.0, 4.0), "2025-01-01T00:00:00.000Z", 2.0, 9.5)
    run = bt.compare(trace, reg, replayed, w=2, bandwidth=1e8, speedup=1.0, host=host)

    def text(run_queue_at_calibration: float) -> str:
        state = HostState(2, (3.0, 3.0, 3.0), run_queue_at_calibration, run_queue_at_calibration, 0.5)
        cal = HostCalibration(
            measured_at="2025-01-01T00:00:00.000Z",
            registration=reg.identity,
            chunk_size=reg.chunk_size,
            bytes_per_chunk=reg.bytes_per_chunk,
            tp_size=reg.tp_size,
            w=2,
            bandwidth=1e8,
            host=host,
            burst_stretch=2.0,
            host_state=state,
            samples=(),
        )
        report = replace(_report(trace, reg, run), calibration=cal, calibration_file="cal.json")
        buf = io.StringIO()
        render.trace_replay(Console(file=buf, width=240, color_system=None), report)
        return buf.getvalue()

    assert "the host changed: the run queue beside bsr was 4.0 at the calibration and 9.5 during" in text(4.0)
    assert "the host changed" not in text(9.0)  # the negative control: the same host


def test_the_prediction_is_made_again_at_the_cores_the_engine_got_during_the_replay() -> None:
    """The host's state is the model's input: a replay during which the engine got fewer cores than at the
    calibration is predicted again on the same host model at those cores, slower for CPU-bound restores, and the
    measurement is set against both. The negative control: a replay that was never short of cores (no figure) gets
    no second prediction, in text or JSON."""
    import io

    from rich.console import Console

    from bsr_cli.cli.render import planning as render
    from bsr_cli.core.host_model import HostModel

    reg = bt.replay_registration()
    trace, _ = _stock_run(_conversations(1, 2), [0, 192])
    measured = [bt.Measured(0, 0.0, 0.0), bt.Measured(1, 1.0, 1.0, 192, 0.4, 0.5, request="r1")]
    # CPU-bound: 3 chunks (192 KiB) need 0.01 + 1,000 s/GB × 196,608 B ≈ 0.21 CPU s, where the bytes take 2 ms.
    host = HostModel(cores=1.0, job_cores=1.0, restore_cpu_s=0.01, restore_cpu_s_per_gb=1000.0, restore_slots=2)
    replayed = bt.BudgetReplayed(2, 1, measured, {0: 1, 1: 1}, (3.0, 4.0), "2025-01-01T00:00:00.000Z", 2.0, 9.5)
    busy = bt.compare(trace, reg, replace(replayed, cores_contended=0.5), w=2, bandwidth=1e8, speedup=1.0, host=host)
    at = busy.at_replay_cores
    assert at is not None and at.cores == 0.5
    # Half the cores: the restore's CPU takes twice as long.
    assert at.latency_s.p50 == pytest.approx(2 * busy.predicted.latency_s.p50, rel=1e-6)
    assert at.latency_ratio["p50"] == pytest.approx(0.4 / at.latency_s.p50)
    assert busy.latency_ratio["p50"] == pytest.approx(0.4 / busy.predicted.latency_s.p50)
    wire = json.loads(json.dumps(busy.to_wire()))
    assert wire["at_replay_cores"]["cores"] == 0.5 and set(wire["at_replay_cores"]["agrees"]) == {"p50", "p99"}
    text = io.StringIO()
    report = replace(_report(trace, reg, busy), stock=bt.StockNotRun("skipped with --no-stock"))
    render.trace_replay(Console(file=text, width=300, color_system=None), report)
    assert "at the replay's cores" in text.getvalue() and "0.50 cores:" in text.getvalue()

    calm = bt.compare(trace, reg, replayed, w=2, bandwidth=1e8, speedup=1.0, host=host)
    assert calm.at_replay_cores is None and "at_replay_cores" not in calm.to_wire()
    text = io.StringIO()
    render.trace_replay(Console(file=text, width=300, color_system=None), replace(report, runs=(calm,)))
    assert not re.search(r"\d cores: ", text.getvalue())  # the column is there, empty
