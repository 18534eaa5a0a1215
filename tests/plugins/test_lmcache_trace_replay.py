"""`bsr bench trace`'s stock side: a small trace slice replayed through real LMCache 0.5.6 (a case process of this
interpreter, a real mooncake_master and segment holder), held to the prefix hits the trace simulates.

Runs through scripts/test-plugins (this interpreter has LMCache); skipped elsewhere. One client at a time, so every
request's store is readable before the next request arrives: the hits are then exactly the simulated ones, on any
load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache")

from bsr_cli.bench import trace as bt
from bsr_cli.core.trace import Trace, TraceRequest, build_trace


def _conversations(n_conv: int, turns: int, shared: bool = True) -> Trace:
    """``n_conv`` interleaved conversations: each turn repeats its conversation's earlier blocks and adds two (or,
    with ``shared`` False, every block id is new: nothing is ever a hit)."""
    rows = []
    history: dict[int, list[int]] = {c: [1000 * (c + 1)] for c in range(n_conv)}
    fresh = 10**6
    for turn in range(turns):
        for c in range(n_conv):
            ids = history[c] + [1000 * (c + 1) + 10 * turn + k for k in (1, 2)]
            history[c] = ids
            if not shared:
                ids = list(range(fresh, fresh + len(ids)))
                fresh += len(ids)
            at = 1000 * len(rows)
            rows.append((f"line {len(rows)}", TraceRequest(at, 512 * len(ids), 8, tuple(ids))))
    return build_trace(rows).scale_tokens(64)


def _replay(
    trace: Trace, tmp: Path, clients: int = 1, serial: bool = False
) -> tuple[bt.StockSummary, list[int], dict[int, int]]:
    reg = bt.replay_registration()
    size = bt.sizing(trace, reg)
    case = bt.StockCase(
        trace, reg, 50.0, 7, 64 << 20, size.kv_tokens, size.segment_bytes, max_clients=clients, serial=serial
    )
    run = bt.replay_stock(case, tmp)
    full = [w // reg.chunk_size * reg.chunk_size for w in bt.expected_hits(trace, reg)]
    return bt.stock_summary(trace, reg, run), full, {r.index: r.loaded_tokens for r in run.requests}


@pytest.mark.timeout(300)
def test_stock_lmcache_loads_the_hits_the_trace_shares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BSR_LMCACHE_PYTHON", sys.executable)
    trace = _conversations(3, 3)
    s, full, loaded = _replay(trace, tmp_path / "shared")
    # Every turn after the first finds its conversation's earlier blocks: 3 + 5 chunks per conversation.
    assert [loaded[i] for i in range(len(trace))] == full
    assert sum(full) == 3 * (3 + 5) * 64
    assert s.hit_tokens == s.expected_hit_tokens == sum(full) and s.restores == 6
    assert s.committed == bt.CommittedCounts(9, 0, 0) and s.failed == 0 and s.ranks_disagree == 0
    # LMCache's L1 held at least the largest whole plan (5 chunks of 64 KiB) on both ranks, within its size.
    assert set(s.l1_peak_by_rank) == {0, 1}
    assert all(5 * (64 << 10) <= v <= s.l1_bytes for v in s.l1_peak_by_rank.values())

    # The negative control: the same shape with every block id new. Nothing is shared, so LMCache loads nothing:
    # the hits above came from the stored prefixes, not from the replay.
    s, full, loaded = _replay(_conversations(3, 3, shared=False), tmp_path / "unshared")
    assert sum(full) == 0 and sum(loaded.values()) == 0
    assert s.restores == 0 and s.committed.exact == 9 and s.failed == 0


@pytest.mark.timeout(300)
def test_stock_lmcache_called_one_request_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--stock-serial: with three clients, each rank's engine still serves one request at a time: its L1 holds one
    request's whole plan, plus at most the chunks of the previous store whose put LMCache has not yet released
    (visible in Mooncake a moment before LMCache frees its staging), whatever the timing."""
    monkeypatch.setenv("BSR_LMCACHE_PYTHON", sys.executable)
    trace = _conversations(3, 3)
    s, full, loaded = _replay(trace, tmp_path / "serial", clients=3, serial=True)
    assert s.serial and s.failed == 0 and s.committed.more == 0
    # A turn served before its previous turn's store is readable loads less (counted apart), never more.
    assert all(loaded[i] <= full[i] for i in range(len(trace)))
    largest = max(r.input_length for r in trace.requests) // 64 * (64 << 10)  # full chunks of the longest prompt
    assert all(0 < v <= 2 * largest for v in s.l1_peak_by_rank.values()), s.l1_peak_by_rank
