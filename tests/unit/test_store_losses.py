"""A segment the store lost, in the fast lane: how the watch tells it from two looks at the master (pure), and how
the coordinator records it once (a typed event, counters) and keeps the tier unhealthy with its reason."""

from __future__ import annotations

import dataclasses

import pytest

from bsr_cli.core.events import SegmentLost
from bsr_cli.core.evidence import EventKind, SegmentLossCause, TierCondition
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.mooncake.health import MountedSegment
from bsr_cli.mooncake.segment_watch import StoreSnapshot, losses_between, parse_metrics
from bsr_cli.runtime.coordinator_state import TIER_FAILURE_TTL_S
from unit.fixtures import build_engine

pytestmark = pytest.mark.fast

A = MountedSegment("127.0.0.1:1001", "c-a", "OK", 64 << 20, "127.0.0.1:1001")
B = MountedSegment("127.0.0.1:1002", "c-b", "OK", 64 << 20, "127.0.0.1:1002")


def _snap(
    at: float, segs: tuple[MountedSegment, ...], keys: int | None, remounts: int | None, **alloc: int
) -> StoreSnapshot:
    return StoreSnapshot(at, segs, keys, remounts, {f"127.0.0.1:{k[1:]}": v for k, v in alloc.items()})


def test_the_masters_metrics_give_keys_remounts_and_bytes_per_segment() -> None:
    text = "\n".join(
        [
            "# HELP master_key_count Total number of keys managed by the master",
            "master_key_count 20",
            "master_remount_segment_requests_total 3",
            'segment_allocated_bytes{segment="127.0.0.1:1001"} 82240',
            'segment_total_capacity_bytes{segment="127.0.0.1:1001"} 67108864',
            "garbage line",
        ]
    )
    assert parse_metrics(text) == (20, 3, {"127.0.0.1:1001": 82240})
    assert parse_metrics("") == (None, None, {})


def test_a_segment_gone_from_the_listing_was_unmounted_with_the_keys_it_took() -> None:
    before = _snap(10.0, (A, B), 30, 2, p1001=80_000, p1002=40_000)
    after = _snap(11.0, (B,), 10, 2, p1002=40_000)
    (loss,) = losses_between(before, after, label=lambda name: f"holder of {name}")
    assert (loss.segment, loss.client_id, loss.cause) == (A.segment_name, "c-a", SegmentLossCause.UNMOUNTED)
    assert (loss.lost_at, loss.last_seen_at, loss.objects_lost, loss.bytes_lost) == (11.0, 10.0, 20, 80_000)
    assert loss.holder == "holder of 127.0.0.1:1001"
    # Already named: not again.
    assert losses_between(before, after, already_lost={A.segment_name: loss}) == []


def test_two_segments_gone_at_once_share_a_key_count_nobody_can_split() -> None:
    got = losses_between(_snap(0.0, (A, B), 30, 2, p1001=1, p1002=2), _snap(1.0, (), 0, 2))
    assert [(x.segment, x.objects_lost, x.bytes_lost) for x in got] == [
        (A.segment_name, None, 1),
        (B.segment_name, None, 2),
    ]


def test_a_segment_dropped_and_mounted_again_between_two_looks_is_named() -> None:
    before = _snap(0.0, (A,), 20, 2, p1001=80_000)
    (loss,) = losses_between(before, _snap(30.0, (A,), 0, 3, p1001=0))
    assert loss.cause is SegmentLossCause.REMOUNTED_EMPTY and (loss.objects_lost, loss.bytes_lost) == (20, 80_000)
    # Another client holding the segment's name (a new holder process) is the old one's loss too.
    other = dataclasses.replace(A, client_id="c-new")
    (loss,) = losses_between(before, _snap(30.0, (other,), 0, 2, p1001=0))
    assert loss.cause is SegmentLossCause.REMOUNTED_EMPTY and loss.client_id == "c-a"
    # Negative controls: bytes removed without a remount (a remove, an eviction) and a remount that removed
    # nothing are no loss; neither is a key count that the master did not report.
    assert losses_between(before, _snap(1.0, (A,), 0, 2, p1001=0)) == []
    assert losses_between(before, _snap(1.0, (A,), 20, 3, p1001=80_000)) == []


def test_a_listed_segment_whose_holder_refuses_connections_is_lost_with_every_object_it_lists() -> None:
    snap = _snap(5.0, (A,), 20, 2, p1001=80_000)
    (loss,) = losses_between(snap, snap, holder_gone=lambda s: s.segment_name == A.segment_name)
    assert loss.cause is SegmentLossCause.HOLDER_GONE and (loss.objects_lost, loss.bytes_lost) == (20, 80_000)
    # With a second segment listed, the master's key count is not all the dead holder's.
    two = _snap(5.0, (A, B), 30, 2, p1001=80_000, p1002=1)
    (loss,) = losses_between(two, two, holder_gone=lambda s: s.segment_name == A.segment_name)
    assert loss.objects_lost is None and loss.bytes_lost == 80_000
    assert losses_between(snap, snap, holder_gone=lambda s: False) == []


def _loss(at: float, **changes: object) -> SegmentLoss:
    base = SegmentLoss("127.0.0.1:1001", "c-a", SegmentLossCause.UNMOUNTED, at, at - 1, 20, 80_000)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_coordinator_records_a_loss_once_and_keeps_the_tier_unhealthy_with_its_sentence() -> None:
    from bsr_cli.server.metrics import exposition

    eng = build_engine()
    c = eng.coordinator
    loss = _loss(1_000.0)
    assert c.record_store_losses("mooncake", [loss]) == [loss]
    assert c.record_store_losses("mooncake", [loss]) == []  # the watch hands everything it knows, every look
    events = [e for e in eng.events.since(0) if e.kind is EventKind.SEGMENT_LOST]
    assert len(events) == 1 and isinstance(events[0], SegmentLost) and events[0].loss == loss
    assert c.counters.value("bsr_store_segments_lost_total", {"tier": "mooncake", "cause": "unmounted"}) == 1
    assert c.counters.value("bsr_store_objects_lost_total", {"tier": "mooncake"}) == 20

    mc = c.health().tiers["mooncake"]
    assert not mc.ok and mc.condition is TierCondition.SEGMENT_LOST and mc.lost_segments == (loss,)
    assert mc.detail[0] == loss.line()
    text = exposition(c)
    assert 'bsr_tier_condition{condition="segment_lost",injected="false",tier="mooncake"} 1.0' in text
    assert 'bsr_store_segments_lost_total{cause="unmounted",tier="mooncake"} 1.0' in text

    # Mounted again (empty): still the tier's condition for the evidence window, then not; a segment still gone
    # keeps it for good.
    back = dataclasses.replace(loss, remounted_at=1_030.0)
    assert c.record_store_losses("mooncake", [back]) == []
    losses = c.observation.store_losses
    assert losses.standing(now=1_030.0)["mooncake"] == [back]
    assert losses.standing(now=1_000.0 + TIER_FAILURE_TTL_S + 1) == {}
    gone = _loss(2_000.0, segment="127.0.0.1:1002")
    c.record_store_losses("mooncake", [back, gone])
    assert losses.standing(now=2_000.0 + 10 * TIER_FAILURE_TTL_S) == {"mooncake": [gone]}
