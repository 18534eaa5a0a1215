"""The trace planner's simulator: hand-computed tiny traces with exact numbers, and the event-driven replay against a
deliberately simple, separately written brute force of the same model on synthetic traces and on a slice of the
real conversation trace."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from bsr_cli.core.registration import Registration
from bsr_cli.core.trace import Trace, TraceRequest, build_trace
from bsr_cli.core.trace_sim import nearest_rank, plan_trace, replay, windows_held
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import builtin_registration, load_trace

# Kept beside the repository (beside the worktrees' folder for a worktree).
_ROOT = Path(__file__).resolve().parents[2]
REAL_TRACE = next(
    (
        p
        for d in (_ROOT.parent, _ROOT.parent.parent)
        if (p := d / "shared" / "traces" / "conversation_trace.jsonl").exists()
    ),
    _ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl",
)


@pytest.fixture(scope="module")
def demo() -> Registration:
    return builtin_registration("demo")  # 256-token chunks, 1 MiB per chunk per rank, aux 0


def _trace(*rows: tuple[int, int, list[int]]) -> Trace:
    return build_trace(
        (f"line {n}", TraceRequest(t, length, 1, tuple(ids))) for n, (t, length, ids) in enumerate(rows, 1)
    )


# -- hand-computed -----------------------------------------------------------------------------------------------

# Bandwidth: one chunk per second. r1 hits 2 blocks = 4 chunks at t=0; r2 hits 3 blocks = 6 chunks at t=1.
# Whole plan: r1 alone moves 1 chunk by t=1; both then share: r1's last 3 chunks take 6 s (t=7), by when r2 has 3
# left, alone: t=10. L1 holds 4 + 6 chunks over [1, 7).
TWO_OVERLAPPING = ((0, 1024, [1, 2]), (0, 1536, [1, 2, 3]), (1000, 2048, [1, 2, 3, 4]))


def test_two_overlapping_restores_whole_plan(demo) -> None:
    p = plan_trace(_trace(*TWO_OVERLAPPING), demo, 2, bandwidth=demo.bytes_per_chunk)
    c = demo.bytes_per_chunk
    assert p.restores == 2 and p.hit_tokens == 1024 + 1536
    wp = p.whole_plan
    assert wp.peak_bytes == 10 * c
    assert wp.latencies == pytest.approx((7.0, 9.0))
    assert (wp.latency.p50, wp.latency.p99) == pytest.approx((7.0, 9.0))
    assert wp.wait.max == 0
    assert [t for t, _ in wp.l1_series] == pytest.approx([0, 1, 7, 10])
    assert [v / c for _, v in wp.l1_series] == [4, 10, 6, 0]
    assert p.largest is not None and (p.largest.chunks, p.largest.tokens) == (6, 1536)


@pytest.mark.parametrize(
    ("k", "held", "peak_chunks", "latencies", "waits"),
    [
        # W=2, B = k·RWS = 2k chunks. Holds min(N, a·W): a = 1 (B=2 chunks), 2 (4), 3 (8), 3 (16).
        (1, 1, 2, (4.0, 9.0), 3.0),  # one at a time: r1 alone to t=4, r2 waits 3 s, then 6 s
        (2, 2, 4, (4.0, 9.0), 3.0),  # holds 4 + 4 > 4: still one at a time
        (4, 3, 6, (4.0, 9.0), 3.0),  # holds 4 + 6 > 8
        (8, 3, 10, (7.0, 9.0), 0.0),  # both fit: exactly the whole plan's timing
    ],
)
def test_two_overlapping_restores_under_each_budget(demo, k, held, peak_chunks, latencies, waits) -> None:
    p = plan_trace(_trace(*TWO_OVERLAPPING), demo, 2, bandwidth=demo.bytes_per_chunk, budgets_rws=(k,))
    (run,) = p.bsr
    assert run.budget_bytes == k * 2 * demo.bytes_per_chunk
    assert run.windows_held == held
    assert run.peak_bytes == peak_chunks * demo.bytes_per_chunk
    assert run.latencies == pytest.approx(latencies)
    assert run.wait.max == pytest.approx(waits)


def test_shared_prefix_and_speedup(demo) -> None:
    # r1 shares one block (2 chunks) with r0; r2 is r0 again (700 tokens: 3 chunks, the partial one included).
    t = _trace((0, 700, [10, 11]), (2000, 900, [10, 12]), (4000, 700, [10, 11]))
    p = plan_trace(t, demo, 32, bandwidth=demo.bytes_per_chunk, speedup=2.0)
    assert (p.restores, p.hit_tokens, p.span_s) == (2, 512 + 700, 2.0)
    # At 2× the pace they arrive at 1 s and 2 s. r1's 2 chunks: 1 alone by 2 s, the other shared by 4 s; r2 has
    # moved 1 of its 3 by then, and the other 2 alone by 6 s. Both are held over [2, 4).
    assert p.whole_plan.peak_bytes == 5 * demo.bytes_per_chunk
    assert p.whole_plan.latencies == pytest.approx((3.0, 4.0))
    # At the trace's pace r1 ends (4 s) as r2 arrives (4 s): the completion frees its L1 first.
    slow = plan_trace(t, demo, 32, bandwidth=demo.bytes_per_chunk)
    assert slow.whole_plan.peak_bytes == 3 * demo.bytes_per_chunk
    assert slow.whole_plan.latencies == pytest.approx((2.0, 3.0))


def test_lru_store_shrinks_the_hits(demo) -> None:
    t = _trace((0, 1024, [1, 2]), (1000, 1024, [3, 4]), (2000, 1024, [1, 2]))
    unbounded = plan_trace(t, demo, 32, bandwidth=demo.bytes_per_chunk)
    bounded = plan_trace(t, demo, 32, bandwidth=demo.bytes_per_chunk, store_capacity=3)
    assert (unbounded.hit_tokens, unbounded.evicted_blocks) == (1024, 0)
    assert (bounded.hit_tokens, bounded.evicted_blocks) == (512, 2)


def test_aux_bytes_count_once_per_restore_in_flight() -> None:
    reg = Registration.from_dict(
        {
            "model": "aux",
            "tp_size": 1,
            "chunk_size": 256,
            "aux_bytes": 1000,
            "groups": [{"name": "g", "block_size": 16}],
            "tensors": [{"name": "kv", "dtype": "fp8", "bytes_per_token": 4096, "group": "g"}],
        }
    )
    c = reg.bytes_per_chunk
    p = plan_trace(_trace(*TWO_OVERLAPPING), reg, 2, bandwidth=c, budgets_rws=(1, 8))
    assert p.whole_plan.peak_bytes == 10 * c + 2 * 1000
    assert p.bsr[0].budget_bytes == 2 * c + 1000 and p.bsr[0].peak_bytes == 2 * c + 1000
    assert windows_held(reg, 2, 8 * (2 * c + 1000)) == 3


def test_nearest_rank_percentiles() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert (nearest_rank(xs, 50), nearest_rank(xs, 95), nearest_rank(xs, 99), nearest_rank(xs, 100)) == (
        50,
        95,
        99,
        100,
    )
    assert nearest_rank([3.0], 99) == 3.0 and nearest_rank([], 50) == 0.0


def test_a_trace_without_hits_restores_nothing(demo) -> None:
    p = plan_trace(_trace((0, 512, [1]), (5, 512, [2])), demo, 32, bandwidth=1e9)
    assert p.restores == 0 and p.largest is None
    assert p.whole_plan.peak_bytes == 0 and p.whole_plan.latency.p99 == 0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"bandwidth": 0.0}, "bandwidth must be a positive"),
        ({"bandwidth": math.inf}, "bandwidth must be a positive"),
        ({"bandwidth": math.nan}, "bandwidth must be a positive"),
        ({"bandwidth": 1e9, "speedup": 0.0}, "speed-up must be"),
        ({"bandwidth": 1e9, "budgets_rws": (0,)}, "positive whole multiples"),
        ({"bandwidth": 1e9, "budgets_rws": ()}, "positive whole multiples"),
        ({"bandwidth": 1e9, "p99_target_s": -1.0}, "p99 target"),
    ],
)
def test_bad_settings_are_refused(demo, kwargs, needle) -> None:
    with pytest.raises(InvalidInput, match=needle):
        plan_trace(_trace(*TWO_OVERLAPPING), demo, 32, **kwargs)
    with pytest.raises(InvalidInput, match="W ≥ 1"):
        plan_trace(_trace(*TWO_OVERLAPPING), demo, 0, bandwidth=1e9)


# -- against a separately written brute force --------------------------------------------------------------------


def brute_hit_chunks(trace: Trace, chunk_size: int, capacity: int | None) -> list[int]:
    """The hit model written out plainly: a dict in use order as the LRU (most recent last)."""
    store: dict[int, None] = {}
    out = []
    for req in trace.requests:
        ids = list(req.hash_ids)
        k = 0
        while k < len(ids) and ids[k] in store:
            k += 1
        tokens = min(k * 512, req.input_length)
        out.append(math.ceil(tokens / chunk_size) if k and tokens == req.input_length else tokens // chunk_size)
        for b in reversed(ids):
            store.pop(b, None)
            store[b] = None
        while capacity is not None and len(store) > capacity:
            del store[next(iter(store))]
    return out


def brute_replay(arrivals, sizes, holds, bandwidth, budget, *, share=True):
    """The transfer model, step by step: bytes left per admitted restore, advanced to the next arrival or finish,
    O(n²). ``share=False`` gives every restore the whole bandwidth (a wrong model, the negative control)."""
    t, held, peak = 0.0, 0, 0
    left: dict[int, float] = {}
    queue: list[int] = []
    finish = [0.0] * len(arrivals)
    nxt = 0
    while nxt < len(arrivals) or left or queue:
        while queue and (budget is None or held + holds[queue[0]] <= budget):
            i = queue.pop(0)
            left[i] = float(sizes[i])
            held += holds[i]
            peak = max(peak, held)
        rate = bandwidth / len(left) if left and share else bandwidth
        to_finish = min(left.values()) / rate if left else math.inf
        to_arrive = arrivals[nxt] - t if nxt < len(arrivals) else math.inf
        step = min(to_finish, to_arrive)
        for i in left:
            left[i] -= step * rate
        t += step
        if to_finish <= to_arrive:
            for i in [i for i, v in left.items() if v <= sizes[i] * 1e-9]:
                del left[i]
                held -= holds[i]
                finish[i] = t
        else:
            queue.append(nxt)
            nxt += 1
    return peak, finish


def _brute_whole_plan(trace: Trace, reg: Registration, bandwidth: float, speedup: float, capacity: int | None):
    chunks = brute_hit_chunks(trace, reg.chunk_size, capacity)
    restoring = [i for i, c in enumerate(chunks) if c]
    t0 = trace.requests[0].arrival_ms
    arrivals = [(trace.requests[i].arrival_ms - t0) / 1000 / speedup for i in restoring]
    sizes = [chunks[i] * reg.bytes_per_chunk for i in restoring]
    return arrivals, sizes


def synthetic_trace(seed: int, n: int = 300) -> Trace:
    """Conversations: each turn extends an earlier prompt of its conversation, arrivals in bursts."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    next_id = 0
    t = 0
    rows = []
    for _ in range(n):
        t += rng.choice((0, 0, 5, 40, 200, 900))
        if convs and rng.random() < 0.7:
            base = rng.choice(convs)
            ids = base[: rng.randint(1, len(base))]
        else:
            ids = []
        grow = rng.randint(1, 30)
        ids = ids + list(range(next_id, next_id + grow))
        next_id += grow
        convs.append(ids)
        length = (len(ids) - 1) * 512 + rng.randint(1, 512)
        rows.append((t, length, ids))
    return _trace(*rows)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("capacity", [None, 400])
