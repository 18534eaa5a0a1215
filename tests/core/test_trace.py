"""Request traces: parsing, the prefix-hit model (with and without an LRU store) and its conversion to chunks."""

from __future__ import annotations

import pytest

from bsr_cli.core.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    build_trace,
    hit_chunks,
    parse_request,
    prefix_hits,
)
from bsr_cli.errors import InvalidInput


def _trace(*rows: tuple[int, int, list[int]]):
    """Requests from (arrival ms, input tokens, block ids)."""
    return build_trace(
        (f"line {n}", TraceRequest(t, length, 1, tuple(ids))) for n, (t, length, ids) in enumerate(rows, 1)
    )


def test_parse_one_record() -> None:
    r = parse_request({"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}, "x:1")
    assert r == TraceRequest(27482, 6955, 52, (46, 47))


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ([1, 2], "expected a JSON object"),
        ({"input_length": 5, "output_length": 1, "hash_ids": [1]}, "missing field 'timestamp'"),
        ({"timestamp": 1.5, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp must be an integer"),
        ({"timestamp": "3", "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp must be an integer"),
        ({"timestamp": True, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp must be an integer"),
        ({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}, "timestamp must be >= 0"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "1,2"}, "hash_ids must be a list"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.0]}, "hash_ids must be integers"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}, "3 hash_ids for 600"),
        ({"timestamp": 0, "input_length": 1 << 30, "output_length": 1, "hash_ids": []}, "input_length must be in"),
    ],
)
def test_bad_records_are_refused_naming_where(record, needle: str) -> None:
    with pytest.raises(InvalidInput) as e:
        parse_request(record, "trace.jsonl:7")
    assert e.value.message.startswith("trace.jsonl:7: ") and needle in e.value.message


def test_arrivals_must_not_go_back_in_time() -> None:
    with pytest.raises(InvalidInput, match=r"line 3: arrival 5 ms is before the previous request's 9 ms"):
        _trace((0, 512, [1]), (9, 512, [2]), (5, 512, [3]))
    assert len(_trace((0, 512, [1]), (0, 512, [2]), (4, 512, [3]))) == 3  # equal arrivals are fine


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(InvalidInput, match="no requests"):
        build_trace([], "empty.jsonl")


def test_shared_prefix_hits_the_longest_seen_prefix() -> None:
    t = _trace(
        (0, 2000, [1, 2, 3, 4]),
        (0, 2000, [1, 2, 9, 10]),  # shares two blocks with the first
        (5, 1000, [1, 7]),  # shares one
        (6, 2000, [8, 2, 3, 4]),  # a different head: block ids stand for whole prefixes, nothing is shared
        (7, 2000, [1, 2, 3, 4]),  # the identical prompt
    )
    assert prefix_hits(t).blocks == (0, 2, 1, 0, 4)
    assert prefix_hits(t).evicted == 0


def test_lru_store_evicts_the_least_recently_used_tail_first() -> None:
    t = _trace(
        (0, 1024, [1, 2]),
        (1, 1024, [3, 4]),  # store of 3 blocks: 2 (the first request's tail) goes
        (2, 1024, [1, 2]),  # 1 still there, 2 not: a one-block hit; then 4 goes
        (3, 1024, [3, 4]),
        (4, 1024, [1, 2]),
    )
    hits = prefix_hits(t, store_capacity=3)
    assert hits.blocks == (0, 0, 1, 1, 1)
    assert hits.evicted == 4
    assert prefix_hits(t).blocks == (0, 0, 2, 2, 2)  # unbounded: everything seen stays
    # Touched head first, the third request would find 1 evicted and hit nothing: the order is what is tested.
    assert prefix_hits(t, store_capacity=4).blocks == (0, 0, 2, 2, 2)  # room for all four: nothing evicted


def test_store_capacity_must_be_positive() -> None:
    with pytest.raises(InvalidInput, match="at least one block"):
        prefix_hits(_trace((0, 512, [1])), store_capacity=0)


@pytest.mark.parametrize(
    ("input_length", "blocks", "chunk_size", "chunks"),
    [
        (900, 1, 256, 2),  # 512 hit tokens = 2 whole chunks
        (900, 1, 384, 1),  # 512 tokens hold one whole 384-token chunk; the straddling one is recomputed
        (700, 2, 256, 3),  # the whole input hits (identical prompt): its trailing partial chunk is restored too
        (1100, 2, 256, 4),  # 1024 tokens of 1100: the partial chunk is not in the hit
        (1024, 2, 256, 4),
        (700, 0, 256, 0),
        (5000, 3, 1024, 1),  # chunks larger than a block: 1536 tokens hold one
    ],
)
def test_hit_chunks_count_whole_chunks_inside_the_hit(input_length, blocks, chunk_size, chunks) -> None:
    req = TraceRequest(0, input_length, 1, tuple(range(-(-input_length // TRACE_BLOCK_TOKENS))))
    assert hit_chunks(req, blocks, chunk_size) == chunks


def test_token_scaling_keeps_every_block() -> None:
    t = _trace((0, 1100, [1, 2, 3]), (1, 1024, [1, 2]), (2, 1, [9]))
    scaled = t.scale_tokens(64)
    assert scaled.block_tokens == 64
    assert [r.input_length for r in scaled.requests] == [2 * 64 + 10, 128, 1]  # 76 of 512 → 10 of 64, rounded up
    assert [r.hash_ids for r in scaled.requests] == [r.hash_ids for r in t.requests]
    assert prefix_hits(scaled).blocks == prefix_hits(t).blocks
    # A hit of two blocks is 128 tokens now: two 64-token chunks, or none of 256.
    assert hit_chunks(scaled.requests[1], 2, 64, 64) == 2
    assert hit_chunks(scaled.requests[0], 2, 256, 64) == 0
    with pytest.raises(InvalidInput, match="tokens per block"):
        t.scale_tokens(0)


def test_synthesized_prompts_share_exactly_the_shared_blocks() -> None:
    from bsr_cli.core.keys import chunk_hashes
    from bsr_cli.core.trace import prompt_tokens

    a = TraceRequest(0, 200, 1, (5, 6, 7, 8))
    b = TraceRequest(0, 256, 1, (5, 6, 9, 10))
    ta, tb = prompt_tokens(a, 64, 3, 0), prompt_tokens(b, 64, 3, 1)
    assert (len(ta), len(tb)) == (200, 256)
    assert ta[:128] == tb[:128] and ta[128:192] != tb[128:192]
    ha, hb = chunk_hashes(ta, 64), chunk_hashes(tb, 64)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    assert prompt_tokens(a, 64, 4, 0)[:64] != ta[:64]  # another salt, other tokens: runs never share objects
    assert all(1 <= x < 1 << 31 for x in ta)
