"""How the coordinator joins each rank's view of its tiers into /health: the condition each names (a host that names
none is "unavailable" when down), and a quarantine directory the ranks share counted once."""

from __future__ import annotations


def test_tier_health_joins_conditions_and_counts_a_shared_quarantine_once() -> None:
    from bsr_cli.core.evidence import TierCondition
    from bsr_cli.core.status import QuarantinedFile, RankTierStatus
    from bsr_cli.runtime.coordinator_state import CoordinatorContext, EngineSettings
    from bsr_cli.runtime.events import EventLog
    from bsr_cli.runtime.metrics import RuntimeCounters
    from bsr_cli.runtime.observation import Observation
    from bsr_cli.runtime.rank_calls import RankCalls
    from unit.fakes import small_registration

    q = QuarantinedFile(
        key="k", file="/t/fs-tier/quarantine/x.1.bsr", reason="payload checksum mismatch", at=5.0, bytes=9
    )
    full = RankTierStatus(
        False, "directory /t/fs-tier: a write fails: No space left on device (ENOSPC)", TierCondition.FULL, (q,), 1
    )
    down = RankTierStatus.from_wire({"ok": False, "detail": "master down"})  # a host that names no reason
    ranks = [(r, {"fs": full, "mooncake": down}) for r in (0, 1)]

    # Only the join: no ranks, no armed faults, no recent failures.
    ctx = CoordinatorContext(small_registration(2), [], EngineSettings(), EventLog(), RuntimeCounters([], ("fs",)))
    tiers = Observation(ctx, calls=RankCalls(ctx), armed_faults=list).tier_health(ranks)
    fs = tiers["fs"]
    assert not fs.ok and fs.condition is TierCondition.FULL and fs.conditions == (TierCondition.FULL,)
    assert fs.quarantined_total == 1 and [x.file for x in fs.quarantined] == [q.file]
    assert len(fs.detail) == 2 and all("(ENOSPC)" in d for d in fs.detail)
    assert tiers["mooncake"].condition is TierCondition.UNAVAILABLE
