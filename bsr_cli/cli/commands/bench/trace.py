"""`bsr bench trace`: replay a slice of a request trace against a dedicated embedded engine, the planner's
prediction for the same slice beside the measurement (bsr_cli/bench/trace.py), on the host model a short
calibration measured first (bsr_cli/bench/calibration.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bsr_cli.cli.commands.bench.common import DEFAULT_OUT, OutOpt
from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.errors import BsrError, DrillViolation, InvalidInput

if TYPE_CHECKING:
    from bsr_cli.bench.calibration import BurstShape, RunQueue
    from bsr_cli.bench.trace import BudgetReplayed, Sizing, StockCase, StockNotRun, StockSummary, TraceReplay
    from bsr_cli.cli.context import AppState
    from bsr_cli.client import AdminClient
    from bsr_cli.core import wire
    from bsr_cli.core.host_model import HostCalibration
    from bsr_cli.core.registration import Registration
    from bsr_cli.core.trace import Trace
    from bsr_cli.engine.supervisor import EngineOptions

_BROKE = "the report's checks say what broke"
_SKIP_HINT = "lower --skip, or replay another part of the trace"


REPLAY_SAMPLE_S = 0.25  # between two samples of the run queue during a replay

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
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        metavar="FILE",
        help="Predict with a calibration saved before [default: calibrate this engine first, a few seconds].",
    ),
]


def _budgets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidInput(
            f"--budget-rws takes comma-separated whole multiples of RWS(W), got {text!r}",
            hint="e.g. --budget-rws 1,2,4",
        ) from None
    if not values or any(v < 1 for v in values):
        raise InvalidInput("--budget-rws multiples of RWS(W) must be at least 1", hint="e.g. --budget-rws 1,2,4")
    return tuple(dict.fromkeys(values))


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
        str,
        typer.Option("--budget-rws", help="The engine's budget B as multiples of RWS(W), one replay each: 1,2,4."),
    ] = "2",
    registration: Annotated[
        str | None,
        typer.Option("--registration", "-r", help="Registration [default: 1 KiB/token/rank, 64-token chunks]."),
    ] = None,
    bandwidth: Annotated[
        str | None,
        typer.Option(
            "--bandwidth", help="Predict from this bandwidth per rank alone, no host model [default: calibrate]."
        ),
    ] = None,
    calibration: CalibrationOpt = None,
    out: OutOpt = DEFAULT_OUT,
    salt: Annotated[
        int | None, typer.Option("--salt", help="Seed of the synthesized tokens [default: random].")
    ] = None,
    stock: StockOpt = True,
    stock_l1: StockL1Opt = None,
    stock_serial: StockSerialOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Replay a slice of a request trace at its arrival times against a dedicated embedded engine (time and
    tokens scaled, both printed), once per budget B: measured pool peak per rank, committed tokens, restore latency
    and what bound each restore, beside the planner's prediction for the same slice on the host model a short
    calibration measured first; and beside stock LMCache replaying the same slice."""
    from bsr_cli import loaders
    from bsr_cli.bench import trace as bt
    from bsr_cli.bench.evidence import new_salt
    from bsr_cli.core.trace_sim import check_rate

    st = state(ctx, json_flag)
    check_rate(1.0, speedup)
    budgets = _budgets(budget_rws)
    rate, saved = _prediction_source(bandwidth, calibration)
    reg = loaders.load_registration(registration) if registration else bt.replay_registration()
    sliced = _load_slice(trace_file, requests, skip, block_tokens)
    size = _sizing(sliced, reg, budgets, calibrating=rate is None and saved is None)
    opts = bt.engine_options(reg, w, max(budgets), size)
    seed = new_salt() if salt is None else salt
    stock_l1_bytes, stock_reason = _stock_setup(st, reg, stock, stock_l1, stock_serial)
    if saved is not None and saved.registration != reg.identity:
        st.out.warn(f"the calibration measured registration {saved.registration}; replaying {reg.identity}")
    _note_replay(st, trace_file, sliced, reg, budgets, skip=skip, speedup=speedup, block_tokens=block_tokens, w=w)
    run = _EngineRun(st, sliced, reg, opts, w=w, speedup=speedup, seed=seed, out=out)
    replayed = run.report(run.replay(budgets, rate, saved, calibration), skip=skip)
    stock_run: bt.StockSummary | bt.StockNotRun
    if stock_reason is None:
        whole_plan_peak = replayed.runs[0].predicted.whole_plan_peak_bytes_per_rank
        l1 = stock_l1_bytes or bt.stock_l1_bytes(sliced, reg, whole_plan_peak)
        case = bt.StockCase(sliced, reg, speedup, seed, l1, size.kv_tokens, size.segment_bytes, serial=stock_serial)
        stock_run = _replay_stock(st, case)
    else:
        stock_run = bt.StockNotRun(stock_reason)
    data = replace(replayed, stock=stock_run)
    data = replace(data, bundle=str(run.write_bundle(data, reg)))
    _report_result(st, data)


