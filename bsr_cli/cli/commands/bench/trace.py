"""`bsr bench trace`: replay a slice of a request trace against a dedicated embedded engine, the planner's
prediction for the same slice beside the measurement (bsr_cli/bench/trace.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.errors import BsrError, DrillViolation, InvalidInput


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
    stock: Annotated[
        bool,
        typer.Option(
            "--stock/--no-stock",
            help="Replay the same slice through stock LMCache 0.5.6 afterwards (needs the plugin venv .venv-lmcache).",
        ),
    ] = True,
    stock_l1: Annotated[
        str | None,
        typer.Option(
            "--stock-l1", help="Stock LMCache's L1 per rank [default: a rung over twice the whole-plan peak]."
        ),
    ] = None,
    stock_serial: Annotated[
        bool,
        typer.Option(
            "--stock-serial",
            help="Stock LMCache serves one request at a time per rank, as vLLM's worker calls it "
            "[default: every client calls it, retrieves overlap].",
        ),
    ] = False,
    json_flag: JsonFlag = False,
) -> None:
    """Replay a slice of a request trace at its arrival times against a dedicated embedded engine (time and
    tokens scaled, both printed): measured pool peak per rank, committed tokens and restore latency, beside the
    planner's prediction for the same slice, and beside stock LMCache replaying the same slice."""
    import tempfile
    import threading

    from bsr_cli import loaders
    from bsr_cli.bench import trace as bt
    from bsr_cli.bench.evidence import new_salt
    from bsr_cli.bench.lifecycle import embedded_engine
    from bsr_cli.core.trace_sim import check_rate
    from bsr_cli.core.units import format_bytes, parse_bytes, parse_rate

    st = state(ctx, json_flag)
    check_rate(1.0, speedup)
    rate = parse_rate(bandwidth) if bandwidth is not None else None
    reg = loaders.load_registration(registration) if registration else bt.replay_registration()
    full = loaders.load_trace(trace_file)
    if skip >= len(full):
        raise InvalidInput(f"--skip {skip} leaves nothing of the trace's {len(full):,} requests")
    sliced = full.head(requests, skip).scale_tokens(block_tokens)
    size = bt.sizing(sliced, reg)
    opts = bt.engine_options(reg, w, budget_rws, size)
    seed = new_salt() if salt is None else salt
    stock_l1_bytes = None
    if stock_l1 is not None:
        try:
            stock_l1_bytes = parse_bytes(stock_l1)
        except InvalidInput as e:
            raise InvalidInput(f"--stock-l1: {e.message}", hint=e.hint) from None
        if stock_l1_bytes <= 0:
            raise InvalidInput(f"--stock-l1 must be a positive size, got {stock_l1}")
    if not stock and (stock_l1 is not None or stock_serial):
        raise InvalidInput("--stock-l1 and --stock-serial set up stock LMCache's replay: drop --no-stock")
    stock_reason = "skipped with --no-stock" if not stock else bt.stock_available()
    if stock_reason is None:
        try:
            bt.stock_model(reg)
        except BsrError as e:
            stock_reason = e.message
    if stock_reason is not None and stock:
        st.out.warn(f"stock LMCache: not run ({stock_reason})")
    st.out.note(
        f"replaying {len(sliced):,} requests of {trace_file} from #{skip}: time ×{speedup:g}, "
        f"tokens ×{block_tokens}/512 ({block_tokens} per block); W={w}, "
        f"B = {budget_rws}·RWS = {format_bytes(opts.budget_bytes)} per rank"
    )
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
        peaks = {int(r["rank"]): int(r["pool"]["peak_bytes"]) for r in client.pool()}
    data = bt.compare(
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
    data["skip"] = skip
    data["salt"] = seed
    if stock_reason is None:
        l1 = stock_l1_bytes or bt.stock_l1_bytes(sliced, reg, int(data["predicted"]["whole_plan_peak_bytes_per_rank"]))
        st.out.note(
            f"replaying the same {len(sliced):,} requests through stock LMCache (L1 {format_bytes(l1)} per rank, "
            f"whole-plan retrieve, {'one request at a time per rank' if stock_serial else 'calls overlapping'})"
        )
        case = bt.StockCase(sliced, reg, speedup, seed, l1, size.kv_tokens, size.segment_bytes, serial=stock_serial)

        def stock_progress(n: int) -> None:
            if n % 50 == 0:
                st.out.note(f"stock: {n:,} of {len(sliced):,} requests done")

        try:
            with tempfile.TemporaryDirectory(prefix="bsr-bench-trace-stock-") as tmp:
                run = bt.replay_stock(case, Path(tmp), on_progress=stock_progress)
        except BsrError as e:
            stock_reason = e.message
            st.out.warn(f"stock LMCache: not run ({stock_reason})")
        else:
            data["stock"] = bt.stock_summary(sliced, reg, run)
    if stock_reason is not None:
        data["stock"] = {"run": False, "reason": stock_reason}
    from bsr_cli.cli.render import planning as render

    st.out.result(data, render.trace_replay)
    broken = [k for k, ok in data["checks"].items() if not ok]
    if broken:
        raise DrillViolation(f"the replay broke {', '.join(broken)}")