def test_whole_plan_peak_equals_a_brute_force_replay_on_synthetic_traces(demo, seed, capacity) -> None:
    trace = synthetic_trace(seed)
    bw = 40 * demo.bytes_per_chunk  # slow enough that restores overlap heavily
    p = plan_trace(trace, demo, 8, bandwidth=bw, store_capacity=capacity)
    arrivals, sizes = _brute_whole_plan(trace, demo, bw, 1.0, capacity)
    assert p.restores == len(sizes) > 100
    peak, finish = brute_replay(arrivals, sizes, sizes, bw, None)
    assert p.whole_plan.peak_bytes == pytest.approx(peak, rel=0.01)
    assert p.whole_plan.peak_in_flight > 3  # the trace does exercise sharing
    lat = sorted(f - a for f, a in zip(finish, arrivals, strict=True))
    assert p.whole_plan.latency.p99 == pytest.approx(nearest_rank(lat, 99), rel=0.01)
    # Negative control: the same brute force without sharing the bandwidth is far from the simulator.
    wrong, _ = brute_replay(arrivals, sizes, sizes, bw, None, share=False)
    assert abs(wrong - p.whole_plan.peak_bytes) > 0.05 * p.whole_plan.peak_bytes


@pytest.mark.parametrize("seed", [4, 5])
def test_bsr_budgets_equal_a_brute_force_replay(demo, seed) -> None:
    trace = synthetic_trace(seed)
    bw = 40 * demo.bytes_per_chunk
    w = 8
    p = plan_trace(trace, demo, w, bandwidth=bw)
    arrivals, sizes = _brute_whole_plan(trace, demo, bw, 1.0, None)
    for run in p.bsr:
        a = run.windows_held
        holds = [min(s // demo.bytes_per_chunk, a * w) * demo.bytes_per_chunk for s in sizes]
        peak, finish = brute_replay(arrivals, sizes, holds, bw, run.budget_bytes)
        assert run.peak_bytes == peak <= run.budget_bytes
        lat = sorted(f - a for f, a in zip(finish, arrivals, strict=True))
        assert run.latency.p99 == pytest.approx(nearest_rank(lat, 99), rel=0.01)
        assert run.latency.p50 == pytest.approx(nearest_rank(lat, 50), rel=0.01)


def test_replay_refuses_a_hold_over_the_budget() -> None:
    with pytest.raises(InvalidInput, match="never be admitted"):
        replay([0.0], [10], [10], 1.0, budget=5)


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"the conversation trace is not at {REAL_TRACE}")
@pytest.mark.parametrize("speedup", [1.0, 10.0])
def test_whole_plan_peak_equals_a_brute_force_replay_on_the_real_trace(speedup: float) -> None:
    reg = builtin_registration("paper-mtp-off")
    trace = load_trace(REAL_TRACE).head(1500)
    bw = 10.31e9
    p = plan_trace(trace, reg, 32, bandwidth=bw, speedup=speedup)
    arrivals, sizes = _brute_whole_plan(trace, reg, bw, speedup, None)
    peak, _ = brute_replay(arrivals, sizes, sizes, bw, None)
    assert p.whole_plan.peak_bytes == pytest.approx(peak, rel=0.01)
    assert p.whole_plan.peak_bytes > 4 * p.rws_bytes  # a slice where the whole plan does pile up
