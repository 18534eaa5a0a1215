"""Rich renderers for the live-engine commands (probe, submit, restore, status, faults, drill).

Just over 500 lines on purpose: these commands print the same engine answers (bitmaps, per-rank outcomes, pool
numbers), and their renderers share the helpers that draw them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from bsr_cli.cli.output import PANEL_PIPE_WIDTH, Output
from bsr_cli.cli.render.planning import b, first_break_line
from bsr_cli.core import wire
from bsr_cli.core.bitmap import Break, HitBitmap
from bsr_cli.core.events import Event, Failure, RestoreFailed, RestoreStarted, WindowReleased
from bsr_cli.core.evidence import FailureKind, Outcome, RankState, ScrubState, TierCondition, window_label
from bsr_cli.core.results import (
    ManualRestoreResult,
    OutputHashes,
    ProbeResult,
    RestoreReport,
    SubmitResult,
)
from bsr_cli.core.status import EngineStatus, FaultListing, PoolEntry, RankFault, RecentRestore
from bsr_cli.core.units import format_bytes
from bsr_cli.tui.palette import BOTH_TIERS, FLEET_STYLE, tier_look

if TYPE_CHECKING:
    from bsr_cli.core.explain import Explanation
    from bsr_cli.core.scrub import ScrubReport
    from bsr_cli.core.store_probe import StoreProbe
    from bsr_cli.drill import DrillResult
    from bsr_cli.fleet import FleetView

STRIP_FIXED_COLUMNS = 36  # what the probe table spends beside the strip: rank, group, held, borders


def strip(cells: str, tiers: list[str], width: int) -> Text:
    """One row of the bitmap, binned to ``width`` cells. A cell shows what *every* chunk in it has: a miss if any
    chunk misses, ``B`` if all are held by several tiers, else the tier they all share (or, when they share none,
    the lowest tier any of them needs)."""
    n = len(cells)
    out = Text()
    if n == 0:
        return out
    bins = min(width, n)
    for i in range(bins):
        lo, hi = i * n // bins, max((i + 1) * n // bins, i * n // bins + 1)
        masks = [int(c, 16) for c in cells[lo:hi]]
        common = ~0
        for m in masks:
            common &= m
        if any(m == 0 for m in masks):
            out.append("·", style="bold red")
        elif bin(common).count("1") > 1:
            out.append(*BOTH_TIERS)
        else:
            if common:
                tier = tiers[common.bit_length() - 1]
            else:  # held throughout, but not by one tier: show the lowest tier some chunk depends on
                worst = max(next(j for j in range(len(tiers)) if m >> j & 1) for m in masks)
                tier = tiers[worst]
            letter, style = tier_look(tier)
            out.append(letter, style=style)
    return out


def strip_width(console: Console, given: int | None) -> int:
    """The strip's cells: --width when given, else what the console has left beside the table's other columns."""
    if given:
        return int(given)
    # Piped without COLUMNS the console is unbounded (nothing wraps); the strip then keeps a page width.
    avail = console.width if console.is_terminal or os.environ.get("COLUMNS") else PANEL_PIPE_WIDTH
    return max(8, avail - STRIP_FIXED_COLUMNS)


def legend(tiers: list[str], chunks: int, width: int) -> str:
    marks = [f"[{tier_look(t)[1]}]{tier_look(t)[0]}[/]={t}" for t in tiers]
    if len(tiers) > 1:
        more = " (or more)" if len(tiers) > 2 else ""
        marks.append(f"[{BOTH_TIERS[1]}]{BOTH_TIERS[0]}[/]=" + "+".join(tiers[:2]) + more)
    marks.append("[bold red]·[/]=miss")
    text = "legend: " + "  ".join(marks)
    per_cell = -(-chunks // width) if chunks > width else 1
    if per_cell > 1:
        text += f"  (1 cell ≈ {per_cell} chunks; --width for more cells)"
    return text


@dataclass(frozen=True)
class ProbeView:
    """`bsr probe`'s result: the engine's answer and the strip width asked for (--width; None: fit the terminal)."""

    result: ProbeResult = field(metadata=wire.meta(flatten=True))  # the engine's answer's keys, then the width
    strip_width: int | None

    to_wire = wire.writer()


def probe(console: Console, view: ProbeView) -> None:
    d = view.result
    bitmap_lines(console, d.bitmap, d.committable_tokens, d.committable_chunks, d.first_break, view.strip_width)
    for rank, errs in d.tier_errors.items():
        for tier, msg in errs.items():
            console.print(f"[red]{rank} {tier} unreachable during probe[/]: {msg}")
    for m in d.markers:
        console.print(f"[magenta]force-local marker[/] on prompt {m.prompt}: {marker_scope(m.excluded_tiers)}")


def bitmap_lines(
    console: Console,
    bm: HitBitmap,
    committable_tokens: int,
    committable_chunks: int,
    first_break: Break | None,
    width_given: int | None,
) -> None:
    """The hit bitmap as a table of strips (one per rank and group), the committable prefix and where it breaks."""
    width = strip_width(console, width_given)
    console.print(
        f"[bold]{bm.model}[/] {bm.registration}  prompt {bm.tokens:,} tokens = {bm.chunks:,} chunks  "
        + legend(list(bm.tiers), bm.chunks, width)
    )
    t = Table(show_header=True)
    t.add_column("rank", justify="right")
    t.add_column("group")
    t.add_column(f"chunks 0…{bm.chunks - 1}" if bm.chunks else "chunks")
    t.add_column("held", justify="right")
    for r in range(bm.ranks):
        for g in bm.groups:
            cells = bm.rows[(r, g)]
            held = sum(1 for c in cells if c != "0")
            t.add_row(str(r), g, strip(cells, list(bm.tiers), width), f"{held}/{len(cells)}")
    console.print(t)
    console.print(f"committable prefix: [bold]{committable_tokens:,} tokens[/] ({committable_chunks:,} chunks)")
    console.print(first_break_line(first_break))


def marker_scope(excluded_tiers: Sequence[str] | None) -> str:
    """What a marker makes the next admission do: skip the tiers it excludes, or (none excluded, a rank failed)
    recompute the prompt locally."""
    tiers = list(excluded_tiers or ())
    return f"excludes {', '.join(tiers)}" if tiers else "recompute locally (no tier excluded)"


def _failure_text(f: Failure) -> str:
    """One failure of a restore result, as `bsr restore` and `bsr submit` print it: never an absent field."""
    who = f"rank {f.rank}" if f.rank is not None else "a rank"
    where = f" at {f.stage.value}" if f.stage else ""
    win = f" window {window_label(f.window)}" if f.window is not None else ""
    tier = f" from tier {f.tier}" if f.tier else ""
    return f"{who}{win}{where}{tier}: {f.reason or 'no reason given'}"


def _restore_line(r: RestoreReport) -> str:
    if r.outcome is Outcome.COMMITTED:
        return (
            f"[green]committed[/] {r.committed_tokens:,} tokens from {'+'.join(r.tiers)} in {r.windows} "
            f"window(s) of W={r.w}, {r.seconds:.2f}s, {r.gbps:.2f} GB/s"
        )
    fails = "; ".join(_failure_text(f) for f in r.failures)
    invalid = ", ".join(f"rank {x.rank}/{x.group}" for x in r.invalid)
    ranks = ", ".join(f"rank {x}" for x in r.blamed_ranks)
    stage = f" at {r.failure_stage.value}" if r.failure_stage else ""
    tiers = ", ".join(r.blamed_tiers)
    headlines = {  # the endings that blame nothing
        Outcome.REFUSED: "[yellow]refused[/], capacity (nothing moved, nothing blamed)",
        Outcome.ABORTED: "[yellow]aborted[/] by the operator (nothing blamed)",
    }
    headline = headlines.get(r.outcome)
    if headline is None:
        causes = {
            FailureKind.RANK: f"{ranks or 'a rank'} failed{stage} (no tier blamed)",
            FailureKind.TIER: f"tier {tiers} failed{stage}" if tiers else f"a tier failed{stage}",
            FailureKind.HOST_OVERLOADED: f"the host was overloaded{stage} (no rank or tier blamed)",
        }
        cause = causes.get(r.failure_kind, "nothing valid to commit") if r.failure_kind else "nothing valid to commit"
        headline = f"[red]failed closed[/], {cause}"
    return (
        f"{headline}: advertised {r.advertised_tokens:,} tokens, committed 0 "
        f"(invalid: {invalid or '—'}) — {fails or 'no failure reported'}"
    )


def submit(console: Console, d: SubmitResult) -> None:
    console.print(f"request {d.request}  prompt {d.prompt}  {d.tokens:,} tokens  W={d.w}")
    t = Table(title="admission passes", title_justify="left")
    for col in ("pass", "excluded tiers", "external tokens", "outcome"):
        t.add_column(col)
    for p in d.passes:
        t.add_row(
            str(p.pass_no),
            ", ".join(p.excluded_tiers) or "—",
            f"{p.external_tokens:,}",
            _restore_line(p.restore) if p.restore else "no external hit: local prefill",
        )
    console.print(t)
    for p in d.passes:
        r = p.restore
        if r is not None and r.failure_kind is FailureKind.CAPACITY and r.hint:
            console.print(f"[yellow]restore refused for capacity[/] (computed locally instead): {r.hint}")
    if d.marker_history:
        console.print(
            f"force-local marker: set ({marker_scope(sorted(d.marker_history[-1].marker.excluded))}), "
            f"{'cleared on admission' if d.marker_cleared else 'still set'}"
        )
    console.print(
        f"served: [bold]{d.external_tokens:,}[/] external tokens from {d.source}, "
        f"{d.computed_tokens:,} computed locally in {d.seconds:.2f}s"
    )
    # A store failure is said on stderr (`bsr: warning: ...`, in --json mode too), not here.
    _hash_line(console, OutputHashes(d.output_hash, d.canonical_hash, d.hash_ok), d.hash_note)


def _hash_line(console: Console, h: OutputHashes | None, hash_note: str | None) -> None:
    if h is None:
        return
    if hash_note is not None:
        console.print(f"output hash {h.output_hash} [dim](canonical hash: not applicable, real KV data)[/]")
    elif h.hash_ok is None:
        console.print(f"output hash {h.output_hash}")
    elif h.hash_ok:
        console.print(f"output hash {h.output_hash} [green]= canonical[/]")
    else:
        console.print(
            f"[red]output hash {h.output_hash} ≠ canonical {h.canonical_hash}[/]: the request failed, its KV was "
            "invalidated and nothing was stored"
        )


@dataclass(frozen=True)
class RestoreView:
    """`bsr restore`'s result: the engine's answer and the budget B its peak is held to (the engine's info)."""

    result: ManualRestoreResult
    budget_bytes: int | None
    # Seconds from the engine's commit to its answer: the output-hash check (text only; the JSON is the engine's).
    hash_check_s: float | None = None

    def to_wire(self) -> wire.JsonObject:
        written = self.result.to_wire()  # budget_bytes only where the answer has none: not a function of the fields
        written.setdefault("budget_bytes", self.budget_bytes)
        return written


def restore(console: Console, view: RestoreView) -> None:
    d = view.result
    console.print(f"request {d.request}  prompt {d.prompt}  {d.tokens:,} tokens  W={d.w}")
    r = d.report
    if r is None:
        br = d.first_break
        console.print(
            "[yellow]nothing to restore[/]: no tier holds the first chunk"
            + (f" (rank {br.rank} group {br.group}: {br.reason})" if br else "")
        )
        return
    console.print(_restore_line(r))
    t = Table(title="per rank", title_justify="left")
    for col in ("rank", "windows", "bytes", "wall s", "Σ fetch s", "Σ install s", "peak pool", "bound"):
        t.add_column(col, justify="right")
    rws, budget = r.rws_bytes, view.budget_bytes
    # W>0: the peak is held to the admission budget B; with B ≥ 2·RWS(W) the next window's fetch overlaps this
    # window's install, so a peak above RWS(W) (up to B) is by design. W=0 (whole plan) is bounded by the pool.
    bound = (budget or rws) if d.w else r.whole_plan_bytes
    over_rws = False
    for rank in r.ranks:
        peak = rank.peak_live_bytes
        over_rws = over_rws or bool(rws and peak > rws)
        ok = bound is None or peak <= bound
        mark = (
            "—" if not bound else (f"[green]≤ {format_bytes(bound)}[/]" if ok else f"[red]> {format_bytes(bound)}[/]")
        )
        t.add_row(
            str(rank.rank),
            f"{rank.windows_done}/{r.windows}",
            format_bytes(rank.bytes_restored),
            f"{rank.seconds:.2f}",
            f"{rank.fetch_seconds:.2f}",
            f"{rank.install_seconds:.2f}",
            b(peak),
            mark,
        )
    console.print(t)
    if d.w and rws:
        what = f"bound = budget B {format_bytes(budget)}" if budget else f"bound = RWS(W={d.w})"
        console.print(
            f"RWS(W={d.w}) = {format_bytes(rws)} per rank; {what}"
            + (
                f"; B holds {budget // rws} window(s), so up to {min(2, budget // rws)} are in flight"
                " (the next fetch overlaps this install)"
                if budget and over_rws
                else ""
            )
        )
    if d.w and r.whole_plan_bytes:
        console.print(f"whole-plan (W=0) would stage {b(r.whole_plan_bytes)} per rank")
    console.print("[dim]Σ fetch/install s add up each window's time; windows overlap, so they can exceed wall s[/]")
    _hash_line(console, d.hashes, d.hash_note)
    if d.hashes is not None and view.hash_check_s is not None:
        console.print(f"[dim]{hash_check_cost(d.hashes, view.hash_check_s)}[/]")
    if d.marker is not None:
        tiers = sorted(d.marker.excluded)
        then = f"skips {', '.join(tiers)}" if tiers else "recomputes it locally (no tier is excluded)"
        console.print(f"[magenta]force-local marker set[/]: the next admission of this prompt {then}")


# What runs between a restore's commit and the engine's answer, as the progress display and the notes name it.
HASH_CHECK = "output-hash check: the canonical KV is recomputed on every rank (--no-verify skips it)"
HASH_ONLY = "hashing the restored KV (the canonical check is skipped: --no-verify)"


def hash_check_cost(hashes: OutputHashes, seconds: float) -> str:
    """The line that says what the hash check after the commit cost, and how to skip it."""
    if hashes.canonical_hash is not None:
        return f"output-hash check: {seconds:.2f} s after the commit (canonical KV recomputed; --no-verify skips it)"
    return f"output hash: {seconds:.2f} s after the commit"


class RestoreProgress:
    """Live per-rank progress (window j of K, bytes, GB/s) while a restore streams, then the output-hash check's
    (from the commit to the engine's answer)."""

    def __init__(self, out: Output, ranks: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=out.err_console,
            transient=False,
        )
        self._tasks = [self._progress.add_task(f"rank {r} windows", total=None, rate="") for r in range(ranks)]
        self._bytes = [0] * ranks
        self._t0 = time.monotonic()
        self._check: Any = None  # the hash check's line, once the restore committed

    def start(self) -> None:
        self._progress.start()

    def stop(self) -> None:
        if self._check is not None:  # the answer came: the check is done (its line keeps the time it took)
            self._progress.update(self._check, total=1, completed=1)
        self._progress.stop()

    def check_started(self, verify: bool) -> None:
        self._check = self._progress.add_task(HASH_CHECK if verify else HASH_ONLY, total=None, rate="")

    def update(self, e: Event) -> None:
        if isinstance(e, RestoreStarted):
            for task in self._tasks:
                self._progress.update(task, total=e.windows)
        elif isinstance(e, WindowReleased) and 0 <= e.rank < len(self._tasks):
            r = e.rank
            self._bytes[r] += e.bytes
            dt = max(time.monotonic() - self._t0, 1e-6)
            self._progress.update(
                self._tasks[r],
                completed=e.window + 1,
                total=e.windows,
                rate=f"{format_bytes(self._bytes[r])} {self._bytes[r] / dt / 1e9:.2f} GB/s",
            )
        elif isinstance(e, RestoreFailed) and 0 <= e.rank < len(self._tasks):
            self._progress.update(self._tasks[e.rank], description=f"[red]rank {e.rank} failed[/]")


def event_line(event: Mapping[str, wire.JsonValue]) -> str:
    """One event as `bsr events` prints it: sequence number, local date and time, rank, what happened."""
    from bsr_cli.tui.model import describe_event

    when = event.get("time")
    at = float(when) if isinstance(when, int | float | str) else 0.0
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "-"
    rank = event.get("rank")
    where = f" r{rank}" if isinstance(rank, int) and not isinstance(rank, bool) else ""
    return f"{event.get('seq', 0):>7} {stamp}{where} {describe_event(event)}"


def faults(console: Console, d: FaultListing) -> None:
    if not d.enabled:
        console.print("fault injection is [bold]disabled[/] on this engine")
    if not d.faults:
        console.print("no faults armed")
        return
    t = Table()
    for col in ("id", "kind", "rank", "window", "group", "fired/count", "expires"):
        t.add_column(col)
    for f in d.faults:
        t.add_row(
            str(f.id),
            Text(f.kind, style="red"),
            "all" if f.rank is None else str(f.rank),
            "first" if f.window is None else f"G{f.window + 1}",
            f.group or "all",
            f"{f.fired}/{f.count or '∞'}",
            time.strftime("%H:%M:%S", time.localtime(f.expires_at)) if f.expires_at else "never",
        )
    console.print(t)


def _rank_state(r: PoolEntry) -> str:
    """A rank's state cell: up (draining to B), starved (the host keeps it from running), unhealthy or down."""
    if not r.healthy:
        return "[red]unhealthy[/]" if r.alive else "[red]down[/]"
    if r.state is RankState.STARVED:
        return "[yellow]up, starved[/]"
    return "[yellow]up, draining to B[/]" if (r.pool or {}).get("draining") else "[green]up[/]"


def status(console: Console, d: EngineStatus) -> None:
    snap = d.snapshot
    info = snap.info
    reg = info.registration
    console.print(
        f"engine [bold]{info.engine}[/] {d.url}  bsr {info.version} api {info.api}  "
        + ("[green]healthy[/]" if d.health.ok else "[red]unhealthy[/]")
    )
    console.print(
        f"registration {reg.identity} ({reg.model}, {reg.tensors} tensors, "
        f"{reg.bytes_per_chunk:,} B/chunk, groups {', '.join(reg.groups)}); chunk {info.chunk_size} tokens"
    )
    console.print(
        f"W={info.w}  RWS {b(info.rws_bytes)}  budget B {b(info.budget_bytes)}  "
        f"pool {b(info.pool_bytes)} per rank  max prompt {info.max_tokens:,} tokens  "
        f"faults {'[red]enabled[/]' if info.faults_enabled else 'disabled'}"
    )
    t = Table(title="ranks", title_justify="left")
    for col in ("rank", "state", "live", "peak", "capacity", "windows live", "restore rate"):
        t.add_column(col, justify="right")
    for r in snap.ranks:
        p = r.pool or {}
        t.add_row(
            str(r.rank),
            _rank_state(r),
            format_bytes(p.get("live_bytes", 0)),
            format_bytes(p.get("peak_bytes", 0)),
            format_bytes(p.get("capacity_bytes", 0)),
            str(p.get("windows_live", 0)),
            f"{r.restore_bps / 1e9:.2f} GB/s",
        )
    console.print(t)
    _l1_lines(console, snap.ranks)
    for r in snap.ranks:
        if not r.healthy:
            console.print(f"[red]rank {r.rank} unhealthy[/]: {r.reason or r.error or 'not running'}")
        elif r.state is RankState.STARVED:  # the host's doing: its deadlines stretch, it is not blamed
            console.print(f"[yellow]rank {r.rank} starved[/] (the host, not the rank): {r.reason or 'waiting to run'}")
        elif r.last_fault is not None:
            console.print(last_fault_line(r.rank, r.last_fault, snap.time, snap.recent))
    for name, h in snap.tiers.items():
        why = f"({h.condition.replace('_', ' ')}{', injected' if h.injected else ''}) "
        why = why if h.condition != TierCondition.OK else ""
        state = "[yellow]unhealthy[/]" if h.injected else "[red]unhealthy[/]"  # a drill's failure, which pages nobody
        line = f"tier {name}: " + ("[green]ok[/]" if h.ok else f"{state} {why}" + "; ".join(h.detail))
        console.print(line + "".join(f" · [yellow]{armed}[/]" for armed in h.faults_armed))
        if h.quarantined_total:
            console.print(
                f"[yellow]tier {name}: {h.quarantined_total} damaged object(s) quarantined[/] "
                "(moved aside or removed, rewritten by the next store; `bsr bundle` lists them)"
            )
            for q in h.quarantined:
                console.print(f"  {q.file or f'{q.key} (removed)'}: {q.reason}")
        for sp in h.scrubs:
            line = escape(sp.describe())
            console.print(f"[yellow]{line}[/]" if sp.state is ScrubState.RUNNING else line)
    for w in snap.admission.blocks_waiting:
        console.print(
            f"[yellow]waiting for destination KV[/] {w.request}: {w.tokens:,} tokens, "
            f"{w.waited_s:.1f}s of {snap.admission.kv_wait_s:g}s"
        )
    worker = info.host_fields.get("worker")
    scheduler = SchedulerView.from_wire(snap.host_fields.get("scheduler"))
    if worker:
        _worker_lines(console, snap.recent, scheduler, VllmWorker.from_wire(worker))
    if snap.markers:
        for m in snap.markers:
            prefix_tokens = m.host_fields.get("prefix_tokens")
            prefix = f" (prefix of {prefix_tokens:,} tokens)" if prefix_tokens else ""
            console.print(
                f"[magenta]force-local marker[/] prompt {m.prompt}{prefix} {marker_scope(m.excluded_tiers)}: {m.reason}"
            )
    elif worker and not scheduler.published:
        console.print("[yellow]markers unknown[/]: vLLM's scheduler has not published its state to this worker")
    else:
        console.print("no force-local markers")
    if snap.faults:
        faults(console, FaultListing(enabled=info.faults_enabled, faults=snap.faults))


def _l1_lines(console: Console, ranks: Sequence[PoolEntry]) -> None:
    """Where a rank's pool is LMCache's L1, the allocator's totals: they hold LMCache's own staging (a store's
    chunks until written) beside the restore windows that B bounds."""
    for r in ranks:
        p = r.pool or {}
        if "l1_live_bytes" in p:
            console.print(
                f"rank {r.rank} LMCache L1: {format_bytes(p['l1_live_bytes'])} live, peak "
                f"{format_bytes(p.get('l1_peak_bytes', 0))} (the windows above and LMCache's own staging, "
                "not held to B)"
            )


def last_fault_line(rank: int, fault: RankFault, now: float, recent: Sequence[RecentRestore]) -> str:
    """A healthy rank's last fault, dated; superseded (dimmed, naming what came after) once a newer restore ended,
    so an old drill's fault never reads as the cause of a newer failure."""
    from bsr_cli.core.when import ago

    head = f"rank {rank} last fault {ago(now - fault.at)} ago" + (f" ({fault.request})" if fault.request else "")
    newer = next((x for x in recent if x.finished > fault.at and x.request != fault.request), None)
    if newer is not None:
        outcome = newer.outcome.value.replace("_", " ") if newer.outcome is not None else "ended"
        why = f": {newer.reason}" if newer.reason else ""
        return (
            f"[dim]{head}, before the newest restore {newer.request} ({outcome} {ago(now - newer.finished)} ago"
            f"{why}): {fault.reason}[/]"
        )
    if fault.stage:  # it failed at its own stage and still answers
        return f"[yellow]{head}[/]: {fault.reason}"
    return f"rank {rank} recovered; {head.removeprefix(f'rank {rank} ')}: {fault.reason}"


@dataclass(frozen=True)
class VllmWorker:
    """What a vLLM worker adds to the engine's info (``worker``), as its status lines read it."""

    tp_rank: int
    window_chunks: int  # W: the connector's bsr_window_chunks
    max_model_len: int
    kv_tokens: int

    from_wire = wire.reader()


@dataclass(frozen=True)
class ForcedLocal:
    """An admission the scheduler's marker sent to local compute."""

    request: str
    marker: str

    from_wire = wire.reader()


@dataclass(frozen=True)
class SchedulerView:
    """What a vLLM worker adds to the snapshot (``scheduler``): whether the scheduler published, what it forced."""

    published: bool = False
    forced_local: tuple[ForcedLocal, ...] = ()

    from_wire = wire.reader()


@dataclass(frozen=True)
class WorkerLoad:
    """A vLLM worker's own keys on a recent restore: one load as the BSR connector saw it."""

    windows: int
    advertised_tokens: int
    loaded_tokens: int
    recomputed_tokens: int
    failed_window: int | None = None

    from_wire = wire.reader()


def _worker_lines(
    console: Console, recent: Sequence[RecentRestore], scheduler: SchedulerView, worker: VllmWorker
) -> None:
    """A vLLM worker (what it adds to the engine's info and snapshot): where its numbers come from, and its last
    loads as the BSR connector saw them."""
    console.print(
        f"vLLM worker tp-rank {worker.tp_rank}: W = the connector's bsr_window_chunks ({worker.window_chunks}), "
        f"one window loaded at a time (B = RWS(W)); max prompt = vLLM's max_model_len "
        f"({worker.max_model_len:,}); KV {worker.kv_tokens:,} tokens; LMCache stores full chunks only"
    )
    for r in recent:
        if "loaded_tokens" not in r.host_fields:  # the worker's own keys: what the connector loaded and recomputed
            continue
        load = WorkerLoad.from_wire(r.host_fields)
        head = f"load {r.request}"
        if r.outcome is Outcome.COMMITTED:
            console.print(
                f"{head}: [green]committed[/] {load.loaded_tokens:,} tokens in {load.windows} window(s) of W={r.w}"
            )
            continue
        failed_window = load.failed_window
        at = f" at window G{failed_window + 1} of {load.windows}" if failed_window is not None else ""
        console.print(
            f"{head}: [red]failed closed[/]{at} (W={r.w}): advertised {load.advertised_tokens:,} tokens, "
            f"loaded {load.loaded_tokens:,}, recomputed {load.recomputed_tokens:,} (vLLM may still count them "
            f"as cached) — {r.reason}"
        )
    for f in scheduler.forced_local:
        console.print(
            f"admission {f.request}: forced local by the marker on prompt {f.marker} (no load; vLLM computed it)"
        )


def scrub(console: Console, d: ScrubReport) -> None:
    """`bsr scrub`: each rank's scrub, what it set apart, and the verdict."""
    what = f"prompt {d.prompt}" if d.prompt else "every object"
    console.print(
        f"scrub of tier {d.tier}, {what}: {d.checked:,} object(s) read back, {d.damaged} damaged, {d.missing} not held"
    )
    for p in d.ranks:
        console.print(
            f"  rank {p.rank}: {p.state.value}, {p.checked:,} checked ({format_bytes(p.bytes)}), "
            f"{p.damaged} damaged, {p.quarantined} set aside, {p.missing} not held"
            + (f" ({p.reason})" if p.reason else "")
        )
    for q in d.quarantined:
        where = f"[yellow]quarantined[/] {escape(q.file)}" if q.file else f"[yellow]removed[/] {escape(q.key)}"
        console.print(f"  {where}: {escape(q.reason)}")
    if d.damaged:
        console.print(f"[red]{d.damaged} damaged object(s)[/]: set aside, rewritten by the next store")
    elif d.complete:
        console.print("[green]clean[/]: every object in scope read back intact")
    else:
        console.print("[yellow]incomplete[/]: not every object was read (see each rank's reason)")


def drill(console: Console, d: DrillResult) -> None:
    t = Table(title=f"failure drill against {d.engine} ({d.tokens:,} tokens, W={d.W})", title_justify="left")
    for col in ("scenario", "first pass", "force-local", "fallback", "hash = canonical", "ranks healthy", "verdict"):
        t.add_column(col)
    for s in d.scenarios:
        c = s.checks
        fp = s.first_pass

        def mark(v: bool) -> str:
            return "[green]yes[/]" if v else "[red]no[/]"

        t.add_row(
            s.scenario,
            (f"collapsed {fp.advertised_tokens:,}→0" if c.prefix_collapsed else "[red]not collapsed[/]"),
            ("set, cleared" if c.force_local_set and c.force_local_cleared else "[red]wrong[/]"),
            (s.fallback if c.fallback else f"[red]{s.fallback} (want {s.expected_fallback})[/]"),
            mark(c.hash_canonical),
            mark(c.ranks_healthy),
            "[green]PASS[/]" if s.ok else "[red]FAIL[/]",
        )
    console.print(t)


def store_probe(console: Console, d: StoreProbe) -> None:
    from bsr_cli.core.store_probe import NoDiagnosis

    bitmap_lines(console, d.bitmap, d.bitmap.prefix_tokens(), d.committable_chunks, d.first_break, d.strip_width)
    tail = d.tail
    if tail:
        if tail.stored:
            console.print(
                f"storable: all {d.prompt_chunks:,} chunks (the partial last chunk of {tail.tokens:,} tokens "
                "is stored too: save_unfull_chunk)"
            )
        else:
            console.print(
                f"storable: {d.storable_chunks:,} of {d.prompt_chunks:,} chunks ({d.storable_tokens:,} "
                f"tokens); the partial last chunk of {tail.tokens:,} tokens is not stored (LMCache stores it only "
                "with save_unfull_chunk)"
            )
    hs = d.key_format.hash_start
    seed = hs.vllm_hash_seed
    how = f"vLLM's start for PYTHONHASHSEED={seed}" if seed is not None else "0 (LMCache without vLLM)"
    if hs.detected is True:
        how += " [dim](detected from the store)[/]"
    elif hs.detected is False:
        how += " [dim](auto: no candidate start matched these keys)[/]"
    console.print(f"hash chain start: {how}")
    matched = hs.chains_matched
    if len(matched) > 1:
        console.print(
            f"[yellow]{len(matched)} hash chains matched[/] (the prompt is stored under several chain starts): "
            + ", ".join(
                f"{m} ({n:,} of the first chunks)" for m, n in zip(matched, hs.candidates_held.values(), strict=True)
            )
            + "; showing the one with the most; pass --vllm-hash-seed to choose"
        )
    if d.key_example:
        console.print(f"[dim]keys look like {d.key_example}[/]")
    live = d.liveness
    segs = live.segments
    state = {"alive": "[green]up[/]", "gone": "[red]gone[/]", "unknown": "[yellow]unknown[/]"}
    console.print(
        f"segments: {live.segments_alive}/{len(segs)} holder(s) alive"
        + "".join(f"  {s.endpoint} {state[s.state.value]}" for s in segs)
    )
    if live.segment_listing_error:
        console.print(f"[yellow]the master's segment listing failed[/]: {live.segment_listing_error}")
    if live.stale_chunks:
        console.print(
            f"[red]{live.stale_chunks} listed chunk(s) sit only on holders that are gone[/]: the master still "
            "lists them (until its client TTL, ~10 s) but they cannot be read"
        )
    if live.unknown_chunks:
        console.print(
            f"[yellow]{live.unknown_chunks} listed chunk(s) have no holder known to be alive[/] (liveness "
            "unknown): not counted"
        )
    if live.stale_chunks or live.unknown_chunks:
        console.print(f"the master's listing alone would give a prefix of {live.listed_committable_chunks:,} chunk(s)")
    integ = d.integrity
    if integ.unverified_chunks:
        first = ", ".join(f"rank {u.rank} chunk {u.chunk}" for u in integ.unverified[:4])
        console.print(
            f"[yellow]{integ.unverified_chunks} held chunk(s) carry no checksum[/] (unverified: stored by stock "
            f"LMCache, or by an older bsr whose checksum covers the bytes alone; first: {first}); bsr's connector "
            "refuses them unless bsr_load_unverified is set"
        )
    elif integ.checksummed_chunks:
        console.print(f"integrity: {integ.checksummed_chunks} held chunk(s) carry bsr's checksum")
    diag = d.diagnosis
    if isinstance(diag, NoDiagnosis):
        console.print(f"[yellow]no chunk matched[/]; {diag.why} ({diag.hint})")
    elif diag is not None:
        for cause in diag.causes:
            console.print(f"[yellow]likely cause[/]: {cause}")


def fleet_table(d: FleetView) -> Table:
    """Engines and their ranks, worst first: one row per engine, then one per rank under it."""
    summary = ", ".join(f"{n} {k}" for k, n in d.counts.items() if n)
    t = Table(title=f"fleet: {len(d.engines)} engines ({summary})", title_justify="left")
    for col, just in (
        ("engine", "left"),
        ("state", "left"),
        ("rank", "right"),
        ("live", "right"),
        ("budget B", "right"),
        ("peak", "right"),
        ("windows", "right"),
        ("restore rate", "right"),
        ("markers", "right"),
        ("why", "left"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for e in d.engines:
        style = FLEET_STYLE.get(e.state, "")
        if e.down:
            # One line each (the departure first, short enough never to wrap): how it went, since when, why.
            why = "\n".join(x for x in (e.departure_text, (e.down_text or "").partition(": ")[2]) if x)
            why += ("\n" if why else "") + e.problems[0]
            t.add_row(e.engine, Text(e.state, style), "", "", "", "", "", "", "", why)
            continue
        t.add_row(
            Text(e.engine, "bold"),
            Text(e.state, style),
            f"{len(e.ranks)} ranks",
            format_bytes(sum(r.live_bytes for r in e.ranks)),
            format_bytes(e.budget_bytes),
            format_bytes(max((r.peak_bytes for r in e.ranks), default=0)),
            str(sum(r.windows_live for r in e.ranks)),
            f"{e.restore_bps / 1e9:.2f} GB/s",
            str(e.markers),
            "; ".join(e.problems) or f"W={e.W} {e.model or ''}".strip(),
        )
        for r in e.ranks:
            t.add_row(
                "",
                Text(r.state, FLEET_STYLE.get(r.state, "")),
                f"r{r.rank}",
                format_bytes(r.live_bytes),
                format_bytes(r.budget_bytes),
                format_bytes(r.peak_bytes),
                str(r.windows_live),
                f"{r.restore_bps / 1e9:.2f} GB/s",
                "",
                r.reason,
            )
    return t


def fleet(console: Console, d: FleetView) -> None:
    console.print(fleet_table(d))
    if d.timeline:
        console.print("timeline (newest first):")
        for i in d.timeline:
            when = time.strftime("%H:%M:%S", time.localtime(i.time))
            console.print(Text(f"  {when} {i.engine}: {i.text}"))


def explain(console: Console, d: Explanation) -> None:
    """The verdict first, then its evidence chain, the other findings, where each tier's prefix ends per rank, the
    last restore per rank and window, and the next command."""
    v = d.findings[0]
    style = "green" if d.reusable else "red"
    subject = f"request {d.request}" if d.request else f"prompt {d.prompt}".strip()
    console.print(f"[bold]{subject}[/]: [{style}]{d.verdict.value}[/]")
    console.print(f"  {v.summary}")
    for line in v.evidence:
        console.print(f"  [dim]·[/] {line}")
    console.print(f"  fix: {v.fix}")
    others = d.findings[1:]
    if others:
        console.print("also:")
        for f in others:
            console.print(f"  [yellow]{f.kind.value}[/]: {f.summary}")
    if d.tiers:
        t = Table(title="prefix per tier and rank (chunks)", title_justify="left")
        for col in ("tier", "rank", "prefix", "held"):
            t.add_column(col, justify="right")
        for row in d.tiers:
            t.add_row(row.tier, str(row.rank), f"{row.prefix_chunks}/{d.chunks}", str(row.held_chunks))
        console.print(t)
    last = d.last_restore
    if last and not d.request:
        console.print(
            f"last restore {last.request}: {last.outcome.value if last.outcome is not None else 'running'}"
            + (f" ({last.failure_kind.value})" if last.failure_kind else "")
            + (f", {last.windows} window(s) of W={last.W}" if last.windows is not None else "")
        )
        for r in last.ranks:
            console.print(f"  rank {r.rank}: {r.windows_released} window(s) released, {format_bytes(r.bytes)}")
        for fail in last.failures:
            win = f" window G{fail.window + 1}" if fail.window is not None else ""
            console.print(f"  [red]failed[/] rank {fail.rank}{win}: {fail.reason}")
    console.print(f"next: [bold]{d.next}[/]")
