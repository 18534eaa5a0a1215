"""`bsr top` over several engines: one row per engine, worst first, refreshed every interval, with why each is
not ok and the fleet's timeline (ranks restarted and why, engines gone and back) under it; Enter opens one
engine's view, `?` the help.

Every engine is polled concurrently in a thread worker, each bounded by its own deadline and read with its own
token (bsr_cli.fleet), and the next round is armed only when the previous one was drawn, so a slow or stopped
engine makes its own row say `down`, never the other rows stale or the screen blank. The fleet remembers each
engine between rounds (`fleet.Memory`): a down row says since when and how the engine went away. An engine's own
view reads the restores its durable history holds, so it still lists them after the engine restarted.

`--record FILE` writes every round (the fleet as `bsr status --json` prints it) as gzip JSON lines, and
`bsr top --replay FILE` plays it back here; an engine opened with Enter is polled live and not recorded.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import DataTable, Static

from bsr_cli import fleet
from bsr_cli.core import events as ev
from bsr_cli.core.events import known_event
from bsr_cli.core.evidence import EventKind
from bsr_cli.core.status import RecentRestore
from bsr_cli.core.units import format_bytes
from bsr_cli.errors import BsrError, InvalidInput
from bsr_cli.runtime.failures import describe
from bsr_cli.tui.palette import FLEET_STYLE
from bsr_cli.tui.screens import HelpScreen

FLEET_FORMAT = "bsr-fleet-recording"
FLEET_FORMAT_VERSION = 1

# "seen" before "why": the text of what is wrong is the one that may be cut at the right edge.
COLUMNS = ("engine", "state", "ranks", "pool (max rank) / B", "markers", "faults", "seen", "why")
TIMELINE_LINES = 5  # the newest of the fleet's timeline, under the table


def _cut(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class FleetPolled(Message):
    def __init__(self, result: fleet.FleetView, latency_s: float) -> None:
        super().__init__()
        self.result = result
        self.latency_s = latency_s


class EnginePolled(Message):
    def __init__(self, view: Any, error: BsrError | None) -> None:
        super().__init__()
        self.view = view
        self.error = error


# -- recording --------------------------------------------------------------------------------------------------
class FleetRecorder:
    """Every fleet round as one gzip JSON line after a header; flushed per line, so a killed terminal keeps it."""

    def __init__(self, path: Path, engines: int) -> None:
        try:
            self._fh = gzip.GzipFile(path, "wb")
        except OSError as e:
            raise InvalidInput(
                f"cannot record to {path}: {e.strerror or e}", hint="give --record a path in a directory you can write"
            ) from None
        self.path = path
        self.lines = 0
        header = {"format": FLEET_FORMAT, "version": FLEET_FORMAT_VERSION, "started": time.time(), "engines": engines}
        self._line(json.dumps(header, separators=(",", ":")))

    def write(self, result: fleet.FleetView, at: float) -> None:
        self._line(json.dumps({"t": at, "fleet": result.to_wire()}, separators=(",", ":"), default=str))

    def _line(self, text: str) -> None:
        self._fh.write(text.encode() + b"\n")
        self._fh.flush()
        self.lines += 1

    def close(self) -> None:
        self._fh.close()


def is_fleet_recording(path: Path) -> bool:
    """Whether ``path`` is a fleet recording (its first line says so); anything else is left to the one-engine
    replay, which reports what is wrong with it."""
    try:
        with gzip.GzipFile(path, "rb") as fh:
            head = json.loads(fh.readline() or b"{}")
    except (OSError, ValueError, EOFError):
        return False
    return isinstance(head, dict) and head.get("format") == FLEET_FORMAT


def read_fleet_recording(path: Path) -> list[tuple[float, fleet.FleetView]]:
    """The rounds of a fleet recording, oldest first; a truncated tail (a killed recorder) is dropped."""
    rounds: list[tuple[float, fleet.FleetView]] = []
    try:
        with gzip.GzipFile(path, "rb") as fh:
            fh.readline()
            for line in fh:
                try:
                    d = json.loads(line)
                except ValueError:
                    break
                rounds.append((float(d["t"]), fleet.FleetView.from_wire(d["fleet"])))
    except (OSError, EOFError, KeyError, TypeError, ValueError, AttributeError):
        pass  # a truncated gzip stream: keep what was read
    if not rounds:
        raise InvalidInput(
            f"{path}: a fleet recording with no round in it",
            hint="record one with `bsr top --engine A,B --record FILE`",
        )
    return rounds


# -- cells ------------------------------------------------------------------------------------------------------
def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "—"


def row_cells(e: fleet.EngineRow, now: float) -> tuple[Text, ...]:
    """One engine's cells: health, pool use, markers and the last failure; a down engine says since when and how
    it went away instead."""
    style = FLEET_STYLE.get(e.state, "")
    name = Text(e.engine, "bold")
    state = Text(e.state, style)
    if e.down:
        seen = Text(e.down_text or "down", "bold" if e.clean_stop is False else "")
        dash = Text("—", "dim")
        return (name, state, dash, dash, dash, dash, seen, Text(_cut(e.problems[0]), "red"))
    up, total = e.ranks_up, len(e.ranks)
    budget, live = e.budget_bytes, e.pool_live_bytes
    pct = f" ({100 * live / budget:.0f}%)" if budget else ""
    pool = f"{format_bytes(live, compact=True)} / {format_bytes(budget, compact=True)}{pct}"
    lf = e.last_failure
    why = Text(_cut("; ".join(e.problems)), "red" if e.severity >= fleet.DEGRADED else "yellow")
    if not e.problems:  # nothing wrong now: its last failure, if it had one
        why = Text("none", "dim") if not lf else Text(_cut(f"last failure {lf.request}: {lf.reason}"), "dim")
    seen = Text(_clock(e.last_seen))
    if e.restarts:
        seen.append(f" · restarted ×{e.restarts}", "yellow")
        if e.previous_stop:
            seen.append(f" (last stop: {e.previous_stop})", "yellow")
    elif e.came_back:
        seen.append(f" · back (it went: {e.came_back})", "yellow")
    return (
        name,
        state,
        Text(f"{up}/{total}", "" if up == total else "bold red"),
        Text(pool, "yellow" if budget and live >= budget else ""),
        Text(str(e.markers), "magenta" if e.markers else "dim"),
        Text(str(e.faults), "bold red" if e.faults else "dim"),
        seen,
        why,
    )


def timeline_text(result: fleet.FleetView, lines: int = TIMELINE_LINES) -> Text:
    """The fleet's newest incidents, one a line (when, which engine, what happened)."""
    out = Text(no_wrap=True, overflow="ellipsis")
    for n, i in enumerate(result.timeline[:lines]):
        bad = i.kind in (fleet.Happened.RANK_RESTARTED, fleet.Happened.RANK_UNRESPONSIVE, fleet.Happened.WENT_DOWN)
        out.append(("\n" if n else "") + f"{_clock(i.time)} ", "dim")
        out.append(f"{i.engine} ", "bold")
        out.append(i.text, "yellow" if bad else "")
    return out or Text("timeline: nothing happened lately", "dim")


