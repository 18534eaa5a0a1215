"""The rich renderers of the top view (`bsr_cli.tui.model.View`): the panels the Textual app lays out, and
`render_text`, the whole view at once for `bsr pool --once` and pipes. Colours come from the one palette
(`bsr_cli.tui.palette`), byte counts from the one formatter (`bsr_cli.core.units.format_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from bsr_cli.core import events as ev
from bsr_cli.core.evidence import FailureKind, window_label
from bsr_cli.core.units import format_bytes
from bsr_cli.core.when import ago
from bsr_cli.tui.model import SPARK, Outcome, RankGauge, View, clock
from bsr_cli.tui.palette import CATEGORY_STYLE, OUTCOME_STYLE, STATE_STYLE, tier_look

# -- formatting ---------------------------------------------------------------------------------------------------


class Bar:
    """A pool gauge as wide as it is given: live bytes against capacity, with the RWS(W) bound and budget B marked.

    █ live now   ▓ high water since the previous snapshot   │ RWS(W)   ┆ B (when it differs)   ░ admissible   · beyond B
    """

    def __init__(self, g: RankGauge) -> None:
        self.g = g

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(options.max_width)

    def text(self, width: int) -> Text:
        g = self.g
        cap = g.capacity_bytes or max(g.budget_bytes, g.high_water_bytes, 1)

        def cells(n: float) -> int:
            return max(0, min(width, round(n / cap * width)))

        live, hw = cells(g.live_bytes), cells(g.high_water_bytes)
        if g.live_bytes and not live:
            live = 1  # a non-empty pool never looks empty
        if g.high_water_bytes and not hw:
            hw = 1
        budget = cells(g.budget_bytes) if g.budget_bytes else width
        rws = cells(g.rws_bytes) if g.rws_bytes else None
        style = STATE_STYLE[g.state] if g.state != "ok" else "green"
        out = Text()
        for i in range(width):
            if rws is not None and i == min(rws, width - 1):
                out.append("┃" if i < hw else "│", f"bold {style}" if i < hw else "bold")
            elif i == min(budget, width - 1) and budget != rws and budget < width:
                out.append("┆", "yellow")
            elif i < live:
                out.append("█", style)
            elif i < hw:
                out.append("▓", style)
            elif i < budget:
                out.append("░", "dim")
            else:
                out.append("·", "dim")
        return out


class Spark:
    """A sparkline of the newest values that fit, scaled to ``top`` (a fixed scale keeps the bound meaningful)."""

    def __init__(self, values: Sequence[float], top: float | None = None, style: str = "cyan") -> None:
        self.values, self.top, self.style = values, top, style

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(4, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(options.max_width)

    def text(self, width: int) -> Text:
        vals = list(self.values)[-width:]
        top = self.top or max(vals, default=0) or 1
        out = Text(" " * (width - len(vals)))
        for v in vals:
            if v <= 0:
                out.append(SPARK[0], "dim")
            else:
                level = min(len(SPARK) - 1, max(1, math.ceil(v / top * (len(SPARK) - 1))))
                out.append(SPARK[level], self.style)
        return out


# -- panels (shared by the app and render_text) -------------------------------------------------------------------
def header(view: View, width: int | None = None) -> Text:
    """The engine's key facts. Given a ``width``, they wrap fact by fact onto as many lines as they need (a fact
    is never cut, unless one alone is wider than the line), and under 100 columns the "bsr top" label gives way."""
    i = view.info
    facts: list[tuple[str, Text]] = []  # (what goes before it on its line, the fact)
    if width is None or width >= 100:
        facts.append(("", Text("bsr top", "bold")))
    if view.faults:  # first, so no terminal is too narrow to show it
        n = len(view.faults)
        facts.append((" ", Text(f" ⚠ {n} INJECTED FAULT{'S' if n > 1 else ''} ", "bold reverse red")))
    faults = Text("faults ")
    faults.append("on" if i.faults_enabled else "off", "yellow" if i.faults_enabled else "dim")
    engine = [Text(f"{i.name} {i.version}"), Text(i.model), Text(f"{i.ranks} ranks"), Text(f"W={i.w}"), faults]
    engine.append(Text(f"tiers {','.join(i.tiers) or '—'}"))
    facts += [("  " if n == 0 else " · ", fact) for n, fact in enumerate(engine)]
    out = Text(no_wrap=True, overflow="ellipsis")
    used = 0  # cells on the current line
    for sep, fact in facts:
        if not used:
            sep = ""
        elif width is not None and used + len(sep) + fact.cell_len > width:
            out.append("\n")
            used, sep = 0, ""
        out.append(sep)
        out.append_text(fact)
        used += len(sep) + fact.cell_len
    return out


def gauges_title(view: View) -> str:
    i = view.info
    return (
        f"Restore pool per rank · RWS(W={i.w}) {fb(i.rws_bytes)} · B {fb(i.budget_bytes)} · capacity {fb(i.pool_bytes)}"
    )


def gauges(view: View, rank: int | None = None, dense: bool = False) -> RenderableType:
    """Two lines per rank (gauge, then high-water history), or one when ``dense`` (many ranks, little room)."""
    if not view.gauges:
        return Text("no ranks reported", "dim")
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=4, no_wrap=True)
    grid.add_column(ratio=2 if dense else 1, no_wrap=True)
    if dense:
        grid.add_column(ratio=1, no_wrap=True)
    grid.add_column(width=30, no_wrap=True)
    for g in view.gauges:
        label = Text(f"{'▶' if rank == g.rank else ' '}r{g.rank}", "bold" if rank == g.rank else "")
        spark = Spark(g.history, g.capacity_bytes or None)
        if not g.alive:
            down = Text(f"✖ DOWN {g.error}".rstrip(), "bold red")
            grid.add_row(label, down, *([spark] if dense else []), Text(""))
            if not dense:
                grid.add_row(Text(" hw", "dim"), spark, Text(""))
            continue
        stats = Text()
        stats.append(fb(g.live_bytes), STATE_STYLE[g.state] if g.state != "ok" else "bold")
        stats.append(f" live · peak {fb(g.peak_bytes)}")
        if g.l1_live_bytes is not None:
            stats.append(f" · L1 {fb(g.l1_live_bytes)}", "dim")
        if g.state == "draining":
            stats.append(" · draining to B", STATE_STYLE["draining"])
        if g.state == "over-budget":
            stats = Text(f"{fb(g.high_water_bytes)} OVER B!", "bold reverse red")
        rate = Text(f"{g.windows_live} win · {g.waiters} wait · {fb(g.restore_bps)}/s", "dim")
        if dense:
            grid.add_row(label, Bar(g), spark, stats)
        else:
            grid.add_row(label, Bar(g), stats)
            grid.add_row(Text(" hw", "dim"), spark, rate)
    return grid


def active_title(view: View) -> str:
    return f"Active restores ({len(view.active)})"


def active(view: View, width: int | None = None) -> RenderableType:
    """In-flight restores; columns drop right to left as ``width`` shrinks (None: every column)."""
    if not view.active:
        return Text("no restore in flight", "dim")
    per_rank = width is None or width >= 45
    full = width is None or width >= 64
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, header_style="bold")
    t.add_column("request", no_wrap=True)
    t.add_column("progress", no_wrap=True)
    if per_rank:
        t.add_column("done per rank", no_wrap=True, overflow="ellipsis")
    if full:
        t.add_column("tok", justify="right", no_wrap=True)
        t.add_column("tiers", no_wrap=True, overflow="ellipsis")
    t.add_column("age", justify="right", no_wrap=True)
    for a in view.active:
        short = f"{a.current_window}/{a.windows}"
        if a.failed:
            state = Text(f"✖ r{','.join(map(str, a.failed))} failed · {short}", "bold red")
        elif a.stalled:
            state = Text(f"STALLED r{','.join(map(str, a.stalled))} · {short}", "bold yellow")
        else:
            state = Text(a.progress_text, "bold cyan")
        cells: list[RenderableType] = [a.request, state]
        if per_rank:
            per = Text()
            for i, (r, d) in enumerate(a.done):
                style = "bold red" if r in a.failed else "bold yellow" if r in a.stalled else ""
                per.append(("" if i == 0 else " ") + f"r{r}:{d}" + ("✖" if r in a.failed else ""), style)
            cells.append(per)
        if full:
            cells += [f"{a.tokens:,}", ",".join(a.tiers)]
        cells.append(f"{a.elapsed_s:.1f}s")
        t.add_row(*cells)
    return t


def recent_title(view: View, compact: bool = False, failed_only: bool = False) -> str:
    failed = sum(1 for o in view.recent if o.failed)
    if failed_only:
        return f"Recent · failed only ({failed} of {len(view.recent)})"
    if compact:
        return f"Recent ({len(view.recent)}, {failed} failed)"
    return f"Recent outcomes ({len(view.recent)}, {failed} failed closed)"


def recent_keys(failed_only: bool = False, compact: bool = False) -> str:
    """The Recent pane's keys, written on its bottom border: Enter opens a restore's whole "why"."""
    show = "o all" if failed_only else ("o failed" if compact else "o failed only")
    return f"⏎ why · {show}"


def recent_shown(view: View, failed_only: bool = False) -> tuple[Outcome, ...]:
    """The recent outcomes the pane lists, newest first (only those that failed closed, when asked)."""
    return tuple(o for o in view.recent if o.failed) if failed_only else view.recent


def recent_head(view: View) -> Text:
    """The column names above `recent_row`'s full rows."""
    w = _request_width(view)
    return Text(f"{'request':<{w}} {'outcome':<13} {'tok':>8} {'secs':>6} {'ago':>4} why", "bold")


