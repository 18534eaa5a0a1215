from __future__ import annotations

import pytest

from bsr_cli.core.bitmap import HitBitmap, full_hit_bitmap
from bsr_cli.core.commit import commit_prefix
from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
from bsr_cli.core.plan import plan_restore
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import builtin_registration


@pytest.fixture(scope="module")
def demo():
    return builtin_registration("demo")  # groups full (block 16) and swa (block 64), tp 2


def test_plan_from_tokens_windows(demo) -> None:
    p = plan_restore(demo, 4, tokens=10 * 256 + 100)
    assert p.committable_chunks == 11 and p.committable_tokens == 2660
    assert [(w.chunk_start, w.chunk_end) for w in p.windows] == [(0, 4), (4, 8), (8, 11)]
    last = p.windows[-1]
    assert last.token_end == 2660
    blocks = {b.group: (b.start, b.end) for b in last.blocks}
    assert blocks == {"full": (128, 167), "swa": (32, 42)}  # ceil(2660/16)=167, ceil(2660/64)=42
    assert p.peak_bytes_per_rank == 4 * demo.bytes_per_chunk
    assert p.whole_plan_bytes == 11 * demo.bytes_per_chunk


def test_w0_is_one_whole_plan_window(demo) -> None:
    p = plan_restore(demo, 0, tokens=5000)
    assert len(p.windows) == 1
    assert p.peak_bytes_per_rank == p.whole_plan_bytes


def _bitmap(demo, rows, tokens):
    return HitBitmap(("mooncake", "fs"), 2, demo.group_names, tokens, 256, rows)


def test_committable_prefix_needs_every_rank_and_group(demo) -> None:
    rows = {(0, "full"): "33333", (0, "swa"): "33333", (1, "full"): "33333", (1, "swa"): "33033"}
    bm = _bitmap(demo, rows, 5 * 256)
    assert bm.prefix_chunks() == 2
    br = bm.first_break()
    assert (br.chunk, br.rank, br.group, br.reason) == (2, 1, "swa", "missing in every tier")
    p = plan_restore(demo, 32, bitmap=bm)
    assert p.committable_tokens == 512 and len(p.windows) == 1


def test_excluding_a_tier_moves_the_break(demo) -> None:
    rows = {(r, g): "33222" if r == 0 else "33333" for r in range(2) for g in demo.group_names}
    rows[(0, "full")] = "31222"
    bm = _bitmap(demo, rows, 5 * 256)
    assert bm.prefix_chunks() == 5
    assert bm.prefix_chunks(exclude=["mooncake"]) == 1  # chunk 1 of rank 0/full only on mooncake
    br = bm.first_break(exclude=["mooncake"])
    assert br.held_by == ("mooncake",) and br.reason == "excluded tier only"
    assert bm.tier_prefix_chunks("fs") == 1
    assert bm.choose_tier(0, "full", 2) == "fs"


@pytest.mark.parametrize(
    "rows",
    [
        {(0, "full"): "333", (0, "swa"): "33", (1, "full"): "333", (1, "swa"): "333"},  # ragged
        {(0, "full"): "333", (0, "swa"): "333", (1, "full"): "333"},  # missing row
        {(0, "full"): "393", (0, "swa"): "333", (1, "full"): "333", (1, "swa"): "333"},  # unknown tier bit
    ],
)
def test_bad_bitmaps(demo, rows) -> None:
    with pytest.raises(InvalidInput):
        _bitmap(demo, rows, 3 * 256)


def test_bitmap_roundtrip_and_mismatch(demo) -> None:
    bm = full_hit_bitmap(("mooncake", "fs"), 2, demo.group_names, 1000, 256, registration=demo.identity)
    again = HitBitmap.from_dict(bm.to_dict())
    assert again == bm
    other = full_hit_bitmap(("mooncake", "fs"), 2, demo.group_names, 1000, 256, registration="reg-other")
    with pytest.raises(InvalidInput, match="registration"):
        plan_restore(demo, 8, bitmap=other)
    with pytest.raises(InvalidInput, match="ranks"):
        plan_restore(demo, 8, bitmap=full_hit_bitmap(("m",), 4, demo.group_names, 1000, 256))


def test_commit_rule_collapses_on_any_invalid_cell() -> None:
    ok = {(r, g): True for r in range(2) for g in ("a", "b")}
    assert commit_prefix(1024, ok, range(2), ("a", "b")).committed_tokens == 1024
    bad = ok | {(1, "b"): False}
    d = commit_prefix(1024, bad, range(2), ("a", "b"))
    assert d.committed_tokens == 0 and d.collapsed and d.invalid == ((1, "b"),)
    missing = {k: v for k, v in ok.items() if k != (0, "a")}
    assert commit_prefix(1024, missing, range(2), ("a", "b")).committed_tokens == 0


def test_chunk_hashes_are_prefix_chained(demo) -> None:
    a = synthetic_tokens(1000, seed=1)
    b = list(a)
    b[10] += 1
    ha, hb = chunk_hashes(a, 256), chunk_hashes(b, 256)
    assert len(ha) == 4
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # a change in chunk 0 changes every later hash
    assert chunk_hashes(a[:512], 256) == ha[:2]
    assert synthetic_tokens(1000, seed=1) == a
    key = object_key(demo, 1, "swa", ha[0])
    assert key == f"bsr-engine:swa@2@1@{ha[0]}@bf16"
