"""uvicorn's h11 protocol with the admin server's connection defences, which uvicorn's settings alone do not give.

A connection is *waiting* from its accept until its request head (line and headers) has arrived, and again between
requests on a kept-alive connection; it is *serving* from the head's arrival to the end of its answer. Waiting
connections cost the server nothing but a socket, and whoever holds them has not shown a token yet, so:

- The head has a short deadline (``head_deadline_s``, from the accept or from the head's first byte on a kept-alive
  connection), however slowly its bytes trickle.
- Waiting connections are capped per client address (``max_waiting_per_client``) and in all
  (``max_waiting``); a kept-alive connection that already carried a request with the token is not waiting between
  requests. A new connection is always accepted: past a cap the *oldest* waiting connections (of that client
  first) that have waited longer than a grace of 1 s get a JSON 503 ``busy`` and are closed (past four times the
  cap, the oldest whatever their age). A client that sends its head at once (every real client)
  is never the oldest, so sockets held open by strangers cannot lock the operator out (PostgreSQL's
  authentication timeout and nginx's per-client ``limit_conn`` serve the same end).
- Serving capacity is split by the ASGI guard (guard.py), which knows the token: requests without it share a small
  number of slots, requests with it always have their own.
- A request's body must arrive within ``request_deadline_s`` of the connection becoming ready for the request, and
  no byte for ``idle_timeout_s`` while a request is incomplete, or before the first one, closes the connection;
  between requests uvicorn's ``timeout_keep_alive`` (set to the same value) does it.
- h11's malformed-request answer (a head over the size cap, a broken request line) is JSON like every other error.

Once a request is complete, no timer runs: a restore may stream for as long as it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from bsr_cli import API_VERSION


def _answer(status: str, kind: str, message: str, hint: str, extra: str = "") -> bytes:
    body = json.dumps({"error": kind, "message": message, "hint": hint}).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}X-BSR-API: {API_VERSION}\r\n\r\n"
    )
    return head.encode() + body


HARD_CAP_FACTOR = 4  # waiting connections beyond 4 × max_waiting are dropped oldest first, whatever their age
BUSY = _answer(
    "503 Service Unavailable",
    "busy",
    "too many connections waiting to send a request",
    "retry shortly",
    "Retry-After: 1\r\n",
)


class GuardedH11Protocol(H11Protocol):
    """Configured per server by :func:`protocol_class` (uvicorn builds one instance per connection)."""

    max_waiting = 128
    max_waiting_per_client = 16
    head_deadline_s = 5.0
    request_deadline_s = 30.0
    idle_timeout_s = 10.0
    # The waiting connections of one server, oldest first (one dict per class built by protocol_class; every
    # connection of a server runs on the server's one event loop, so no lock is needed).
    eviction_grace_s = 1.0
    waiting: ClassVar[OrderedDict[GuardedH11Protocol, tuple[str, float]]] = OrderedDict()
    # The peers (address, port) of connections that carried a request with the right token (the guard adds them):
    # between requests such a connection is not "waiting" and never dropped for a stranger's sake.
    trusted: ClassVar[set[tuple[str, int]]] = set()
    _deadline: asyncio.TimerHandle | None = None
    _head: asyncio.TimerHandle | None = None
    _idle: asyncio.TimerHandle | None = None
    _peer = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else ""
        self._arm_deadline()
        self._arm_idle()
        self._arm_head()
        self._start_waiting()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head is None:
            self._arm_head()  # the first byte of a later request's head on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_arrived()
        if self._incomplete():
            self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.waiting.pop(self, None)
        if self.client is not None:
            self.trusted.discard(self.client)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # the next request on this connection gets its own deadline
            self._start_waiting()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request (a head over the cap, a malformed line): a JSON 400, then close."""
        self.waiting.pop(self, None)
        with contextlib.suppress(RuntimeError, OSError):
            self.transport.write(
                _answer("400 Bad Request", "bad-request", msg, "the request head is limited to 16 KiB")
            )
        self.transport.close()

    # -- waiting connections -----------------------------------------------------------------------------------
    def _start_waiting(self) -> None:
        waiting = self.waiting
        waiting.pop(self, None)
        if self.client in self.trusted:
            return  # the operator's kept-alive connection
        now = self.loop.time()
        waiting[self] = (self._peer, now)
        # Past a cap, drop the oldest connections that have waited longer than the grace: a burst of new
        # connections from a real client sends its heads well within it. Past the hard cap, the oldest, whatever
        # their age (a flood cannot grow the table without bound).
        stale_before = now - self.eviction_grace_s
        mine = [c for c, (peer, since) in waiting.items() if peer == self._peer and since <= stale_before]
        for old in mine[: max(0, sum(1 for p, _ in waiting.values() if p == self._peer) - self.max_waiting_per_client)]:
            old._evict()
        over = len(waiting) - self.max_waiting
        for old in [c for c, (_, since) in waiting.items() if since <= stale_before][: max(0, over)]:
            old._evict()
        while len(waiting) > HARD_CAP_FACTOR * self.max_waiting:
            next(iter(waiting))._evict()

    def _head_arrived(self) -> None:
        self.waiting.pop(self, None)
        if self._head is not None:
            self._head.cancel()
            self._head = None

    def _evict(self) -> None:
        self.waiting.pop(self, None)
        sending_a_head = self._head is not None  # a new connection, or a kept-alive one that began its next head
        self._cancel()
        if not self.transport.is_closing():
            if sending_a_head:
                with contextlib.suppress(RuntimeError, OSError):
                    self.transport.write(BUSY)
            # An idle kept-alive connection is closed without a word: a client reusing it later must not read an
            # answer to a request it has not sent yet (it sees the close and opens a new connection).
            self.transport.close()

    # -- timers ------------------------------------------------------------------------------------------------
    def _incomplete(self) -> bool:
        """A request has not fully arrived: its head (or the next one's) or its body is still being sent."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _arm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.request_deadline_s, self._expire)

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self.loop.call_later(self.idle_timeout_s, self._expire)

    def _arm_head(self) -> None:
        if self._head is not None:
            self._head.cancel()
        self._head = self.loop.call_later(self.head_deadline_s, self._head_expired)

    def _cancel(self) -> None:
        for t in (self._deadline, self._idle, self._head):
            if t is not None:
                t.cancel()
        self._deadline = self._idle = self._head = None

    def _head_expired(self) -> None:
        self._head = None
        if self.conn.their_state is h11.IDLE and not self._answering():
            self._cancel()
            self.waiting.pop(self, None)
            self.transport.close()

    def _answering(self) -> bool:
        """Between a complete request and the end of its answer (h11 resets its state only after the answer)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _expire(self) -> None:
        if self.transport.is_closing() or not self._incomplete():
            return
        if self.conn.their_state is h11.IDLE and self._answering():
            return
        self._cancel()
        self.waiting.pop(self, None)
        self.transport.close()  # a handler blocked reading the body sees a disconnect and ends


def protocol_class(
    *,
    request_deadline_s: float,
    idle_timeout_s: float,
    head_deadline_s: float,
    max_waiting: int,
    max_waiting_per_client: int,
    trusted: set[tuple[str, int]],
) -> type[H11Protocol]:
    class BsrH11Protocol(GuardedH11Protocol):
        pass

    BsrH11Protocol.request_deadline_s = request_deadline_s
    BsrH11Protocol.idle_timeout_s = idle_timeout_s
    BsrH11Protocol.head_deadline_s = min(head_deadline_s, request_deadline_s)
    BsrH11Protocol.max_waiting = max_waiting
    BsrH11Protocol.max_waiting_per_client = max_waiting_per_client
    BsrH11Protocol.waiting = OrderedDict()  # this server's own, not shared with another's class
    BsrH11Protocol.trusted = trusted
    return BsrH11Protocol
