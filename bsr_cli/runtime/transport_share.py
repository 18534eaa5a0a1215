"""A fetch deadline counted in the fetch's share of the transport, for window loops that keep two fetches in flight.

Two of a restore's fetches in flight at once share the transport (a link, the store's sender): each takes about
twice as long on the clock as it would alone. A deadline counted on the clock then fails, at the first windows, a
restore over a link that moves one window in a little more than half the deadline, where one window at a time
commits it. Counted in each fetch's share (while n are in flight each one's share grows at 1/n of the clock:
processor sharing's virtual time), each window gets the deadline with the transport to itself, as one at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from types import TracebackType
from typing import Any


class TransportShare:
    """The share of the transport each of a restore's fetches has had. Each fetch gets a ``ticket`` when it is
    issued; its thread holds the ticket (``with ticket:``) while it transfers, and the window loop ``wait``s for the
    fetch against its deadline by the ticket."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._virtual = 0.0
        self._at = clock()

    def _advance(self) -> None:  # under the lock
        now = self._clock()
        if self._in_flight:
            self._virtual += (now - self._at) / self._in_flight
        self._at = now

    def ticket(self) -> ShareTicket:
        return ShareTicket(self)

    def enter(self) -> float:
        """A fetch starts: the virtual time its share counts from."""
        with self._lock:
            self._advance()
            self._in_flight += 1
            return self._virtual

    def leave(self) -> None:
        with self._lock:
            self._advance()
            self._in_flight -= 1

    def since(self, start: float) -> tuple[float, int]:
        """The share a fetch that entered at ``start`` has had, and how many fetches share the transport now."""
        with self._lock:
            self._advance()
            return self._virtual - start, self._in_flight

    def wait(self, future: Future[Any], ticket: ShareTicket, timeout_s: float) -> bool:
        """Wait for ``future``, the fetch holding ``ticket``; False when its share reached ``timeout_s`` first (a
        fetch whose thread has not begun it has had none yet). Re-judged at least four times a deadline, since the
        number sharing the transport changes while it waits."""
        while not future.done():
            wait_s = timeout_s / 4
            if ticket.start is not None:
                used, sharing = self.since(ticket.start)
                if used >= timeout_s and not future.done():
                    return False
                wait_s = min(wait_s, (timeout_s - used) * max(sharing, 1))
            wait([future], timeout=wait_s)
        return True


class ShareTicket:
    """One fetch's place in the share: held by its thread while it transfers (``with ticket:``)."""

    def __init__(self, share: TransportShare) -> None:
        self.share = share
        self.start: float | None = None  # where its share counts from, once its thread has begun the transfer

    def __enter__(self) -> ShareTicket:
        self.start = self.share.enter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.share.leave()
