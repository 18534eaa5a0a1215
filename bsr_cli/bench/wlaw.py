"""The W law: the measured restore working set against W·Σc_i + aux at one prefix, one B = RWS(W) per W."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    BenchRow,
    Bundle,
    OnRow,
    RestoreEvidence,
    RowMeta,
    Run,
    WarmEvidence,
    completed,
    flat,
    isolate,
    new_salt,
    prompt_of,
    put_back,
    require_pool,
    require_tokens,
    restore_checks,
    target,
    warm_evidence,
    written_with,
)
from bsr_cli.core import accounting, wire
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


W_LAW: tuple[int, ...] = accounting.DEFAULT_W_SWEEP


@dataclass(frozen=True)
class WLawParams:
    """What the W law was asked to measure (the tier: the one it restored from)."""

    tokens: int
    W: list[int]
    tier: str | None


@dataclass(frozen=True)
class WLawSummary:
    """Measured peak per W against the law, and the least-squares line through the measurements (fields in the
    evidence's order, named as its keys)."""

    tokens: int
    coefficient_bytes: int  # Σc_i
    aux_bytes: int
    measured: dict[str, int]  # by W: the largest rank's pool peak
    predicted: dict[str, int]  # by W: W·Σc_i + aux
    fit_slope_bytes_per_W: float | None  # None with fewer than two distinct W measured
    fit_intercept_bytes: float | None
    law_holds: bool | None  # None when no row completed
    completed: int
    interrupted: int


@dataclass(frozen=True, kw_only=True)
class WLawRow(BenchRow):
    """One W: B = RWS(W), the prompt restored (the first row also warms it), its peak against the law."""

    W: int
    tokens: int
    meta: RowMeta
    warm: WarmEvidence | None = wire.field(omit_none=True, default=None)  # only the first row warms the prompt
    restore: RestoreEvidence | None = flat(present="outcome")  # None: interrupted before it finished
    law_bytes: int | None = written_with("restore")  # W·Σc_i + aux, written with the restore

    @classmethod
    def begun(cls, w: int, tokens: int) -> Callable[[str], WLawRow]:
        return lambda started_at: cls(W=w, tokens=tokens, meta=RowMeta(started_at=started_at))


# -- W law -------------------------------------------------------------------------------------------------------


def run_wlaw(
    client: AdminClient,
    *,
    tokens: int = 262_144,
    ws: Sequence[int] = W_LAW,
    salt: int | None = None,
    tier: str | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, bool | float | None] | None = None,
) -> Bundle:
    """Measured RWS against W·Σc_i + aux at one prefix, B = RWS(W) for each W."""
    w_list = sorted(set(ws))
    if not w_list or w_list[0] <= 0:
        raise InvalidInput(
            "the W law needs positive window sizes", hint="give --Ws positive window sizes, e.g. --Ws 8,16,32"
        )
    salt = new_salt() if salt is None else salt
    params = WLawParams(tokens=tokens, W=w_list, tier=tier)
    run: Run[WLawRow] = Run("wlaw", "wlaw", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    require_tokens(info, tokens)
    chosen, exclude = isolate(info, tier)
    run.params = replace(params, tier=chosen)
    require_pool(client, accounting.rws_bytes(reg, w_list[-1]), f"W={w_list[-1]}")
    original = {"budget_bytes": info.budget_bytes}
    prompt = prompt_of(tokens, salt)
    try:
        warm: WarmEvidence | None = None
        for w in w_list:
            with run.row(WLawRow.begun(w, tokens)) as slot:
                rws = accounting.rws_bytes(reg, w)
                client.update_settings(budget_bytes=rws)
                if warm is None:
                    warm = warm_evidence(client.submit(prompt, w=w))
                    slot.row = replace(slot.row, warm=warm)
                ev = run.restore(prompt, tokens, w, exclude=exclude)
                checks = restore_checks(ev, tokens, peak=ev.predicted_peak_bytes)
                slot.row = replace(slot.row, restore=ev, law_bytes=rws, meta=slot.row.meta.judged(checks))
            if run.stopped:
                break
    finally:
        run.engine["settings_restored"] = put_back(client, original)
    done = [r for r in completed(run.rows) if r.restore]
    peak = {r.W: max((x.pool_peak_bytes for x in r.restore.ranks), default=0) for r in done if r.restore}
    xs = [float(r.W) for r in done]
    ys = [float(peak[r.W]) for r in done if r.restore and r.restore.ranks]
    slope = intercept = None
    if len(xs) >= 2 and len(xs) == len(ys) and len(set(xs)) > 1:
        fit = statistics.linear_regression(xs, ys)
        slope, intercept = round(fit.slope, 3), round(fit.intercept, 3)
    law = all((r.meta.checks or {}).get("peak_equals_bound") for r in done) if done else None
    summary = WLawSummary(
        tokens=tokens,
        coefficient_bytes=reg.bytes_per_chunk,
        aux_bytes=reg.aux_bytes,
        measured={str(w): p for w, p in peak.items()},
        predicted={str(r.W): r.law_bytes for r in done if r.law_bytes is not None},
        fit_slope_bytes_per_W=slope,
        fit_intercept_bytes=intercept,
        law_holds=law,
        completed=len(done),
        interrupted=len(run.rows) - len(done),
    )
    targets = [
        target(
            "measured RWS equals W·Σc_i + aux for every W",
            f"slope {reg.bytes_per_chunk:,} B/W, intercept {reg.aux_bytes:,} B",
            {"slope": slope, "intercept": intercept},
            law,
        )
    ]
    return run.finish(summary, targets)
