"""The failure taxonomy's rules: which kind wins, which tiers a marker may blame, what the hint names."""

from __future__ import annotations

from bsr_cli.runtime import failures


def test_the_most_specific_kind_wins() -> None:
    assert failures.classify([]) is None
    assert failures.classify([{"kind": "capacity"}, {"kind": "capacity"}]) == "capacity"
    assert failures.classify([{"kind": "capacity"}, {"kind": "tier"}]) == "tier"  # a real tier failure outranks
    assert failures.classify([{"kind": "tier"}, {"kind": "aborted"}]) == "aborted"
    assert failures.classify([{"kind": "aborted"}, {"kind": "rank"}]) == "rank"  # the stall explains the aborts
    assert failures.classify([{"reason": "old rank without a kind"}]) == "tier"


def test_only_a_tier_fault_blames_tiers() -> None:
    fails = [{"kind": "tier", "tier": "mooncake"}, {"kind": "tier", "tier": None}]
    assert failures.blamed_tiers("tier", fails, ["fs", "mooncake"]) == {"mooncake"}
    assert failures.blamed_tiers("tier", [{"kind": "tier"}], ["fs", "mooncake"]) == {"fs", "mooncake"}
    for kind in ("capacity", "rank", "aborted", None):
        assert failures.blamed_tiers(kind, fails, ["mooncake"]) == set()


def test_capacity_hints_name_the_setting_and_a_value_that_fits() -> None:
    mib = 1 << 20
    over_b = failures.capacity_hint(
        "capacity: a window of 64 chunks ... the budget B is",
        w=64,
        slot_bytes=mib,
        budget_bytes=32 * mib,
        pool_bytes=64 * mib,
    )
    assert "--W 32" in over_b and "budget" in over_b
    whole = failures.capacity_hint("pool capacity", w=0, slot_bytes=mib, budget_bytes=32 * mib, pool_bytes=64 * mib)
    assert "--pool" in whole and "64 chunk" in whole
    waited = failures.capacity_hint("timed out after 60.0s waiting", w=8, slot_bytes=mib, budget_bytes=0, pool_bytes=0)
    assert "retry" in waited


def test_summary_names_the_rank_or_the_tier() -> None:
    rank = {
        "failure_kind": "rank",
        "failures": [
            {"rank": 0, "kind": "aborted", "reason": "aborted by the operator"},
            {"rank": 1, "kind": "rank", "reason": "no heartbeat for 2.3s"},
        ],
    }
    assert failures.summary(rank) == "rank 1 stopped responding: no heartbeat for 2.3s"
    tier = {"failure_kind": "tier", "failures": [{"rank": 0, "kind": "tier", "tier": "fs", "reason": "missing"}]}
    assert failures.summary(tier) == "tier fs failed on rank 0: missing"
