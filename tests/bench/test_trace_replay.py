"""`bsr bench trace`: a written trace replayed against a real embedded engine (Mooncake master and segment, rank
processes), the planner's prediction printed beside the measurement; and the slice's sizing refused when it cannot
fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_cli.bench import trace as bt
from bsr_cli.core.trace import TraceRequest, build_trace
from bsr_cli.errors import ExitCode, InvalidInput


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
def test_replay_against_the_embedded_engine(bsr, tmp_path: Path) -> None:
    f = tmp_path / "trace.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _conversations()))
    r = bsr("bench", "trace", str(f), "-n", "24", "--speedup", "4", "--W", "2", "--budget-rws", "2", "--json")
    assert r.code == 0, r.err
    d = r.json()
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
    ):
        r = bsr("bench", "trace", str(f), *args)
        assert r.code == ExitCode.INVALID_INPUT, (args, r.err)
        assert needle in r.err and "Traceback" not in r.err
