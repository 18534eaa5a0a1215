"""Planning commands (pure, offline): `bsr rws`, `bsr plan`, `bsr registration show|diff`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.core import accounting
from bsr_cli.core.registration import DEFAULT_CHUNK_SIZE, Registration, diff_registrations
from bsr_cli.core.units import parse_bytes
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.core.host_model import HostCalibration, HostModel

DEFAULT_REGISTRATION = "paper-mtp-off"

RegOpt = Annotated[
    str | None,
    typer.Option(
        "--registration",
        "-r",
        help="Registration file (JSON/YAML) or built-in name: paper-mtp-off, paper-mtp-on, demo.",
    ),
]
HfOpt = Annotated[Path | None, typer.Option("--hf-config", help="Derive the registration from a HF config.json.")]
TpOpt = Annotated[int, typer.Option("--world-size", "--tp", help="TP world size (with --hf-config).", min=1)]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="KV cache dtype (with --hf-config), e.g. bf16, fp8.")]
BlockOpt = Annotated[int | None, typer.Option("--block-size", help="Tokens per KV block (with --hf-config).", min=1)]
MtpOpt = Annotated[bool, typer.Option("--mtp", help="Add the config's MTP layers (with --hf-config).")]
ChunkOpt = Annotated[int, typer.Option("--chunk-size", help="Tokens per chunk (with --hf-config).", min=1)]
WOpt = Annotated[
    int, typer.Option("--W", "-W", "--window-size", help="Window size in chunks (0 = whole-plan path).", min=0)
]


def resolve_registration(
    registration: str | None,
    hf_config: Path | None,
    *,
    tp: int = 1,
    dtype: str | None = None,
    block_size: int | None = None,
    mtp: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    note: typer.Context | None = None,
) -> Registration:
    from bsr_cli import loaders

    if registration and hf_config:
        raise InvalidInput(
            "give --registration or --hf-config, not both",
            hint="--registration names a registration file or built-in; --hf-config derives one from a config.json",
        )
    if hf_config:
        return loaders.load_hf_registration(
            hf_config, tp=tp, dtype=dtype, block_size=block_size, include_mtp=mtp, chunk_size=chunk_size
        )
    if registration is None:
        if note is not None:
            state(note).out.note(f"[dim]using the built-in registration {DEFAULT_REGISTRATION} (pass -r to choose)[/]")
        registration = DEFAULT_REGISTRATION
    return loaders.load_registration(registration)


def _flagged_registration(
    ctx: typer.Context,
    registration: str | None,
    hf_config: Path | None,
    tp: int,
    dtype: str | None,
    block_size: int | None,
    mtp: bool,
    chunk_size: int,
) -> functools.partial[Registration]:
    """The registration the flags name (or the default, noted as such), resolved when called."""
    return functools.partial(
        resolve_registration,
        registration,
        hf_config,
        tp=tp,
        dtype=dtype,
        block_size=block_size,
        mtp=mtp,
        chunk_size=chunk_size,
        note=ctx,
    )


def _parse_sweep(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidInput(
            f"--sweep takes comma-separated window sizes, got {text!r}", hint="e.g. --sweep 8,16,32,64"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise InvalidInput("--sweep window sizes must be positive", hint="e.g. --sweep 8,16,32,64")
    return values


def rws(
    ctx: typer.Context,
    registration: RegOpt = None,
    hf_config: HfOpt = None,
    tp: TpOpt = 1,
    dtype: DtypeOpt = None,
    block_size: BlockOpt = None,
    mtp: MtpOpt = False,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    w: WOpt = 32,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prompt length for whole-plan figures.", min=0)] = 0,
    l1: Annotated[
        str | None, typer.Option("--l1", help="L1 capacity per rank (e.g. 1GiB): largest W that fits.")
    ] = None,
    sweep: Annotated[str, typer.Option("--sweep", help="Window sizes to compare.")] = "8,16,32,64",
    all_tensors: Annotated[
        bool, typer.Option("--all-tensors", help="List every tensor, not one row per shape.")
    ] = False,
    json_flag: JsonFlag = False,
) -> None:
    """Restore working set RWS(W) = W·Σc_i + aux per rank, from a registration."""
    st = state(ctx, json_flag)
    reg = _flagged_registration(ctx, registration, hf_config, tp, dtype, block_size, mtp, chunk_size)()
    acc = accounting.account(
        reg, w, tokens, sweep=_parse_sweep(sweep), l1_bytes=parse_bytes(l1) if l1 is not None else None
    )
    from bsr_cli.cli.render import planning as render

    report = render.RwsReport(
        registration=render.registration_summary(reg), accounting=acc, tensors=render.tensor_rows(reg, all_tensors)
    )
    st.out.result(report, render.rws)


# `bsr plan`'s own options; those after --trace only a trace plan reads (_TraceFlags).
PlanTokensOpt = Annotated[int | None, typer.Option("--tokens", "-n", help="Prompt length (every chunk a hit).", min=0)]
ProbeOpt = Annotated[Path | None, typer.Option("--probe", help="A saved `bsr probe --json` result.")]
ExcludeTierOpt = Annotated[
    list[str] | None,
    typer.Option("--exclude-tier", metavar="TIER", help="Plan as if this tier were unusable (repeatable)."),
]
AllWindowsOpt = Annotated[bool, typer.Option("--all-windows", help="List every window.")]
TraceOpt = Annotated[
    Path | None,
    typer.Option("--trace", help="Plan L1 and B for a request trace (Mooncake JSONL: arrivals, lengths, block ids)."),
]
BandwidthOpt = Annotated[
    str | None, typer.Option("--bandwidth", help="With --trace: restore bandwidth per rank, e.g. 10.31GB/s.")
]
SpeedupOpt = Annotated[
    float, typer.Option("--speedup", help="With --trace: replay the arrivals this many times faster.")
]
StoreCapacityOpt = Annotated[
    int | None,
    typer.Option("--store-capacity", help="With --trace: the store keeps this many 512-token blocks (LRU).", min=1),
]
BudgetsOpt = Annotated[
    str, typer.Option("--budgets", help="With --trace: budgets B to compare, as multiples of RWS(W).")
]
P99Opt = Annotated[
    float | None,
    typer.Option(
        "--p99", metavar="SECONDS", help="With --trace: name the smallest B whose p99 restore latency meets this."
    ),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option("--plot", metavar="DIR", help="With --trace: write PNG plots into DIR (needs matplotlib)."),
]
CalibrationOpt = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        metavar="FILE",
        help="With --trace: the host model (and bandwidth) a `bsr bench trace` calibration saved.",
    ),
]
CoresOpt = Annotated[
    float | None,
    typer.Option("--cores", help="With --trace: cores available to bsr (the host's less the run queue beside it)."),
]
CpuPerGbOpt = Annotated[
    float | None,
    typer.Option("--cpu-per-gb", metavar="SECONDS", help="With --trace: CPU seconds a restore needs per GB per rank."),
]
DEFAULT_BUDGETS = "1,2,4,8"  # --budgets away from it counts as given


def plan(
    ctx: typer.Context,
    w: WOpt = 32,
    tokens: PlanTokensOpt = None,
    probe: ProbeOpt = None,
    registration: RegOpt = None,
    hf_config: HfOpt = None,
    tp: TpOpt = 1,
    dtype: DtypeOpt = None,
    block_size: BlockOpt = None,
    mtp: MtpOpt = False,
    chunk_size: ChunkOpt = DEFAULT_CHUNK_SIZE,
    exclude_tier: ExcludeTierOpt = None,
    all_windows: AllWindowsOpt = False,
    trace: TraceOpt = None,
    bandwidth: BandwidthOpt = None,
    speedup: SpeedupOpt = 1.0,
    store_capacity: StoreCapacityOpt = None,
    budgets: BudgetsOpt = DEFAULT_BUDGETS,
    p99: P99Opt = None,
    plot: PlotOpt = None,
    calibration: CalibrationOpt = None,
    cores: CoresOpt = None,
    cpu_per_gb: CpuPerGbOpt = None,
    json_flag: JsonFlag = False,
) -> None:
    """Dry-run window planning: schedule, committable prefix, first break, peak vs whole-plan; or, with --trace,
    L1 per rank and restore latency over a request trace, whole-plan against BSR budgets.

    Without a prompt (`bsr plan --W 32`): the registration over a ladder of prompt lengths, 8K to 1M tokens, every
    chunk a hit."""
    st = state(ctx, json_flag)
    given = [flag for flag, v in (("--tokens", tokens), ("--probe", probe), ("--trace", trace)) if v is not None]
    trace_flags = _TraceFlags(bandwidth, speedup, store_capacity, budgets, p99, plot, calibration, cores, cpu_per_gb)
    _check_plan_flags(given, trace_flags.given(), one_prompt_flags=bool(exclude_tier or all_windows))
    # Resolved the same way for a trace and for one prompt.
    flagged_registration = _flagged_registration(ctx, registration, hf_config, tp, dtype, block_size, mtp, chunk_size)
    named = registration is not None or hf_config is not None
    if not given:
        _plan_ladder(st, w, flagged_registration(note=None), named)
    elif trace is not None:
        _plan_trace(st, trace, flagged_registration, w, trace_flags)
    else:
        _plan_prompt(st, w, tokens, probe, flagged_registration, named, exclude_tier or [], all_windows)


@dataclass(frozen=True)
class _TraceFlags:
    """The flags that only a trace plan reads, each field's default the flag's."""

    bandwidth: str | None = None
    speedup: float = 1.0
    store_capacity: int | None = None
    budgets: str = DEFAULT_BUDGETS
    p99: float | None = None
    plot: Path | None = None
    calibration: Path | None = None
    cores: float | None = None
    cpu_per_gb: float | None = None

    def given(self) -> list[str]:
        """The flags given (each away from its default)."""
        return [f"--{f.name.replace('_', '-')}" for f in fields(self) if getattr(self, f.name) != f.default]


def _check_plan_flags(given: list[str], trace_flags: list[str], *, one_prompt_flags: bool) -> None:
    """At most one prompt (or trace) flag, the trace's own flags only with --trace, and the flags that plan one
    prompt (--exclude-tier, --all-windows) only with --tokens or --probe."""
    if len(given) > 1:
        raise InvalidInput(
            f"give one of --tokens N, --probe FILE or --trace FILE, not {' and '.join(given)}",
            hint="--tokens plans a prompt fully held, --probe one as a saved probe found it, --trace a request trace",
        )
    if "--trace" not in given and trace_flags:
        raise InvalidInput(
            f"{', '.join(trace_flags)} plan a trace: add --trace FILE",
            hint="a request trace in the Mooncake format, e.g. examples/trace.jsonl; `bsr events --trace` writes one",
        )
    if one_prompt_flags and given in ([], ["--trace"]):
        raise InvalidInput(
            "--exclude-tier and --all-windows plan one prompt, not a trace or a ladder: add --tokens N or --probe FILE",
            hint="without a prompt `bsr plan --W N` plans a ladder of prompt lengths; --trace plans a trace",
        )


def _plan_ladder(st: AppState, w: int, reg: Registration, registration_named: bool) -> None:
    """`bsr plan --W N` with no prompt: what an operator asks first, how W bounds staging at every prompt length."""
    from bsr_cli.cli.render import planning as render
    from bsr_cli.core.plan import DEFAULT_PROMPT_LADDER, plan_ladder

    lengths = DEFAULT_PROMPT_LADDER
    which = f"registration {reg.source}" if registration_named else f"the built-in registration {reg.source} (-r)"
    st.out.note(
        f"[dim]no prompt given: planning {which} at {lengths[0]:,} to {lengths[-1]:,} tokens, every chunk a hit "
        "(--tokens N, --probe FILE or --trace FILE plans one)[/]"
    )
    st.out.result(render.LadderReport(plan_ladder(reg, w, lengths), reg.model), render.plan_ladder)


def _host_model(
    calibration: Path | None, cores: float | None, cpu_per_gb: float | None
) -> tuple[HostCalibration | None, HostModel | None]:
    """The calibration given (if any) and the host model a trace plan runs on: the calibration's, with --cores and
    --cpu-per-gb put in its place; or the plain one of those two flags; or none (the bandwidth alone)."""
    from bsr_cli import loaders
    from bsr_cli.core.host_model import HostModel

    saved = loaders.load_calibration(calibration) if calibration is not None else None
    if saved is None:
        if (cores is None) != (cpu_per_gb is None):
            raise InvalidInput(
                "--cores and --cpu-per-gb model the host together",
                hint="give both, or a calibration (--calibration FILE) whose figures they replace",
            )
        host = HostModel.of_cores(cores, cpu_per_gb) if cores is not None and cpu_per_gb is not None else None
    else:
        host = saved.host
        if cores is not None:
            host = replace(host, cores=cores)
        if cpu_per_gb is not None:
            host = replace(host, restore_cpu_s_per_gb=cpu_per_gb)
    if host is not None:
        host.check()
    return saved, host


def _plan_prompt(
    st: AppState,
    w: int,
    tokens: int | None,
    probe: Path | None,
    flagged_registration: Callable[[], Registration],
    registration_named: bool,
    exclude_tiers: list[str],
    all_windows: bool,
) -> None:
    """One prompt's window plan, every chunk a hit (--tokens) or as a saved probe found it (--probe). A probe
    planned without --registration/--hf-config uses the registration it was saved with."""
    from bsr_cli import loaders
    from bsr_cli.cli.render import planning as render
    from bsr_cli.core.plan import plan_restore

    bitmap = loaders.load_probe(probe) if probe else None
    if bitmap is not None and not registration_named:
        raw = loaders.read_structured(probe) if probe else None
        embedded = raw.get("registration_spec") if isinstance(raw, dict) else None
        reg = Registration.from_dict(embedded, source=str(probe)) if embedded else resolve_registration(None, None)
    else:
        reg = flagged_registration()
    result = plan_restore(reg, w, bitmap=bitmap, tokens=tokens, exclude_tiers=exclude_tiers)
    st.out.result(
        render.PlanReport(
            plan=result, bytes_per_chunk=reg.bytes_per_chunk, model=reg.model, show_all_windows=all_windows
        ),
        render.plan,
    )


def _parse_budgets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InvalidInput(
            f"--budgets takes comma-separated whole multiples of RWS(W), got {text!r}", hint="e.g. --budgets 1,2,4,8"
        ) from None
    if not values or any(v < 1 for v in values):
        raise InvalidInput("--budgets multiples of RWS(W) must be at least 1", hint="e.g. --budgets 1,2,4,8")
    return values


def _plan_trace(
    st: AppState,
    trace_path: Path,
    flagged_registration: Callable[[], Registration],
    w: int,
    flags: _TraceFlags,
) -> None:
    """`bsr plan --trace`: replay the trace's arrivals through the planning model (bsr_cli.core.trace_sim), on the
    host model when one is given (a calibration's, or --cores with --cpu-per-gb)."""
    saved, host = _host_model(flags.calibration, flags.cores, flags.cpu_per_gb)
    if flags.bandwidth is None and saved is None:
        raise InvalidInput(
            "--trace needs --bandwidth (the restore bandwidth per rank, e.g. 10.31GB/s) or --calibration FILE",
            hint="`bsr bench store` measures the bandwidth (the paper's tier reads 10.31GB/s); `bsr bench trace` "
            "saves a calibration",
        )
    reg = flagged_registration()
    if saved is not None and saved.registration != reg.identity:
        st.out.warn(f"the calibration measured registration {saved.registration}; planning {reg.identity}")
    from bsr_cli.core.units import parse_rate

    rate = parse_rate(flags.bandwidth) if flags.bandwidth is not None else saved.bandwidth if saved is not None else 0.0
    from bsr_cli import loaders
    from bsr_cli.core.trace_sim import plan_trace

    multiples = _parse_budgets(flags.budgets)
    result = plan_trace(
        loaders.load_trace(trace_path),
        reg,
        w,
        bandwidth=rate,
        speedup=flags.speedup,
        budgets_rws=multiples,
        store_capacity=flags.store_capacity,
        p99_target_s=flags.p99,
        host=host,
    )
    plots = None
    if flags.plot is not None:
        from bsr_cli.bench import trace_plots

        plots = tuple(str(p) for p in trace_plots.write_plots(result, flags.plot))
    from bsr_cli.cli.render import planning as render

    st.out.result(render.TracePlanReport(result, plots), render.trace_plan)


registration_app = typer.Typer(help="Inspect and compare registrations.", no_args_is_help=True)


@registration_app.command("show")
def registration_show(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(help="Registration file or built-in name.", metavar="REGISTRATION")],
    all_tensors: Annotated[bool, typer.Option("--all-tensors", help="List every tensor.")] = False,
    json_flag: JsonFlag = False,
) -> None:
    """Show a registration: groups, tensors, Σc_i and its identity."""
    from bsr_cli import loaders
    from bsr_cli.cli.render import planning as render

    st = state(ctx, json_flag)
    reg = loaders.load_registration(spec)
    report = render.RegistrationReport(
        summary=render.registration_summary(reg), registration=reg, tensor_rows=render.tensor_rows(reg, all_tensors)
    )
    st.out.result(report, render.registration)


@registration_app.command("diff")
def registration_diff(
    ctx: typer.Context,
    a: Annotated[str, typer.Argument(help="First registration (file or built-in name).", metavar="A")],
    b: Annotated[str, typer.Argument(help="Second registration.", metavar="B")],
    w: WOpt = 32,
    json_flag: JsonFlag = False,
) -> None:
    """What changed between two registrations and what it does to Σc_i and RWS(W)."""
    from bsr_cli import loaders
    from bsr_cli.cli.render import planning as render

    st = state(ctx, json_flag)
    ra, rb = loaders.load_registration(a), loaders.load_registration(b)
    report = render.RegistrationDiffReport.of(
        diff_registrations(ra, rb),
        a,
        b,
        ra,
        rb,
        w,
        rws_a=accounting.rws_bytes(ra, w) if w else None,
        rws_b=accounting.rws_bytes(rb, w) if w else None,
    )
    st.out.result(report, render.registration_diff)
