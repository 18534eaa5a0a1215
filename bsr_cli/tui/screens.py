"""`bsr top`'s modal screens: help, confirmation, fault injection, the paged event log, a restore's whole "why"
and a chooser."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from bsr_cli.core import events as ev
from bsr_cli.core.faults import FaultRequest
from bsr_cli.errors import BsrError
from bsr_cli.tui import model, panels

FAULT_KINDS = {
    "restore-fault": "the install (H2D copy) of a window fails on the target rank",
    "timeout": "the window's fetch misses its deadline",
    "corrupt": "a staged object arrives with a flipped byte (its checksum catches it)",
    "remote-unavailable": "Mooncake answers nothing: every fetch from it fails",
    "remote-and-ssd-absent": "Mooncake and the filesystem tier both fail: only recompute is left",
}


# At most 76 columns and 22 lines: the whole help fits an 80x24 terminal (and scrolls, should a line wrap).
HELP = """\
[b]bsr top[/b]: restore-pool occupancy per rank, live or replayed

 [b]tab[/b] [b]⇧tab[/b]  next / previous pane; it scrolls with ↑ ↓ PgUp PgDn Home End
 [b]↓ j[/b] [b]↑[/b]     events: older / newer, [b]Home[/b] newest, [b]End[/b] oldest, [b]enter[/b] full log
 [b]enter[/b] [b]d[/b]   recent restores: the highlighted one's whole "why" ([b]esc[/b] back)
 [b]o[/b]         recent restores: only those that failed closed / all ([b]ctrl+z[/b] too)
 [b]e[/b]         the event log, paged from the engine's store or the recording:
           [b]/[/b] filter, [b]s[/b] sort, [b]m[/b] an older page, [b]enter[/b] details
 [b]p[/b] [b]space[/b]   pause the display (a live session keeps polling and recording)
 [b]r[/b] / [b]k[/b]     cycle the rank / event-kind filter (the rank's gauge is marked)
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


# Reads one page of an event log: ``before`` is the cursor a previous page gave (None: the newest page).
PageReader = Callable[[int | None], model.LogPage]
# How near the oldest loaded event the cursor comes before the next older page is read.
PREFETCH_ROWS = 10


class EventLogScreen(ModalScreen[None]):
    """The event log in full, paged through whatever holds it (the engine's durable store, or a recording): the
    newest page first, older pages read as the cursor nears the oldest loaded event (or with `m`); every line
    whole and scrollable, a `/` filter over what is loaded, `s` to flip the order, Enter for one event's details.
    The title says how many events the engine holds, how many are loaded and where the cursor is."""

    DEFAULT_CSS = """
    EventLogScreen { align: center middle; }
    EventLogScreen > Vertical { width: 100%; height: 100%; border: round $accent; background: $surface; }
    EventLogScreen #title { width: 100%; }
    EventLogScreen Input { display: none; }
    EventLogScreen Input.-shown { display: block; }
    EventLogScreen OptionList { height: 1fr; }
    EventLogScreen #detail { height: auto; max-height: 8; border-top: solid $primary-darken-1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "close"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
        Binding("m", "older", "older page"),
    ]

    def __init__(self, read_page: PageReader, title: str, *, rank: int | None = None, in_thread: bool = True) -> None:
        super().__init__()
        self.read_page = read_page
        self.title_text = title
        self.rank = rank  # the rank filter, applied to what is read (the engine filters by kind, not by rank)
        self.in_thread = in_thread  # a live engine is read off the UI thread; a recording is in memory
        self.events: list[model.Event] = []  # every event read so far, oldest first
        self._listed: list[model.Event] = []  # those the filter lets through, in the order shown
        self.older: int | None = None  # the cursor of the next older page (None: the oldest is loaded)
        self.held: int | None = None
        self.oldest_seq: int | None = None
        self.pages = 0
        self.grew = True  # the last page added rows to the list: reading on as the cursor nears the end may help
        self.reading = False
        self.note = ""
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
        self._read(None)

    # -- reading pages ----------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Every event the source holds (that the kind filter lets through) is loaded."""
        return self.pages > 0 and self.older is None

    def action_older(self) -> None:
        if not self.reading and not self.complete:
            self._read(self.older)

    def _read(self, before: int | None) -> None:
        self.reading = True
        self._title()
        if self.in_thread:
            self._read_worker(before)
        else:
            self._page_read(self._try_read(before))

    @work(thread=True, exclusive=True, exit_on_error=False, group="log-page")
    def _read_worker(self, before: int | None) -> None:
        page = self._try_read(before)
        self.app.call_from_thread(self._page_read, page)

    def _try_read(self, before: int | None) -> model.LogPage | str:
        try:
            return self.read_page(before)
        except BsrError as e:
            return e.message
        except Exception as e:  # noqa: BLE001 - the log stays open with what it has, and says why no more came
            return f"{type(e).__name__}: {e}"

    def _page_read(self, page: model.LogPage | str) -> None:
        self.reading = False
        if not self.is_attached:
            return
        if isinstance(page, str):
            self.note = f"could not read more: {page}"
            self._title()
            return
        self.pages += 1
        self.older, self.held, self.oldest_seq, self.note = page.older, page.held, page.oldest_seq, page.note
        mine = [e for e in page.events if self.rank is None or self.rank in e.ranks]
        shown = len(self.shown())
        self.events = mine + self.events
        self._fill()
        # A page the filters left empty does not read the next by itself (a rank with no events would read the
        # whole store): `m` reads on.
        self.grew = len(self.shown()) > shown

    # -- the list ---------------------------------------------------------------------------------------------------
    def shown(self) -> list[model.Event]:
        """The events listed, in the order shown (as of the last `_fill`)."""
        return self._listed

    def _select(self) -> list[model.Event]:
        needle = self.needle.lower()
        evs = [e for e in self.events if not needle or needle in _event_line(e).lower()]
        return list(reversed(evs)) if self.newest_first else evs

    def _fill(self) -> None:
        """(Re)build the list, the cursor kept on the event it was on."""
        lines = self.query_one("#lines", OptionList)
        before = self.current()
        evs = self._listed = self._select()
        lines.clear_options()
        lines.add_options([Option(Text(_event_line(e)), id=str(i)) for i, e in enumerate(evs)])
        if evs:
            at = next((i for i, e in enumerate(evs) if e is before), 0)
            lines.highlighted = at
        self._title()

    def current(self) -> model.Event | None:
        """The event under the cursor."""
        lines = self.query_one("#lines", OptionList)
        evs = self.shown()
        i = lines.highlighted
        return evs[i] if i is not None and 0 <= i < len(evs) else None

    def _title(self) -> None:
        self.query_one("#title", Label).update(self.title_line())

    def title_line(self) -> Text:
        evs = self.shown()
        t = Text()
        t.append(self.title_text, "bold")
        held = f"{self.held:,}" if self.held is not None else "an unknown number of"
        t.append(f" · {len(self.events):,} loaded of {held} events held")
        if self.events:
            t.append(f" (seq {self.events[0].seq:,}–{self.events[-1].seq:,})")
        at = self.current()
        if at is not None:
            t.append(f" · at seq {at.seq:,}", "bold")
        if self.needle:
            t.append(f" · {len(evs):,} match “{self.needle}”")
        t.append(f" · {'newest' if self.newest_first else 'oldest'} first")
        if self.reading:
            t.append(" · reading older events…", "italic")
        elif self.complete:
            t.append(" · oldest loaded", "dim")
        if self.note:
            t.append(f" · {self.note}", "yellow")
        t.append("  / filter · s sort · m older · enter details · esc close", "dim")
        return t

    @on(OptionList.OptionHighlighted, "#lines")
    def _moved(self) -> None:
        """Near the oldest loaded event, read the page before it."""
        lines = self.query_one("#lines", OptionList)
        i, n = lines.highlighted, lines.option_count
        if i is not None:
            left = (n - 1 - i) if self.newest_first else i  # rows between the cursor and the oldest loaded
            if left < PREFETCH_ROWS and self.grew:
                self.action_older()
        self._title()

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


# Reads how a restore ended (its failures), from wherever the events are: None when they are not held any more.
EndingReader = Callable[[str], ev.RestoreEnded | None]


class WhyScreen(ModalScreen[None]):
    """One finished restore's whole "why": its outcome, the failure's kind, stage, tier, rank and window, and the
    full reason of each failure, none of it cut; it scrolls when it is longer than the terminal. The failures are
    read from the restore's end event (from the engine's store, or the recording); Esc (or q) goes back."""

    DEFAULT_CSS = """
    WhyScreen { align: center middle; }
    WhyScreen > VerticalScroll { width: 100; max-width: 100%; height: auto; max-height: 100%;
                                 border: round $error; background: $surface; }
    WhyScreen Static { padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "back")]

    def __init__(self, outcome: model.Outcome, now: float, read_ending: EndingReader, *, in_thread: bool = True):
        super().__init__()
        self.outcome = outcome
        self.now = now
        self.read_ending = read_ending
        self.in_thread = in_thread
        self.ending: ev.RestoreEnded | None = None
        self.lookup = "reading its end event…"

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self._body(), id="why")

    def on_mount(self) -> None:
        box = self.query_one(VerticalScroll)
        box.border_title = f"Why {self.outcome.request} {self.outcome.outcome.replace('_', ' ')}"
        box.border_subtitle = "esc back · ↑ ↓ scroll"
        box.focus()
        if self.in_thread:
            self._read_worker()
        else:
            self._read_done(self._try_read())

    def _body(self) -> RenderableType:
        return panels.why(self.outcome, self.now, self.ending, self.lookup)

    @work(thread=True, exclusive=True, exit_on_error=False, group="why")
    def _read_worker(self) -> None:
        got = self._try_read()
        self.app.call_from_thread(self._read_done, got)

    def _try_read(self) -> ev.RestoreEnded | str | None:
        try:
            return self.read_ending(self.outcome.request)
        except BsrError as e:
            return e.message
        except Exception as e:  # noqa: BLE001 - the screen still shows what the snapshot said, and why no more
            return f"{type(e).__name__}: {e}"

    def _read_done(self, got: ev.RestoreEnded | str | None) -> None:
        if isinstance(got, str):
            self.lookup = f"its end event could not be read: {got}"
        elif got is None:
            self.lookup = "its end event is not held any more: the reason above is what the engine kept"
        else:
            self.ending, self.lookup = got, ""
        if self.is_attached:
            self.query_one("#why", Static).update(self._body())

    def action_close(self) -> None:
        self.dismiss(None)


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
