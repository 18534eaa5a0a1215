"""Pure: a segment the store lost, as one sentence (status, events, bench rows), on the wire of /health, and as
`explain`'s finding for a prompt whose chunks went with it (and not for one another tier still holds)."""

from __future__ import annotations

import dataclasses

import pytest

from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.evidence import SegmentLossCause, TierCondition
from bsr_cli.core.explain import Explanation, FindingKind, explain_engine
from bsr_cli.core.status import EngineInfo, Health, TierHealth
from bsr_cli.core.store_loss import SegmentLoss, clock
from bsr_cli.loaders import builtin_registration

pytestmark = pytest.mark.fast

AT = 1_800_000_000.0
LOSS = SegmentLoss(
    segment="127.0.0.1:12655",
    client_id="1-2",
    cause=SegmentLossCause.UNMOUNTED,
    lost_at=AT,
    last_seen_at=AT - 1,
    objects_lost=20,
    bytes_lost=82_240,
    holder="segment_holder pid 42",
)


def test_the_sentence_names_the_holder_the_time_what_went_and_why() -> None:
    assert LOSS.line() == (
        f"the store dropped holder 127.0.0.1:12655 (segment_holder pid 42)'s segment at {clock(AT)}, 20 objects "
        "(80.31 KiB) lost (the master unmounted it: the holder missed its heartbeats for the client TTL)"
    )
    back = dataclasses.replace(LOSS, cause=SegmentLossCause.REMOUNTED_EMPTY, remounted_at=AT + 20)
    assert back.line().endswith(f"mounted it again, empty); mounted again, empty, at {clock(AT + 20)}")
    gone = dataclasses.replace(LOSS, cause=SegmentLossCause.HOLDER_GONE, objects_lost=None, bytes_lost=None, holder="")
    assert gone.line() == (
        f"the store lost holder 127.0.0.1:12655's segment at {clock(AT)}, its objects lost (how many, the master "
        "did not say) (its holder process is gone; the master lists the segment until the client TTL runs out)"
    )
    assert dataclasses.replace(LOSS, objects_lost=1, bytes_lost=None).amount() == "1 object lost"


def test_a_tier_names_its_lost_segments_on_the_wire_and_an_older_answer_reads_without_them() -> None:
    health = TierHealth(
        ok=False,
        detail=(LOSS.line(),),
        conditions=(TierCondition.SEGMENT_LOST,),
        quarantined=(),
        quarantined_total=0,
        condition=TierCondition.SEGMENT_LOST,
        lost_segments=(LOSS,),
    )
    wire = health.to_wire()
    assert wire["condition"] == "segment_lost" and wire["lost_segments"][0]["cause"] == "unmounted"
    assert TierHealth.from_wire(wire) == health
    older = {k: v for k, v in wire.items() if k != "lost_segments"}
    assert TierHealth.from_wire(older).lost_segments == ()
    # A tier that lost nothing says nothing of it.
    ok = dataclasses.replace(health, ok=True, detail=(), conditions=(), lost_segments=(), condition=TierCondition.OK)
    assert "lost_segments" not in ok.to_wire()


def _explain(tiers: list[str], cells: str, lost: dict[str, SegmentLoss]) -> Explanation:
    reg = builtin_registration("demo")
    n = 4 * reg.chunk_size
    bitmap = HitBitmap.from_dict(
        {
            "tokens": n,
            "chunk_size": reg.chunk_size,
            "tiers": tiers,
            "ranks": 2,
            "groups": list(reg.group_names),
            "rows": [{"rank": r, "group": g, "cells": cells} for r in range(2) for g in reg.group_names],
        }
    )
    info = EngineInfo.from_wire(
        {"W": 4, "budget_bytes": 4 * reg.bytes_per_chunk, "pool_bytes": 8 * reg.bytes_per_chunk, "engine": "t"}
    )
    tier_health = {
        t: {
            "ok": False,
            "conditions": ["segment_lost"],
            "detail": [lost[t].line()],
            "lost_segments": [lost[t].to_wire()],
        }
        if t in lost
        else {"ok": True}
        for t in tiers
    }
    return explain_engine(
        prompt="p",
        prompt_flags="--synthetic 1024",
        registration=reg,
        bitmap=bitmap,
        n_tokens=n,
        info=info,
        health=Health.from_wire({"ranks": [], "tiers": tier_health}),
        markers=[],
        faults=[],
        w=None,
        last_restore=None,
    )


def test_explain_names_the_lost_segment_as_why_the_prompt_is_gone() -> None:
    d = _explain(["mooncake"], "0000", {"mooncake": LOSS})
    assert d.verdict is FindingKind.SEGMENT_LOST and not d.reusable
    assert d.summary.startswith("the store dropped holder 127.0.0.1:12655") and "20 objects" in d.summary
    assert "went with it (it holds 0/4 of its chunks now)" in d.summary
    assert d.next == "bsr submit --synthetic 1024"
    assert [f.kind for f in d.findings][:2] == [FindingKind.SEGMENT_LOST, FindingKind.NEVER_STORED]


def test_a_dead_holder_whose_objects_are_still_listed_is_the_verdict_though_the_probe_calls_them_held() -> None:
    gone = dataclasses.replace(LOSS, cause=SegmentLossCause.HOLDER_GONE)
    d = _explain(["mooncake"], "1111", {"mooncake": gone})
    assert d.verdict is FindingKind.SEGMENT_LOST and "its holder process is gone" in d.summary


def test_a_loss_another_healthy_tier_covers_is_no_verdict() -> None:
    # fs holds the whole prompt and is healthy: the prompt is restored from there; the loss stays tier information.
    d = _explain(["mooncake", "fs"], "3333", {"mooncake": LOSS})
    assert d.verdict is FindingKind.RESTORABLE
    assert FindingKind.SEGMENT_LOST not in [f.kind for f in d.findings]
    assert any(f.kind is FindingKind.TIER_UNHEALTHY and LOSS.line() in f.evidence[0] for f in d.findings)