def recent_row(view: View, o: Outcome, compact: bool = False) -> Text:
    """One finished restore in the Recent pane: one line under the column names, or (compact, a narrow pane) two,
    the second its reason, so the "why" keeps a whole line. A line wider than the pane ends in "…" there; Enter
    shows it whole."""
    outcome = Text(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))
    ago_ = ago(view.time - o.finished)
    row = Text()
    if compact:
        row.append(f"{o.request} ")
        row.append_text(outcome)
        row.append(f" {ago_} ago")
        if o.reason:
            row.append(f"\n  {o.reason}")
        return row
    row.append(f"{o.request:<{_request_width(view)}} ")
    outcome.pad_right(13 - outcome.cell_len)
    row.append_text(outcome)
    row.append(f" {o.tokens:>8,} {o.seconds:>6.2f} {ago_:>4} {o.reason}")
    return row


def _request_width(view: View) -> int:
    return max((len(o.request) for o in view.recent), default=7)


def recent(view: View, limit: int = 8, compact: bool = False) -> RenderableType:
    """Finished restores, newest first, as a table (`render_text`); the app lists them with `recent_row`."""
    if not view.recent:
        return Text("no restore finished yet", "dim")
    if compact:
        lines = Text(no_wrap=True, overflow="ellipsis")
        for i, o in enumerate(view.recent[: max(1, limit // 2)]):
            if i:
                lines.append("\n")
            lines.append(f"{o.request} ")
            lines.append(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))
            lines.append(f" {ago(view.time - o.finished)} ago")
            if o.reason:
                lines.append(f"\n  {o.reason}")
        return lines
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, header_style="bold")
    t.add_column("request", no_wrap=True)
    t.add_column("outcome", no_wrap=True)
    if not compact:
        t.add_column("tok", justify="right", no_wrap=True)
        t.add_column("secs", justify="right", no_wrap=True)
    t.add_column("ago", justify="right", no_wrap=True)
    t.add_column("why", no_wrap=True, overflow="ellipsis", ratio=1)
    for o in view.recent[: max(1, limit - 1)]:  # one row goes to the header
        cells: list[RenderableType] = [o.request, Text(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))]
        if not compact:
            cells += [f"{o.tokens:,}", f"{o.seconds:.2f}"]
        cells += [ago(view.time - o.finished), o.reason]
        t.add_row(*cells)
    return t


