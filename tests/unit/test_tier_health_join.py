"""How the coordinator joins each rank's view of its tiers into /health: the condition each names (a host that names
none is "unavailable" when down), and a quarantine directory the ranks share counted once."""

from __future__ import annotations

from typing import Any


def test_tier_health_joins_conditions_and_counts_a_shared_quarantine_once() -> None:
    from bsr_cli.api.codec import to_json
    from bsr_cli.api.ranks import QuarantinedObject, TierStatus
    from bsr_cli.runtime.observation import Observation

    q = QuarantinedObject(
        key="k", file="/t/fs-tier/quarantine/x.1.bsr", reason="payload checksum mismatch", at=5.0, bytes=9
    )
    full = TierStatus(False, "directory /t/fs-tier: a write fails: No space left on device (ENOSPC)", "full", [q], 1)
    down = TierStatus(False, "master down")  # a host that names no reason
    ranks = [{"rank": r, "tiers": {"fs": to_json(full), "mooncake": to_json(down)}} for r in (0, 1)]

    class Bare(Observation):  # only the join: no ranks, no faults, no recent failures
        def __init__(self) -> None:
            pass

        def _tier_flags(self) -> dict[str, Any]:
            return {}

    tiers = Bare()._tier_health(ranks)
    fs = tiers["fs"]
    assert not fs["ok"] and fs["condition"] == "full" and fs["conditions"] == ["full"]
    assert fs["quarantined_total"] == 1 and [x["file"] for x in fs["quarantined"]] == [q.file]
    assert len(fs["detail"]) == 2 and all("(ENOSPC)" in d for d in fs["detail"])
    assert tiers["mooncake"]["condition"] == "unavailable"
