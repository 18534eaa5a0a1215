"""Pure: how `explain` names a chunk the last restore quarantined, as the cause of its gap and then as repaired."""

from __future__ import annotations

from bsr_cli.core import events as ev
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.explain import Explanation, FindingKind, FoldedRestore, explain_engine, fold_restore
from bsr_cli.core.status import EngineInfo, Health
from bsr_cli.loaders import builtin_registration


def _explain(cells: str, last: FoldedRestore | None) -> Explanation:
    reg = builtin_registration("demo")
    n = 4 * reg.chunk_size
    bitmap = {
        "tokens": n,
        "chunk_size": reg.chunk_size,
        "tiers": ["fs"],
        "ranks": 2,
        "groups": list(reg.group_names),
        "rows": [{"rank": r, "group": g, "cells": cells} for r in range(2) for g in reg.group_names],
    }
    info = EngineInfo.from_wire(
        {"W": 4, "budget_bytes": 4 * reg.bytes_per_chunk, "pool_bytes": 8 * reg.bytes_per_chunk, "engine": "t"}
    )
    return explain_engine(
        prompt="p",
        prompt_flags="--synthetic 1024",
        registration=reg,
        bitmap=HitBitmap.from_dict(bitmap),
        n_tokens=n,
        info=info,
        health=Health.from_wire({"ranks": [], "tiers": {"fs": {"ok": True}}}),
        markers=[],
        faults=[],
        w=None,
        last_restore=last,
    )


def _last_restore() -> FoldedRestore | None:
    return fold_restore(
        [
            ev.ObjectQuarantined(
                rank=0,
                tier="fs",
                chunk=2,
                group="full",
                key="k",
                file="/t/fs-tier/quarantine/x.1.bsr",
                reason="payload checksum mismatch: chunk 2 group full on rank 0",
                request="r-1",
            )
        ]
    )


def test_a_quarantined_chunk_is_named_as_the_cause_of_the_gap_then_as_repaired() -> None:
    last = _last_restore()
    assert last is not None and last.quarantined[0].chunk == 2
    # The tier lost chunk 2 on every rank and group (rank 0 quarantined it; here both miss it): the cause is named.
    d = _explain("1101", last)
    q = [f for f in d.findings if f.kind is FindingKind.QUARANTINED]
    assert d.verdict is FindingKind.QUARANTINED and len(q) == 1, d.findings
    assert "chunk 2 group full on rank 0 in tier fs" in q[0].summary
    assert q[0].next == "bsr submit --synthetic 1024"
    assert "moved to /t/fs-tier/quarantine/x.1.bsr" in q[0].evidence
    # Held again (the next submit rewrote it): restorable, with the repair listed after it.
    d = _explain("1111", last)
    assert d.verdict is FindingKind.RESTORABLE and [f.kind for f in d.findings] == [
        FindingKind.RESTORABLE,
        FindingKind.REPAIRED,
    ]
    # No quarantine in the last restore: neither finding.
    assert [f.kind for f in _explain("1111", None).findings] == [FindingKind.RESTORABLE]
