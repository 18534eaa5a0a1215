"""The paper's E1: bounded restores of growing prefixes at one W on one running engine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    BenchRow,
    Bundle,
    OnRow,
    Repeat,
    RestoreEvidence,
    RowMeta,
    RowStatus,
    Run,
    Target,
    WarmEvidence,
    completed,
    flat,
    isolate,
    new_run_id,
    new_salt,
    prompt_of,
    put_back,
    require_pool,
    require_tokens,
    restore_checks,
    target,
    warm_evidence,
)
from bsr_cli.core import accounting, wire
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


E1_PREFIXES: tuple[int, ...] = (32_768, 65_536, 131_072, 262_144, 393_216, 524_032)

SWEEP_TIME_TARGET_S = 600.0

_W_HINT = "give --W 1 or more (W=0 is the whole-plan path the sweep compares against)"
_PREFIX_HINT = "give --tokens with one or more prefix lengths, e.g. --tokens 32768,131072"


@dataclass(frozen=True)
class SweepParams:
    """What the sweep was asked to measure (the tier: the one it restored from)."""

    prefixes: list[int]
    W: int
    repeat: bool
    tier: str | None


@dataclass(frozen=True)
class SweepSummary:
    """The main rows' results (the repeat only by its status and in the peaks), fields in the evidence's order."""

    rows: int
    completed: int
    interrupted: int
    passed: int
    repeat_status: str | None  # None when there was no repeat
    rws_bytes: int
    peak_pool_bytes_per_rank: list[int]  # distinct peaks over every rank of every completed row, repeat included
    peak_identical: bool
    peak_equals_rws: bool
    whole_plan_bytes: dict[str, int]  # by prefix length
    restore_seconds: dict[str, float]
    gbps: dict[str, float]
    block_seconds: float


@dataclass(frozen=True, kw_only=True)
class SweepRow(BenchRow):
    """One prefix warmed and restored at W (a row of the sweep or of its repeat)."""

    tokens: int
    W: int
    salt: int
    meta: RowMeta
    warm: WarmEvidence | None = wire.field(omit_none=True, default=None)  # None: interrupted before
    restore: RestoreEvidence | None = flat(present="outcome")


# -- sweep (E1) ------------------------------------------------------------------------------------------------


def run_sweep(
    client: AdminClient,
    *,
    prefixes: Sequence[int] = E1_PREFIXES,
    w: int = 32,
    repeat: bool = True,
    salt: int | None = None,
    tier: str | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, bool | float | None] | None = None,
) -> Bundle:
    """The paper's E1: one block on one running engine (no restart), rows in ascending prefix length at W with
    B = RWS(W); then a fresh salt repeats the largest row. Each row warms its prompt (submit), resets the pool
    peak and restores from one tier only."""
    if w <= 0:
        raise InvalidInput("the sweep measures bounded restores: W must be positive", hint=_W_HINT)
    rows_in = sorted(set(prefixes))
    if not rows_in:
        raise InvalidInput("the sweep needs at least one prefix length", hint=_PREFIX_HINT)
    salt = new_salt() if salt is None else salt
    params = SweepParams(prefixes=rows_in, W=w, repeat=repeat, tier=tier)
    run: Run[SweepRow] = Run("sweep", "e1", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    require_tokens(info, rows_in[-1])
    chosen, exclude = isolate(info, tier)
    run.params = replace(params, tier=chosen)
    rws = accounting.rws_bytes(reg, w)
    require_pool(client, rws, f"W={w}")
    original = {"budget_bytes": info.budget_bytes}
    # B = RWS(W): one live window per rank, the paper's serialized restore.
    client.update_settings(budget_bytes=rws)
    repeat_rows: list[SweepRow] = []
    t0 = time.monotonic()
    try:
        for n in rows_in:
            _sweep_row(run, run.rows, n, salt, w, exclude)
            if run.stopped:
                break
        if repeat and not run.stopped:
            salt2, repeat_id = new_salt(), new_run_id("e1")
            try:
                _sweep_row(run, repeat_rows, rows_in[-1], salt2, w, exclude)
            finally:
                run.repeat = Repeat(repeat_id, salt2, list(repeat_rows))
    finally:
        block_s = time.monotonic() - t0
        run.engine["settings_restored"] = put_back(client, original)
    every = run.rows + repeat_rows
    done = completed(every)
    peaks = sorted({r.pool_peak_bytes for row in done if row.restore for r in row.restore.ranks})
    summary = _sweep_summary(run.rows, repeat_rows, rws, peaks, block_s)
    full = tuple(rows_in) == E1_PREFIXES
    targets = _sweep_targets(rws, peaks, block_s, measured=bool(done), timed=full and not run.stopped, full=full)
    return run.finish(summary, targets, every)


def _sweep_summary(
    rows: list[SweepRow], repeat_rows: list[SweepRow], rws: int, peaks: list[int], block_s: float
) -> SweepSummary:
    """The main rows' results, the repeat's status, and the peaks over every completed row (``peaks``)."""
    main_done = [r for r in completed(rows) if r.restore]
    return SweepSummary(
        rows=len(rows),
        completed=len(main_done),
        interrupted=len(rows) - len(main_done),
        passed=sum(r.meta.status == RowStatus.PASS for r in main_done),
        repeat_status=repeat_rows[0].meta.status if repeat_rows else None,
        rws_bytes=rws,
        peak_pool_bytes_per_rank=peaks,
        peak_identical=len(peaks) == 1,
        peak_equals_rws=peaks == [rws],
        whole_plan_bytes={str(r.tokens): r.restore.whole_plan_bytes for r in main_done if r.restore},
        restore_seconds={str(r.tokens): r.restore.seconds for r in main_done if r.restore},
        gbps={str(r.tokens): r.restore.gbps for r in main_done if r.restore},
        block_seconds=round(block_s, 3),
    )


def _sweep_targets(
    rws: int, peaks: list[int], block_s: float, *, measured: bool, timed: bool, full: bool
) -> list[Target]:
    """The sweep's targets: flat peaks (judged once a row completed) and the block's time (judged for the paper's
    six rows run to the end)."""
    return [
        target(
            "peak pool per rank identical for every row and equal to RWS(W)",
            f"== {rws:,} bytes",
            peaks,
            (len(peaks) == 1 and peaks == [rws]) if measured else None,
        ),
        target(
            "the whole sweep finishes in under 10 minutes",
            f"< {SWEEP_TIME_TARGET_S:.0f} s",
            round(block_s, 1),
            (block_s < SWEEP_TIME_TARGET_S) if timed else None,
            "" if full else "reduced sweep: the time target applies to the paper's six rows only",
        ),
    ]


def _sweep_row(run: Run[SweepRow], rows: list[SweepRow], n: int, salt: int, w: int, exclude: Sequence[str]) -> None:
    """Warm the prompt of ``n`` tokens, then restore it at W: one row into ``rows``."""
    with run.row(lambda at: SweepRow(tokens=n, W=w, salt=salt, meta=RowMeta(started_at=at)), rows) as slot:
        prompt = prompt_of(n, salt)
        warm = warm_evidence(run.client.submit(prompt, w=w))
        ev = run.restore(prompt, n, w, exclude=exclude)
        checks = {"warm_hash_ok": warm.hash_ok is True} | restore_checks(ev, n, peak=ev.predicted_peak_bytes)
        slot.row = replace(slot.row, warm=warm, restore=ev, meta=slot.row.meta.judged(checks))