# -- screens ----------------------------------------------------------------------------------------------------
FLEET_HELP = """\
[b]bsr top[/b] over a fleet: one row per engine, worst first

  [b]↑ / ↓[/b]  [b]j / k[/b]  move between engines      [b]enter[/b]  open the engine's own view (esc comes back)
  [b]p[/b] / [b]space[/b]        pause the display (polling and recording go on)
  [b]?[/b]                this help      [b]q[/b]  quit

state: down (no answer), unhealthy (a rank down or failing), degraded (a tier unhealthy or a pool at B),
       attention (markers, armed faults, a drill's failure, a rank restarted or a restore failed closed in
       the last 5 minutes), ok.
seen:  when the engine last answered. A down engine says since when, and how it went away:
       stopped cleanly (it said it was stopping, or its own record on this machine says so), went away without
       a clean stop (nothing listens and it never said so), stopped answering (hung), never seen up.
why:   what is wrong now (a rank's reason, a tier's), else its last failed restore.
Under the table: the fleet's timeline, newest first (ranks restarted and why, engines gone and back).

[dim]any key closes this[/dim]"""


class EngineScreen(Screen[None]):
    """One engine of the fleet, as `bsr pool` draws it (the same panels as the one-engine `bsr top`), polled live
    while it is open. Esc goes back to the fleet."""

    DEFAULT_CSS = """
    EngineScreen #engine-header { height: 1; background: $boost; padding: 0 1; }
    EngineScreen #engine-body { height: 1fr; }
    EngineScreen #engine-status { height: 1; background: $panel; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,backspace,h", "back", "back to the fleet"),
        Binding("question_mark", "app.help", "help"),
    ]

    def __init__(self, target: fleet.Target, *, interval: float, timeout_s: float) -> None:
        super().__init__()
        from bsr_cli.client import AdminClient
        from bsr_cli.tui.source import LiveSource

        self.target = target
        self.interval = interval
        # Read with the engine's own token, looked up again on every reconnect (a restarted engine has a new one).
        self.source = LiveSource(
            lambda: AdminClient(target.url, fleet.credential(target).token, timeout_s=timeout_s),
            timeout_s=timeout_s,
            label=target.name,
        )
        self.view: Any = None
        self.error: BsrError | None = None
        self.polls = 0
        self._timer: Timer | None = None
        self._widgets: tuple[Widget, ...] = ()  # the header, the view and the status line, once mounted
        # The restores the engine's history holds, read once per start of the engine (its own list starts empty).
        self._history_of: float | None = None
        self._durable: tuple[RecentRestore, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(
            Text(f"{self.target.name} ({self.target.url}) · waiting for the first snapshot…"), id="engine-header"
        )
        with VerticalScroll(id="engine-body"):
            yield Static(id="engine-view")
        yield Static(Text("esc back to the fleet · ↑↓ PgUp PgDn scroll · ? help", "dim"), id="engine-status")

    def on_mount(self) -> None:
        # Kept by reference, so that one already removed is noticed (`_drawable`).
        self._widgets = tuple(self.query_one(f"#engine-{name}") for name in ("header", "view", "status"))
        self.query_one("#engine-body", VerticalScroll).focus()
        self._poll()

    def on_unmount(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self.source.close()

    @work(thread=True, exclusive=True, exit_on_error=False, group="engine")
    def _poll(self) -> None:
        from bsr_cli.tui import model

        try:
            view = model.fold(self.view, self._with_history(self.source.poll()))
            self.post_message(EnginePolled(view, None))
        except BsrError as e:
            self.post_message(EnginePolled(self.view, e))

    def _with_history(self, frame: Any) -> Any:
        """The frame with the restores the engine's history holds beside those it lists itself (newest first): a
        restarted engine lists none of its earlier ones, and its store still has them."""
        snap = frame.snapshot
        if snap.info.started_at != self._history_of:
            try:
                raw = self.source.events(kinds=list(RESTORE_KINDS), limit=RESTORE_EVENTS)
            except BsrError:
                raw = None  # shown without them; asked again at the next poll
            if raw is not None:
                self._durable = durable_recent([e for w in raw if (e := known_event(w)) is not None])
                self._history_of = snap.info.started_at
        listed = {r.request for r in snap.recent}
        merged = (*snap.recent, *(r for r in self._durable if r.request not in listed))
        recent = tuple(sorted(merged, key=lambda r: -r.finished)[:RECENT_SHOWN])
        return replace(frame, snapshot=replace(snap, recent=recent))

    def _drawable(self) -> bool:
        """False once the screen is going: a poll's last message may arrive after some of its widgets are gone."""
        return self.is_attached and bool(self._widgets) and all(w.is_attached for w in self._widgets)

    def on_engine_polled(self, message: EnginePolled) -> None:
        if not self._drawable():
            return
        from bsr_cli.tui import panels

        self.polls += 1
        self.view, self.error = message.view, message.error
        header = Text(f"{self.target.name} ", "bold")
        header.append(self.target.url)
        if self.error is not None:
            header.append(f" · ✖ {self.error.kind}: {self.error.message}", "bold red")
        self.query_one("#engine-header", Static).update(header)
        if self.view is not None:
            self.query_one("#engine-view", Static).update(panels.render_text(self.view))
        elif self.error is not None:
            self.query_one("#engine-view", Static).update(Text(f"no snapshot: {self.error.message}", "red"))
        self._timer = self.set_timer(self.interval, self._poll)

    def action_back(self) -> None:
        self.dismiss(None)


