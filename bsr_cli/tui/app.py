"""The `bsr top` Textual app: it renders immutable views and nothing else (its modal screens: screens.py; the
messages its workers post: messages.py).

Every poll and every operator action runs in a thread worker that posts a past-tense message
(`SnapshotReceived`, `PollFailed`, `FaultInjected`, ...); handlers on the UI thread fold the snapshot into a new
immutable `View` and redraw. The next poll is armed only when the previous one has been handled, so a slow
engine makes the display older, never the request queue longer: the status bar shows how old and how slow.

About 650 lines on purpose: one App class (polls, replay, drawing, operator actions), whose handlers share its
state; everything that could stand apart (screens, messages, panes, panels, the model) already does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Container
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Static

from bsr_cli.core.evidence import Outcome as RestoreOutcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.tui import model, panels
from bsr_cli.tui.messages import (
    ActionFailed,
    FaultInjected,
    FaultsCleared,
    PollFailed,
    RecordingFailed,
    RequestAborted,
    SnapshotReceived,
)
from bsr_cli.tui.model import Frame, View
from bsr_cli.tui.panes import EventsPane, RecentList, ScrollPane, navigation
from bsr_cli.tui.screens import ChooseScreen, ConfirmScreen, EventLogScreen, FaultScreen, HelpScreen, WhyScreen
from bsr_cli.tui.source import LOG_PAGE, LiveSource, PollFailure, Recorder, ReplayFrame, ReplaySource


def _rows(w: Static) -> int:
    return max(w.content_size.height, 8)


def _narrow(w: Widget) -> bool:
    width = w.content_size.width
    return 0 < width < 60


# -- the app -------------------------------------------------------------------------------------------------------
class TopApp(App[None]):
    TITLE = "bsr top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]  # noqa: RUF012 - textual's own declaration
    CSS = """
    Screen { layout: vertical; }
    #header { height: auto; padding: 0 1; }
    #banner { display: none; height: auto; background: $error; color: $text; padding: 0 1; text-style: bold; }
    #banner.-shown { display: block; }
    .panel { border: round $primary-darken-1; border-title-color: $text; border-subtitle-color: $text-muted;
             padding: 0 1; height: 1fr; }
    /* The pane in focus (Tab moves it) takes the arrows, PgUp/PgDn and Home/End: its border says which. */
    .panel:focus, .panel:focus-within { border: round $accent; }
    ScrollPane.panel { scrollbar-size-vertical: 0; }
    ScrollPane > Static { height: auto; }
    #gauges-pane { height: auto; max-height: 50%; }
    #panels { layout: grid; grid-size: 2 2; grid-columns: 9fr 11fr; grid-rows: auto 1fr; height: 1fr; }
    #active-pane, #health-pane { height: auto; min-height: 4; max-height: 10; }
    RecentList { text-wrap: nowrap; text-overflow: ellipsis; overflow: hidden hidden; }
    #events { overflow: hidden hidden; }
    /* Under 100 columns the halves are even and the recent outcomes (with their "why") and the events go compact:
       both stay on screen, as they are what an operator reads first in an incident. */
    .-narrow #panels { grid-columns: 1fr 1fr; }
    #status { height: 1; background: $panel; padding: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p,space", "toggle_pause", "pause"),
        Binding("r", "cycle_rank", "rank filter"),
        Binding("k", "cycle_kind", "kind filter"),
        Binding("question_mark", "help", "help"),
        Binding("f", "inject_fault", "inject fault"),
        Binding("c", "clear_faults", "clear faults"),
        Binding("e,enter", "event_log", "event log"),
        *navigation(
            ("scroll_events(-1)", "newer events"),
            ("scroll_events(1)", "older events"),
            ("scroll_events_page(-1)", "newer page"),
            ("scroll_events_page(1)", "older page"),
            ("scroll_events_home", "newest events"),
            ("scroll_events_end", "oldest events"),
        ),
        Binding("o,ctrl+z", "toggle_failed", "failed only"),  # ctrl+z: k9s's toggle for faulty resources
        Binding("a", "abort", "abort a restore"),
        Binding("plus,equals_sign", "speed(2.0)", "faster", show=False),
        Binding("minus", "speed(0.5)", "slower", show=False),
        Binding("n", "next_failure", "next failure", show=False),
        Binding("left", "seek(-1)", "back", show=False),
        Binding("right", "seek(1)", "forward", show=False),
        Binding("shift+left", "seek(-10)", "back 10", show=False),
        Binding("shift+right", "seek(10)", "forward 10", show=False),
    ]

    def __init__(
        self,
        source: LiveSource | ReplaySource,
        *,
        interval: float = 1.0,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = time.time,
        paused: bool = False,
        log_page: int = LOG_PAGE,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval = max(0.05, interval)
        self.recorder = recorder
        self._clock = clock
        self.view: View | None = None  # the newest view (a live session keeps folding while paused)
        self.shown: View | None = None  # the view on screen
        self.failure: PollFailure | None = None  # the last poll's failure, until a snapshot arrives
        self.paused = paused
        self.rank: int | None = None
        self.kind = "all"
        self.failed_only = False  # the Recent pane lists only the restores that failed closed
        self.log_page = log_page  # events per page of the full event log
        self.speed = 1.0  # replay speed (× recorded time)
        self.polls = 0
        self._polling = False
        self._poll_timer: Timer | None = None
        self._replay_timer: Timer | None = None
        self._replay_frame: ReplayFrame | None = None
        self._panels: dict[str, Static] = {}
        self._frames: dict[str, Widget] = {}
        self.events_back = 0  # how many of the newest matching events the event pane is scrolled past
        self.aborts_pending: set[str] = set()  # abort sent, engine said aborting: its outcome is still to be told
        self._events_matching = 0  # how many matched at the last draw (new ones keep a scrolled pane still)

    def _panel(self, name: str) -> Static:
        return self._panels[name]

    @property
    def _drawable(self) -> bool:
        """False once the app is exiting: a worker's last message may arrive after the widgets are gone."""
        return bool(self._panels) and self._panels["status"].is_attached

    @property
    def replay(self) -> bool:
        return isinstance(self.source, ReplaySource)

    def compose(self) -> ComposeResult:
        yield Static(Text("bsr top: waiting for the first snapshot…", "dim"), id="header")
        yield Static(id="banner")
        with ScrollPane(id="gauges-pane", classes="panel"):
            yield Static(Text("…", "dim"), id="gauges")
        with Container(id="panels"):
            with ScrollPane(id="active-pane", classes="panel"):
                yield Static(id="active")
            with ScrollPane(id="health-pane", classes="panel"):
                yield Static(id="health")
            yield RecentList(id="recent", classes="panel")
            yield EventsPane(id="events", classes="panel")
        yield Static(id="status")

    def on_mount(self) -> None:
        # Kept by reference: drawn on every snapshot, and still checkable (`_drawable`) once the app is exiting.
        self._panels = {w.id: w for w in self.query(Static) if w.id}
        self._frames = {w.id: w for w in self.query(".panel") if w.id}  # the bordered panes, for their titles
        self._recent = self.query_one("#recent", RecentList)
        self._frames["gauges-pane"].border_title = "Restore pool per rank"
        self._panel("events").border_subtitle = "⏎ full log"
        self._panel("events").focus()  # the arrows scroll the events until Tab moves the focus to another pane
        if isinstance(self.source, ReplaySource):
            self.source.paused = self.paused
            self._show_replay(self.source.frame())
            self._arm_replay()
        else:
            self._start_poll()
            # Only the status bar ticks on its own (snapshot age); panels redraw when a snapshot arrives.
            self.set_interval(1.0, self._draw_status)
        self._draw_status()

    def on_unmount(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self.source.close()

    # -- polling (live) ---------------------------------------------------------------------------------------------
    def _start_poll(self) -> None:
        if self._polling or self.replay:
            return
        if self._poll_timer is not None:
            self._poll_timer.stop()
            self._poll_timer = None
        self._polling = True
        self._poll_worker()

    @work(thread=True, exclusive=True, exit_on_error=False, group="poll")
    def _poll_worker(self) -> None:
        assert isinstance(self.source, LiveSource)
        t0 = time.monotonic()
        item: Frame | PollFailure
        try:
            item = self.source.poll()
        except Exception as e:  # noqa: BLE001 - any failure must still reach the banner and re-arm the poll
            item = PollFailure.from_error(e, self._clock(), time.monotonic() - t0)
        if self.recorder is not None:
            try:
                self.recorder.write(item)
            except (OSError, ValueError) as e:  # disk full, or the file closed as the app quits
                self.post_message(RecordingFailed(str(e)))
        self.post_message(SnapshotReceived(item) if isinstance(item, Frame) else PollFailed(item))

    def _rearm(self, latency_s: float) -> None:
        self._polling = False
        self.polls += 1
        # Never a zero delay: textual's timer divides by it.
        self._poll_timer = self.set_timer(max(0.001, self.interval - latency_s), self._start_poll)

    def on_snapshot_received(self, message: SnapshotReceived) -> None:
        if not self._drawable:
            return
        self.view = model.fold(self.view, message.frame)
        self.failure = None
        if self.aborts_pending:
            self._report_aborts(self.view)
        self._draw_banner()
        if not self.paused:
            self._draw(self.view)
        self._draw_status()
        self._rearm(message.frame.latency_s)

    def on_poll_failed(self, message: PollFailed) -> None:
        if not self._drawable:
            return
        self.failure = message.failure
        self._draw_banner()
        self._draw_status()
        self._rearm(message.failure.latency_s)

    def on_recording_failed(self, message: RecordingFailed) -> None:
        self.notify(f"recording stopped: {message.error}", severity="error", timeout=10)
        if self.recorder is not None:
            rec, self.recorder = self.recorder, None
            rec.close()

    # -- replay -----------------------------------------------------------------------------------------------------
    def _arm_replay(self) -> None:
        assert isinstance(self.source, ReplaySource)
        if self._replay_timer is not None:
            self._replay_timer.stop()
        if not self.paused and not self.source.at_end:
            delay = self.source.delay_after(self.source.position, self.speed)
            self._replay_timer = self.set_timer(delay, self._replay_step)

    def _replay_step(self) -> None:
        assert isinstance(self.source, ReplaySource)
        if self.paused:
            return
        frame = self.source.advance()
        if frame is not None:
            self._show_replay(frame)
        self._arm_replay()

    def _show_replay(self, frame: ReplayFrame) -> None:
        self._replay_frame = frame
        self.view = frame.view
        self.failure = frame.failure
        self._draw_banner()
        if frame.view is not None:
            self._draw(frame.view)
        self._draw_status()

    def action_seek(self, delta: int) -> None:
        if not isinstance(self.source, ReplaySource):
            return
        self._show_replay(self.source.seek(delta))
        self._arm_replay()

    def action_speed(self, factor: float) -> None:
        if not isinstance(self.source, ReplaySource):
            return
        self.speed = min(16.0, max(0.25, self.speed * factor))
        self._arm_replay()
        self._draw_status()

    def action_next_failure(self) -> None:
        if not isinstance(self.source, ReplaySource):
            return
        target = self.source.next_failure()
        if target is None:
            self.notify("no failure after this frame", severity="information")
            return
        self._show_replay(self.source.seek(target - self.source.position))
        self._arm_replay()

    # -- drawing ----------------------------------------------------------------------------------------------------
    def _draw(self, view: View) -> None:
        if not self._drawable:
            return
        self.shown = view
        self._panel("header").update(panels.header(view, width=max(1, self.size.width - 2)))
        self._frames["gauges-pane"].border_title = panels.gauges_title(view)
        self._panel("gauges").update(panels.gauges(view, self.rank, dense=self._dense(view)))
        a = self._panel("active")
        self._frames["active-pane"].border_title = panels.active_title(view)
        a.update(panels.active(view, width=a.content_size.width or None))
        h = self._panel("health")
        self._frames["health-pane"].border_title = panels.health_title(view, compact=_narrow(h))
        h.update(panels.health(view, compact=_narrow(h)))
        self._draw_sized()

    def _dense(self, view: View) -> bool:
        # Two lines per rank while they take at most a third of the screen; one line per rank beyond that.
        return 2 * len(view.gauges) + 2 > self.size.height // 3

    def _draw_sized(self) -> None:
        """The panels whose row count follows their height: only rows that fit are built (CPU stays low)."""
        if self.shown is None or not self._drawable:
            return
        self._draw_recent(self.shown)
        e = self._panel("events")
        matching = len(self.shown.filtered_events(self.rank, self.kind))
        if self.events_back:  # scrolled back: events that arrived since stay above, the rows read stay put
            self.events_back += max(0, matching - self._events_matching)
        self._events_matching = matching
        self.events_back = max(0, min(self.events_back, matching - 1))
        e.border_title = panels.events_title(
            self.shown, self.rank, self.kind, back=self.events_back, compact=_narrow(e)
        )
        e.update(
            panels.events(self.shown, self.rank, self.kind, limit=_rows(e), compact=_narrow(e), back=self.events_back)
        )

    def _draw_recent(self, view: View) -> None:
        """The Recent pane: every finished restore (or only the failed ones), one row each; it scrolls."""
        recent = self._recent
        compact = _narrow(recent)
        recent.border_title = panels.recent_title(view, compact=compact, failed_only=self.failed_only)
        shown = panels.recent_shown(view, self.failed_only)
        if self.failed_only:
            empty = Text("no restore failed closed (o lists them all)", "dim")
        else:
            empty = Text("no restore finished yet", "dim")
        recent.show(
            shown,
            [panels.recent_row(view, o, compact=compact) for o in shown],
            empty=empty,
            head=None if compact else panels.recent_head(view),
            keys=panels.recent_keys(self.failed_only, compact=compact),
        )

    def on_resize(self) -> None:
        # Sizes settle after the layout pass; draw with the new ones then.
        self.call_after_refresh(self._redraw)

    def _redraw(self) -> None:
        if self.shown is not None:
            self._draw(self.shown)

    def _draw_banner(self) -> None:
        if not self._drawable:
            return
        banner = self._panel("banner")
        f = self.failure
        if f is None:
            banner.remove_class("-shown")
            return
        title = "ENGINE UNREACHABLE" if f.unreachable else f"ENGINE ERROR ({f.kind})"
        text = Text()
        text.append(f"✖ {title}: ", "bold")
        text.append(f.message)
        if not self.replay:
            text.append(f" · retrying every {self.interval:g}s")
        if self.view is not None:
            text.append(" · showing the last snapshot", "italic")
        if f.hint:
            text.append(f"\n  {f.hint}")
        banner.update(text)
        banner.add_class("-shown")

    def status_text(self) -> Text:
        t = Text(no_wrap=True, overflow="ellipsis")
        view = self.shown if self.paused else self.view
        if isinstance(self.source, ReplaySource):
            fr = self._replay_frame
            t.append("▶ replay ", "bold")
            t.append(self.source.label)
            if fr is not None:
                t.append(f" · frame {fr.index + 1}/{fr.total} @ {model.clock(fr.at)}")
                if fr.index + 1 >= fr.total:
                    t.append(" · end", "bold")
            if self.speed != 1.0:
                t.append(f" · ×{self.speed:g}", "bold")
        else:
            if self.failure is not None:
                t.append("✖ ", "bold red")
            else:
                t.append("● ", "green" if view is not None else "dim")
            t.append(self.source.label)
            if view is not None:
                age = self._clock() - view.received_at
                stale = age > 3 * self.interval + 1
                t.append(f" · snapshot {age:.1f}s old", "bold yellow" if stale or self.failure else "")
            if self.recorder is not None:
                t.append(f" · REC {self.recorder.path.name}", "bold red")
        if view is not None:
            t.append(f" · poll {view.latency_s * 1e3:.0f} ms · seq {view.seq}")
        if self.paused:
            t.append(" · ")
            t.append(" PAUSED ", "bold reverse yellow")
        t.append(" · ? help", "dim")  # the filters are in the event log's title
        return t

    def _draw_status(self) -> None:
        if self._drawable:
            self._panel("status").update(self.status_text())

    # -- keys -------------------------------------------------------------------------------------------------------
    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if isinstance(self.source, ReplaySource):
            self.source.paused = self.paused
            self._arm_replay()
        elif not self.paused and self.view is not None:
            self._draw(self.view)  # catch up with what was polled while frozen
        self._draw_status()

    def action_cycle_rank(self) -> None:
        ranks = [g.rank for g in self.shown.gauges] if self.shown else []
        self.rank = model.next_rank(self.rank, ranks)
        self.events_back = 0  # another filter: start again from the newest
        if self.shown is not None:
            self._panel("gauges").update(panels.gauges(self.shown, self.rank, dense=self._dense(self.shown)))
        self._draw_sized()
        self._draw_status()

    def action_scroll_events(self, delta: int) -> None:
        """Down (or j) shows older events, up newer ones: the pane lists the newest first."""
        if isinstance(self.screen, ModalScreen):
            return
        self.events_back = max(0, self.events_back + delta)
        self._draw_sized()

    def action_scroll_events_page(self, pages: int) -> None:
        self.action_scroll_events(pages * max(1, _rows(self._panel("events")) - 1))

    def action_scroll_events_home(self) -> None:
        self.events_back = 0
        self._draw_sized()

    def action_scroll_events_end(self) -> None:
        """The oldest events the pane holds (the full log, `e`, reaches further back)."""
        if isinstance(self.screen, ModalScreen) or self.shown is None:
            return
        matching = len(self.shown.filtered_events(self.rank, self.kind))
        self.events_back = max(0, matching - _rows(self._panel("events")))
        self._draw_sized()

    def action_toggle_failed(self) -> None:
        """List only the restores that failed closed in the Recent pane, or all of them again."""
        if isinstance(self.screen, ModalScreen):
            return
        self.failed_only = not self.failed_only
        if self.shown is not None:
            self._draw_recent(self.shown)

    def on_recent_list_chosen(self, message: RecentList.Chosen) -> None:
        """Enter (or d) on a finished restore: its whole "why", read from its end event."""
        if self.shown is None or isinstance(self.screen, ModalScreen):
            return
        self.push_screen(WhyScreen(message.outcome, self.shown.time, self.source.ending, in_thread=not self.replay))

    def action_cycle_kind(self) -> None:
        self.kind = model.next_kind(self.kind)
        self.events_back = 0
        self._draw_sized()
        self._draw_status()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def _can_act(self) -> bool:
        if isinstance(self.screen, ModalScreen):
            return False  # app keys still reach us under a dialog; one dialog at a time
        if self.replay:
            self.notify("a replay is read-only", severity="warning")
            return False
        if self.view is None or self.failure is not None:
            self.notify("no live engine to act on", severity="warning")
            return False
        return True

    def action_inject_fault(self) -> None:
        if not self._can_act():
            return
        assert self.view is not None
        if not self.view.info.faults_enabled:
            self.notify(
                "this engine does not allow fault injection (start it with `bsr engine up --enable-faults`)",
                severity="warning",
                timeout=6,
            )
            return

        def chosen(fault: FaultRequest | None) -> None:
            if fault is not None:
                self._inject_worker(fault)

        ranks = len(self.view.gauges) or self.view.info.ranks
        self.push_screen(FaultScreen(self.source.label, ranks, self.view.info.groups), chosen)

    def action_clear_faults(self) -> None:
        if not self._can_act():
            return
        assert self.view is not None
        n = len(self.view.faults)

        def answered(yes: bool | None) -> None:
            if yes:
                self._clear_worker()

        self.push_screen(
            ConfirmScreen(f"Clear {n} injected fault{'s' if n != 1 else ''} on {self.source.label}?", "Clear"),
            answered,
        )

    def action_event_log(self) -> None:
        if isinstance(self.screen, ModalScreen) or self.shown is None:
            return
        title = panels.events_title(self.shown, self.rank, self.kind)
        kinds = model.category_kinds(self.kind)

        def read(before: int | None) -> model.LogPage:
            return self.source.log_page(before, kinds, self.log_page)

        self.push_screen(EventLogScreen(read, title, rank=self.rank, in_thread=not self.replay))

    def action_abort(self) -> None:
        if not self._can_act():
            return
        assert self.view is not None
        active = self.view.active
        if not active:
            self.notify("no restore in flight", severity="information")
            return

        def confirm(request: str | None) -> None:
            if not request:
                return

            def answered(yes: bool | None) -> None:
                if not yes:
                    return
                # The restore may have finished while the question was open: say how, and send nothing.
                if self.view is not None and not any(a.request == request for a in self.view.active):
                    self._tell_finished(request, "did not abort it")
                    return
                self._abort_worker(request)

            self.push_screen(
                ConfirmScreen(f"Abort {request}? It fails closed: nothing is committed.", "Abort"), answered
            )

        if len(active) == 1:
            confirm(active[0].request)
        else:
            choices = [(a.request, f"{a.request} · {a.progress_text} · {a.tokens:,} tok") for a in active]
            self.push_screen(ChooseScreen("Abort which restore?", choices), confirm)

    @work(thread=True, exclusive=True, exit_on_error=False, group="action")
    def _abort_worker(self, request: str) -> None:
        assert isinstance(self.source, LiveSource)
        try:
            self.post_message(RequestAborted(self.source.abort(request)))
        except Exception as e:  # noqa: BLE001 - shown to the operator, who decides what next
            self.post_message(ActionFailed("abort", PollFailure.from_error(e, self._clock(), 0.0)))

    def on_request_aborted(self, message: RequestAborted) -> None:
        request = message.result.request
        if message.result.aborting:
            # Not "aborted" yet: the restore may commit before the abort reaches it. Its outcome, when it lands in
            # a snapshot, says which (`_report_aborts`).
            self.aborts_pending.add(request)
            self.notify(f"abort requested for {request}: waiting for its outcome", severity="warning")
        else:
            self._tell_finished(request, "the abort came too late")
        if self._drawable:
            self._start_poll()

    def _tell_finished(self, request: str, what: str) -> None:
        """A restore that finished before an abort reached it: its outcome, if a snapshot has it."""
        done = next((o for o in (self.view.recent if self.view else ()) if o.request == request), None)
        how = f": {done.outcome.replace('_', ' ')}" if done is not None else ""
        self.notify(f"{request} had already finished{how}; {what}", severity="information", timeout=8)

    def _report_aborts(self, view: View) -> None:
        """Tell each pending abort's outcome once it is known: aborted (the abort won: failed closed, nothing
        committed) or how the restore ended before the abort reached it (committed, or failed closed on a fault)."""
        for o in view.recent:
            if o.request not in self.aborts_pending:
                continue
            self.aborts_pending.discard(o.request)
            if o.outcome == RestoreOutcome.ABORTED:
                self.notify(f"{o.request} aborted: failed closed, nothing committed", severity="warning", timeout=8)
            else:
                outcome = o.outcome.replace("_", " ")
                self.notify(f"{o.request} {outcome} before the abort reached it", severity="information", timeout=8)

    @work(thread=True, exclusive=True, exit_on_error=False, group="action")
    def _inject_worker(self, fault: FaultRequest) -> None:
        assert isinstance(self.source, LiveSource)
        try:
            self.post_message(FaultInjected(self.source.inject_fault(fault)))
        except Exception as e:  # noqa: BLE001 - shown to the operator, who decides what next
            self.post_message(ActionFailed("inject fault", PollFailure.from_error(e, self._clock(), 0.0)))

    @work(thread=True, exclusive=True, exit_on_error=False, group="action")
    def _clear_worker(self) -> None:
        assert isinstance(self.source, LiveSource)
        try:
            self.post_message(FaultsCleared(self.source.clear_faults()))
        except Exception as e:  # noqa: BLE001 - shown to the operator, who decides what next
            self.post_message(ActionFailed("clear faults", PollFailure.from_error(e, self._clock(), 0.0)))

    def on_fault_injected(self, message: FaultInjected) -> None:
        f = model.fault_view(message.fault)
        self.notify(f"injected {f.describe()}", severity="warning", timeout=6)
        if self._drawable:
            self._start_poll()  # show it now rather than at the next tick

    def on_faults_cleared(self, message: FaultsCleared) -> None:
        self.notify(f"cleared {message.count} fault{'s' if message.count != 1 else ''}")
        if self._drawable:
            self._start_poll()

    def on_action_failed(self, message: ActionFailed) -> None:
        f = message.failure
        self.notify(f"{message.what} failed: {f.message}" + (f"\n{f.hint}" if f.hint else ""), severity="error")
