"""The bench's typed measurements write the evidence keys they always wrote: a key that was absent stays absent."""

from __future__ import annotations

import json
from dataclasses import replace

from bsr_cli.bench.cpu_bound import RestoreRow
from bsr_cli.bench.evidence import RankEvidence, RestoreEvidence, RowMeta, RowStatus
from bsr_cli.bench.probes import PageEviction
from bsr_cli.bench.store import StoreRestoreRow
from bsr_cli.bench.sweep import SweepRow
from bsr_cli.bench.wlaw import WLawRow


def test_a_page_eviction_says_only_what_happened() -> None:
    assert PageEviction("drop_caches").to_wire() == {"method": "drop_caches"}
    assert PageEviction("posix_fadvise", files=3).to_wire() == {"method": "posix_fadvise", "files": 3}
    failed = PageEviction("posix_fadvise", error="permission denied")
    assert failed.to_wire() == {"method": "posix_fadvise", "error": "permission denied"} and not failed.ok


def _restore_row(reason: str | None) -> RestoreRow:
    return RestoreRow(
        trial=0,
        budget_windows=2,
        budget_bytes=4096,
        bytes=8192,
        windows=4,
        seconds=0.5,
        gbps=1.0,
        cpu_s_per_gb=0.2,
        stage_cpu_s_per_gb={"fetch": 0.05, "verify": 0.05, "install": 0.05, "other": 0.05},
        peak_live_bytes=4096,
        hash_ok=reason is None,
        checks={"committed": reason is None},
        status=RowStatus.PASS if reason is None else RowStatus.FAIL,
        reason=reason,
    )


def test_a_cpu_bound_restore_row_names_its_kind_first_and_a_reason_only_when_it_failed() -> None:
    ok = _restore_row(None).to_wire()
    assert next(iter(ok)) == "kind" and ok["kind"] == "restore" and "reason" not in ok
    assert list(ok)[-2:] == ["checks", "status"]
    failed = _restore_row("checksum mismatch").to_wire()
    assert list(failed)[-1] == "reason" and failed["reason"] == "checksum mismatch"


def _meta() -> RowMeta:
    return RowMeta(started_at="2026-01-01T00:00:00.000Z")


def _evidence() -> RestoreEvidence:
    rank = RankEvidence(0, 8, 8, 4, 0.5, 0.25, 0.0, 1.0, True)
    return RestoreEvidence(
        request="r-1",
        outcome=None,  # the engine named none: "unknown" in the bundle
        tiers=["fs"],
        excluded_tiers=[],
        advertised_tokens=512,
        committed_tokens=512,
        chunks=2,
        windows=1,
        expected_windows=1,
        seconds=0.5,
        total_bytes=16,
        gbps=0.0,
        gbps_per_rank=0.0,
        peak_pool_bytes=8,
        predicted_peak_bytes=8,
        rws_bytes=None,
        whole_plan_bytes=16,
        ranks=(rank,),
        output_hash=None,
        canonical_hash=None,
        hash_ok=None,
        healthy=True,
        failure=None,
    )


def test_a_row_writes_its_status_labels_start_its_measurement_beside_them_then_its_checks() -> None:
    judged = _meta().judged({"committed_all": True}).timed(1.5)
    row = SweepRow(tokens=512, W=2, salt=7, restore=_evidence(), meta=judged)
    wire = row.to_wire()
    ev = _evidence().to_wire()
    assert list(wire) == ["status", "tokens", "W", "salt", "started_at", *ev, "checks", "elapsed_s"]
    assert wire["status"] == "pass" and wire["outcome"] == "unknown" and wire["bytes"] == 16
    again = SweepRow.from_wire(json.loads(json.dumps(wire)))
    assert again == row and again.to_wire() == wire
    # Interrupted before the restore: no evidence keys, and the reason said.
    stopped = SweepRow(tokens=512, W=2, salt=7, meta=_meta().stopped("interrupted by the operator (Ctrl-C)"))
    assert list(stopped.to_wire()) == ["status", "tokens", "W", "salt", "started_at", "reason"]
    assert SweepRow.from_wire(stopped.to_wire()).restore is None


def test_what_comes_with_the_restore_is_written_only_with_it() -> None:
    bare = StoreRestoreRow(W=2, budget_bytes=None, trial=0, tokens=512, meta=_meta())
    assert "paired_raw_get" not in bare.to_wire() and "vs_paired_raw" not in bare.to_wire()
    wire = replace(bare, restore=_evidence(), meta=_meta().judged({"ok": True})).to_wire()
    assert wire["paired_raw_get"] is None and wire["vs_paired_raw"] is None  # said, though unmeasured
    assert list(wire)[-3:] == ["paired_raw_get", "vs_paired_raw", "checks"]
    law = WLawRow(W=2, tokens=512, restore=_evidence(), law_bytes=8, meta=_meta())
    assert law.to_wire()["law_bytes"] == 8 and "law_bytes" not in WLawRow(W=2, tokens=512, meta=_meta()).to_wire()