def _prediction_source(bandwidth: str | None, calibration: Path | None) -> tuple[float | None, HostCalibration | None]:
    """The bandwidth the prediction takes alone, or the saved calibration it takes (neither: calibrate first)."""
    from bsr_cli import loaders
    from bsr_cli.core.units import parse_rate

    if bandwidth is not None and calibration is not None:
        raise InvalidInput(
            "--bandwidth predicts without a host model; --calibration with one: give one of them",
            hint="--calibration carries its own bandwidth; drop --bandwidth to use it",
        )
    rate = parse_rate(bandwidth) if bandwidth is not None else None
    saved = loaders.load_calibration(calibration) if calibration is not None else None
    return rate, saved


def _load_slice(trace_file: Path, requests: int, skip: int, block_tokens: int) -> Trace:
    """The slice of the trace to replay, its tokens scaled."""
    from bsr_cli import loaders

    full = loaders.load_trace(trace_file)
    if skip >= len(full):
        raise InvalidInput(f"--skip {skip} leaves nothing of the trace's {len(full):,} requests", hint=_SKIP_HINT)
    return full.head(requests, skip).scale_tokens(block_tokens)


def _sizing(sliced: Trace, reg: Registration, budgets: tuple[int, ...], *, calibrating: bool) -> Sizing:
    """What the engine needs for one replay per budget, and the calibration's prompts when it calibrates."""
    from bsr_cli.bench import calibration as cb
    from bsr_cli.bench import trace as bt

    stored = cb.stored_tokens(bt.burst_shape(sliced, reg), reg.chunk_size) if calibrating else 0
    return bt.sizing(sliced, reg, replays=len(budgets), calibration_tokens=stored)


def _note_replay(
    st: AppState,
    trace_file: Path,
    sliced: Trace,
    reg: Registration,
    budgets: tuple[int, ...],
    *,
    skip: int,
    speedup: float,
    block_tokens: int,
    w: int,
) -> None:
    """What is replayed, how time and tokens are scaled, and the budgets B."""
    from bsr_cli.core import accounting
    from bsr_cli.core.units import format_bytes

    rws = accounting.rws_bytes(reg, w)
    budget_text = ", ".join(f"{k}·RWS = {format_bytes(k * rws)}" for k in budgets)
    st.out.note(
        f"replaying {len(sliced):,} requests of {trace_file} from #{skip}: time ×{speedup:g}, "
        f"tokens ×{block_tokens}/512 ({block_tokens} per block); W={w}; B per rank: {budget_text}"
    )


def _report_result(st: AppState, data: TraceReplay) -> None:
    """The report, failing with the checks the replay broke."""
    from bsr_cli.cli.render import planning as render

    broken = [k for k, ok in data.checks.items() if not ok]
    if broken:
        broke = f"the replay broke {', '.join(broken)}"
        st.out.fail(data, render.trace_replay, DrillViolation(broke, hint=f"{_BROKE}; its evidence: {data.bundle}"))
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


