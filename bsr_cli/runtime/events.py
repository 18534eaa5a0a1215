"""The engine's event log: sequence numbers, a bounded in-memory tail (long polls, listeners), and, where the host
has a state directory, the durable event store behind it (`bsr_cli.runtime.event_store`).

Writers append a typed event (`bsr_cli.core.events`; a host that receives an event's wire form parses it where it
arrives, with ``parse_event``). The log stamps ``seq`` and ``time`` and holds the typed events; listeners,
observers and readers get them as types. Their wire form is written only where JSON is: by the store (its rows)
and by the admin API (its answers).

With a store, every event is also handed to it (in ``seq`` order), ``seq`` continues from the last one the store
ever wrote (so a client's cursor survives a restart), and reads reach past the tail into the store: ``since`` a
cursor older than the tail, and every filtered ``query``. Hosts without a state directory (the LMCache host, the
vLLM worker admin, the unit fakes) keep only the tail.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable

from bsr_cli.core.events import Event, request_of
from bsr_cli.runtime.event_store import EventStore, Query

Listener = Callable[[Event], None]
TAIL = 2000  # events kept in memory: long polls and the live view read them without touching the store


class EventLog:
    def __init__(self, capacity: int = TAIL, store: EventStore | None = None) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self._store = store
        self._seq = store.last_seq if store is not None else 0
        self._cond = threading.Condition()
        self._listeners: dict[str, list[Listener]] = {}
        self._observers: list[Listener] = []  # every event, whatever its request (metrics, the failure log)

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def store(self) -> EventStore | None:
        return self._store

    @property
    def durable(self) -> bool:
        """Whether events outlive the tail (and a restart)."""
        return self._store is not None

    def append(self, event: Event) -> Event:
        """Record ``event``: stamped with the next ``seq`` and the time, kept, stored, handed to the listeners of
        its request and to every observer. Returns the stamped event."""
        with self._cond:
            self._seq += 1
            ev = dataclasses.replace(event, seq=self._seq, time=time.time())
            self._events.append(ev)
            if self._store is not None:
                self._store.put(ev)  # under the lock: the store receives events in seq order
            mine = self._listeners.get(request_of(ev) or "", []) if self._listeners else []
            listeners = list(mine) + self._observers
            self._cond.notify_all()
        for fn in listeners:
            fn(ev)
        return ev

    def since(self, seq: int, *, wait_s: float = 0.0, limit: int = 500) -> list[Event]:
        """Events after ``seq``, oldest first, waiting up to ``wait_s`` for one; from the store when the tail no
        longer reaches back to ``seq``."""
        deadline = time.monotonic() + max(0.0, wait_s)
        with self._cond:
            while self._seq <= seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            oldest = self._events[0].seq if self._events else self._seq + 1
            if self._store is None or seq + 1 >= oldest:
                return [e for e in self._events if e.seq > seq][:limit]
        return self._store.query(Query(after_seq=seq, limit=limit))

    def query(self, q: Query) -> list[Event]:
        """Every event matching ``q`` that this log still holds (the store's, or the tail's without one)."""
        if self._store is not None:
            return self._store.query(q)
        with self._cond:
            found = [e for e in self._events if q.matches(e)]
        return found[-q.limit :] if q.newest else found[: q.limit]

    def extent(self) -> tuple[int, int]:
        """(how many events this log still holds, the sequence number of the oldest; 0 when it holds none): the
        store's, or the tail's without one."""
        if self._store is not None:
            return self._store.extent()
        with self._cond:
            return len(self._events), (self._events[0].seq if self._events else 0)

    def recent(self, n: int = 50) -> list[Event]:
        with self._cond:
            return list(self._events)[-n:]

    def observe(self, fn: Listener) -> list[Event]:
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

    def close(self) -> None:
        """Commit every event to the store and close it (nothing to do without one)."""
        if self._store is not None:
            self._store.close()
