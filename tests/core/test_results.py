"""The typed results of probe, submit, restore and abort: each writes the wire form the admin API has always
answered (keys, order, which are absent) and reads it back, ignoring keys a newer engine adds."""

from __future__ import annotations

import json
from pathlib import Path

from bsr_cli.core.bitmap import full_hit_bitmap
from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import FailureKind, Outcome, Stage
from bsr_cli.core.markers import Marker
from bsr_cli.core.results import (
    AbortAnswer,
    AdmissionPass,
    InvalidCell,
    ManualRestoreResult,
    MarkerStep,
    OutputHashes,
    PrefixLookup,
    ProbeResult,
    RankRestore,
    RestoreReport,
    StoreReport,
    SubmitResult,
)

BITMAP = full_hit_bitmap(("mooncake", "fs"), 2, ("full",), 64, 16, registration="reg-1", model="m")
HEAD = ["request", "prompt", "tokens", "W"]
REPORT_KEYS = [
    "tiers",
    "advertised_tokens",
    "committed_tokens",
    "outcome",
    "invalid",
    "failures",
    "failure_kind",
    "failure_stage",
    "blamed_tiers",
    "blamed_ranks",
    "hint",
    "windows",
    "chunks",
    "seconds",
    "bytes",
    "gbps",
    "ranks",
    "rws_bytes",
    "whole_plan_bytes",
    "fired_faults",
]


def _report(committed: int = 64) -> RestoreReport:
    failed = not committed
    fail = Failure(rank=1, reason="unavailable", kind=FailureKind.TIER, stage=Stage.FETCH, window=0, tier="mooncake")
    return RestoreReport(
        request="req-00002",
        w=2,
        tiers=("mooncake",),
        advertised_tokens=64,
        committed_tokens=committed,
        outcome=Outcome.FAILED_CLOSED if failed else Outcome.COMMITTED,
        invalid=(InvalidCell(1, "full"),) if failed else (),
        failures=(fail,) if failed else (),
        failure_kind=FailureKind.TIER if failed else None,
        failure_stage=Stage.FETCH if failed else None,
        blamed_tiers=("mooncake",) if failed else (),
        blamed_ranks=(),
        hint=None,
        windows=2,
        ranks=(
            RankRestore(rank=0, ok=True, valid={"full": True}, windows_done=2, bytes_restored=4096, seconds=0.5),
            RankRestore(
                rank=1,
                ok=not failed,
                valid={"full": not failed},
                failed_window=0 if failed else None,
                kind=FailureKind.TIER if failed else None,
                tier="mooncake" if failed else None,
                stage=Stage.FETCH if failed else None,
            ),
        ),
        chunks=4,
        seconds=0.5,
        bytes=8192,
        gbps=1.5e-05,
        rws_bytes=4096,
        whole_plan_bytes=8192,
        fired_faults=(3,) if failed else (),
    )


def _json(wire: dict) -> dict:
    """What a client reads: the wire form through JSON."""
    return json.loads(json.dumps(wire))


def test_a_committed_restore_has_its_hashes_after_the_report() -> None:
    res = ManualRestoreResult(
        "req-00002", "p1", 64, 2, PrefixLookup({}, None, BITMAP), _report(), OutputHashes("ab", "ab", True)
    )
    wire = res.to_wire()
    assert list(wire) == [*HEAD, "tier_errors", "first_break", "bitmap", *REPORT_KEYS, "output_hash", "canonical_hash",
                          "hash_ok"]  # fmt: skip
    assert wire["outcome"] == "committed" and wire["failure_kind"] is None and wire["ranks"][0]["kind"] == ""
    assert ManualRestoreResult.from_wire(_json(wire)).to_wire() == _json(wire)
    unchecked = ManualRestoreResult("r", "p", 64, 2, PrefixLookup({}, None, BITMAP), _report(), OutputHashes("ab"))
    assert "canonical_hash" not in unchecked.to_wire()  # --no-verify: no canonical hash at all, not a null one


