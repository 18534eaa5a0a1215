"""`bsr bench trace`: replay a slice of a request trace against a dedicated embedded engine, the planner's
prediction for the same slice beside the measurement (bsr_cli/bench/trace.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.errors import BsrError, DrillViolation, InvalidInput

if TYPE_CHECKING:
    from bsr_cli.bench.trace import Calibration, Measured, StockCase, StockNotRun, StockSummary
    from bsr_cli.cli.context import AppState
    from bsr_cli.core.registration import Registration
    from bsr_cli.core.trace import Trace
    from bsr_cli.engine.supervisor import EngineOptions

_BROKE = "the report's checks say what broke; rerun with --json to keep the measured numbers"
_SKIP_HINT = "lower --skip, or replay another part of the trace"


# The stock LMCache side of the replay (bsr_cli/bench/trace.py, plugins/lmcache_bsr/trace_replay.py).
StockOpt = Annotated[
    bool,
    typer.Option(
        "--stock/--no-stock",
        help="Replay the same slice through stock LMCache 0.5.6 afterwards (needs the plugin venv .venv-lmcache).",
    ),
]
StockL1Opt = Annotated[
    str | None,
    typer.Option("--stock-l1", help="Stock LMCache's L1 per rank [default: a rung over twice the whole-plan peak]."),
]
StockSerialOpt = Annotated[
    bool,
    typer.Option(
        "--stock-serial",
        help="Stock LMCache serves one request at a time per rank, as vLLM's worker calls it "
        "[default: every client calls it, retrieves overlap].",
    ),
]


def trace(
    ctx: typer.Context,
    trace_file: Annotated[Path, typer.Argument(help="A request trace (Mooncake JSONL).", metavar="TRACE")],
    requests: Annotated[int, typer.Option("--requests", "-n", help="Requests of the slice.", min=1)] = 500,
    skip: Annotated[int, typer.Option("--skip", help="Start the slice after this many requests.", min=0)] = 0,
    speedup: Annotated[float, typer.Option("--speedup", help="Replay the arrivals this many times faster.")] = 1.0,
    block_tokens: Annotated[
        int, typer.Option("--block-tokens", help="Tokens per 512-token block of the trace (the token scale).", min=1)
    ] = 64,
    w: Annotated[int, typer.Option("--W", "-W", "--window-size", help="Window size in chunks.", min=1)] = 8,
    budget_rws: Annotated[
        int, typer.Option("--budget-rws", help="The engine's budget B as a multiple of RWS(W).", min=1)
    ] = 2,
    registration: Annotated[
        str | None,
        typer.Option("--registration", "-r", help="Registration [default: 1 KiB/token/rank, 64-token chunks]."),
    ] = None,
    bandwidth: Annotated[
        str | None,
        typer.Option("--bandwidth", help="The planner's bandwidth per rank [default: one restore alone, measured]."),
    ] = None,
    salt: Annotated[
        int | None, typer.Option("--salt", help="Seed of the synthesized tokens [default: random].")
    ] = None,
    stock: StockOpt = True,
    stock_l1: StockL1Opt = None,
    stock_serial: StockSerialOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Replay a slice of a request trace at its arrival times against a dedicated embedded engine (time and
    tokens scaled, both printed): measured pool peak per rank, committed tokens and restore latency, beside the
    planner's prediction for the same slice, and beside stock LMCache replaying the same slice."""
    from bsr_cli import loaders
    from bsr_cli.bench import trace as bt
    from bsr_cli.bench.evidence import new_salt
    from bsr_cli.core.trace_sim import check_rate
    from bsr_cli.core.units import format_bytes, parse_rate

    st = state(ctx, json_flag)
    check_rate(1.0, speedup)
    rate = parse_rate(bandwidth) if bandwidth is not None else None
    reg = loaders.load_registration(registration) if registration else bt.replay_registration()
    full = loaders.load_trace(trace_file)
    if skip >= len(full):
        raise InvalidInput(f"--skip {skip} leaves nothing of the trace's {len(full):,} requests", hint=_SKIP_HINT)
    sliced = full.head(requests, skip).scale_tokens(block_tokens)
    size = bt.sizing(sliced, reg)
    opts = bt.engine_options(reg, w, budget_rws, size)
    seed = new_salt() if salt is None else salt
    stock_l1_bytes, stock_reason = _stock_setup(st, reg, stock, stock_l1, stock_serial)
    st.out.note(
        f"replaying {len(sliced):,} requests of {trace_file} from #{skip}: time ×{speedup:g}, "
        f"tokens ×{block_tokens}/512 ({block_tokens} per block); W={w}, "
        f"B = {budget_rws}·RWS = {format_bytes(opts.budget_bytes)} per rank"
    )
    measured, peaks, cal, rate = _replay_engine(st, sliced, reg, opts, w=w, speedup=speedup, seed=seed, rate=rate)
    replayed = bt.compare(
        sliced,
        reg,
        measured,
        w=w,
        budget_rws=budget_rws,
        bandwidth=rate,
        speedup=speedup,
        pool_peaks=peaks,
        calibration=cal,
    )
    stock_run: bt.StockSummary | bt.StockNotRun
    if stock_reason is None:
        whole_plan_peak = replayed.predicted.whole_plan_peak_bytes_per_rank
        l1 = stock_l1_bytes or bt.stock_l1_bytes(sliced, reg, whole_plan_peak)
        case = bt.StockCase(sliced, reg, speedup, seed, l1, size.kv_tokens, size.segment_bytes, serial=stock_serial)
        stock_run = _replay_stock(st, case)
    else:
        stock_run = bt.StockNotRun(stock_reason)
    data = replace(replayed, skip=skip, salt=seed, stock=stock_run)
    from bsr_cli.cli.render import planning as render

    broken = [k for k, ok in data.checks.items() if not ok]
    if broken:
        st.out.fail(data, render.trace_replay, DrillViolation(f"the replay broke {', '.join(broken)}", hint=_BROKE))
    st.out.result(data, render.trace_replay)


