"""The store probe's matching, without a store: the query its flags make, the chain start auto-detection chooses,
which chunks count as live, and the result built from what a store answered (bitmap of live holders only, where the
prefix breaks and why, the partial tail, checksums). What a real store answers is tests/cli/test_store_probe.py's."""

from __future__ import annotations

import pytest

from bsr_cli.core.integrity import LEGACY_SIDECAR_BYTES, SIDECAR_BYTES, sidecar_key
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_key, vllm_seeded_start
from bsr_cli.core.store_match import (
    AUTO_SEEDS,
    DETECT_CHUNKS,
    Holders,
    KeyFormat,
    ListedSegment,
    StoreQuery,
    StoreRead,
    checksummed,
    choose_start,
    detection_hashes,
    hash_starts,
    liveness,
    prompt_chains,
    prompt_keys,
    store_probe_result,
    store_query,
)
from bsr_cli.errors import InvalidInput


def _query(store: str = "mooncake://10.0.0.5:50051", **flags: object) -> StoreQuery:
    given: dict[str, object] = {
        "model": "org/m",
        "world_size": 2,
        "metadata": None,
        "admin": None,
        "dtype": "bf16",
        "tags": (),
        "vllm_hash_seed": "auto",
        "chunk_size": 256,
        "own_seed": "",
    }
    return store_query(store, **(given | flags))  # type: ignore[arg-type]


def test_a_query_takes_its_endpoints_from_the_master_address_unless_given() -> None:
    q = _query(tags=("user=alice",), dtype="fp16")
    assert (q.rpc_address, q.metadata_url, q.admin_url) == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
        "http://10.0.0.5:9003",
    )
    assert q.key_format == KeyFormat("org/m", 2, "half", (("user", "alice"),))
    given = _query(metadata="http://m:1/metadata", admin="http://m:2")
    assert (given.metadata_url, given.admin_url) == ("http://m:1/metadata", "http://m:2")


@pytest.mark.parametrize(
    ("store", "flags", "says"),
    [
        ("redis://x:1", {}, "--store must look like"),
        ("mooncake://host", {}, "--store must look like"),
        ("mooncake://host:99999", {}, "--store must look like"),
        ("mooncake://h:1", {"model": None}, "--store needs --model"),
        ("mooncake://h:1", {"world_size": 0}, "--world-size must be positive"),
        ("mooncake://h:1", {"dtype": "float17"}, "unknown KV dtype"),
        ("mooncake://h:1", {"vllm_hash_seed": "random"}, "PYTHONHASHSEED"),
        # The address is checked first: a bad one is named even when the model is missing too.
        ("redis://x:1", {"model": None}, "--store must look like"),
    ],
)
def test_a_query_refuses_the_first_wrong_flag(store: str, flags: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidInput, match=says.replace("-", r"\-")):
        _query(store, **flags)


def test_auto_tries_no_vllm_then_this_process_seed_then_the_usual_ones() -> None:
    labels = [label for label, _ in hash_starts("auto", own_seed="7")]
    assert labels == ["none", "7", *AUTO_SEEDS]
    once = ["none", "42", *(s for s in AUTO_SEEDS if s != "42")]  # this process's seed first, each seed once
    assert [label for label, _ in hash_starts("auto", own_seed="42")] == once
    assert [label for label, _ in hash_starts("auto", own_seed="random")] == ["none", *AUTO_SEEDS]
    assert hash_starts(" None ", own_seed="7") == [("none", 0)]
    assert hash_starts("42", own_seed="7") == [("42", vllm_seeded_start("42"))]
    q = _query(own_seed="7")
    assert q.auto and q.starts == tuple(hash_starts("auto", own_seed="7")) == q.auto_starts
    assert not _query(vllm_hash_seed="42").auto


def test_auto_detection_chooses_the_start_with_the_most_hits_and_breaks_ties_by_order() -> None:
    starts = [("none", 0), ("7", 7), ("42", 42)]
    batch = {"none": [["a", "b"], ["c", "d"]], "7": [["e", "f"], ["g", "h"]], "42": [["i", "j"], ["k", "l"]]}
    held = [False] * 4 + [True, False, False, False] + [True, True, False, False]
    assert choose_start(starts, batch, held) == ("42", {"7": 1, "42": 2})
    tie = [False] * 4 + [True, False, False, False] + [False, False, True, False]
    assert choose_start(starts, batch, tie) == ("7", {"7": 1, "42": 1})
    assert choose_start(starts, batch, [False] * 12) == ("none", {})


def test_detection_asks_each_candidate_for_its_first_chunks_only_under_auto() -> None:
    toks = synthetic_tokens((DETECT_CHUNKS + 3) * 16, 4)
    q = _query(chunk_size=16, own_seed="")
    found = detection_hashes(q, toks)
    assert list(found) == [label for label, _ in q.starts]
    assert found["42"] == lmcache_chunk_hashes(toks, 16, vllm_seeded_start("42"))[:DETECT_CHUNKS]
    assert detection_hashes(_query(vllm_hash_seed="none"), toks) == {}


def test_a_sidecar_counts_only_at_this_format_size() -> None:
    sizes = {sidecar_key("a"): SIDECAR_BYTES, sidecar_key("b"): LEGACY_SIDECAR_BYTES}
    assert checksummed(["a", "b", "c"], sizes) == [True, False, False]


def _read(
    q: StoreQuery, toks: list[int], held: set[tuple[int, int]], replicas: dict[str, list[str]], sums: set[str]
) -> StoreRead:
    """What a store that lists the (worker, chunk) cells of ``held`` answered for the prompt ``toks``."""
    hashes, tail, rows = prompt_keys(q.key_format, toks, q.chunk_size, 0)
    flags = [(w, i) in held for w, row in enumerate(rows) for i in range(len(row))]
    held_keys = [k for k, h in zip([k for row in rows for k in row], flags, strict=True) if h]
    return StoreRead("none", {}, hashes, tail, rows, flags, held_keys, replicas, [k in sums for k in held_keys])