def test_a_restore_whose_output_hash_is_not_canonical_reads_as_failed_and_keeps_what_it_restored() -> None:
    marker = Marker("p1", set(), "output hash ab != canonical cd", "req-00002", set_at=12.5)
    hashes = OutputHashes("ab", "cd", False)
    res = ManualRestoreResult(
        "req-00002", "p1", 64, 2, PrefixLookup({}, None, BITMAP), _report(), hashes, marker=marker
    )
    assert res.output_mismatch and res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    wire = res.to_wire()
    assert wire["outcome"] == "failed_closed" and wire["committed_tokens"] == 0 and wire["restored_tokens"] == 64
    assert wire["hash_ok"] is False and wire["marker"]["excluded_tiers"] == []
    back = ManualRestoreResult.from_wire(_json(wire))
    assert back.output_mismatch and back.report is not None and back.report.committed_tokens == 64
    assert back.to_wire() == _json(wire)
    ok = ManualRestoreResult("r", "p", 64, 2, PrefixLookup({}, None, BITMAP), _report(), OutputHashes("ab", "ab", True))
    assert not ok.output_mismatch and "restored_tokens" not in ok.to_wire()


def test_a_failed_restore_names_its_marker_and_reads_back_typed() -> None:
    marker = Marker("p1", {"mooncake"}, "tier mooncake failed at fetch", "req-00002", set_at=12.5)
    res = ManualRestoreResult("req-00002", "p1", 64, 2, PrefixLookup({}, None, BITMAP), _report(0), marker=marker)
    wire = res.to_wire()
    assert list(wire)[-1] == "marker" and "output_hash" not in wire
    back = ManualRestoreResult.from_wire(_json(wire) | {"added_by_a_newer_engine": 1})
    assert back.report is not None and back.report.failures[0].stage is Stage.FETCH
    assert back.report.failure_kind is FailureKind.TIER and back.marker is not None
    assert back.marker.excluded == {"mooncake"} and back.report.ranks[1].kind is FailureKind.TIER
    assert back.to_wire() == _json(wire)


def test_nothing_to_restore_and_a_restore_that_never_started_keep_their_shapes() -> None:
    nothing = ManualRestoreResult("r", "p", 64, 2, PrefixLookup({"rank0": {"fs": "down"}}, None, BITMAP), None)
    wire = nothing.to_wire()
    assert list(wire) == [*HEAD, "tier_errors", "first_break", "bitmap", "outcome", "committed_tokens",
                          "advertised_tokens"]  # fmt: skip
    assert ManualRestoreResult.from_wire(_json(wire)).outcome is Outcome.NOTHING_TO_RESTORE
    stalled = RestoreReport(
        request="r",
        w=2,
        tiers=(),
        advertised_tokens=0,
        committed_tokens=0,
        outcome=Outcome.FAILED_CLOSED,
        invalid=(),
        failures=(Failure(rank=1, reason="no heartbeat", kind=FailureKind.RANK),),
        failure_kind=FailureKind.RANK,
        failure_stage=None,
        blamed_tiers=(),
        blamed_ranks=(1,),
        hint="resume it",
        windows=0,
        ranks=(),
    )
    wire = ManualRestoreResult("r", "p", 64, 2, None, stalled).to_wire()
    assert list(wire) == [*HEAD, "outcome", "advertised_tokens", "committed_tokens", "failures", "failure_kind",
                          "failure_stage", "blamed_tiers", "blamed_ranks", "invalid", "tiers", "ranks", "windows",
                          "hint"]  # fmt: skip
    assert ManualRestoreResult.from_wire(_json(wire)).to_wire() == _json(wire)


def test_a_hosts_not_applicable_hash_comes_last_in_both_answers() -> None:
    res = ManualRestoreResult(
        "r", "p", 64, 2, PrefixLookup({}, None, BITMAP), _report(), OutputHashes("ab"), hash_note="real KV"
    )
    wire = res.to_wire()
    assert list(wire)[-6:] == ["output_hash", "hash", "hash_note", "kv_checksum", "canonical_hash", "hash_ok"]
    assert wire["hash"] == "not applicable" and wire["kv_checksum"] == "ab" and wire["hash_ok"] is None
    assert ManualRestoreResult.from_wire(_json(wire)).hash_note == "real KV"
    sub = _submit(hash_note="real KV").to_wire()
    assert list(sub)[-4:] == ["seconds", "hash", "hash_note", "kv_checksum"]
    assert "hash" not in _submit().to_wire()