# -- an engine's durable history ---------------------------------------------------------------------------------
# What the drill-down reads of an engine's history: restores started and ended (the newest RESTORE_EVENTS).
RESTORE_KINDS = (
    EventKind.RESTORE_STARTED,
    EventKind.RESTORE_COMMITTED,
    EventKind.RESTORE_FAILED_CLOSED,
    EventKind.RESTORE_REFUSED,
    EventKind.RESTORE_ABORTED,
)
RESTORE_EVENTS = 200
RECENT_SHOWN = 50  # as many as an engine lists itself


def durable_recent(events: Sequence[ev.Event]) -> tuple[RecentRestore, ...]:
    """The restores that ended among ``events``, newest first, as an engine lists its recent ones: what each
    restored (from its ``restore_started``), how it ended and why."""
    started = {e.request: e for e in events if isinstance(e, ev.RestoreStarted)}
    out = []
    for e in events:
        if not isinstance(e, ev.RestoreEnded):
            continue
        s = started.get(e.request)
        deciding = next((f for f in e.failures if f.kind is e.failure_kind), None)
        out.append(
            RecentRestore(
                request=e.request,
                outcome=e.outcome,
                tokens=e.advertised_tokens or (s.tokens if s is not None else 0),
                w=s.W if s is not None else 0,
                tiers=s.tiers if s is not None else (),
                seconds=e.seconds,
                finished=e.time,
                reason=describe(deciding) if deciding is not None else "",
                failure_kind=e.failure_kind,
                failure_stage=deciding.stage if deciding is not None else None,
            )
        )
    return tuple(sorted(out, key=lambda r: -r.finished))


