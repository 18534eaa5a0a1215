"""The engine's event log: a bounded ring of events with sequence numbers, long-pollable.

Writers append a typed event (`bsr_cli.core.events`); a wire dict is accepted too and is parsed, so a malformed
event is refused where it is written rather than where it is read. The log stamps ``seq`` and ``time`` and holds
the wire form (``type``, ``seq``, ``time`` and the event's fields).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bsr_cli.core.events import Event, parse_event

Listener = Callable[[dict[str, Any]], None]


class EventLog:
    def __init__(self, capacity: int = 2000) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self._cond = threading.Condition()
        self._listeners: dict[str, list[Listener]] = {}
        self._observers: list[Listener] = []  # every event, whatever its request (metrics)

    @property
    def last_seq(self) -> int:
        return self._seq

    def append(self, event: Event | dict[str, Any]) -> dict[str, Any]:
        typed = event if isinstance(event, Event) else parse_event(event)
        with self._cond:
            self._seq += 1
            ev = typed.stamped(self._seq, time.time()).to_wire()
            self._events.append(ev)
            listeners = list(self._listeners.get(str(ev.get("request", "")), ())) + self._observers
            self._cond.notify_all()
        for fn in listeners:
            fn(ev)
        return ev

    def since(self, seq: int, *, wait_s: float = 0.0, limit: int = 500) -> list[dict[str, Any]]:
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            while self._seq <= seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            return [e for e in self._events if e["seq"] > seq][:limit]

    def recent(self, n: int = 50) -> list[dict[str, Any]]:
        with self._cond:
            return list(self._events)[-n:]

    def observe(self, fn: Listener) -> list[dict[str, Any]]:
        """Call ``fn`` with every event from now on; returns the events already held, so an observer that starts
        late can count those too without counting any twice."""
        with self._cond:
            self._observers.append(fn)
            return list(self._events)

    def listen(self, request: str, fn: Listener) -> Callable[[], None]:
        with self._cond:
            self._listeners.setdefault(request, []).append(fn)

        def stop() -> None:
            with self._cond:
                fns = self._listeners.get(request, [])
                if fn in fns:
                    fns.remove(fn)
                if not fns:
                    self._listeners.pop(request, None)

        return stop