def _submit(hash_note: str | None = None) -> SubmitResult:
    marker = Marker("p1", {"mooncake"}, "why", "req-00002", set_at=1.0)
    return SubmitResult(
        request="req-00002",
        prompt="p1",
        tokens=64,
        w=2,
        external_tokens=64,
        computed_tokens=0,
        source="fs",
        passes=(
            AdmissionPass(pass_no=1, excluded_tiers=(), external_tokens=64, tier_errors={}, restore=_report(0)),
            AdmissionPass(
                pass_no=2, excluded_tiers=("mooncake",), external_tokens=64, tier_errors={}, restore=_report()
            ),
            AdmissionPass(pass_no=3, excluded_tiers=("mooncake", "fs"), external_tokens=0, tier_errors={}),
        ),
        marker_history=(MarkerStep(pass_no=1, marker=marker),),
        marker_cleared=True,
        stored=StoreReport({"rank0": {"fs": 4}}, {"rank1": {"fs": "read-only"}}),
        output_hash="ab",
        canonical_hash=None if hash_note else "ab",
        hash_ok=None if hash_note else True,
        seconds=0.25,
        hash_note=hash_note,
    )


def test_a_submit_says_why_each_pass_failed_and_reads_back() -> None:
    wire = _submit().to_wire()
    failed, committed, local = wire["passes"]
    assert list(failed) == ["pass", "excluded_tiers", "external_tokens", "tier_errors", "restore", "failure_kind"]
    assert failed["failure_kind"] == "tier" and "failure_kind" not in committed and "restore" not in local
    assert wire["force_local"] == {"history": [{"pass": 1, "marker": wire["force_local"]["history"][0]["marker"]}],
                                   "cleared": True}  # fmt: skip
    back = SubmitResult.from_wire(_json(wire))
    assert back.passes[1].restore is not None and back.passes[1].restore.outcome is Outcome.COMMITTED
    assert back.stored is not None and back.stored.errors == {"rank1": {"fs": "read-only"}}
    assert back.to_wire() == _json(wire)
    nothing_stored = SubmitResult.from_wire(_json(wire) | {"stored": {}})
    assert nothing_stored.stored is None and nothing_stored.to_wire()["stored"] == {}


def test_an_abort_answer_reads_back() -> None:
    assert AbortAnswer.from_wire({"request": "r", "aborting": True, "new": 1}) == AbortAnswer("r", True)
    assert list(AbortAnswer("r", False).to_wire()) == ["request", "aborting"]


def test_a_probe_reads_back_typed_markers_and_writes_the_same_document() -> None:
    doc = json.loads((Path(__file__).parents[2] / "examples" / "probe.json").read_text())
    doc.pop("strip_width")  # `bsr probe --json` adds it; the engine's answer has no such key
    doc["markers"] = [
        {"prompt": "c27416f8", "excluded_tiers": ["mooncake"], "reason": "tier fault", "request": "req-1",
         "set_at": 1.5, "prefix_tokens": 512},  # a vLLM worker's marker adds its prefix
    ]  # fmt: skip
    probe = ProbeResult.from_wire(doc)
    assert probe.markers[0].excluded_tiers == ("mooncake",) and probe.markers[0].host_fields == {"prefix_tokens": 512}
    assert probe.registration.tp_size == 2 and probe.first_break is None
    assert json.dumps(probe.to_wire()) == json.dumps(doc)  # key for key, in order


def test_a_ranks_stage_costs_travel_by_stage_and_are_absent_from_an_older_ranks_answer() -> None:
    from bsr_cli.core.evidence import TimedStage
    from bsr_cli.core.results import RankRestore
    from bsr_cli.core.stage_costs import StageCost, StageCosts

    costs = StageCosts(process_cpu_s=2.0).plus(TimedStage.FETCH, 1.5, 0.5).plus(TimedStage.VERIFY, 0.2, 0.1)
    rank = RankRestore(rank=0, ok=True, valid={"full": True}, stages=costs)
    w = rank.to_wire()
    assert list(w["stages"]) == ["fetch", "verify", "install", "wait", "process_cpu_s"]
    assert w["stages"]["fetch"] == {"wall_s": 1.5, "cpu_s": 0.5} and w["stages"]["install"] == {
        "wall_s": 0.0,
        "cpu_s": 0.0,
    }
    assert RankRestore.from_wire(w) == rank
    assert costs.staged_cpu_s == 0.6 and costs.of(TimedStage.VERIFY) == StageCost(0.2, 0.1)
    assert StageCosts.total([costs, costs]).fetch == StageCost(3.0, 1.0)
    older = RankRestore(rank=0, ok=True, valid={"full": True})
    assert "stages" not in older.to_wire() and RankRestore.from_wire(older.to_wire()).stages is None