def health_title(view: View, compact: bool = False) -> str:
    return "Health" if compact else "Admission · tiers · markers · faults"


def health(view: View, compact: bool = False) -> RenderableType:
    a = view.admission
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=7 if compact else 9, no_wrap=True, style="bold")
    grid.add_column(ratio=1, overflow="fold")
    if compact:
        admit = f"{fb(a.live_bytes)} / {fb(a.budget_total)} · {a.queued} queued"
    else:
        per_rank = f"(B {fb(a.budget_bytes)} × {a.ranks})"
        admit = f"{fb(a.live_bytes)} live of {fb(a.budget_total)} {per_rank} · {a.queued} queued"
    grid.add_row("admit" if compact else "admission", Text(admit, "yellow" if a.queued else ""))
    if a.waiting_for_blocks:  # queued before the budget: no destination KV blocks are free for them yet
        n = a.waiting_for_blocks
        waiting = f"{n} request{'s' if n != 1 else ''} waiting{'' if compact else ' for destination KV blocks'}"
        grid.add_row("blocks", Text(waiting, "yellow"))
    tiers = Text()
    if not view.tiers:
        tiers.append("not reported", "dim")
    for i, th in enumerate(view.tiers):
        if i:
            tiers.append("  ")
        if th.ok:  # the dot says healthy, the name wears the tier's colour (the one palette the CLI uses too)
            tiers.append("● ", "green")
            tiers.append(th.name, tier_look(th.name)[1])
        else:
            tiers.append(f"✖ {th.name} DOWN", "bold red")
        if th.detail:
            tiers.append(f" ({'; '.join(th.detail)})", "red")
    grid.add_row("tiers", tiers)
    if view.recent:
        o = view.recent[0]
        last = Text(f"{o.request} ")
        last.append(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))
        last.append(f" {ago(view.time - o.finished)}{'' if compact else ' ago'}")
        grid.add_row("last", last)
    if not view.markers:
        grid.add_row("markers", Text("none", "dim"))
    for m in view.markers:
        # A marker that excludes no tier (a rank failed at install) makes the next admission recompute locally.
        excl = f"exclude {','.join(m.excluded)}" if m.excluded else "recompute locally"
        text = f"{m.prompt[:8]} {excl}"
        if not compact:
            text = f"{m.prompt[:12]} {excl} · {m.request}: {m.reason}"
        grid.add_row("marker", Text(text, "magenta"))
    if not view.faults:
        grid.add_row("faults", Text("none injected", "dim"))
    for f in view.faults:
        line = Text()
        line.append("INJECTED" if compact else " INJECTED ", "bold reverse red")
        line.append(f" {f.short() if compact else f.describe()}", "red")
        grid.add_row("fault", line)
    return grid