def test_the_result_counts_live_holders_only_and_says_why_the_prefix_breaks() -> None:
    """Worker 0 holds chunks 0-3, worker 1 chunks 0-2 (its chunk 2 on a gone holder) and chunk 3 unnamed by the
    master; the 40-token tail is stored by worker 0 only. The prefix is what both workers hold live: 2 chunks, and
    it breaks at worker 1's chunk 2 because its holder is gone, not because it is missing."""
    q = _query(vllm_hash_seed="none")
    toks = synthetic_tokens(4 * 256 + 40, 9)
    held = {(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (1, 2), (1, 3)}
    _, _, rows = prompt_keys(q.key_format, toks, 256, 0)
    replicas = {rows[w][i]: ["up"] for w, i in held if (w, i) not in ((1, 2), (1, 3))}
    replicas[rows[1][2]] = ["down"]
    read = _read(q, toks, held, replicas, sums={rows[0][0], rows[0][1]})
    holders = Holders([ListedSegment("up", "up"), ListedSegment("down", "down")], None)
    holders.alive.update({"up": True, "down": False})
    live = liveness(holders, read.rows, read.listed, read.replicas, 256)
    assert live.cells == ("11111", "11su0")
    d = store_probe_result(q, toks, read, live, None, 40)
    assert dict(d.bitmap.rows) == {(0, "attn"): "11111", (1, "attn"): "11000"}  # the live cells only
    assert (d.prompt_chunks, d.storable_chunks, d.committable_chunks) == (5, 5, 2)
    assert d.first_break is not None and (d.first_break.rank, d.first_break.chunk) == (1, 2)
    assert d.first_break.reason == "listed by the master, but its holder is gone"
    assert d.tail is not None and (d.tail.tokens, d.tail.stored) == (40, True)
    assert (d.integrity.checksummed_chunks, d.integrity.unverified_chunks) == (2, 7)
    assert [(c.rank, c.chunk) for c in d.integrity.unverified][:2] == [(0, 2), (0, 3)]
    wire = d.to_wire()
    assert wire["committable_chunks"] == 2 and wire["strip_width"] == 40 and wire["key_example"] == rows[0][0]
    assert wire["key_format"]["hash_start"] == {
        "requested": "none",
        "vllm_hash_seed": None,
        "start": 0,
        "detected": None,
        "candidates_held": {},
        "chains_matched": [],
    }


def test_an_unstored_tail_is_not_storable_and_an_unknown_holder_breaks_the_prefix() -> None:
    q = _query(world_size=1, vllm_hash_seed="none")
    toks = synthetic_tokens(3 * 256 + 5, 2)
    _, _, rows = prompt_keys(q.key_format, toks, 256, 0)
    read = _read(q, toks, {(0, 0), (0, 1), (0, 2)}, {rows[0][0]: ["up"], rows[0][2]: ["up"]}, sums=set())
    holders = Holders([ListedSegment("up", "up")], None)
    holders.alive["up"] = True
    d = store_probe_result(q, toks, read, liveness(holders, read.rows, read.listed, read.replicas, 256), None, None)
    assert d.liveness.cells == ("1u10",)
    assert (d.prompt_chunks, d.storable_chunks, d.committable_chunks) == (4, 3, 1)
    assert d.tail is not None and not d.tail.stored
    assert d.first_break is not None and d.first_break.chunk == 1
    assert d.first_break.reason == "listed by the master, but no live holder is known (liveness unknown)"


def test_a_holder_only_a_replica_names_is_reported_even_unchecked() -> None:
    holders = Holders([ListedSegment("", "10.0.0.1:1", 64)], "the listing failed")
    live = liveness(holders, [["k"]], {0: [True]}, {"k": ["10.0.0.2:2"]}, 256)
    assert [(s.name, s.state.value, s.size_bytes) for s in live.segments] == [
        ("10.0.0.1:1", "unknown", None),  # named by its endpoint; its size is listed under its (empty) name
        ("10.0.0.2:2", "unknown", None),
    ]
    assert live.cells == ("u",) and live.segment_listing_error == "the listing failed"
    assert holders.unchecked(["10.0.0.2:2", "10.0.0.2:2"]) == ["10.0.0.2:2"]


def test_a_diagnosis_looks_for_the_prompt_under_every_start_bsr_knows() -> None:
    q = _query(vllm_hash_seed="42", own_seed="9")
    toks = synthetic_tokens(2 * 256, 5)
    read = _read(q, toks, set(), {}, set())
    read = StoreRead("42", {}, [1, 2], None, read.rows, read.held_flags, [], {}, [])
    chains = prompt_chains(q, read, toks)
    assert list(chains) == ["42", "none", "9", *[s for s in AUTO_SEEDS if s != "42"]]
    assert chains["42"] == {"1", "2"}  # the chosen start's hashes are reused, not recomputed
    assert chains["9"] == {f"{h:x}" for h in lmcache_chunk_hashes(toks, 256, vllm_seeded_start("9"))}


def test_keys_are_one_row_per_worker() -> None:
    fmt = KeyFormat("m", 2, "half", (("t", "x"),))
    assert fmt.keys_of([-0x1F, 0xA]) == [
        [lmcache_key("m", 2, 0, -0x1F, "half", (("t", "x"),)), lmcache_key("m", 2, 0, 0xA, "half", (("t", "x"),))],
        ["m@2@1@-1f@half@t%x", "m@2@1@a@half@t%x"],
    ]
