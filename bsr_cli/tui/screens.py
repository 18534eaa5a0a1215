"""`bsr top`'s modal screens: help, confirmation, fault injection, the event log and a chooser."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from bsr_cli.core.faults import FaultRequest
from bsr_cli.tui import model

FAULT_KINDS = {
    "restore-fault": "the install (H2D copy) of a window fails on the target rank",
    "timeout": "the window's fetch misses its deadline",
    "corrupt": "a staged object arrives with a flipped byte (its checksum catches it)",
    "remote-unavailable": "Mooncake answers nothing: every fetch from it fails",
    "remote-and-ssd-absent": "Mooncake and the filesystem tier both fail: only recompute is left",
}


# At most 76 columns and 20 lines: the whole help fits an 80x24 terminal (and scrolls, should a line wrap).
HELP = """\
[b]bsr top[/b]: restore-pool occupancy per rank, live or replayed

 [b]p[/b] [b]space[/b]   pause the display (a live session keeps polling and recording)
 [b]r[/b] / [b]k[/b]     cycle the rank / event-kind filter (the rank's gauge is marked)
 [b]↓ j[/b] [b]↑[/b]     scroll the events back / forward  [b]PgDn PgUp[/b] a page  [b]Home[/b] newest
 [b]e[/b] [b]enter[/b]   the event log in full: [b]/[/b] filter, [b]s[/b] sort, [b]enter[/b] details
 [b]f[/b]         inject a fault: kind, rank, window, count, group (asks first;
           only on engines started with faults enabled)
 [b]c[/b]         clear every injected fault (asks first)
 [b]a[/b]         abort a restore in flight (asks first; it fails closed)
 [b]← →[/b]       replay: one frame back / forward ([b]shift[/b]: ten)
 [b]+ -[/b]       replay: faster / slower     [b]n[/b]  replay: the next failure
 [b]?[/b]         this help                   [b]q[/b]  quit

Gauge: [b]█[/b] live  [b]▓[/b] high water since the last snapshot  [b]│[/b] RWS(W)  [b]┆[/b] budget B
       [b]░[/b] admissible  [b]·[/b] beyond B; below it, the high water per snapshot.
Status bar: the shown snapshot's age and the last poll's latency.

[dim]any key closes this[/dim]"""


class HelpScreen(ModalScreen[None]):
    """A page of help over the app; any key or click closes it. ``text`` is the page (rich markup): `bsr top`'s
    unless the app passes its own (the fleet view does)."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: auto; max-width: 100%; height: auto; max-height: 100%;
                                  border: round $accent; background: $surface; }
    HelpScreen Static { width: auto; padding: 0 1; }
    """

    def __init__(self, text: str = HELP) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self.text)

    def on_key(self) -> None:
        self.dismiss(None)

    def on_click(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; only an explicit yes returns True."""

    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 64; max-width: 100%; height: auto; border: thick $error; padding: 0 1;
                               background: $surface; }
    ConfirmScreen Horizontal { height: auto; align-horizontal: right; }
    ConfirmScreen Button { margin-left: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            with Horizontal():
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class FaultScreen(ModalScreen[FaultRequest | None]):
    """Pick a fault kind and a rank, and confirm: the choice is shown in full before anything is sent."""

    DEFAULT_CSS = """
    FaultScreen { align: center middle; }
    FaultScreen > Vertical { width: 100; max-width: 100%; height: auto; border: thick $error; padding: 0 1;
                             background: $surface; }
    FaultScreen Horizontal#pick { height: auto; }
    FaultScreen OptionList { height: auto; max-height: 8; }
    FaultScreen #kinds { width: 2fr; }
    FaultScreen #ranks { width: 1fr; }
    FaultScreen Horizontal#where { height: auto; }
    FaultScreen Horizontal#where > Vertical { width: 1fr; height: auto; }
    FaultScreen Horizontal#where Label { width: 1fr; color: $text-muted; }
    FaultScreen Input { width: 1fr; }
    FaultScreen Horizontal#buttons { height: auto; align-horizontal: right; }
    FaultScreen Button { margin-left: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "inject", "inject"),
        Binding("n,escape", "cancel", "cancel"),
    ]

    def __init__(self, engine: str, ranks: int, groups: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.engine = engine
        self.ranks = ranks
        self.groups = groups

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"[b]Inject a fault into {self.engine}[/b]: the next restore breaks on purpose (once).")
            with Horizontal(id="pick"):
                yield OptionList(*(Option(f"{k}: {d}", id=k) for k, d in FAULT_KINDS.items()), id="kinds")
                yield OptionList(
                    Option("every rank", id="all"),
                    *(Option(f"rank {r}", id=str(r)) for r in range(self.ranks)),
                    id="ranks",
                )
            # Each field says what it takes in a label above it (wrapping as the dialog narrows); the placeholder
            # is only the default, short enough for the narrowest box.
            with Horizontal(id="where"):
                with Vertical():
                    yield Label("window (1-based; blank = first)")
                    yield Input(placeholder="first", id="window", type="integer")
                with Vertical():
                    yield Label("count (0 = until cleared)")
                    yield Input(placeholder="1", id="count", type="integer")
                with Vertical():
                    groups = f" ({', '.join(self.groups)})" if self.groups else ""
                    yield Label(f"group{groups}")
                    yield Input(placeholder="all", id="group")
            yield Label("", id="summary")
            with Horizontal(id="buttons"):
                yield Button("Inject (y)", variant="error", id="inject")
                yield Button("Cancel (n)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#kinds", OptionList).highlighted = 0
        self.query_one("#ranks", OptionList).highlighted = 0
        self._show()

    def spec(self) -> FaultRequest:
        """The fault as the operator chose it (window 0-based); ValueError names a field that does not parse."""
        kinds, ranks = self.query_one("#kinds", OptionList), self.query_one("#ranks", OptionList)
        kind = kinds.get_option_at_index(kinds.highlighted or 0).id or "restore-fault"
        rank = ranks.get_option_at_index(ranks.highlighted or 0).id
        window = self.query_one("#window", Input).value.strip()
        if window and (not window.isdigit() or int(window) < 1):
            raise ValueError("window must be a number from 1")
        count = self.query_one("#count", Input).value.strip()
        if count and not count.isdigit():
            raise ValueError("count must be 0 (until cleared) or more")
        group = self.query_one("#group", Input).value.strip()
        if group and self.groups and group not in self.groups:
            raise ValueError(f"group must be one of {', '.join(self.groups)}")
        return FaultRequest(
            kind,
            rank=None if rank in (None, "all") else int(rank),
            window=int(window) - 1 if window else None,
            group=group or None,
            count=int(count) if count else 1,
        )

    def _show(self) -> None:
        summary = self.query_one("#summary", Label)
        try:
            f = self.spec()
        except ValueError as e:
            summary.update(f"[b red]✖ {e}[/]")
            return
        where = f"rank {f.rank}" if f.rank is not None else "every rank"
        win = f"window {f.window + 1}" if f.window is not None else "the first window"
        grp = f", group {f.group}" if f.group is not None else ""
        times = "until cleared" if f.count == 0 else ("once" if f.count == 1 else f"{f.count} restores")
        summary.update(f"→ [b red]{f.kind}[/] on [b]{where}[/], {win}{grp}, {times}")

    @on(OptionList.OptionHighlighted)
    @on(Input.Changed)
    def _changed(self) -> None:
        self._show()

    @on(Button.Pressed, "#inject")
    def action_inject(self) -> None:
        try:
            self.dismiss(self.spec())
        except ValueError:
            self._show()  # the summary says which field is wrong; nothing is sent

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class EventLogScreen(ModalScreen[None]):
    """The event log in full: every line whole and scrollable, a `/` filter, `s` to flip the order, Enter for one
    event's details."""

    DEFAULT_CSS = """
    EventLogScreen { align: center middle; }
    EventLogScreen > Vertical { width: 100%; height: 100%; border: round $accent; background: $surface; }
    EventLogScreen Input { display: none; }
    EventLogScreen Input.-shown { display: block; }
    EventLogScreen OptionList { height: 1fr; }
    EventLogScreen #detail { height: auto; max-height: 8; border-top: solid $primary-darken-1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "close"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
    ]

    def __init__(self, events: list[model.Event], title: str) -> None:
        super().__init__()
        self.events = events
        self.title_text = title
        self.newest_first = True
        self.needle = ""

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("", id="title")
            yield Input(placeholder="filter (substring, Enter to apply, Esc to close)", id="filter")
            yield OptionList(id="lines")
            yield Static(Text("Enter: details of the highlighted event", "dim"), id="detail")

    def on_mount(self) -> None:
        self._fill()
        self.query_one("#lines", OptionList).focus()

    def shown(self) -> list[model.Event]:
        needle = self.needle.lower()
        evs = [e for e in self.events if not needle or needle in _event_line(e).lower()]
        return list(reversed(evs)) if self.newest_first else evs

    def _fill(self) -> None:
        lines = self.query_one("#lines", OptionList)
        lines.clear_options()
        evs = self.shown()
        lines.add_options([Option(Text(_event_line(e)), id=str(i)) for i, e in enumerate(evs)])
        if evs:
            lines.highlighted = 0
        order = "newest first" if self.newest_first else "oldest first"
        flt = f" · filter “{self.needle}”" if self.needle else ""
        self.query_one("#title", Label).update(
            f"[b]{self.title_text}[/b] · {len(evs)} of {len(self.events)} events · {order}{flt}"
            " · [dim]/ filter · s sort · enter details · esc close[/dim]"
        )

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("-shown")
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.needle = event.value.strip()
        self._fill()

    @on(Input.Submitted, "#filter")
    def _filter_done(self) -> None:
        self.query_one("#lines", OptionList).focus()

    def action_sort(self) -> None:
        self.newest_first = not self.newest_first
        self._fill()

    @on(OptionList.OptionSelected, "#lines")
    def _details(self, event: OptionList.OptionSelected) -> None:
        e = self.shown()[int(event.option.id or 0)]
        ranks = ", ".join(map(str, e.ranks)) or "—"
        self.query_one("#detail", Static).update(
            Text(
                f"seq {e.seq} · {model.clock(e.time)} · {e.type} ({e.category}) · ranks {ranks}"
                f" · request {e.request or '—'}\n{e.text}"
            )
        )

    def action_close(self) -> None:
        if self.query_one("#filter", Input).has_focus:
            self.query_one("#lines", OptionList).focus()
            return
        self.dismiss(None)


def _event_line(e: model.Event) -> str:
    ranks = f" r{','.join(map(str, e.ranks))}" if e.ranks else ""
    return f"{e.seq:>6} {model.clock(e.time)}{ranks} {e.text}"


class ChooseScreen(ModalScreen[str | None]):
    """Pick one item (e.g. the restore to abort); Esc picks nothing."""

    DEFAULT_CSS = """
    ChooseScreen { align: center middle; }
    ChooseScreen > Vertical { width: 80; max-width: 100%; height: auto; border: thick $error; padding: 0 1;
                              background: $surface; }
    ChooseScreen OptionList { height: auto; max-height: 12; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "cancel"),
        # A `y` typed ahead (expecting the confirmation that follows) must not vanish without a word.
        Binding("y,n", "hint", "hint", show=False),
    ]

    def __init__(self, question: str, choices: list[tuple[str, str]]) -> None:
        super().__init__()
        self.question = question
        self.choices = choices  # (id, label)

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question)
            yield OptionList(*(Option(label, id=cid) for cid, label in self.choices), id="choices")

    def on_mount(self) -> None:
        self.query_one("#choices", OptionList).focus()

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_hint(self) -> None:
        self.notify("first pick one with ↑/↓ and Enter (Esc cancels); the confirmation comes next", timeout=5)
