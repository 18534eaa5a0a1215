"""Pure: the lines `bsr status` and `bsr events` print tell evidence apart. A rank's last fault is dated and, once a
newer restore ended, shown as superseded (an old drill's fault never reads as the cause of a newer failure); two
admission passes of one request are two different lines, each naming its pass and the tier it blamed."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from bsr_cli.cli.render.ops import event_line, last_fault_line, status
from bsr_cli.core import events as ev
from bsr_cli.core.evidence import FailureKind, Outcome, Stage, WindowStep
from bsr_cli.core.status import EngineStatus, Health, RankFault, RecentRestore, Snapshot

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
    no_pass = ev.WindowStepped(step=WindowStep.INSTALLED, request="req-00012", rank=0, window=0).to_wire()
    assert "pass" not in no_pass and "req-00012 window 1 installed" in event_line(no_pass)


# What a vLLM worker adds: its limits to the info, its loads' own keys to each recent restore, the scheduler's state.
WORKER = {"tp_rank": 1, "window_chunks": 4, "max_model_len": 8192, "kv_tokens": 65_536, "staging_bytes": 1}
LOAD = {
    "request": "req-1",
    "prefix_tokens": 512,
    "outcome": "committed",
    "advertised_tokens": 512,
    "loaded_tokens": 512,
    "recomputed_tokens": 0,
    "windows": 2,
    "failed_window": None,
    "W": 4,
    "reason": "",
}
FAILED_LOAD = LOAD | {
    "request": "req-2",
    "outcome": "failed_closed",
    "advertised_tokens": 1024,
    "loaded_tokens": 0,
    "recomputed_tokens": 1024,
    "windows": 3,
    "failed_window": 1,
    "reason": "injected",
}


def _status_text(snapshot: dict[str, object]) -> str:
    console = Console(record=True, width=240, file=io.StringIO())
    status(console, EngineStatus("http://127.0.0.1:1", Health.from_wire({}), Snapshot.from_wire(snapshot)))
    return console.export_text()


@pytest.mark.timeout(30)
def test_a_vllm_workers_status_names_its_limits_its_loads_and_what_the_scheduler_forced_local() -> None:
    text = _status_text(
        {
            "info": {"serves_restores": False, "worker": WORKER},
            "recent": [LOAD, FAILED_LOAD, {"request": "req-3", "outcome": "committed"}],  # req-3: not a load
            "scheduler": {"published": True, "forced_local": [{"request": "req-9", "marker": "m9", "at": 2.0}]},
        }
    )
    assert "vLLM worker tp-rank 1: W = the connector's bsr_window_chunks (4)" in text
    assert "max_model_len (8,192); KV 65,536 tokens" in text
    assert "load req-1: committed 512 tokens in 2 window(s) of W=4" in text
    assert (
        "load req-2: failed closed at window G2 of 3 (W=4): advertised 1,024 tokens, loaded 0, recomputed 1,024" in text
    )
    assert "req-3" not in text
    assert "admission req-9: forced local by the marker on prompt m9" in text
    assert "no force-local markers" in text
    # A scheduler that never published: its markers are unknown, not absent.
    unpublished = _status_text({"info": {"worker": WORKER}})
    assert "markers unknown" in unpublished and "admission" not in unpublished