# -- the app ----------------------------------------------------------------------------------------------------
class FleetApp(App[None]):
    TITLE = "bsr top (fleet)"
    CSS = """
    #header { height: 1; background: $boost; padding: 0 1; }
    #table { height: 1fr; }
    #timeline { height: auto; max-height: 6; padding: 0 1; }
    #status { height: 1; background: $boost; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p,space", "pause", "pause"),
        Binding("question_mark", "help", "help"),
        Binding("j", "cursor(1)", "down", show=False),
        Binding("k", "cursor(-1)", "up", show=False),
    ]

    def __init__(
        self,
        targets: Sequence[fleet.Target],
        *,
        interval: float = 1.0,
        timeout_s: float = 5.0,
        poll: Any = None,
        memory: fleet.Memory | None = None,
        recorder: FleetRecorder | None = None,
        replay: list[tuple[float, fleet.FleetView]] | None = None,
    ) -> None:
        super().__init__()
        self.targets = list(targets)
        self.interval = max(0.05, interval)
        self.timeout_s = timeout_s
        self.poll = poll or fleet.http_poll(timeout_s)
        self.memory = memory or fleet.Memory()
        self.recorder = recorder
        self.replay = replay
        self.result: fleet.FleetView | None = None  # the newest round
        self.rounds = 0
        self.paused = False
        self._timer: Timer | None = None
        self._widgets: tuple[Widget, ...] = ()  # the header, table and status line, once mounted
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(16, len(self.targets))), thread_name_prefix="bsr-fleet")

    def compose(self) -> ComposeResult:
        what = f"replaying {len(self.replay)} rounds" if self.replay else f"polling {len(self.targets)} engines"
        yield Static(Text(f"bsr top: {what}…", "dim"), id="header")
        table: DataTable[Text] = DataTable(id="table", cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        yield table
        yield Static(id="timeline")
        yield Static(id="status")

    def on_mount(self) -> None:
        # Kept by reference: drawn on every round, and still checkable (`_drawable`) once the app is exiting.
        self._widgets = tuple(self.query_one(f"#{name}") for name in ("header", "table", "timeline", "status"))
        self.query_one("#table", DataTable).focus()
        if self.replay:
            self._replay_step()
        else:
            self._round()

    def on_unmount(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.recorder is not None:
            self.recorder.close()
        self.memory.save()

    # -- rounds -----------------------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="fleet")
    def _round(self) -> None:
        t0 = time.monotonic()
        rows = self.memory.observe(fleet.poll_all(self.targets, self.poll, pool=self._pool))
        result = fleet.fleet_result(rows)
        if self.recorder is not None:
            self.recorder.write(result, time.time())
        self.post_message(FleetPolled(result, time.monotonic() - t0))

    def _replay_step(self) -> None:
        assert self.replay is not None
        _at, result = self.replay[min(self.rounds, len(self.replay) - 1)]
        self.post_message(FleetPolled(result, 0.0))

    def _drawable(self) -> bool:
        """False once the app is exiting: a round's last message may arrive after some of the widgets are gone
        (they are removed one by one)."""
        return bool(self._widgets) and all(w.is_attached for w in self._widgets)

    def on_fleet_polled(self, message: FleetPolled) -> None:
        if not self._drawable():
            return
        self.result = message.result
        self.rounds += 1
        if not self.paused:
            self._draw(message.result)
        worst = message.result.worst
        header = Text(f"bsr top · {len(message.result.engines)} engines · worst: {worst}", "bold")
        if worst in ("down", "unhealthy"):
            header.stylize("bold red")
        counts = ", ".join(f"{n} {k}" for k, n in message.result.counts.items() if n)
        header.append(f" · {counts}", "")
        if self.paused:
            header.append(" · PAUSED (p resumes)", "bold yellow")
        self.query_one("#header", Static).update(header)
        status = Text(no_wrap=True, overflow="ellipsis")
        if self.replay:
            status.append(f"▶ replay · round {min(self.rounds, len(self.replay))}/{len(self.replay)} · ", "bold")
        else:
            status.append(
                f"round {self.rounds} at {time.strftime('%H:%M:%S')} took {message.latency_s * 1000:.0f} ms · "
            )
        if self.recorder is not None:
            status.append(f"REC {self.recorder.path.name} · ", "bold red")
        status.append("enter open · ? help · p pause · q quit", "dim")
        self.query_one("#status", Static).update(status)
        if self.replay:
            if self.rounds < len(self.replay):
                nxt = self.replay[self.rounds][0] - self.replay[self.rounds - 1][0]
                self._timer = self.set_timer(max(0.001, min(nxt, 5.0)), self._replay_step)
            return
        self._timer = self.set_timer(max(0.001, self.interval - message.latency_s), self._round)

    def _draw(self, result: fleet.FleetView) -> None:
        table: DataTable[Text] = self.query_one("#table", DataTable)
        selected = self.selected_url()
        now = time.time()
        table.clear()
        for e in result.engines:
            table.add_row(*row_cells(e, now), key=e.url)
        self.query_one("#timeline", Static).update(timeline_text(result))
        if selected is not None:
            urls = [e.url for e in result.engines]
            if selected in urls:
                table.move_cursor(row=urls.index(selected), animate=False)

    def selected_url(self) -> str | None:
        table: DataTable[Text] = self.query_one("#table", DataTable)
        if not table.row_count:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except Exception:  # noqa: BLE001 - a cursor left outside a table just redrawn: no selection
            return None
        return str(key.value) if key.value is not None else None

    # -- keys -------------------------------------------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused and self.result is not None:
            self._draw(self.result)

    def action_help(self) -> None:
        if not isinstance(self.screen, ModalScreen):
            self.push_screen(HelpScreen(FLEET_HELP))

    def action_cursor(self, delta: int) -> None:
        table: DataTable[Text] = self.query_one("#table", DataTable)
        if self.screen is self.screen_stack[0]:
            table.move_cursor(row=max(0, table.cursor_row + delta))

    @on(DataTable.RowSelected, "#table")
    def _open(self, event: DataTable.RowSelected) -> None:
        url = str(event.row_key.value)
        target = next((t for t in self.targets if t.url == url), None)
        if target is None:  # a replay: the engine is named in the recording but not polled
            self.notify("a replay shows the fleet only; open an engine from a live `bsr top`", severity="warning")
            return
        self.push_screen(EngineScreen(target, interval=self.interval, timeout_s=self.timeout_s))
