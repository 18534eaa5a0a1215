"""The bench's typed measurements write the evidence keys they always wrote: a key that was absent stays absent."""

from __future__ import annotations

from bsr_cli.bench.cpu_bound import RestoreRow
from bsr_cli.bench.evidence import RowStatus
from bsr_cli.bench.probes import PageEviction


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
