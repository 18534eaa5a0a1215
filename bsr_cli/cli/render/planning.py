"""The planning commands' tables (rws, plan, registration), and the typed reports they print (as data with --json)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bsr_cli.core import wire
from bsr_cli.core.accounting import Accounting
from bsr_cli.core.bitmap import Break
from bsr_cli.core.evidence import RestoreBound
from bsr_cli.core.plan import LadderPlan, RestorePlan
from bsr_cli.core.registration import Registration, RegistrationDiff, TensorSpec
from bsr_cli.core.trace_sim import PathRun, RestorePath, TracePlan
from bsr_cli.core.units import format_bytes

if TYPE_CHECKING:
    from bsr_cli.bench.trace import AtReplayCores, BudgetRun, CommittedCounts, StockSummary, TraceReplay

# Exact bytes and the binary-unit reading, as operators quote them: 525,074,432 (500.75 MiB). The one formatter.
b = partial(format_bytes, exact=True)


# -- the reports (their fields are the wire keys, in the wire's order) -----------------------------------------


@dataclass(frozen=True)
class GroupSummary:
    name: str
    block_size: int
    tensors: int
    bytes_per_chunk: int


@dataclass(frozen=True)
class RegistrationSummary:
    model: str
    identity: str
    source: str
    tp_size: int
    chunk_size: int
    tensors_count: int
    bytes_per_token: int
    bytes_per_chunk: int
    aux_bytes: int
    groups: tuple[GroupSummary, ...]

    @classmethod
    def of(cls, reg: Registration) -> RegistrationSummary:
        return cls(
            model=reg.model,
            identity=reg.identity,
            source=reg.source,
            tp_size=reg.tp_size,
            chunk_size=reg.chunk_size,
            tensors_count=len(reg.tensors),
            bytes_per_token=reg.bytes_per_token,
            bytes_per_chunk=reg.bytes_per_chunk,
            aux_bytes=reg.aux_bytes,
            groups=tuple(
                GroupSummary(g.name, g.block_size, len(reg.tensors_of(g.name)), reg.group_bytes_per_chunk(g.name))
                for g in reg.groups
            ),
        )


@dataclass(frozen=True)
class TensorRow:
    """One tensor, or one (group, dtype, shape) with how many tensors share it."""

    count: int
    name: str
    group: str
    dtype: str
    shape: tuple[int, ...]
    bytes_per_chunk: int


@dataclass(frozen=True, kw_only=True)
class RegistrationReport:
    """`bsr registration show`."""

    summary: RegistrationSummary = wire.field(flatten=True)  # its keys first, beside the report's
    registration: Registration
    tensor_rows: tuple[TensorRow, ...]

    to_wire = wire.writer()


@dataclass(frozen=True, kw_only=True)
class RwsReport:
    """`bsr rws`."""

    registration: RegistrationSummary
    accounting: Accounting = wire.field(flatten=True)  # the accounting's keys beside the report's
    tensors: tuple[TensorRow, ...]

    to_wire = wire.writer()


@dataclass(frozen=True)
class CapacityFit:
    """A dry run against a live engine: whether its budget B (W=0: its pool) can admit the planned windows."""

    fits: bool
    window_bytes: int
    budget_bytes: int
    pool_bytes: int
    # Why not, and what to do: keys only when it does not fit (the dry run always says both then, never when it fits).
    message: str = wire.field(omit_empty=True, default="")
    hint: str = wire.field(omit_empty=True, default="")


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """`bsr plan` (and `bsr restore --dry-run`, with the engine's capacity)."""

    plan: RestorePlan = wire.field(flatten=True)  # the plan's keys first, beside the report's
    bytes_per_chunk: int
    model: str
    show_all_windows: bool
    capacity: CapacityFit | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class TensorChange:
    """A tensor both registrations name, as each declares it."""

    a: TensorSpec
    b: TensorSpec

    to_wire = wire.writer()


@dataclass(frozen=True)
class SettingChange:
    """A registration setting (model, tp_size, chunk_size, aux_bytes, groups) that differs, on both sides."""

    field: str
    a: str | int | list[tuple[str, int]]
    b: str | int | list[tuple[str, int]]

    to_wire = wire.writer()


@dataclass(frozen=True)
class ChunkBytes:
    """Σc_i on both sides, and what the change adds (negative: removes)."""

    a: int
    b: int

    @property
    def delta(self) -> int:
        return self.b - self.a

    to_wire = wire.writer(computed=("delta",))


@dataclass(frozen=True)
class DiffSide:
    """One side of the diff: where it was read from, its identity and how many tensors it registers."""

    source: str
    identity: str
    tensors: int

    to_wire = wire.writer()


@dataclass(frozen=True)
class RwsPair:
    """RWS(W) per rank on both sides."""

    a: int
    b: int

    to_wire = wire.writer()


@dataclass(frozen=True, kw_only=True)
class RegistrationDiffReport:
    """`bsr registration diff A B`: what changed, and RWS(W) on both sides (W > 0)."""

    identical: bool
    added: tuple[TensorSpec, ...]
    removed: tuple[TensorSpec, ...]
    changed: tuple[TensorChange, ...]
    settings: tuple[SettingChange, ...]
    bytes_per_chunk: ChunkBytes
    a: DiffSide
    b: DiffSide
    w: int = wire.field(name="W")
    rws_bytes: RwsPair | None  # None: W=0, no window to size

    to_wire = wire.writer()

    @classmethod
    def of(
        cls,
        diff: RegistrationDiff,
        a_source: str,
        b_source: str,
        a: Registration,
        b: Registration,
        w: int,
        rws_a: int | None,
        rws_b: int | None,
    ) -> RegistrationDiffReport:
        return cls(
            identical=diff.identical,
            added=diff.added,
            removed=diff.removed,
            changed=tuple(TensorChange(x, y) for x, y in diff.changed),
            settings=tuple(SettingChange(f, x, y) for f, x, y in diff.settings),
            bytes_per_chunk=ChunkBytes(*diff.bytes_per_chunk),
            a=DiffSide(a_source, a.identity, len(a.tensors)),
            b=DiffSide(b_source, b.identity, len(b.tensors)),
            w=w,
            rws_bytes=None if rws_a is None or rws_b is None else RwsPair(rws_a, rws_b),
        )


@dataclass(frozen=True)
class TracePlanReport:
    """`bsr plan --trace`: the replay through the planning model, and the plots written (with --plot)."""

    result: TracePlan = wire.field(flatten=True)  # the replay's keys, then the plots
    plots: tuple[str, ...] | None = wire.field(omit_none=True, default=None)  # None: drawn none (no --plot)

    to_wire = wire.writer()


# -- building them ---------------------------------------------------------------------------------------------


def first_break_line(br: Break | None) -> str:
    """Where the committable prefix ends, in one line (probe and plan say it the same way)."""
    if not br:
        return "[green]no break[/]: every rank and group holds the whole prompt"
    held = f" (held only by excluded {', '.join(br.held_by)})" if br.held_by else ""
    return f"[yellow]first break[/]: chunk {br.chunk} rank {br.rank} group {br.group}: {br.reason}{held}"


def registration_summary(reg: Registration) -> RegistrationSummary:
    return RegistrationSummary.of(reg)


def tensor_rows(reg: Registration, every: bool) -> tuple[TensorRow, ...]:
    """One row per tensor, or one row per (group, dtype, shape) with a count (167 rows help nobody)."""
    if every:
        return tuple(
            TensorRow(1, t.name, t.group, t.dtype, tuple(t.shape), t.bytes_per_token * reg.chunk_size)
            for t in reg.tensors
        )
    counts = Counter((t.group, t.dtype, t.shape) for t in reg.tensors)
    first: dict[tuple[str, str, tuple[int, ...]], str] = {}
    for t in reg.tensors:
        key = (t.group, t.dtype, t.shape)
        # layers.0.attn / layers.1.attn / ... -> layers.*.attn
        first[key] = t.name if key not in first else _merge_names(first[key], t.name)
    return tuple(
        TensorRow(n, first[k], k[0], k[1], tuple(k[2]), n * reg.chunk_size * _prod_bytes(reg, k[0], k[1], k[2]))
        for k, n in counts.items()
    )


def _merge_names(a: str, b: str) -> str:
    pa, pb = re.split(r"(\d+)", a), re.split(r"(\d+)", b)
    if len(pa) != len(pb):
        return a
    return "".join(x if x == y else "*" for x, y in zip(pa, pb, strict=True))


def _prod_bytes(reg: Registration, group: str, dtype: str, shape: tuple[int, ...]) -> int:
    for t in reg.tensors:
        if (t.group, t.dtype, t.shape) == (group, dtype, shape):
            return t.bytes_per_token
    return 0


def _registration_tables(console: Console, s: RegistrationSummary, rows: Sequence[TensorRow]) -> None:
    console.print(
        f"[bold]{s.model}[/]  {s.identity}  tp={s.tp_size}  chunk={s.chunk_size} tokens  "
        f"{s.tensors_count} tensors" + (f"  [dim]{s.source}[/]" if s.source else "")
    )
    t = Table(title="tensors (per rank)", title_justify="left")
    for col in ("count", "tensor", "group", "dtype", "shape/token"):
        t.add_column(col)
    t.add_column("bytes/chunk", justify="right")
    for r in rows:
        t.add_row(str(r.count), r.name, r.group, r.dtype, "×".join(map(str, r.shape)), f"{r.bytes_per_chunk:,}")
    console.print(t)
    g = Table(title="KV groups", title_justify="left")
    for col in ("group", "block size", "tensors"):
        g.add_column(col)
    g.add_column("bytes/chunk", justify="right")
    for grp in s.groups:
        g.add_row(grp.name, str(grp.block_size), str(grp.tensors), f"{grp.bytes_per_chunk:,}")
    g.add_row("[bold]Σ c_i[/]", "", str(s.tensors_count), f"[bold]{b(s.bytes_per_chunk)}[/]")
    console.print(g)


def registration(console: Console, r: RegistrationReport) -> None:
    _registration_tables(console, r.summary, r.tensor_rows)


def rws(console: Console, r: RwsReport) -> None:
    _registration_tables(console, r.registration, r.tensors)
    acc = r.accounting
    w = acc.w
    if w:
        console.print(
            f"RWS(W={w}) = {w} · {acc.bytes_per_chunk:,} + {acc.aux_bytes:,} = [bold]{b(acc.rws_bytes)}[/] per rank"
        )
    else:
        console.print("W=0: the whole-plan path; its staging grows with the prompt (see below)")
    sw = Table(title="window sweep", title_justify="left")
    sw.add_column("W", justify="right")
    sw.add_column("RWS per rank", justify="right")
    if acc.tokens:
        sw.add_column(f"windows for {acc.tokens:,} tokens", justify="right")
    for cost in acc.sweep:
        cells = [str(cost.w), b(cost.rws_bytes)]
        if acc.tokens:
            cells.append(str(cost.windows))
        sw.add_row(*cells, style="bold" if cost.w == w else None)
    console.print(sw)
    if acc.tokens:
        rung = acc.ladder_rung
        console.print(
            f"{acc.tokens:,} tokens = {acc.chunks:,} chunks → {acc.windows} window(s) at W={w}; "
            f"whole-plan (W=0) staging {b(acc.whole_plan_bytes)} per rank → "
            + (f"first ladder rung {format_bytes(rung)}" if rung else "[red]above the largest ladder rung[/]")
        )
    if acc.l1_bytes is not None:
        fit = acc.max_w_for_l1
        console.print(
            f"L1 {b(acc.l1_bytes)} per rank holds W ≤ [bold]{fit}[/]"
            + ("" if fit else " [red](not even one chunk fits)[/]")
        )


def plan(console: Console, r: PlanReport) -> None:
    p = r.plan
    w = p.w
    console.print(
        f"[bold]{r.model}[/] {p.registration}  W={w}{' (whole-plan path)' if w == 0 else ''}  "
        f"prompt {p.prompt_tokens:,} tokens = {p.prompt_chunks:,} chunks"
    )
    console.print(
        f"committable prefix: [bold]{p.committable_tokens:,} tokens[/] ({p.committable_chunks:,} chunks) "
        f"in {len(p.windows)} window(s)"
        + (
            f"; objects by tier: {', '.join(f'{k} {v:,}' for k, v in p.objects_by_tier.items())}"
            if p.objects_by_tier
            else ""
        )
    )
    console.print(first_break_line(p.first_break))
    windows = p.windows
    if windows:
        t = Table(title="window schedule", title_justify="left")
        for col in ("window", "chunks", "tokens"):
            t.add_column(col, justify="right")
        groups = [s.group for s in windows[0].blocks]
        for g in groups:
            t.add_column(f"{g} blocks", justify="right")
        t.add_column("bytes/rank", justify="right")
        shown = windows if r.show_all_windows or len(windows) <= 10 else [*windows[:6], None, *windows[-2:]]
        for win in shown:
            if win is None:
                t.add_row("…", f"{len(windows) - 8} more", *([""] * (len(groups) + 2)))
                continue
            t.add_row(
                f"G{win.index + 1}",
                f"{win.chunk_start}–{win.chunk_end}",
                f"{win.token_start:,}–{win.token_end:,}",
                *(f"{s.start}–{s.end}" for s in win.blocks),
                f"{win.bytes_per_rank:,}",
            )
        console.print(t)
    cmp = Table(title="restore staging per rank", title_justify="left")
    cmp.add_column("path")
    cmp.add_column("peak live bytes", justify="right")
    cmp.add_column("ladder rung", justify="right")
    rung = p.whole_plan_rung
    if w:
        cmp.add_row(f"BSR, W={w}", b(p.peak_bytes_per_rank), "")
    cmp.add_row(
        "whole plan (W=0)",
        b(p.whole_plan_bytes),
        format_bytes(rung) if rung else ("—" if not p.committable_chunks else "beyond ladder"),
    )
    console.print(cmp)
    if w and p.whole_plan_bytes and p.peak_bytes_per_rank:
        console.print(staging_ratio_line(w, p.committable_chunks, p.whole_plan_bytes, p.peak_bytes_per_rank))
    fit = r.capacity
    if fit:  # a dry run against a live engine: can its budget B (W=0: its pool) admit these windows?
        if fit.fits:
            console.print(
                f"[green]fits[/] this engine: a window stages {b(fit.window_bytes)} per rank; budget B "
                f"{b(fit.budget_bytes)}, pool {b(fit.pool_bytes)}"
            )
        else:
            console.print(f"[red]does not fit[/] this engine: {fit.message}")


def staging_ratio_line(w: int, chunks: int, whole_plan_bytes: int, peak_bytes: int) -> str:
    """How much less BSR stages than the whole-plan path; a prompt of at most W chunks is one window either way."""
    if chunks <= w:
        return f"the prompt fits in one window of W={w}: BSR and the whole-plan path stage the same"
    return f"BSR stages {whole_plan_bytes / peak_bytes:,.1f}× less than the whole-plan path for this prompt."


@dataclass(frozen=True)
class LadderReport:
    """`bsr plan --W N` without a prompt: the ladder plan and the registration's name."""

    ladder: LadderPlan = field(metadata=wire.meta(flatten=True))
    model: str

    to_wire = wire.writer()


def plan_ladder(console: Console, r: LadderReport) -> None:
    p = r.ladder
    console.print(f"[bold]{r.model}[/] {p.registration}  W={p.w}{' (whole-plan path)' if p.w == 0 else ''}")
    t = Table(title="every chunk a hit, per prompt length", title_justify="left")
    for col in ("prompt tokens", "chunks", "windows", f"BSR peak (W={p.w})", "whole plan (W=0)", "ladder rung"):
        t.add_column(col, justify="right")
    t.add_column("BSR stages")
    for row in p.rows:
        t.add_row(
            f"{row.tokens:,}",
            f"{row.chunks:,}",
            f"{row.windows:,}",
            format_bytes(row.peak_bytes_per_rank),
            format_bytes(row.whole_plan_bytes),
            format_bytes(row.whole_plan_rung) if row.whole_plan_rung else "beyond ladder",
            "the same (one window)"
            if not p.w or row.chunks <= p.w
            else f"{row.whole_plan_bytes / row.peak_bytes_per_rank:,.1f}× less",
        )
    console.print(t)
    if p.rws_bytes is not None:
        console.print(f"the BSR peak is RWS(W={p.w}) = {b(p.rws_bytes)} per rank, whatever the prompt length")


def registration_diff(console: Console, r: RegistrationDiffReport) -> None:
    console.print(f"A: {r.a.source} ({r.a.tensors} tensors, {r.a.identity})")
    console.print(f"B: {r.b.source} ({r.b.tensors} tensors, {r.b.identity})")
    if r.identical:
        console.print("[green]identical[/]")
        return
    t = Table()
    for col in ("change", "tensor", "group", "dtype", "shape/token"):
        t.add_column(col)
    for x in r.added:
        t.add_row(Text("+ added", style="green"), x.name, x.group, x.dtype, "×".join(map(str, x.shape)))
    for x in r.removed:
        t.add_row(Text("- removed", style="red"), x.name, x.group, x.dtype, "×".join(map(str, x.shape)))
    for change in r.changed:
        x, y = change.a, change.b
        t.add_row(
            Text("~ changed", style="yellow"),
            x.name,
            f"{x.group}→{y.group}",
            f"{x.dtype}→{y.dtype}",
            f"{'×'.join(map(str, x.shape))}→{'×'.join(map(str, y.shape))}",
        )
    if t.row_count:
        console.print(t)
    for s in r.settings:
        console.print(f"{s.field}: {s.a} → {s.b}")
    sums = r.bytes_per_chunk
    console.print(f"Σ c_i: {sums.a:,} → {sums.b:,} bytes per chunk ({sums.delta:+,})")
    if r.rws_bytes is not None:
        console.print(f"RWS(W={r.w}): {b(r.rws_bytes.a)} → {b(r.rws_bytes.b)} per rank")


def seconds(x: float) -> str:
    """A latency as people read it: milliseconds below a second, seconds above."""
    return f"{x * 1000:,.0f} ms" if x < 1 else f"{x:,.2f} s"


def trace_plan(console: Console, report: TracePlanReport) -> None:
    """`bsr plan --trace`: the trace, its hits, then one row per restore path (whole plan, each budget B)."""
    d = report.result
    pace = "its own pace" if d.speedup == 1 else f"{d.speedup:g}× its pace"
    share = d.hit_tokens / d.input_tokens if d.input_tokens else 0.0
    console.print(
        f"[bold]{d.source}[/]: {d.requests:,} requests over {d.span_s:,.1f} s at {pace}; "
        f"{d.restores:,} restore a hit, {d.hit_tokens:,} of {d.input_tokens:,} input tokens ({share:.1%})"
    )
    store = (
        f"LRU store of {d.store_capacity:,} blocks ({d.evicted_blocks:,} evicted)"
        if d.store_capacity is not None
        else "store keeps every block"
    )
    console.print(
        f"{d.model} {d.registration}  chunk {d.chunk_size} tokens = {b(d.bytes_per_chunk)} per rank; "
        f"W={d.w}: RWS {b(d.rws_bytes)}; bandwidth {d.bandwidth / 1e9:,.2f} GB/s per rank; "
        f"{store}"
    )
    if d.host is not None:
        h = d.host
        slots = f"{h.restore_slots} served at once" if h.restore_slots else "all served at once"
        console.print(
            f"host: cores available to bsr {h.cores:g}, at most {h.job_cores:g} per restore; a restore needs "
            f"{h.restore_cpu_s * 1000:.1f} ms + {h.restore_cpu_s_per_gb:g} s/GB of CPU per rank's bytes; restores "
            f"{slots}" + (f"; the trace needs {d.cpu_load:.0%} of those cores" if d.cpu_load is not None else "")
        )
    big = d.largest
    if big:
        console.print(
            f"largest single hit: {big.tokens:,} tokens = {big.chunks:,} chunks = "
            f"{b(big.bytes_per_rank)} per rank (request #{big.request}, counting from 0)"
        )
    t = Table(title="restore L1 and latency per rank", title_justify="left")
    t.add_column("path")
    t.add_column("B per rank", justify="right")
    t.add_column("peak L1 per rank", justify="right")
    for col in ("latency p50", "p95", "p99", "wait p50", "p95", "p99"):
        t.add_column(col, justify="right")
    t.add_column("in flight (peak)", justify="right")
    t.add_column("queued (peak)", justify="right")
    if d.host is not None:
        t.add_column("bound (restores)")
    best = d.smallest_meeting
    for row in [d.whole_plan, *d.bsr]:
        bold = best is not None and row.path is RestorePath.BSR and row.budget_rws == best.budget_rws
        bound = [_bounds(row.bound_by)] if d.host is not None else []
        t.add_row(*_path_cells(row), *bound, style="bold" if bold else None)
    console.print(t)
    whole = d.whole_plan
    target = d.p99_target_s
    if target is None:
        console.print("[dim]--p99 SECONDS names the smallest B that meets a p99 restore-latency target[/]")
    elif best:
        console.print(
            f"smallest B with p99 restore latency ≤ {seconds(target)}: [bold]{best.budget_rws}·RWS = "
            f"{b(best.budget_bytes)}[/] per rank, against {format_bytes(whole.peak_bytes)} "
            "for the whole plan"
        )
    else:
        tried = ", ".join(f"{r.budget_rws}·RWS" for r in d.bsr)
        wp99 = seconds(whole.latency.p99)
        if whole.meets_p99:
            need = format_bytes(whole.peak_bytes)
            why = f"the whole plan meets it (p99 {wp99}) with {need}: try larger --budgets"
        else:
            why = f"neither does the whole plan (p99 {wp99}): the bandwidth, not B, limits latency here"
        console.print(f"[red]no budget B ({tried}) meets p99 ≤ {seconds(target)}[/]; {why}")
    for plot in report.plots or ():
        console.print(f"plot: {plot}")
    if d.host is None:
        model = "transfer only, the per-rank bandwidth shared equally by the restores in flight"
    else:
        model = "the slower of bytes at a bandwidth share and CPU at a share of the cores available to bsr"
    console.print(f"[dim]model: {model}, FIFO admission under B; see docs/capacity-planning.md[/]")


def _path_cells(row: PathRun) -> list[str]:
    whole = row.path is RestorePath.WHOLE_PLAN
    lat, wait = row.latency, row.wait
    return [
        "whole plan (W=0)" if whole else f"BSR, B = {row.budget_rws}·RWS",
        "unbounded" if whole or row.budget_bytes is None else format_bytes(row.budget_bytes),
        format_bytes(row.peak_bytes),
        *(seconds(x) for x in (lat.p50, lat.p95, lat.p99)),
        *(seconds(x) for x in (wait.p50, wait.p95, wait.p99)),
        f"{row.peak_in_flight:,}",
        f"{row.peak_queued:,}",
    ]


def trace_replay(console: Console, d: TraceReplay) -> None:
    """`bsr bench trace`: per budget B the planner's prediction beside the engine's measurement, what bound the
    restores on both sides, then stock LMCache beside the first budget's run."""
    from bsr_cli.bench.trace import StockSummary

    console.print(
        f"[bold]{d.trace}[/]: {d.requests:,} requests from #{d.skip}, time ×{d.speedup:g}, tokens "
        f"×{d.block_tokens}/512; {d.model} {d.registration} ({b(d.bytes_per_chunk)} per chunk per "
        f"rank); W={d.w}; planner bandwidth {d.bandwidth_bytes_per_s / 1e9:.3f} GB/s per rank"
    )
    _calibration_lines(console, d)
    _runs_table(console, d)
    for run in d.runs:
        _run_lines(console, d, run)
    if isinstance(d.stock, StockSummary):
        _stock_lines(console, d, d.stock)
    else:
        why = d.stock.reason if d.stock is not None else "not recorded"
        console.print(f"stock LMCache: not run ({why})")
    for name, ok in d.checks.items():
        console.print(f"{'[green]pass[/]' if ok else '[red]FAIL[/]'} {name.replace('_', ' ')}")
    if d.bundle:
        console.print(f"bundle: {d.bundle}")


def _calibration_lines(console: Console, d: TraceReplay) -> None:
    cal = d.calibration
    if cal is None:
        console.print("[dim]no host model: the prediction counts bytes over the bandwidth alone[/]")
        return
    h, s = cal.host, cal.host_state
    slots = f"{h.restore_slots} restores served at once" if h.restore_slots else "every restore served at once"
    contended = f", {s.cores_contended:.2f} read as a replay reads them" if s.cores_contended is not None else ""
    console.print(
        f"host model ({d.calibration_file}): {h.cores:.2f} cores available to bsr of {s.cpu_count}{contended} "
        f"(run queue beside it {s.run_queue_beside:.1f} idle, {s.run_queue_busy:.1f} busy; load {s.loadavg[0]:.1f}); a "
        f"restore needs {h.restore_cpu_s * 1000:.1f} ms + {h.restore_cpu_s_per_gb:.1f} s/GB of CPU (alone), at most "
        f"{h.job_cores:.2f} cores; {slots}; a request's own work {h.compute_cpu_s_per_gb:.1f} s/GB, replayed beside "
        f"the restores; the calibration's bursts took {cal.burst_stretch:.1f}× what the model gives them"
    )
    console.print(
        "[dim]CPU needed: the share of the cores available to bsr the slice's restores and requests need on "
        "average; near 100 % latency depends steeply on the host's state[/]"
    )


def _bounds(counts: dict[RestoreBound, int] | None) -> str:
    if not counts:
        return ""
    return ", ".join(f"{bound.value.replace('_', ' ')} {n:,}" for bound, n in counts.items())


def _runs_table(console: Console, d: TraceReplay) -> None:
    t = Table(title="restore latency: planner against engine, per budget", title_justify="left")
    columns = ("B", "load", "run queue", "CPU needed", "predicted p50", "measured p50", "predicted p99", "measured p99")
    for col in (*columns, "at the replay's cores: p50 / p99", "bandwidth alone"):
        t.add_column(col, justify="right")
    t.add_column("bound (predicted)")
    t.add_column("bound (measured)")
    for run in d.runs:
        p, m = run.predicted, run.measured
        alone = p.bandwidth_only_latency_s
        t.add_row(
            f"{run.budget_rws}·RWS",
            f"{run.loadavg[0]:.1f}→{run.loadavg[1]:.1f}",
            f"{run.run_queue_beside:.1f}" if run.run_queue_beside is not None else "",
            f"{p.cpu_load:.0%}" if p.cpu_load is not None else "",
            seconds(p.latency_s.p50),
            _against(m.latency_s.p50, run.latency_ratio.get("p50"), run.agrees.get("p50")),
            seconds(p.latency_s.p99),
            _against(m.latency_s.p99, run.latency_ratio.get("p99"), run.agrees.get("p99")),
            _at_replay_cores(run.at_replay_cores),
            f"{seconds(alone.p50)} / {seconds(alone.p99)}" if alone is not None else "",
            _bounds(p.bound_by),
            _bounds(m.bound_by),
        )
    console.print(t)


def _at_replay_cores(at: AtReplayCores | None) -> str:
    """The prediction at the cores the engine got during the replay, each with measured over it in brackets."""
    if at is None:
        return ""
    parts = [_against(getattr(at.latency_s, p), at.latency_ratio.get(p), at.agrees.get(p)) for p in ("p50", "p99")]
    return f"{at.cores:.2f} cores: {' / '.join(parts)}"


def _against(measured: float, ratio: float | None, agrees: bool | None) -> str:
    if ratio is None:
        return seconds(measured)
    colour = "green" if agrees else "red"
    return f"{seconds(measured)} [{colour}]({ratio:.2f}×)[/]"


# A run queue beside bsr during a replay further than this fraction from the calibration's: the host changed.
HOST_CHANGED = 0.25


def _unstored(c: CommittedCounts) -> str:
    """What the requests that committed more than the plan had found: a later turn's store, or nothing stored."""
    if not c.more:
        return ""
    if not c.unstored:
        return " (each a later turn's store done before its lookup)"
    return f" ([red]{c.unstored:,} more than any store before it ended held[/])"


def _run_lines(console: Console, d: TraceReplay, run: BudgetRun) -> None:
    p, m, c = run.predicted, run.measured, run.committed
    peaks = ", ".join(f"rank {r} {format_bytes(v)}" for r, v in sorted(m.pool_peak_by_rank.items()))
    console.print(
        f"B = {run.budget_rws}·RWS ({b(run.budget_bytes)}): restores {m.restores:,} of {p.restores:,} predicted, "
        f"{m.hit_tokens:,} of {p.hit_tokens:,} tokens; pool peak {peaks}; waits p99: B {seconds(m.budget_wait_s.p99)}"
        f" (predicted {seconds(p.wait_s.p99)}), destination KV {seconds(m.kv_wait_s.p99)}; committed exactly the "
        f"predicted tokens {c.exact:,}, fewer {c.fewer:,}, more {c.more:,}{_unstored(c)}; failed {m.failed:,}"
    )
    if m.first_failure:
        console.print(f"[red]first failure[/]: {m.first_failure}")
    psi = ", ".join(f"{name} {v:.0f} %" for name, v in run.pressure.items() if v is not None)
    if psi:
        console.print(f"host pressure as the replay ended (PSI, some avg10): {psi}")
    calibrated = d.calibration.host_state.run_queue_beside if d.calibration is not None else None
    during = run.run_queue_beside
    if calibrated is not None and during is not None and abs(during - calibrated) > HOST_CHANGED * max(calibrated, 1):
        console.print(
            f"[yellow]the host changed[/]: the run queue beside bsr was {calibrated:.1f} at the calibration and "
            f"{during:.1f} during this replay; the prediction was for the calibration's host (calibrate again, or give "
            "`bsr plan --trace --cores` for this one)"
        )


def _stock_lines(console: Console, d: TraceReplay, stock: StockSummary) -> None:
    first = d.runs[0]
    sc = stock.committed
    sp = ", ".join(f"rank {r} {format_bytes(v)}" for r, v in sorted(stock.l1_peak_by_rank.items()))
    calls = "one request at a time per rank, as vLLM's worker calls it" if stock.serial else "retrieves overlap"
    lat = stock.latency_s
    console.print(
        f"stock LMCache {stock.lmcache}: restore latency p50 {seconds(lat.p50)}, p95 {seconds(lat.p95)}, p99 "
        f"{seconds(lat.p99)}; L1 high-water per rank {sp} (L1 {format_bytes(stock.l1_bytes)}, staging only), against "
        f"the engine's pool peak {format_bytes(first.measured.peak_bytes_per_rank)} and the planner's whole-plan "
        f"peak {format_bytes(first.predicted.whole_plan_peak_bytes_per_rank)}; {calls}"
    )
    console.print(
        f"stock LMCache loaded exactly the hit's full chunks: {sc.exact:,} of {d.requests:,} requests; "
        f"fewer: {sc.fewer:,}; more: {sc.more:,}; {stock.hit_tokens:,} of {stock.expected_hit_tokens:,} tokens "
        f"({stock.partial_chunk_tokens:,} more sit in partial chunks LMCache does not store by default); failed "
        f"{stock.failed:,}"
    )
    if stock.first_failure:
        console.print(f"[red]stock LMCache's first failure[/]: {stock.first_failure}")
