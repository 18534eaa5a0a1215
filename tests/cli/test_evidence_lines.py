"""Pure: the lines `bsr status` and `bsr events` print tell evidence apart. A rank's last fault is dated and, once a
newer restore ended, shown as superseded (an old drill's fault never reads as the cause of a newer failure); two
admission passes of one request are two different lines, each naming its pass and the tier it blamed."""

from __future__ import annotations

import pytest

from bsr_cli.cli.render.ops import event_line, last_fault_line
from bsr_cli.core import events as ev
from bsr_cli.core.evidence import FailureKind, Outcome, Stage
from bsr_cli.core.status import RankFault, RecentRestore

NOW = 10_000.0
OLD_FAULT = RankFault(
    reason="rank 1 failed at install (window G2): injected restore fault",
    request="req-00003",
    at=NOW - 600,
    stage=Stage.INSTALL,
)


@pytest.mark.timeout(30)
def test_a_rank_fault_with_nothing_newer_is_dated_and_stands() -> None:
    line = last_fault_line(1, OLD_FAULT, NOW, [])
    assert line.startswith("[yellow]rank 1 last fault 10m ago (req-00003)[/]")
    assert line.endswith(OLD_FAULT.reason)
    older = RecentRestore(request="req-00002", outcome=Outcome.COMMITTED, finished=NOW - 700)
    assert last_fault_line(1, OLD_FAULT, NOW, [older]) == line  # a restore from before the fault changes nothing


@pytest.mark.timeout(30)
def test_a_rank_fault_older_than_the_newest_restore_is_superseded() -> None:
    newer = RecentRestore(
        request="req-00009",
        outcome=Outcome.FAILED_CLOSED,
        finished=NOW - 5,
        reason="tier fs failed at verify on rank 0 (window G1): checksum mismatch in chunk 0 group full",
        failure_kind=FailureKind.TIER,
        failure_stage=Stage.VERIFY,
    )
    line = last_fault_line(1, OLD_FAULT, NOW, [newer])
    assert line.startswith("[dim]rank 1 last fault 10m ago (req-00003), before the newest restore req-00009")
    assert "failed closed 5s ago: tier fs failed at verify" in line and "[yellow]" not in line


@pytest.mark.timeout(30)
def test_two_passes_of_one_request_are_two_lines_naming_pass_and_tier() -> None:
    def failed(pass_no: int, tier: str) -> dict[str, object]:
        return ev.RestoreFailed(
            seq=pass_no,
            time=NOW,
            request="req-00012",
            rank=1,
            reason="unavailable fetching chunk 64 group full",
            stage=Stage.FETCH,
            window=2,
            tier=tier,
            failure_kind=FailureKind.TIER,
            pass_no=pass_no,
        ).to_wire()

    first, second = event_line(failed(1, "mooncake")), event_line(failed(2, "fs"))
    assert "req-00012 pass 1 rank 1 failed at window 3 (fetch, tier mooncake)" in first
    assert "req-00012 pass 2 rank 1 failed at window 3 (fetch, tier fs)" in second
    ended = ev.RestoreEnded(
        outcome=Outcome.FAILED_CLOSED,
        request="req-00012",
        advertised_tokens=65_536,
        failures=(ev.Failure(rank=1, reason="unavailable", kind=FailureKind.TIER, window=2, tier="fs"),),
        failure_kind=FailureKind.TIER,
        pass_no=2,
    )
    assert "req-00012 pass 2 FAILED CLOSED, 0/65,536 tok: rank 1 window 3 tier fs unavailable" in event_line(
        ended.to_wire()
    )
    # An event from a host that names no pass reads as before.
    no_pass = ev.WindowInstalled(request="req-00012", rank=0, window=0).to_wire()
    assert "pass" not in no_pass and "req-00012 window 1 installed" in event_line(no_pass)