def events_title(view: View, rank: int | None = None, kind: str = "all", back: int = 0, compact: bool = False) -> str:
    who = "all ranks" if rank is None else f"rank {rank}"
    if compact and back:  # a narrow pane: the scroll position must still show
        who = "all" if rank is None else f"r{rank}"
    missed = f" · {view.events_missed} not seen (poll faster)" if view.events_missed else ""
    scrolled = (f" · ↑{back} newer" if compact else f" · {back} newer above (Home)") if back else ""
    return f"Events · {who} · {kind}{scrolled}{missed}"


def events(
    view: View, rank: int | None = None, kind: str = "all", limit: int = 200, compact: bool = False, back: int = 0
) -> RenderableType:
    """The newest ``limit`` events that match, newest first; ``back`` skips that many of the newest (scrolled)."""
    matching = view.filtered_events(rank, kind)
    shown = matching[: max(0, len(matching) - back)][-limit:]
    if not shown:
        return Text("no events match" if view.events else "no events yet", "dim")
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, show_header=False)
    if not compact:
        t.add_column(no_wrap=True, style="dim")  # time
    t.add_column(no_wrap=True, width=2)  # rank
    t.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    for e in reversed(shown):  # newest first: what just happened is what an operator looks for
        who = ",".join(str(r) for r in e.ranks) if e.ranks else "·"
        cells: list[RenderableType] = [] if compact else [clock(e.time)]
        t.add_row(*cells, who, Text(e.text, CATEGORY_STYLE.get(e.category, "")))
    return t


