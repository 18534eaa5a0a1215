"""The paper's failure matrix: every `bsr drill` scenario as one row."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    Bundle,
    OnRow,
    RowStatus,
    Run,
    completed,
    judge,
    require_tokens,
    target,
)
from bsr_cli.errors import FaultsDisabled

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


# -- failure matrix ----------------------------------------------------------------------------------------------


def run_failures(
    client: AdminClient,
    *,
    tokens: int = 8192,
    w: int | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, bool | float | None] | None = None,
) -> Bundle:
    """The paper's failure matrix (the scenarios of `bsr drill`), one row per scenario."""
    from bsr_cli.drill import SCENARIOS, run_drill

    run = Run("failures", "fail", client, {"tokens": tokens, "W": w}, on_row=on_row, engine_meta=engine_meta)
    require_tokens(run.info, tokens)
    if not run.info.get("faults_enabled"):
        # Checked here: inside a row, the drill's refusal would read as an interrupted scenario.
        raise FaultsDisabled(
            "the failure matrix needs an engine started with faults enabled",
            hint="bsr engine up --enable-faults, or run the bench with --embedded",
        )
    for sc in SCENARIOS:
        with run.row(scenario=sc.name) as row:
            # One scenario per drill call, so an interruption marks just the scenario it hit.
            res = run_drill(client, tokens=tokens, w=w, scenarios=(sc,)).scenarios[0]
            row |= asdict(res)
            judge(row, asdict(res.checks))
        if run.stopped:
            break
    done = completed(run.rows)
    summary = {
        "scenarios": {r["scenario"]: r["status"] for r in run.rows},
        "passed": sum(r["status"] == RowStatus.PASS for r in done),
        "completed": len(done),
        "interrupted": len(run.rows) - len(done),
    }
    ok = bool(done) and all(r["status"] == RowStatus.PASS for r in done) and len(done) == len(SCENARIOS)
    targets = [target("every failure scenario fails closed and recovers", "all PASS", summary["scenarios"], ok)]
    return run.finish(summary, targets)
