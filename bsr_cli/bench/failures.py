"""The paper's failure matrix: every `bsr drill` scenario as one row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    BenchRow,
    Bundle,
    OnRow,
    RowMeta,
    RowStatus,
    Run,
    completed,
    flat,
    require_tokens,
    target,
)
from bsr_cli.drill import ScenarioResult  # its fields are the row's (the codec reads them)
from bsr_cli.errors import FaultsDisabled

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


@dataclass(frozen=True, kw_only=True)
class FailureRow(BenchRow):
    """One `bsr drill` scenario: its result carries its own checks, written where the drill writes them."""

    scenario: str
    meta: RowMeta
    result: ScenarioResult | None = flat(present="first_pass")  # None: interrupted before the drill answered

    @classmethod
    def begun(cls, scenario: str) -> Callable[[str], FailureRow]:
        return lambda started_at: cls(scenario=scenario, meta=RowMeta(started_at=started_at))


@dataclass(frozen=True)
class FailuresParams:
    tokens: int
    W: int | None  # None: the drill's default


@dataclass(frozen=True)
class FailuresSummary:
    scenarios: dict[str, str]  # each scenario's row status
    passed: int
    completed: int
    interrupted: int


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

    params = FailuresParams(tokens=tokens, W=w)
    run: Run[FailureRow] = Run("failures", "fail", client, params, on_row=on_row, engine_meta=engine_meta)
    require_tokens(run.info, tokens)
    if not run.info.faults_enabled:
        # Checked here: inside a row, the drill's refusal would read as an interrupted scenario.
        raise FaultsDisabled(
            "the failure matrix needs an engine started with faults enabled",
            hint="bsr engine up --enable-faults, or run the bench with --embedded",
        )
    for sc in SCENARIOS:
        with run.row(FailureRow.begun(sc.name)) as slot:
            # One scenario per drill call, so an interruption marks just the scenario it hit.
            res = run_drill(client, tokens=tokens, w=w, scenarios=(sc,)).scenarios[0]
            slot.row = replace(slot.row, result=res, meta=slot.row.meta.judged(asdict(res.checks)))
        if run.stopped:
            break
    done = completed(run.rows)
    scenarios = {r.scenario: str(r.meta.status) for r in run.rows}
    summary = FailuresSummary(
        scenarios=scenarios,
        passed=sum(r.meta.status == RowStatus.PASS for r in done),
        completed=len(done),
        interrupted=len(run.rows) - len(done),
    )
    ok = bool(done) and all(r.meta.status == RowStatus.PASS for r in done) and len(done) == len(SCENARIOS)
    targets = [target("every failure scenario fails closed and recovers", "all PASS", scenarios, ok)]
    return run.finish(summary, targets)