def _stock_setup(
    st: AppState, reg: Registration, stock: bool, stock_l1: str | None, stock_serial: bool
) -> tuple[int | None, str | None]:
    """Stock LMCache's L1 (when given) and why its replay will not run (None: it will)."""
    from bsr_cli.bench import trace as bt
    from bsr_cli.core.units import parse_bytes

    stock_l1_bytes = None
    if stock_l1 is not None:
        try:
            stock_l1_bytes = parse_bytes(stock_l1)
        except InvalidInput as e:
            raise InvalidInput(f"--stock-l1: {e.message}", hint=e.hint) from None
        if stock_l1_bytes <= 0:
            raise InvalidInput(f"--stock-l1 must be a positive size, got {stock_l1}", hint="give a size such as 4GiB")
    if not stock and (stock_l1 is not None or stock_serial):
        raise InvalidInput(
            "--stock-l1 and --stock-serial set up stock LMCache's replay: drop --no-stock",
            hint="drop --no-stock to run stock LMCache's replay, or drop --stock-l1/--stock-serial",
        )
    stock_reason = "skipped with --no-stock" if not stock else bt.stock_available()
    if stock_reason is None:
        try:
            bt.stock_model(reg)
        except BsrError as e:
            stock_reason = e.message
    if stock_reason is not None and stock:
        st.out.warn(f"stock LMCache: not run ({stock_reason})")
    return stock_l1_bytes, stock_reason


def _replay_engine(
    st: AppState,
    sliced: Trace,
    reg: Registration,
    opts: EngineOptions,
    *,
    w: int,
    speedup: float,
    seed: int,
    rate: float | None,
) -> tuple[list[Measured], dict[int, int], Calibration | None, float]:
    """The slice against a dedicated embedded engine: what each request measured, each rank's pool peak, the
    calibration (when the bandwidth was measured here) and the planner's bandwidth."""
    import tempfile
    import threading

    from bsr_cli.bench import trace as bt
    from bsr_cli.bench.lifecycle import embedded_engine

    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="bsr-bench-trace-") as tmp, embedded_engine(Path(tmp), opts) as client:
        cal = None
        if rate is None:
            cal = bt.calibrate(client, reg, w, seed)
            rate = cal.bandwidth
            st.out.note(
                f"one restore of {cal.chunks} chunks alone: {rate / 1e9:.3f} GB/s per rank (the planner's bandwidth); "
                f"of one chunk: {cal.one_chunk_s * 1000:.0f} ms"
            )
        client.reset_peak()
        done = [0]

        def progress(m: bt.Measured) -> None:
            done[0] += 1
            if done[0] % 50 == 0:
                st.out.note(f"{done[0]:,} of {len(sliced):,} requests done")

        try:
            measured = bt.replay(client, sliced, w=w, speedup=speedup, salt=seed, stop=stop, on_done=progress)
        except KeyboardInterrupt:
            stop.set()
            raise
        peaks = {r.rank: int((r.pool or {})["peak_bytes"]) for r in client.pool()}
    return measured, peaks, cal, rate


def _replay_stock(st: AppState, case: StockCase) -> StockSummary | StockNotRun:
    """The same slice through stock LMCache: its summary, or why it did not run."""
    import tempfile

    from bsr_cli.bench import trace as bt
    from bsr_cli.core.units import format_bytes

    n = len(case.trace)
    st.out.note(
        f"replaying the same {n:,} requests through stock LMCache (L1 {format_bytes(case.l1_bytes)} per rank, "
        f"whole-plan retrieve, {'one request at a time per rank' if case.serial else 'calls overlapping'})"
    )

    def stock_progress(done: int) -> None:
        if done % 50 == 0:
            st.out.note(f"stock: {done:,} of {n:,} requests done")

    try:
        with tempfile.TemporaryDirectory(prefix="bsr-bench-trace-stock-") as tmp:
            run = bt.replay_stock(case, Path(tmp), on_progress=stock_progress)
    except BsrError as e:
        st.out.warn(f"stock LMCache: not run ({e.message})")
        return bt.StockNotRun(e.message)
    return bt.stock_summary(case.trace, case.reg, run)