class _EngineRun:
    """The slice against a dedicated embedded engine: the calibration first (unless given), then one replay per
    budget; and the bundle of it all."""

    def __init__(
        self,
        st: AppState,
        sliced: Trace,
        reg: Registration,
        opts: EngineOptions,
        *,
        w: int,
        speedup: float,
        seed: int,
        out: Path,
    ) -> None:
        from bsr_cli.bench.evidence import machine_info, now
        from bsr_cli.bench.trace_bundle import new_trace_run_id

        self.st, self.sliced, self.reg, self.opts = st, sliced, reg, opts
        self.w, self.speedup, self.seed, self.out = w, speedup, seed, out
        self.run_id, self.started_at, self.t0 = new_trace_run_id(), now(), time.monotonic()
        self.machine = machine_info()
        self.engine: wire.JsonObject = {}
        self.calibration: HostCalibration | None = None
        self.calibration_file: str | None = None
        self.bandwidth = 0.0
        self.pids: list[int] = []

    def replay(
        self,
        budgets: tuple[int, ...],
        rate: float | None,
        saved: HostCalibration | None,
        saved_path: Path | None,
    ) -> list[BudgetReplayed]:
        import tempfile

        from bsr_cli.bench.lifecycle import embedded_engine

        with (
            tempfile.TemporaryDirectory(prefix="bsr-bench-trace-") as tmp,
            embedded_engine(Path(tmp), self.opts) as client,
        ):
            info = client.info()
            self.engine = {"url": client.url, "embedded": True, "startup_s": None, "info": info.to_wire()}
            self.pids = _engine_pids(Path(tmp))
            if rate is not None:
                self.bandwidth = rate
            elif saved is not None:
                self.calibration, self.calibration_file, self.bandwidth = saved, str(saved_path), saved.bandwidth
            else:
                self._calibrate(client)
            return [self._replay_at(client, k, n) for n, k in enumerate(budgets)]

    def _calibrate(self, client: AdminClient) -> None:
        from bsr_cli.bench import calibration as cb
        from bsr_cli.bench.evidence import now
        from bsr_cli.bench.trace import burst_shape

        shape: BurstShape = burst_shape(self.sliced, self.reg)
        self.st.out.note(
            f"calibrating the host model (restores alone, steady work, {cb.BURSTS} bursts of {shape.requests} "
            "requests)…"
        )
        salt = self.seed + cb.SALT_OFFSET  # prompts of its own, never a replay's
        cal = cb.calibrate_host(client, self.pids, self.reg, w=self.w, salt=salt, measured_at=now(), burst=shape)
        self.calibration, self.bandwidth = cal, cal.bandwidth
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"calibration-{self.run_id}.json"
        import json

        path.write_text(json.dumps(cal.to_wire(), indent=1) + "\n")
        self.calibration_file = str(path)
        h, s = cal.host, cal.host_state
        self.st.out.note(
            f"calibration {path}: {h.cores:.2f} cores available to bsr (run queue beside it {s.run_queue_beside:.1f}, "
            f"load {s.loadavg[0]:.1f}); a restore alone {cal.bandwidth / 1e6:.1f} MB/s per rank, "
            f"{h.restore_cpu_s * 1000:.1f} ms + {h.restore_cpu_s_per_gb:.1f} s/GB of CPU; a request's own work "
            f"{h.compute_cpu_s_per_gb:.1f} s/GB; its bursts {cal.burst_stretch:.1f}× the model"
        )

    def _replay_at(self, client: AdminClient, budget_rws: int, n: int) -> BudgetReplayed:
        import os
        import threading

        from bsr_cli.bench import trace as bt
        from bsr_cli.bench.evidence import now
        from bsr_cli.core import accounting

        client.update_settings(budget_bytes=budget_rws * accounting.rws_bytes(self.reg, self.w))
        client.reset_peak()
        salt = self.seed + n  # a salt of its own: it finds nothing of another run's (the first: stock's too)
        stop, done = threading.Event(), [0]

        def progress(m: bt.Measured) -> None:
            done[0] += 1
            if done[0] % 50 == 0:
                self.st.out.note(f"B = {budget_rws}·RWS: {done[0]:,} of {len(self.sliced):,} requests done")

        started_at, since, t0, load0 = now(), time.time(), time.monotonic(), os.getloadavg()[0]
        with _sampler(self.pids) as sampler:
            try:
                measured = bt.replay(
                    client, self.sliced, w=self.w, speedup=self.speedup, salt=salt, stop=stop, on_done=progress
                )
            except KeyboardInterrupt:
                stop.set()
                raise
        bt.read_waits(client, measured, since - 1)
        peaks = {r.rank: int((r.pool or {})["peak_bytes"]) for r in client.pool()}
        loads = (round(load0, 2), round(os.getloadavg()[0], 2))
        queue = round(sampler.mean, 2) if sampler is not None else None
        cores = sampler.cores_contended if sampler is not None else None
        elapsed = round(time.monotonic() - t0, 3)
        from bsr_cli.bench.calibration import pressure

        return bt.BudgetReplayed(
            budget_rws, salt, measured, peaks, loads, started_at, elapsed, queue, pressure(), cores_contended=cores
        )

    def report(self, replays: list[BudgetReplayed], *, skip: int) -> TraceReplay:
        """The prediction beside the measurement of each replay, on the host model (or bandwidth) this run used."""
        from bsr_cli.bench import trace as bt

        cal = self.calibration
        host = cal.host if cal is not None else None
        sliced, reg, w, speedup = self.sliced, self.reg, self.w, self.speedup
        runs = tuple(
            bt.compare(sliced, reg, r, w=w, bandwidth=self.bandwidth, speedup=speedup, host=host) for r in replays
        )
        return bt.TraceReplay(
            trace=sliced.source,
            requests=len(sliced),
            speedup=speedup,
            block_tokens=sliced.block_tokens,
            registration=reg.identity,
            model=reg.model,
            bytes_per_chunk=reg.bytes_per_chunk,
            w=w,
            bandwidth_bytes_per_s=self.bandwidth,
            calibration=cal,
            calibration_file=self.calibration_file,
            runs=runs,
            skip=skip,
        )

    def write_bundle(self, report: TraceReplay, reg: Registration) -> Path:
        from bsr_cli.bench import bundle as bundles
        from bsr_cli.bench.trace_bundle import trace_bundle

        bundle = trace_bundle(
            report,
            reg,
            run_id=self.run_id,
            started_at=self.started_at,
            elapsed_s=time.monotonic() - self.t0,
            engine=self.engine,
            machine=self.machine,
            salt=self.seed,
        )
        return bundles.write(bundle, self.out)


def _engine_pids(state_dir: Path) -> list[int]:
    from bsr_cli.engine.supervisor import read_record

    record = read_record(state_dir)
    return [pid for _, pid, _ in record.processes()] if record is not None else []


@contextlib.contextmanager
def _sampler(pids: list[int]) -> Iterator[RunQueue | None]:
    """The host's state sampled while a replay runs (None where /proc cannot tell the engine's CPU)."""
    from bsr_cli.bench.calibration import EngineCpu, RunQueue

    try:
        cpu = EngineCpu(pids)
    except BsrError:
        yield None
        return
    with RunQueue(cpu, every_s=REPLAY_SAMPLE_S) as sampler:
        yield sampler


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
