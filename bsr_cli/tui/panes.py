"""The focusable panes `bsr top` lays out, k9s-style: Tab (shift+Tab back) moves the focus from pane to pane, the
pane in focus wears a bright border and takes the arrows, PgUp/PgDn and Home/End.

    ScrollPane   a pane whose whole content scrolls (the gauges, the restores in flight, the health panel)
    RecentList   the finished restores, one row each, with a cursor: Enter (or d) opens a restore's whole "why"
    EventsPane   the newest events; its keys are the app's own (they scroll the pane without focus too)

← and → are left to the app in every pane: in a replay they step through the frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Static

from bsr_cli.tui.model import Outcome

NAVIGATION_KEYS = ("up", "down,j", "pageup", "pagedown", "home", "end")


def navigation(*moves: tuple[str, str]) -> list[BindingType]:
    """The keys every scrolling view moves by, one (action, description) each in NAVIGATION_KEYS' order (↑, ↓/j,
    PgUp, PgDn, Home, End): the same keys in every pane and the event log. Kept out of the footer."""
    return [Binding(key, action, what, show=False) for key, (action, what) in zip(NAVIGATION_KEYS, moves, strict=True)]


class ScrollPane(VerticalScroll, can_focus=True):
    """A bordered pane whose content scrolls when it is taller than the pane. A pane as tall as its content (up to a
    cap) draws no scrollbar: the bar would narrow the content, wrap a line, and keep itself (its height is laid out
    without one); its bottom border says where more lines are instead."""

    inherit_bindings = False  # a scroll container's ← → would shadow the replay's seek
    BINDINGS: ClassVar[list[BindingType]] = navigation(
        ("scroll_up", "scroll up"),
        ("scroll_down", "scroll down"),
        ("page_up", "page up"),
        ("page_down", "page down"),
        ("scroll_home", "top"),
        ("scroll_end", "bottom"),
    )

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._mark_more()

    def watch_virtual_size(self) -> None:
        self._mark_more()

    def on_resize(self) -> None:
        self._mark_more()

    def _mark_more(self) -> None:
        if self.has_class("panel"):
            above, below = self.scroll_y > 0, self.scroll_y < self.max_scroll_y
            self.border_subtitle = f"{'↑' if above else ''}{'↓' if below else ''} more" if above or below else ""


class RecentList(Static, can_focus=True):
    """The finished restores, newest first (`panels.recent_row`), as a bordered pane with a cursor that stays on
    the restore it is on while snapshots arrive. ↑/↓ (j), PgUp/PgDn and Home/End move it, and the rows scroll to
    keep it in view; Enter (or d, as k9s's describe) posts `Chosen`. Only the rows in view are drawn (a busy engine
    lists 50, and a snapshot moves the "ago" of many), and the bottom border counts those above and below."""

    BINDINGS: ClassVar[list[BindingType]] = [
        *navigation(
            ("move(-1)", "up"),
            ("move(1)", "down"),
            ("page(-1)", "page up"),
            ("page(1)", "page down"),
            ("move(-1_000_000)", "first"),
            ("move(1_000_000)", "last"),
        ),
        Binding("enter,d", "choose", "why", show=False),
    ]

    class Chosen(Message):
        """Enter (or d) on a restore: the app opens its whole "why"."""

        def __init__(self, outcome: Outcome) -> None:
            super().__init__()
            self.outcome = outcome

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.outcomes: tuple[Outcome, ...] = ()
        self.cursor: int | None = None  # no cursor until the pane first has the focus
        self.top = 0  # the first row in view
        self._rows: list[Text] = []
        self._head: Text | None = None
        self._empty = Text("")
        self._keys = ""
        self._drawn: object = None  # what is on screen now, to draw only what changed

    def show(
        self, outcomes: Sequence[Outcome], rows: Sequence[Text], *, empty: Text, head: Text | None, keys: str
    ) -> None:
        """List ``outcomes`` as ``rows`` under ``head`` (``empty`` when there are none), the cursor kept on its
        restore; ``keys`` goes on the bottom border."""
        on = self.chosen()
        self.outcomes, self._rows, self._empty, self._head, self._keys = tuple(outcomes), list(rows), empty, head, keys
        if not self.outcomes:
            self.cursor = None
        elif on is not None:
            at = next((i for i, o in enumerate(self.outcomes) if o.request == on.request), self.cursor or 0)
            self.cursor = min(at, len(self.outcomes) - 1)
        self._draw()

    def chosen(self) -> Outcome | None:
        """The restore under the cursor, if any."""
        i = self.cursor
        return self.outcomes[i] if i is not None and 0 <= i < len(self.outcomes) else None

    def on_focus(self) -> None:
        if self.cursor is None and self.outcomes:
            self.cursor = self.top  # the cursor shows where Enter goes as soon as the pane has the focus
            self._draw()

    def on_resize(self) -> None:
        self._draw()

    def action_move(self, delta: int) -> None:
        if self.outcomes:
            self.cursor = max(
                0, min(len(self.outcomes) - 1, (self.top if self.cursor is None else self.cursor) + delta)
            )
            self._draw()

    def action_page(self, pages: int) -> None:
        self.action_move(pages * max(1, len(self._in_view()) - 1))

    def action_choose(self) -> None:
        chosen = self.chosen()
        if chosen is not None:
            self.post_message(self.Chosen(chosen))

    def on_mouse_scroll_down(self, event: events.MouseScrollDown) -> None:
        event.stop()
        self.action_move(1)

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        event.stop()
        self.action_move(-1)

    def _lines(self) -> int:
        """Lines for rows (the head takes one); before the first layout, as many as the rows need."""
        height = self.content_size.height or sum(_height(r) for r in self._rows) + 1
        return max(1, height - (1 if self._head is not None else 0))

    def _in_view(self) -> range:
        """The rows in view from ``top``, moved first so that the cursor's row is whole in view."""
        lines, n = self._lines(), len(self._rows)
        self.top = max(0, min(self.top, n - 1))
        if self.cursor is not None:
            self.top = min(self.top, self.cursor)
            while self.top < self.cursor and sum(_height(r) for r in self._rows[self.top : self.cursor + 1]) > lines:
                self.top += 1
        end, used = self.top, 0
        while end < n and used + _height(self._rows[end]) <= lines:
            used += _height(self._rows[end])
            end += 1
        return range(self.top, max(end, min(self.top + 1, n)))

    def _draw(self) -> None:
        shown = self._in_view() if self.outcomes else range(0)
        key = (tuple(self._rows[i].plain for i in shown), self._head, self.cursor, self._keys, self.size)
        if key == self._drawn:
            return
        self._drawn = key
        body = Text(no_wrap=True, overflow="ellipsis")
        if self._head is not None:
            body.append_text(self._head)
        for i in shown:
            if body:
                body.append("\n")
            row = self._rows[i]
            if i == self.cursor:
                row = row.copy()
                row.stylize("reverse")
            body.append_text(row)
        self.update(body if self.outcomes else self._empty)
        above, below = (shown.start, len(self._rows) - shown.stop) if self.outcomes else (0, 0)
        more = " ".join(f"{arrow}{n}" for arrow, n in (("↑", above), ("↓", below)) if n)
        self.border_subtitle = f"{more} more · {self._keys}" if more else self._keys


def _height(row: Text) -> int:
    return row.plain.count("\n") + 1


class EventsPane(Static, can_focus=True):
    """The newest events that match the filters. The app draws only the rows that fit and scrolls them itself
    (`events_back`), so its keys are the app's: they work whether or not this pane has the focus."""
