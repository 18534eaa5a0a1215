"""The failure taxonomy's rules: which kind wins, blame by stage (a tier only for fetch/verify, the rank for install
and synchronize), outcomes and exit codes, what the hint names (from the typed cause, never the text)."""

from __future__ import annotations

import pytest

from bsr_cli.api.jobs import RestoreResult
from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome, Stage
from bsr_cli.core.results import ManualRestoreResult, RestoreReport
from bsr_cli.errors import ExitCode
from bsr_cli.runtime import failures

pytestmark = pytest.mark.fast


def _f(kind: FailureKind, stage: Stage | None = None, tier: str | None = None, rank: int = 0) -> Failure:
    return Failure(rank=rank, reason=f"{kind.value} failure", kind=kind, stage=stage, tier=tier)


def _report(wire: dict) -> RestoreReport:
    """A failed restore's report read from the wire form the admin API answers."""
    kind = FailureKind(wire["failure_kind"])
    return RestoreReport.from_wire({"request": "req-1", "W": 4, "outcome": kind.outcome.value} | wire)


def _manual(wire: dict) -> ManualRestoreResult:
    return ManualRestoreResult("req-1", "p", 1024, 4, lookup=None, report=_report(wire))


def test_the_most_specific_kind_wins() -> None:
    assert failures.classify([]) is None
    cap, tier = _f(failures.CAPACITY, Stage.ADMISSION), _f(failures.TIER, Stage.FETCH, "fs")
    assert failures.classify([cap, cap]) is FailureKind.CAPACITY
    assert failures.classify([cap, tier]) is FailureKind.TIER  # a real tier failure outranks
    assert failures.classify([tier, _f(failures.ABORTED)]) is FailureKind.ABORTED
    assert failures.classify([_f(failures.ABORTED), _f(failures.RANK)]) is FailureKind.RANK  # the stall explains


def test_a_result_without_a_kind_is_an_error_never_a_tier_fault() -> None:
    """The old code read a missing kind as a tier fault, which steers traffic away from a healthy tier."""
    result = RestoreResult(rank=2, ok=False, valid={"full": False}, reason="old host without a kind")
    with pytest.raises(ValueError, match="names no failure kind"):
        failures.failure_of(result)


def test_only_a_tier_failure_at_a_tier_stage_blames_tiers() -> None:
    fails = [_f(failures.TIER, Stage.FETCH, "mooncake"), _f(failures.TIER, Stage.VERIFY)]
    assert failures.blamed_tiers(FailureKind.TIER, fails, ["fs", "mooncake"]) == {"mooncake"}
    unnamed = [_f(failures.TIER, Stage.FETCH)]
    assert failures.blamed_tiers(FailureKind.TIER, unnamed, ["fs", "mooncake"]) == {"fs", "mooncake"}
    for kind in (FailureKind.CAPACITY, FailureKind.RANK, FailureKind.ABORTED, None):
        assert failures.blamed_tiers(kind, fails, ["mooncake"]) == set()
    # An install failure carries the tier it restored from in no field: nothing to blame even if it did.
    install = [_f(failures.RANK, Stage.INSTALL, "mooncake", rank=1)]
    assert failures.blamed_tiers(failures.classify(install), install, ["mooncake"]) == set()
    assert failures.blamed_ranks(install) == [1]


def test_outcomes_and_exit_codes_follow_the_kind() -> None:
    assert failures.outcome(None) is Outcome.COMMITTED
    assert failures.outcome(FailureKind.CAPACITY) is Outcome.REFUSED
    assert failures.outcome(FailureKind.ABORTED) is Outcome.ABORTED
    assert failures.outcome(FailureKind.TIER) is failures.outcome(FailureKind.RANK) is Outcome.FAILED_CLOSED
    refused = {"failure_kind": "capacity", "failures": [_f(failures.CAPACITY, Stage.ADMISSION).to_wire()]}
    aborted = {"failure_kind": "aborted", "failures": [_f(failures.ABORTED).to_wire()]}
    rank = {"failure_kind": "rank", "failures": [_f(failures.RANK, Stage.INSTALL, rank=1).to_wire()]}
    assert failures.restore_error(_manual(refused)).exit_code == ExitCode.CAPACITY == 12
    assert failures.restore_error(_manual(aborted)).exit_code == ExitCode.INTERRUPTED == 130
    err = failures.restore_error(_manual(rank))
    assert err.exit_code == ExitCode.FAILED_CLOSED and "rank 1 failed at install" in err.message
    assert "no tier blamed" in err.message and "rank 1" in (err.hint or "")


def test_capacity_hints_come_from_the_typed_cause_not_the_text() -> None:
    mib = 1 << 20
    over_b = failures.capacity_hint(
        CapacityCause.WINDOW_OVER_BUDGET, w=64, slot_bytes=mib, budget_bytes=32 * mib, pool_bytes=64 * mib
    )
    assert "--W 32" in over_b and "budget" in over_b
    whole = failures.capacity_hint(
        CapacityCause.WINDOW_OVER_POOL, w=0, slot_bytes=mib, budget_bytes=32 * mib, pool_bytes=64 * mib
    )
    assert "--pool" in whole and "64 chunk" in whole
    waited = failures.capacity_hint(
        CapacityCause.ADMISSION_TIMEOUT, w=8, slot_bytes=mib, budget_bytes=32 * mib, pool_bytes=0
    )
    assert "retry" in waited
    blocks = failures.capacity_hint(
        CapacityCause.NO_DESTINATION_BLOCKS, w=8, slot_bytes=mib, budget_bytes=32 * mib, pool_bytes=0
    )
    assert "--kv-tokens" in blocks


def test_summary_names_the_rank_and_its_stage_or_the_tier() -> None:
    stall = {
        "failure_kind": "rank",
        "failures": [
            {"rank": 0, "kind": "aborted", "reason": "aborted by the operator"},
            {"rank": 1, "kind": "rank", "reason": "no heartbeat for 2.3s"},
        ],
    }
    assert failures.summary(_report(stall)) == "rank 1 stopped responding: no heartbeat for 2.3s"
    install = {"failure_kind": "rank", "failures": [_f(failures.RANK, Stage.INSTALL, rank=1).to_wire() | {"window": 3}]}
    assert (
        failures.summary(_report(install)) == "rank 1 failed at install (window G4): rank failure"
    )  # window 3 in JSON
    tier = {
        "failure_kind": "tier",
        "failures": [{"rank": 0, "kind": "tier", "stage": "fetch", "tier": "fs", "reason": "missing"}],
    }
    assert failures.summary(_report(tier)) == "tier fs failed at fetch on rank 0: missing"
    no_tier = {"failure_kind": "tier", "failures": [{"rank": 0, "kind": "tier", "reason": "missing"}]}
    assert failures.summary(_report(no_tier)) == "a tier failed on rank 0: missing"  # never "tier None" or "tier ?"
