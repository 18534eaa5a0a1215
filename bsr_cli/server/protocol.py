"""uvicorn's h11 protocol with the admin server's connection defences, which uvicorn's settings alone do not give.

A connection is *waiting* from its accept until its request head (line and headers) has arrived, and again between
requests on a kept-alive connection; it is *serving* from the head's arrival to the end of its answer. Waiting
connections cost the server a socket and a few KiB, and whoever holds them has not shown a token yet, so:

- The head has a short deadline (``head_deadline_s``, from the accept or from the head's first byte on a kept-alive
  connection), however slowly its bytes trickle.
- Waiting connections are capped per client address (``max_waiting_per_client``) and in all (``max_waiting``); a
  kept-alive connection that already carried a request with the token is not waiting between requests. A new
  connection is always accepted: past a cap the *oldest* waiting connections (of that client first) that have
  waited longer than a grace of 1 s get a JSON 503 ``busy`` and are closed; past twice ``max_waiting``, the oldest
  whatever their age. A connection whose whole head already lies in its socket, unread because the event loop is
  behind, is never the one closed (the server looks with ``MSG_PEEK``): it has sent its request, and the loop
  reads it on its next turn. The table is kept oldest first, in all and per client, so an accept costs the same
  however many connections wait.
- Serving capacity is split by the ASGI guard (guard.py), which knows the token: requests without it share a small
  number of slots, requests with it always have their own.
- A request's body must arrive within ``request_deadline_s`` of the connection becoming ready for the request, and
  no byte for ``idle_timeout_s`` while a request is incomplete, or before the first one, closes the connection;
  between requests uvicorn's ``timeout_keep_alive`` (set to the same value) does it.
- h11's malformed-request answer (a head over the size cap, a broken request line) is JSON like every other error.

What the operator is promised (PostgreSQL keeps ``superuser_reserved_connections`` for the same end): a request with
the token whose head is sent at once is answered, never closed as ``busy`` and never refused for want of a slot,
however many tokenless connections are held open. Up to ``max_waiting`` of them (2,048 by default, 16 per address)
are simply held until their head deadline, and the answer comes as fast as without them; past the caps every
stranger's reconnect costs the event loop an accept and a close, which delays the answer (see docs/admin-api.md for
what was measured) but still does not drop it.

Once a request is complete, no timer runs: a restore may stream for as long as it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
from collections import OrderedDict
from typing import ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from bsr_cli import API_VERSION
from bsr_cli.core.results import ErrorBody


def _answer(status: str, kind: str, message: str, hint: str, extra: str = "") -> bytes:
    body = json.dumps(ErrorBody(error=kind, message=message, hint=hint).to_wire()).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}X-BSR-API: {API_VERSION}\r\n\r\n"
    )
    return head.encode() + body


HARD_CAP_FACTOR = 2  # past 2 × max_waiting, the oldest waiting connections are closed whatever their age
PEEK_BYTES = 16 * 1024  # as much of an unread head as the server accepts (h11_max_incomplete_event_size)
EVICTION_SCAN = 8  # candidates looked at per eviction (each a recv with MSG_PEEK): a bound on the work per accept
BUSY = _answer(
    "503 Service Unavailable",
    "busy",
    "too many connections waiting to send a request",
    "retry shortly",
    "Retry-After: 1\r\n",
)


class WaitingConnections:
    """One server's connections still waiting to send a request head, oldest first, in all and per client address.

    Adding, removing and finding the oldest cost the same however many are held (an accept during a flood of
    connections must not cost the event loop a scan of them all). Every connection of a server runs on the server's
    one event loop, so no lock is needed."""

    def __init__(self, max_waiting: int, max_per_client: int, grace_s: float) -> None:
        self.max_waiting, self.max_per_client, self.grace_s = max_waiting, max_per_client, grace_s
        self.all: OrderedDict[GuardedH11Protocol, float] = OrderedDict()  # since when, oldest first
        self.by_client: dict[str, OrderedDict[GuardedH11Protocol, float]] = {}

    def __contains__(self, conn: object) -> bool:
        return conn in self.all

    def add(self, conn: GuardedH11Protocol, now: float) -> None:
        """``conn`` waits from ``now``; then, past a cap, the oldest stale connections (of its client first) are
        closed: waiting longer than the grace (past the hard cap, whatever their age), never one whose whole head is
        already in its socket (the loop reads it on its next turn)."""
        self.remove(conn)
        self.all[conn] = now
        mine = self.by_client.setdefault(conn.peer, OrderedDict())
        mine[conn] = now
        stale_before = now - self.grace_s
        self._evict(mine, len(mine) - self.max_per_client, stale_before, conn)
        self._evict(self.all, len(self.all) - self.max_waiting, stale_before, conn)
        self._evict(self.all, len(self.all) - HARD_CAP_FACTOR * self.max_waiting, now, conn)

    def remove(self, conn: GuardedH11Protocol) -> None:
        if self.all.pop(conn, None) is None:
            return
        mine = self.by_client.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.by_client[conn.peer]

    def _evict(
        self, table: OrderedDict[GuardedH11Protocol, float], over: int, stale_before: float, newest: GuardedH11Protocol
    ) -> None:
        """Close up to ``over`` of ``table``'s oldest connections that waited since ``stale_before`` or earlier,
        looking at no more than ``over + EVICTION_SCAN`` of them."""
        if over <= 0:
            return
        for conn, since in list(itertools.islice(table.items(), over + EVICTION_SCAN)):
            if since > stale_before or over <= 0:
                return  # oldest first: every later one waited less
            if conn is newest or conn.head_pending():
                continue
            conn.evict()
            over -= 1


LINGER_S = 10.0  # how long the rest of a refused request's body is read (and dropped) after the answer...
LINGER_BYTES = 64 << 20  # ...at most this much of it...
MAX_LINGERING = 256  # ...on at most this many connections at once (past it, a connection closes at once)


class Lingering:
    """Connections closed after answering a request whose body they had not read (a refusal: 413, 411, 401...).

    Closing a socket with unread bytes makes the kernel reset the connection, and a client still sending its body
    may never read the answer. So, as nginx's lingering close does, the server keeps a duplicate of the socket past
    the transport's close, ends its own side (FIN after the answer), and reads and drops what the client still
    sends, until the client closes its side, LINGER_BYTES were dropped or LINGER_S passed."""

    def __init__(self) -> None:
        self.sockets: set[socket.socket] = set()

    def start(self, loop: asyncio.AbstractEventLoop, transport: asyncio.BaseTransport) -> None:
        raw = transport.get_extra_info("socket")
        if raw is None or raw.fileno() < 0 or len(self.sockets) >= MAX_LINGERING:
            return
        try:
            sock = raw.dup()  # keeps the connection open past the transport's close of its own descriptor
            sock.setblocking(False)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        self.sockets.add(sock)
        dropped = 0

        def finish() -> None:
            if sock in self.sockets:
                self.sockets.discard(sock)
                loop.remove_reader(sock.fileno())
                timer.cancel()
                sock.close()

        def drop() -> None:
            nonlocal dropped
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            dropped += len(data)
            if not data or dropped > LINGER_BYTES:
                finish()

        timer = loop.call_later(LINGER_S, finish)
        loop.add_reader(sock.fileno(), drop)

    def close_all(self) -> None:
        """When the server has stopped (its loop is gone): close what still lingers."""
        for sock in list(self.sockets):
            sock.close()
        self.sockets.clear()


class GuardedH11Protocol(H11Protocol):
    """Configured per server by :func:`protocol_class` (uvicorn builds one instance per connection)."""

    head_deadline_s = 5.0
    request_deadline_s = 30.0
    idle_timeout_s = 10.0
    eviction_grace_s = 1.0
    # The waiting connections of one server (one table per class built by protocol_class).
    waiting: ClassVar[WaitingConnections] = WaitingConnections(128, 16, 1.0)
    lingering: ClassVar[Lingering] = Lingering()
    # The peers (address, port) of connections that carried a request with the right token (the guard adds them):
    # between requests such a connection is not "waiting" and never dropped for a stranger's sake.
    trusted: ClassVar[set[tuple[str, int]]] = set()
    _deadline: asyncio.TimerHandle | None = None
    _head: asyncio.TimerHandle | None = None
    _idle: asyncio.TimerHandle | None = None
    peer = ""
    _tail = b""  # the last bytes of a head being received (a head's end may straddle a read)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else ""
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
        elif self in self.waiting:
            self._tail = (self._tail + data)[-3:]
        if self._incomplete():
            self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.waiting.remove(self)
        if exc is None and self._answered_before_its_body():
            self.lingering.start(self.loop, self.transport)
        if self.client is not None:
            self.trusted.discard(self.client)
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # the next request on this connection gets its own deadline
            # Between requests uvicorn's keep-alive timeout counts the idle time; the idle timer last armed while a
            # request arrived would otherwise fire then, and close a connection whose next request is on its way.
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            self._start_waiting()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request (a head over the cap, a malformed line): a JSON 400, then close."""
        self.waiting.remove(self)
        with contextlib.suppress(RuntimeError, OSError):
            self.transport.write(
                _answer("400 Bad Request", "bad-request", msg, "the request head is limited to 16 KiB")
            )
        self.transport.close()

    # -- waiting connections -----------------------------------------------------------------------------------
    def _start_waiting(self) -> None:
        self._tail = b""
        if self.client in self.trusted:
            self.waiting.remove(self)
            return  # the operator's kept-alive connection
        self.waiting.add(self, self.loop.time())

    def _head_arrived(self) -> None:
        self.waiting.remove(self)
        if self._head is not None:
            self._head.cancel()
            self._head = None

    def head_pending(self) -> bool:
        """Whether the rest of a whole request head lies unread in this connection's socket: it has sent its
        request, and the event loop (behind, in a flood of connections) reads it on its next turn. Told by a
        ``recv`` with ``MSG_PEEK``, which leaves the bytes where they are."""
        sock = self.transport.get_extra_info("socket")
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return False
        view = socket.socket(sock.family, sock.type, 0, fd)  # the same descriptor, detached again below
        try:
            unread = view.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False
        finally:
            view.detach()
        return b"\r\n\r\n" in self._tail + unread

    def evict(self) -> None:
        self.waiting.remove(self)
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
            self.waiting.remove(self)
            self.transport.close()

    def _answered_before_its_body(self) -> bool:
        """The server answered (a refusal) and closed while the client was still sending the request's body."""
        return self.conn.their_state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete

    def _answering(self) -> bool:
        """Between a complete request and the end of its answer (h11 resets its state only after the answer)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _expire(self) -> None:
        if self.transport.is_closing() or not self._incomplete():
            return
        if self.conn.their_state is h11.IDLE and self._answering():
            return
        self._cancel()
        self.waiting.remove(self)
        self.transport.close()  # a handler blocked reading the body sees a disconnect and ends


def protocol_class(
    *,
    request_deadline_s: float,
    idle_timeout_s: float,
    head_deadline_s: float,
    max_waiting: int,
    max_waiting_per_client: int,
    trusted: set[tuple[str, int]],
) -> type[GuardedH11Protocol]:
    class BsrH11Protocol(GuardedH11Protocol):
        pass

    BsrH11Protocol.request_deadline_s = request_deadline_s
    BsrH11Protocol.idle_timeout_s = idle_timeout_s
    BsrH11Protocol.head_deadline_s = min(head_deadline_s, request_deadline_s)
    # This server's own table, not shared with another's class.
    BsrH11Protocol.waiting = WaitingConnections(max_waiting, max_waiting_per_client, BsrH11Protocol.eviction_grace_s)
    BsrH11Protocol.lingering = Lingering()
    BsrH11Protocol.trusted = trusted
    return BsrH11Protocol
