"""`bsr bench trace`'s evidence bundle: one row per budget B (the planner's prediction beside the engine's
measurement, what bound each restore on both sides), the calibration the prediction used, and the targets: each
run's p50 and p99 restore latency within 25 % of the prediction.

The envelope is every experiment's (bsr_cli.bench.evidence.Bundle); bsr_cli.bench.models validates it."""

from __future__ import annotations

from dataclasses import dataclass

from bsr_cli import __version__
from bsr_cli.bench.evidence import Bundle, MachineInfo, Target, new_run_id, now, record_of, registration_identity
from bsr_cli.bench.trace import AGREEMENT, BudgetRun, StockNotRun, StockSummary, TraceReplay, read_stock
from bsr_cli.core import wire
from bsr_cli.core.host_model import HostCalibration
from bsr_cli.core.registration import Registration


@dataclass(frozen=True)
class TraceParams:
    """What the replay was asked."""

    trace: str
    skip: int
    requests: int
    speedup: float
    block_tokens: int
    w: int = wire.field(name="W")
    budgets_rws: tuple[int, ...] = ()
    calibration_file: str | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class TraceSummary:
    """The runs against their predictions, and the calibration they were predicted with."""

    runs: int
    agreeing_p50: int  # runs whose measured p50 is within 25 % of the prediction
    agreeing_p99: int
    bandwidth_bytes_per_s: float
    calibration: HostCalibration | None
    # Stock LMCache's replay of the slice, or why it did not run (`bench.trace.read_stock` reads it back; None: a
    # bundle written before bsr kept it).
    stock: wire.JsonObject | None = wire.field(omit_none=True, default=None, shape=StockSummary | StockNotRun)

    to_wire = wire.writer()
    from_wire = wire.reader()


def new_trace_run_id() -> str:
    return new_run_id("trace")


def targets(runs: tuple[BudgetRun, ...]) -> tuple[Target, ...]:
    """Per run, its p50 and p99 restore latency against the prediction."""
    out = []
    for run in runs:
        for p in ("p50", "p99"):
            ratio = run.latency_ratio.get(p)
            out.append(
                Target(
                    name=f"{p}_within_prediction_B{run.budget_rws}",
                    target=f"measured {p} restore latency within {AGREEMENT:.0%} of the planner's at B = "
                    f"{run.budget_rws}·RWS",
                    measured=None if ratio is None else round(ratio, 3),
                    met=run.agrees.get(p),
                    note=f"load average {run.loadavg[0]:.1f} → {run.loadavg[1]:.1f}",
                )
            )
    return tuple(out)


def trace_bundle(
    report: TraceReplay,
    reg: Registration,
    *,
    run_id: str,
    started_at: str,
    elapsed_s: float,
    engine: wire.JsonObject,
    machine: MachineInfo,
    salt: int,
) -> Bundle:
    """The replay's report as an evidence bundle."""
    runs = report.runs
    return Bundle(
        experiment="trace",
        run_id=run_id,
        salt=salt,
        bsr_version=__version__,
        started_at=started_at,
        finished_at=now(),
        elapsed_s=round(elapsed_s, 3),
        registration=registration_identity(reg),
        engine=engine,
        machine=machine,
        params=TraceParams(
            trace=report.trace,
            skip=report.skip or 0,
            requests=report.requests,
            speedup=report.speedup,
            block_tokens=report.block_tokens,
            w=report.w,
            budgets_rws=tuple(r.budget_rws for r in runs),
            calibration_file=report.calibration_file,
        ),
        rows=list(runs),
        summary=TraceSummary(
            runs=len(runs),
            agreeing_p50=sum(1 for r in runs if r.agrees.get("p50")),
            agreeing_p99=sum(1 for r in runs if r.agrees.get("p99")),
            bandwidth_bytes_per_s=report.bandwidth_bytes_per_s,
            calibration=report.calibration,
            stock=None if report.stock is None else report.stock.to_wire(),
        ),
        targets=targets(runs),
        interrupted=False,
        interrupted_by=None,
        ok=all(report.checks.values()),
    )


def report_of(bundle: Bundle, path: str) -> TraceReplay:
    """The replay's report again from its bundle (written at ``path``): what `bsr bench show` prints."""
    p, s = record_of(TraceParams, bundle.params), record_of(TraceSummary, bundle.summary)
    reg = bundle.registration
    return TraceReplay(
        trace=p.trace,
        requests=p.requests,
        speedup=p.speedup,
        block_tokens=p.block_tokens,
        registration=reg.identity,
        model=reg.model,
        bytes_per_chunk=reg.bytes_per_chunk,
        w=p.w,
        bandwidth_bytes_per_s=s.bandwidth_bytes_per_s,
        calibration=s.calibration,
        calibration_file=p.calibration_file,
        runs=tuple(r for r in bundle.rows if isinstance(r, BudgetRun)),
        bundle=path,
        skip=p.skip,
        stock=read_stock(s.stock),
    )
