"""`bsr top` over several engines: one table of engines and their ranks, worst first, refreshed every interval.

Every engine is polled concurrently in a thread worker, each bounded by its own deadline (bsr_cli.fleet), and the
next round is armed only when the previous one was drawn, so a slow or stopped engine makes its own row say
`down`, never the other rows stale or the screen blank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.timer import Timer
from textual.widgets import Static

from bsr_cli import fleet
from bsr_cli.cli.render.ops import fleet_table


class FleetPolled(Message):
    def __init__(self, result: dict[str, Any], latency_s: float) -> None:
        super().__init__()
        self.result = result
        self.latency_s = latency_s


class FleetApp(App[None]):
    TITLE = "bsr top (fleet)"
    CSS = """
    #header { height: 1; background: $boost; }
    #table { height: 1fr; }
    #status { height: 1; background: $boost; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("p,space", "pause", "pause"),
    ]

    def __init__(
        self, targets: Sequence[fleet.Target], *, interval: float = 1.0, timeout_s: float = 5.0, poll: Any = None
    ) -> None:
        super().__init__()
        self.targets = list(targets)
        self.interval = max(0.05, interval)
        self.poll = poll or fleet.http_poll(timeout_s)
        self.result: dict[str, Any] | None = None  # the newest round
        self.rounds = 0
        self.paused = False
        self._timer: Timer | None = None
        self._pool = ThreadPoolExecutor(max_workers=min(16, len(self.targets)), thread_name_prefix="bsr-fleet")

    def compose(self) -> ComposeResult:
        yield Static(Text(f"bsr top: polling {len(self.targets)} engines…", "dim"), id="header")
        yield Static(id="table")
        yield Static(id="status")

    def on_mount(self) -> None:
        self._round()

    def on_unmount(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @work(thread=True, exclusive=True, exit_on_error=False, group="fleet")
    def _round(self) -> None:
        t0 = time.monotonic()
        rows = fleet.poll_all(self.targets, self.poll, pool=self._pool)
        self.post_message(FleetPolled(fleet.fleet_result(rows), time.monotonic() - t0))

    def on_fleet_polled(self, message: FleetPolled) -> None:
        table = self.query("#table")
        if not table or not table.first().is_attached:
            return
        self.result = message.result
        self.rounds += 1
        if not self.paused:
            self.query_one("#table", Static).update(fleet_table(message.result))
        worst = message.result["worst"]
        self.query_one("#header", Static).update(
            Text(
                f"bsr top · {len(self.targets)} engines · worst: {worst}"
                + (" · PAUSED (p resumes)" if self.paused else ""),
                "bold red" if worst in ("down", "unhealthy") else "bold",
            )
        )
        self.query_one("#status", Static).update(
            Text(
                f"round {self.rounds} at {time.strftime('%H:%M:%S')} took {message.latency_s * 1000:.0f} ms · "
                "q quit · p pause",
                "dim",
            )
        )
        self._timer = self.set_timer(max(0.001, self.interval - message.latency_s), self._round)

    def action_pause(self) -> None:
        self.paused = not self.paused
