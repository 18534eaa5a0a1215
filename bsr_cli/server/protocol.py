"""uvicorn's h11 protocol with the admin server's connection defences, which uvicorn's settings alone do not give.

- A cap on open connections: past it a new connection gets one JSON 503 (``busy``) and is closed, without the
  request being parsed. uvicorn's own ``limit_concurrency`` answers plain text and only once a request's head has
  arrived, so it is left off.
- A request deadline: a request's line and headers must all arrive within ``request_deadline_s`` of the moment the
  connection became ready for it, and its body within the same deadline, however slowly the client trickles them.
  (uvicorn's ``timeout_keep_alive`` only limits the wait between requests.)
- An idle timeout: no byte for ``idle_timeout_s`` while a request is incomplete, or before the first one, closes the
  connection; between requests uvicorn's ``timeout_keep_alive`` (set to the same value) does it.

Once a request is complete, no timer runs: a restore may stream for as long as it takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from bsr_cli import API_VERSION


def _refusal() -> bytes:
    body = json.dumps({"error": "busy", "message": "too many open connections", "hint": "retry shortly"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\nX-BSR-API: {API_VERSION}\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """Configured per server by :func:`protocol_class` (uvicorn builds one instance per connection)."""

    max_connections = 64
    request_deadline_s = 30.0
    idle_timeout_s = 10.0
    _refused = False
    _deadline: asyncio.TimerHandle | None = None
    _idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._refused = True
            self.transport = transport
            transport.write(_refusal())
            # Half-close so the client reads the answer before the end; the socket is closed at its EOF (or soon).
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
            self.loop.call_later(2.0, transport.close)
            return
        super().connection_made(transport)
        self._arm_deadline()
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the request of a refused connection is never parsed
        super().data_received(data)
        if self._incomplete():
            self._arm_idle()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused:
            self.transport.close()
        return super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._refused:
            return
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # the next request on this connection gets its own deadline

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

    def _cancel(self) -> None:
        for t in (self._deadline, self._idle):
            if t is not None:
                t.cancel()
        self._deadline = self._idle = None

    def _expire(self) -> None:
        if self.transport.is_closing() or not self._incomplete():
            return
        if self.conn.their_state is h11.IDLE and self.cycle is not None and not self.cycle.response_complete:
            return  # between a complete request and its answer (h11 resets only after the answer)
        self._cancel()
        self.transport.close()  # a handler blocked reading the body sees a disconnect and ends


def protocol_class(*, max_connections: int, request_deadline_s: float, idle_timeout_s: float) -> type[H11Protocol]:
    attrs: dict[str, Any] = {
        "max_connections": max_connections,
        "request_deadline_s": request_deadline_s,
        "idle_timeout_s": idle_timeout_s,
    }
    return type("BsrH11Protocol", (GuardedH11Protocol,), attrs)
