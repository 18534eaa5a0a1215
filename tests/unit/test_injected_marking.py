"""What an injected fault causes is marked as injected wherever it shows (the restore's events, the marker it sets,
`fault_fired`, the counters' `injected` label, tier health), so that a drill pages nobody; arming a fault alone
changes no health. The same failure not injected (a tier that serves short objects) is marked nowhere: the control
that the marking follows the cause, not the failure."""

from __future__ import annotations

import re
import time

import pytest

from bsr_cli.core import events as ev
from bsr_cli.core.evidence import EventKind, FaultAct, Outcome, SegmentLossCause, TierCondition
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.server.metrics import exposition
from unit.fixtures import FakeEngine, build_engine

pytestmark = pytest.mark.fast

PROMPT = synthetic_tokens(6 * 16, seed=21)  # 6 chunks: 3 windows at W=2


@pytest.fixture
def warm() -> FakeEngine:
    engine = build_engine()
    out = engine.coordinator.submit(PROMPT)
    assert out.stored is not None and out.stored.objects
    yield engine
    for r in engine.ranks:
        r.close()


def _since(engine: FakeEngine, seq: int) -> list[ev.Event]:
    return [e for e in engine.events.recent(2000) if e.seq > seq]


def _sample(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_arming_a_fault_changes_no_health_it_is_shown_as_armed(warm: FakeEngine) -> None:
    c = warm.coordinator
    c.inject(FaultRequest("remote-unavailable", count=1))
    tier = c.health().tiers["mooncake"]
    assert tier.ok and tier.condition is TierCondition.OK and not tier.injected
    assert tier.faults_armed and "remote-unavailable armed" in tier.faults_armed[0]
    text = exposition(c)
    assert _sample(text, "bsr_tier_healthy", 'injected="false",tier="mooncake"') == 1.0
    assert "bsr_tier_condition{" not in text
    assert re.search(r"^bsr_faults_armed 1\.0$", text, re.M)


def test_an_injected_failure_is_marked_on_everything_it_causes(warm: FakeEngine) -> None:
    c = warm.coordinator
    seq = warm.events.last_seq
    c.inject(FaultRequest("remote-unavailable", count=1))
    out = c.restore(PROMPT, request="r-drill")
    assert out.outcome is Outcome.FAILED_CLOSED and out.marker is not None
    seen = _since(warm, seq)
    fired = [e for e in seen if isinstance(e, ev.FaultEvent) and e.act is FaultAct.FIRED]
    assert [(e.request, e.fault, e.fired) for e in fired] == [("r-drill", "remote-unavailable", 1)]
    parts = [e for e in seen if isinstance(e, ev.RestoreFailed)]
    assert parts and all(e.injected for e in parts) and all(e.to_wire()["injected"] is True for e in parts)
    (closed,) = [e for e in seen if (isinstance(e, ev.RestoreEnded) and e.outcome is Outcome.FAILED_CLOSED)]
    assert closed.injected and closed.to_wire()["injected"] is True
    (marker,) = [e for e in seen if isinstance(e, ev.MarkerSet)]
    assert marker.injected
    # The fault fired before the restore's end was recorded.
    kinds = [e.kind for e in seen]
    assert kinds.index(EventKind.FAULT_FIRED) < kinds.index(EventKind.RESTORE_FAILED_CLOSED)

    tier = c.health().tiers["mooncake"]
    assert not tier.ok and tier.condition is TierCondition.RESTORE_FAILED and tier.injected
    assert tier.to_wire()["injected"] is True
    text = exposition(c)
    failed = 'injected="{}",kind="tier",outcome="failed_closed",stage="fetch"'
    assert _sample(text, "bsr_restores_total", failed.format("true")) == 1.0
    assert _sample(text, "bsr_restores_total", failed.format("false")) == 0.0
    assert _sample(text, "bsr_force_local_markers_set_total", 'injected="true"') == 1.0
    assert _sample(text, "bsr_force_local_markers_set_total", 'injected="false"') == 0.0
    assert _sample(text, "bsr_tier_healthy", 'injected="true",tier="mooncake"') == 0.0
    assert 'bsr_tier_healthy{injected="false",tier="mooncake"}' not in text
    cond = 'condition="restore_failed",injected="true",tier="mooncake"'
    assert _sample(text, "bsr_tier_condition", cond) == 1.0


def test_the_same_failure_not_injected_is_marked_nowhere(warm: FakeEngine) -> None:
    c = warm.coordinator
    seq = warm.events.last_seq
    warm.tiers["mooncake"].short = set(warm.tiers["mooncake"].objects)  # every object served one byte short
    out = c.restore(PROMPT, request="r-real")
    assert out.outcome is Outcome.FAILED_CLOSED and out.marker is not None
    seen = _since(warm, seq)
    assert not [e for e in seen if isinstance(e, ev.FaultEvent) and e.act is FaultAct.FIRED]
    parts = [e for e in seen if isinstance(e, ev.RestoreFailed)]
    assert parts and not any(e.injected for e in parts) and "injected" not in parts[0].to_wire()
    (closed,) = [e for e in seen if (isinstance(e, ev.RestoreEnded) and e.outcome is Outcome.FAILED_CLOSED)]
    assert not closed.injected
    (marker,) = [e for e in seen if isinstance(e, ev.MarkerSet)]
    assert not marker.injected
    tier = c.health().tiers["mooncake"]
    assert not tier.ok and tier.condition is TierCondition.RESTORE_FAILED and not tier.injected
    assert "injected" not in tier.to_wire()
    text = exposition(c)
    failed = 'injected="{}",kind="tier",outcome="failed_closed",stage="{}"'
    real = sum(_sample(text, "bsr_restores_total", failed.format("false", s)) for s in ("fetch", "verify"))
    assert real == 1.0
    assert _sample(text, "bsr_tier_healthy", 'injected="false",tier="mooncake"') == 0.0


def test_a_segment_lost_during_a_drill_still_pages(warm: FakeEngine) -> None:
    """No fault can lose a segment (faults act on a restore's fetch, install and checksum), so a lost segment is a
    real reason: a tier that a drill made unhealthy is no longer `injected` once its store lost a segment."""
    c = warm.coordinator
    c.inject(FaultRequest("remote-unavailable", count=1))
    assert c.restore(PROMPT, request="r-drill").outcome is Outcome.FAILED_CLOSED
    assert c.health().tiers["mooncake"].injected  # the control: the drill's failure alone is injected
    loss = SegmentLoss("127.0.0.1:1001", "c-a", SegmentLossCause.UNMOUNTED, time.time(), time.time() - 1, 20, 80_000)
    assert c.record_store_losses("mooncake", [loss]) == [loss]
    tier = c.health().tiers["mooncake"]
    assert not tier.ok and not tier.injected and "injected" not in tier.to_wire()
    assert tier.conditions == (TierCondition.SEGMENT_LOST, TierCondition.RESTORE_FAILED)
    text = exposition(c)
    assert _sample(text, "bsr_tier_healthy", 'injected="false",tier="mooncake"') == 0.0
    assert _sample(text, "bsr_tier_condition", 'condition="segment_lost",injected="false",tier="mooncake"') == 1.0
    assert 'injected="true",tier="mooncake"' not in text
