"""The ASGI layer in front of the FastAPI app: what must happen before a byte of a body is read.

FastAPI reads a request's body before any dependency runs, so routing, the token and the body's size are checked
here instead: an unknown path is a JSON 404 (a wrong API version says so), a method a path does not serve a JSON
405 with ``Allow``, a state-changing route without the right bearer token a 401, a chunked body a 411, a body over
the cap a 413, all answered without reading the body (and with ``Connection: close`` when one is left unread).
Then the body is read whole and checked to be a UTF-8 JSON object (no NaN, no absurd nesting or integers) and
handed on; FastAPI validates it against the route's model.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from bsr_cli import API_VERSION

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SERVED_METHODS = ("DELETE", "GET", "POST")
_VERSIONED = re.compile(r"^/bsr/(v\d+)(/.*)?$")


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # a template: /bsr/v1/restores/{id}/abort
    auth: bool
    json_body: bool
    pattern: re.Pattern[str] = field(compare=False)


def route(method: str, path: str, *, auth: bool, json_body: bool) -> Route:
    regex = "^" + re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(path)) + "$"
    return Route(method, path, auth, json_body, re.compile(regex))


class Refusal(Exception):
    def __init__(self, status: int, kind: str, message: str, hint: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.hint, self.extra = status, kind, message, hint, extra


def error_body(kind: str, message: str, hint: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"error": kind, "message": message, "hint": hint, **extra}


async def send_json(
    send: Send, status: int, data: Any, *, close: bool = False, headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(data, default=str).encode()
    raw = [
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
        (b"X-BSR-API", API_VERSION.encode()),
        *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
    ]
    if close:
        raw.append((b"Connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json(raw: bytes) -> None:
    """Refuse a body that is not a UTF-8 JSON object, with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "bad-request", "body is not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise Refusal(400, "bad-request", f"body is not JSON: {e.msg}") from None
    except RecursionError:
        raise Refusal(400, "bad-request", "body is nested too deeply") from None
    except ValueError as e:  # NaN/Infinity, or an integer with thousands of digits
        raise Refusal(400, "bad-request", f"body is not acceptable JSON: {e}") from None
    if not isinstance(data, dict):
        raise Refusal(400, "bad-request", "body must be a JSON object")


class Guard:
    """Wraps the app. ``routes``: what it serves; ``token``: the bearer token; ``max_body``: the body cap."""

    def __init__(self, app: ASGIApp, routes: list[Route], *, token: str, max_body: int, on_request: Callable[[], None]):
        self.app, self.routes, self.token, self.max_body, self.on_request = app, routes, token, max_body, on_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.on_request()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        has_body = bool(headers.get("transfer-encoding")) or headers.get("content-length", "0").strip() not in ("", "0")
        try:
            r = self._route(scope["method"], scope["path"])
            if r.auth:
                self._auth(headers)
            raw = await self._read_body(headers, receive)
            if raw is None:
                return  # the client went away mid-body: nobody to answer
            if r.json_body:
                raw = raw or b"{}"  # no body is an empty object, as it always was
                check_json(raw)
        except Refusal as e:
            # An unread body must never be parsed as the next request: close the connection after answering.
            allow = {"Allow": ", ".join(e.extra["allowed"])} if e.status == 405 else None
            await send_json(
                send, e.status, error_body(e.kind, e.message, e.hint, **e.extra), close=has_body, headers=allow
            )
            return
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"] + [
            (b"content-type", b"application/json")
        ]
        await self.app(scope, _replay(raw, receive), send)

    def _route(self, method: str, path: str) -> Route:
        if path != "/metrics":
            m = _VERSIONED.match(path)
            if not m:
                raise Refusal(404, "not-found", f"no route {path}")
            if m.group(1) != API_VERSION:
                raise Refusal(
                    404,
                    "version-mismatch",
                    f"this engine speaks {API_VERSION}, not {m.group(1)}",
                    supported=[API_VERSION],
                )
        same_path = [r for r in self.routes if r.pattern.match(path)]
        for r in same_path:
            if r.method == method:
                return r
        if same_path:
            allowed = sorted(r.method for r in same_path)
            raise Refusal(405, "method-not-allowed", f"{path} does not serve {method}", allowed=allowed)
        if method not in SERVED_METHODS:
            raise Refusal(405, "method-not-allowed", f"method {method!r} is not served here", allowed=SERVED_METHODS)
        raise Refusal(404, "not-found", f"no route {method} {path}")

    def _auth(self, headers: dict[str, str]) -> None:
        got = headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(errors="replace"), f"Bearer {self.token}".encode()):
            raise Refusal(
                401,
                "unauthorized",
                "missing or wrong admin token",
                hint="pass --token or BSR_TOKEN (the embedded engine's token is in its state directory)",
            )

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | None:
        """The whole body, once the route and the token are known good: strangers cannot make the engine buffer."""
        if headers.get("transfer-encoding"):
            raise Refusal(411, "bad-request", "chunked bodies are not accepted: send Content-Length")
        text = headers.get("content-length", "0").strip() or "0"
        if not text.isascii() or not text.isdigit():
            raise Refusal(400, "bad-request", f"bad Content-Length {text[:40]!r}")
        length = int(text)
        if length > self.max_body:
            raise Refusal(
                413,
                "bad-request",
                f"body of {length:,} bytes is over this engine's limit of {self.max_body:,}",
                hint="the limit follows from the engine's prompt limit (--max-tokens)",
            )
        chunks: list[bytes] = []
        got = 0
        while got < length:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            chunks.append(chunk)
            got += len(chunk)
            if not msg.get("more_body", False):
                break
        if got != length:
            raise Refusal(400, "bad-request", "the body ended before Content-Length bytes")
        return b"".join(chunks)


def _replay(raw: bytes, receive: Receive) -> Receive:
    """The body once, then the connection's own messages (so a disconnect still reaches a streaming answer)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay
