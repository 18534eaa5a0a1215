"""Pure: `bsr explain` gives one verdict per prompt, and its other findings never contradict it. A prompt whose marker
says "recompute locally" is not also "restorable"; a tier failure that this prompt's later restore contradicts is
dropped, and one older than that restore is dated."""

from __future__ import annotations

from typing import Any

from bsr_cli.core import events as ev
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.evidence import FailureKind, Outcome, Stage
from bsr_cli.core.explain import Explanation, FindingKind, FoldedRestore, explain_engine, fold_restore
from bsr_cli.core.status import EngineInfo, Health, MarkerView
from bsr_cli.loaders import builtin_registration

REG = builtin_registration("demo")
N = 4 * REG.chunk_size
FAILED_AT = 1_000.0  # when the earlier restore from mooncake failed


def _explain(*, markers: tuple[MarkerView, ...] = (), last: FoldedRestore | None = None) -> Explanation:
    """A prompt every rank holds whole in both tiers, on an engine whose mooncake tier is unhealthy only because
    a restore from it failed at FAILED_AT."""
    bitmap = {
        "tokens": N,
        "chunk_size": REG.chunk_size,
        "tiers": ["mooncake", "fs"],
        "ranks": 2,
        "groups": list(REG.group_names),
        "rows": [{"rank": r, "group": g, "cells": "3333"} for r in range(2) for g in REG.group_names],
    }
    info = EngineInfo.from_wire(
        {"W": 4, "budget_bytes": 4 * REG.bytes_per_chunk, "pool_bytes": 8 * REG.bytes_per_chunk, "engine": "t"}
    )
    mooncake: dict[str, Any] = {
        "ok": False,
        "detail": ["restore req-1 from it failed 40s ago on rank 1: unavailable fetching chunk 0 group full"],
        "conditions": ["restore_failed"],
        "failed_at": FAILED_AT,
    }
    return explain_engine(
        prompt="p",
        prompt_flags="--synthetic 1024",
        registration=REG,
        bitmap=HitBitmap.from_dict(bitmap),
        n_tokens=N,
        info=info,
        health=Health.from_wire({"ranks": [], "tiers": {"mooncake": mooncake, "fs": {"ok": True}}}),
        markers=list(markers),
        faults=[],
        w=None,
        last_restore=last,
    )


def _recompute_marker() -> MarkerView:
    return MarkerView.from_wire(
        {
            "prompt": "p",
            "excluded_tiers": [],
            "reason": "rank 1 failed at install (window G2): injected restore fault",
            "request": "req-2",
            "set_at": FAILED_AT + 20,
        }
    )


def _last_restore(*, started: float, tiers: tuple[str, ...], failure: ev.Failure | None) -> FoldedRestore:
    """A restore of this prompt that started at ``started``, read ``tiers`` and failed with ``failure`` (or
    committed)."""
    ending: ev.Event
    if failure is None:
        ending = ev.RestoreEnded(
            outcome=Outcome.COMMITTED, request="req-2", committed_tokens=N, advertised_tokens=N, time=started + 1
        )
    else:
        ending = ev.RestoreEnded(
            outcome=Outcome.FAILED_CLOSED,
            request="req-2",
            advertised_tokens=N,
            failures=(failure,),
            failure_kind=failure.kind,
            time=started + 1,
        )
    folded = fold_restore(
        [ev.RestoreStarted(request="req-2", prompt="p", W=4, windows=1, tokens=N, tiers=tiers, time=started), ending]
    )
    assert folded is not None and folded.started_at == started
    return folded


INSTALL_FAULT = ev.Failure(
    rank=1, reason="injected restore fault", kind=FailureKind.RANK, stage=Stage.INSTALL, window=1
)


def test_a_recompute_marker_is_the_verdict_and_the_held_prompt_does_not_say_it_will_be_restored() -> None:
    d = _explain(markers=(_recompute_marker(),))
    assert d.verdict is FindingKind.FORCE_LOCAL_MARKER and not d.reusable
    assert "recompute this prompt locally" in d.summary
    kinds = [f.kind for f in d.findings]
    assert FindingKind.RESTORABLE not in kinds and FindingKind.HELD in kinds
    held = next(f for f in d.findings if f.kind is FindingKind.HELD)
    assert "will be restored" not in held.summary and "force-local-marker" in held.summary
    assert "holds all 4 chunks (1,024 tokens)" in held.summary
    # Without another verdict the same prompt is restorable, and says so.
    alone = _explain(last=_last_restore(started=FAILED_AT + 10, tiers=("mooncake",), failure=None))
    assert alone.verdict is FindingKind.RESTORABLE and alone.reusable


def test_a_tier_failure_that_this_prompts_later_restore_contradicts_is_dropped() -> None:
    """The later restore read mooncake and failed at a rank's install: mooncake served it, so the older
    restore_failed is not evidence against mooncake for this prompt any more."""
    later = _last_restore(started=FAILED_AT + 10, tiers=("mooncake",), failure=INSTALL_FAULT)
    d = _explain(markers=(_recompute_marker(),), last=later)
    assert FindingKind.TIER_UNHEALTHY not in [f.kind for f in d.findings], d.findings


def test_a_tier_failure_older_than_the_last_restore_is_dated_when_that_restore_did_not_read_the_tier() -> None:
    later = _last_restore(started=FAILED_AT + 10, tiers=("fs",), failure=INSTALL_FAULT)
    d = _explain(last=later)
    (tier,) = [f for f in d.findings if f.kind is FindingKind.TIER_UNHEALTHY]
    assert "older than this prompt's last restore (req-2, failed closed)" in " ".join(tier.evidence)


def test_a_tier_failure_newer_than_the_last_restore_stands_undated() -> None:
    earlier = _last_restore(started=FAILED_AT - 100, tiers=("mooncake",), failure=None)
    d = _explain(last=earlier)
    (tier,) = [f for f in d.findings if f.kind is FindingKind.TIER_UNHEALTHY]
    assert not any("older than" in e for e in tier.evidence)
    assert earlier.outcome is Outcome.COMMITTED
