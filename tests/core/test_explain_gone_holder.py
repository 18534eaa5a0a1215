"""Pure: `bsr explain --store` blames chunks missing while the master lists a gone holder's segment on that holder,
and restates what the probe saw whole, whatever it holds: an address (host:port) or a key or group with ':' in it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.explain import Finding, FindingKind, _put_to_gone_holder, explain_store
from bsr_cli.core.store_probe import (
    HashStart,
    HolderState,
    Integrity,
    KeyFormatReport,
    KeyFormatValue,
    Liveness,
    SegmentHolder,
    StoreProbe,
)

GONE = SegmentHolder("seg-vllm-0", "10.0.0.7:12655", HolderState.GONE)
ALIVE = SegmentHolder("seg-vllm-1", "10.0.0.8:12655", HolderState.ALIVE)
TAKEN_BY_GONE = "while the master lists 1 segment(s) whose holder is gone: it still places new objects there"


def _liveness(chunks: int, ranks: int) -> Liveness:
    """Every listed chunk on a live holder (none stale), beside a gone holder's segment still listed."""
    return Liveness((GONE, ALIVE), tuple("1" * chunks for _ in range(ranks)), 256, 0, 0)


def test_the_gone_holder_restates_what_was_seen_whole_though_it_holds_colons() -> None:
    seen = "chunk 2 of key lost@model@1@0@ab:cd (on 10.0.0.5:12345) is missing while 3 later chunk(s) are held"
    missing = Finding(
        FindingKind.EVICTED,
        f"{seen}: it was evicted from the store",
        ("probe: committable prefix 2/6 chunks",),
        "give the tier more room",
        "bsr submit --synthetic 1536",
        observed=seen,
    )
    f = _put_to_gone_holder(missing, _liveness(6, 1), "bsr probe --store 10.0.0.5:50051")
    assert f.kind is FindingKind.HOLDER_GONE
    assert f.summary.startswith(f"{seen}, {TAKEN_BY_GONE}"), f.summary
    assert f.evidence == (
        "probe: committable prefix 2/6 chunks",
        "segment seg-vllm-0 at 10.0.0.7:12655: not answering, still listed",
    )
    # Nothing of the cause the replaced finding gave is kept: the gone holder is the cause now.
    assert "evicted" not in f.summary and f.next == "bsr probe --store 10.0.0.5:50051"


def _store(bitmap: HitBitmap, committable: int) -> StoreProbe:
    return StoreProbe(
        store="10.0.0.5:50051",
        bitmap=bitmap,
        prompt_tokens=bitmap.tokens,
        prompt_chunks=bitmap.chunks,
        storable_chunks=bitmap.chunks,
        committable_chunks=committable,
        first_break=None,
        strip_width=None,
        key_format=KeyFormatReport("bfloat16", [], HashStart("auto", None, 0, None, {}, [])),
        key_example=None,
        liveness=_liveness(bitmap.chunks, bitmap.ranks),
        integrity=Integrity(bitmap.chunks * bitmap.ranks, 0, []),
    )


def _command(verb: str, changes: Mapping[str, KeyFormatValue]) -> str:
    return f"bsr {verb} --store 10.0.0.5:50051 --synthetic 1024"


def test_a_rank_skew_on_a_group_named_with_a_colon_is_restated_whole() -> None:
    """Rank 1 lacks chunk 1 of group kv:attn that rank 0 holds, while a gone holder's segment is listed: the puts
    placed there were lost. The verdict names the group whole."""
    group = "kv:attn"
    bitmap = HitBitmap(("mooncake",), 2, (group,), 4 * 256, 256, {(0, group): "1111", (1, group): "1011"})
    result = explain_store(prompt="p", prompt_flags="--synthetic 1024", store=_store(bitmap, 1), command=_command)
    assert result.verdict is FindingKind.HOLDER_GONE, result.summary
    assert result.summary.startswith(f"the prefix breaks at chunk 1 on rank 1 group {group} only, {TAKEN_BY_GONE}")
    # The negative control: every holder answers, so the same bitmap is the rank skew it looks like.
    answering = dataclasses.replace(_liveness(4, 2), segments=(ALIVE,))
    alive = dataclasses.replace(_store(bitmap, 1), liveness=answering)
    skew = explain_store(prompt="p", prompt_flags="--synthetic 1024", store=alive, command=_command)
    assert skew.verdict is FindingKind.RANK_SKEW
    assert skew.summary.startswith(f"the prefix breaks at chunk 1 on rank 1 group {group} only: the other ranks")