def why(o: Outcome, now: float, ending: ev.RestoreEnded | None, lookup: str = "") -> RenderableType:
    """One finished restore's whole "why", nothing cut: how it ended, the deciding failure's kind and stage, the
    reason in full, then each failure its end event lists (rank, window, kind, stage, tier, reason). ``lookup``
    says why the failures are not (yet) shown."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=9, no_wrap=True, style="bold")
    grid.add_column(ratio=1, overflow="fold")
    outcome = Text(o.outcome.replace("_", " ").upper(), OUTCOME_STYLE.get(o.outcome, ""))
    if ending is not None:
        outcome.append(f" · {ending.committed_tokens:,} of {ending.advertised_tokens:,} tok committed", "")
    grid.add_row("request", Text(o.request))
    grid.add_row("outcome", outcome)
    if o.failure_kind:
        blame = Text(o.failure_kind)
        if o.failure_stage:
            blame.append(f" · at {o.failure_stage}")
        grid.add_row("failure", blame)
    grid.add_row("why", Text(o.reason or "no reason given (it did not fail)", "" if o.reason else "dim"))
    tiers = ",".join(o.tiers) or "—"
    grid.add_row("restore", Text(f"W={o.w} · tiers {tiers} · {o.tokens:,} tok · {o.seconds:.2f} s"))
    grid.add_row("ended", Text(f"{clock(o.finished)} ({ago(now - o.finished)} ago)"))
    failures = ending.failures if ending is not None else ()
    for n, f in enumerate(failures, start=1):
        grid.add_row("", Text(""))
        grid.add_row(f"failure {n}" if len(failures) > 1 else "failure", _failure(f))
    if lookup:
        grid.add_row("", Text(lookup, "italic dim"))
    grid.add_row("", Text(""))
    grid.add_row("next", Text(f"bsr explain {o.request}  (its windows per rank: bsr describe {o.request})", "dim"))
    return grid


def _failure(f: ev.Failure) -> Text:
    """One failure of a restore, every field it names: who is blamed, where, and the reason whole."""
    t = Text()
    faulty = f.kind in (FailureKind.TIER, FailureKind.RANK)  # a fault, not the operator's or capacity's refusal
    t.append(f"kind {f.kind.value}", "bold red" if faulty else "bold")
    if f.stage is not None:
        t.append(f" · stage {f.stage.value}")
    if f.tier:
        t.append(f" · tier {f.tier}")
    t.append(f" · rank {f.rank}" if f.rank is not None else " · before any rank answered")
    if f.window is not None:
        t.append(f" · window {window_label(f.window)}")
    t.append(f"\n{f.reason or 'no reason given'}")
    return t


def render_text(view: View, *, events_limit: int = 12) -> RenderableType:
    """The whole view once, for `bsr pool --once` and pipes: the same panels the app draws."""
    return Group(
        header(view),
        Panel(gauges(view), title=gauges_title(view), title_align="left"),
        Panel(active(view), title=active_title(view), title_align="left"),
        Panel(recent(view), title=recent_title(view), title_align="left"),
        Panel(health(view), title=health_title(view), title_align="left"),
        Panel(events(view, limit=events_limit), title=events_title(view), title_align="left"),
        Text(
            f"snapshot {clock(view.time)} · seq {view.seq} · poll {view.latency_s * 1e3:.0f} ms",
            "dim",
        ),
    )


def fb(n: float | None) -> str:
    """Bytes in a dense panel: the one formatter, compact (4.0 MiB, 512 KiB)."""
    return format_bytes(n, compact=True)
