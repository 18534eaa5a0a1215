"""The ASGI layer in front of the FastAPI app: what must happen before a byte of a body is read.

FastAPI reads a request's body before any dependency runs, so these are checked here instead, in this order:

- the head: over 16 KiB of line and headers is a 431; a ``Host`` that is not one of the engine's names (loopback
  names by default) or an ``Origin`` from another site is a 403 (a web page cannot drive the engine, whatever a
  browser lets it send); a second ``Authorization``, ``Host``, ``Origin``, ``Content-Type`` or ``Content-Length``
  header is a 400 (never "the last one wins");
- the route: an unknown path is a JSON 404 (a wrong API version says so), a method a path does not serve a JSON
  405 with ``Allow``, a query parameter the route does not take, or one given twice, a 400;
- the token: every route but ``/health`` (and ``/metrics`` where the engine serves it openly) needs the bearer
  token, reads included (401);
- capacity: requests without the token share a few serving slots, requests with it have their own (503 ``busy``
  past either): strangers cannot use up what the operator needs. A submit or a restore (a *queued* route: its
  work may wait for destination KV or for room in B) takes no serving slot: it takes a place in the engine's
  request queue (``max_queued``, 503 ``busy`` past it), whatever it then waits for, so requests waiting for
  capacity never leave the operator's reads without a slot;
- the body: a chunked body is a 411, one over the cap a 413, one that is not ``application/json`` a 415, all
  answered without reading it (and with ``Connection: close`` when one is left unread). Then it is read whole and
  checked to be a UTF-8 JSON object (no NaN, no absurd nesting or integers, no key given twice) and handed on;
  FastAPI validates it against the route's model.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from bsr_cli import API_VERSION
from bsr_cli.core import wire
from bsr_cli.core.results import ErrorBody

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

SERVED_METHODS = ("DELETE", "GET", "POST")
_VERSIONED = re.compile(r"/bsr/(v\d+)(/.*)?", re.DOTALL)  # fullmatch; a path parameter may hold any character


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # a template: /bsr/v1/restores/{id}/abort
    auth: bool
    json_body: bool
    pattern: re.Pattern[str] = field(compare=False)
    query: frozenset[str] = frozenset()  # the query parameters it takes (any other is refused)
    repeatable: frozenset[str] = frozenset()  # those that take a list (`kind=a&kind=b`): given more than once
    queued: bool = False  # its work may wait for engine capacity: a place in the request queue, not a slot


def route(
    method: str,
    path: str,
    *,
    auth: bool,
    json_body: bool,
    query: Iterable[str] = (),
    repeatable: Iterable[str] = (),
    queued: bool = False,
) -> Route:
    regex = re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(path))
    pattern = re.compile(regex, re.DOTALL)
    return Route(method, path, auth, json_body, pattern, frozenset(query), frozenset(repeatable), queued)


class Refusal(Exception):
    """A request refused before the app sees it: its status and its answer (``allowed``: the methods a path serves,
    for a 405; ``supported``: the API versions this engine speaks, for a version mismatch)."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        hint: str | None = None,
        *,
        allowed: Sequence[str] = (),
        supported: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(
            error=kind, message=message, hint=hint, allowed=tuple(allowed), supported=tuple(supported)
        )


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


def _content_length(headers: dict[str, str]) -> int | None:
    """The body length a request declares (0 when it declares none), or None when its Content-Length is not a
    decimal number."""
    text = headers.get("content-length", "0").strip() or "0"
    return int(text) if text.isascii() and text.isdigit() else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _no_duplicates(pairs: list[tuple[str, wire.JsonValue]]) -> wire.JsonObject:
    out: wire.JsonObject = {}
    for key, value in pairs:
        if key in out:
            raise Refusal(400, "bad-request", f"body gives the key {key!r} more than once")
        out[key] = value
    return out


def check_json(raw: bytes) -> None:
    """Refuse a body that is not a UTF-8 JSON object, with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Refusal(400, "bad-request", "body is not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise Refusal(400, "bad-request", f"body is not JSON: {e.msg}") from None
    except RecursionError:
        raise Refusal(400, "bad-request", "body is nested too deeply") from None
    except ValueError as e:  # NaN/Infinity, or an integer with thousands of digits
        raise Refusal(400, "bad-request", f"body is not acceptable JSON: {e}") from None
    if not isinstance(data, dict):
        raise Refusal(400, "bad-request", "body must be a JSON object")


RETRY_AFTER_S = 1  # what a 503 busy says in Retry-After
MAX_HEAD_BYTES = 16 * 1024  # the request line and headers together (docs/admin-api.md)
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_SINGLE = (b"authorization", b"host", b"origin", b"content-type", b"content-length")
_JSON_TYPES = ("application/json",)


def allowed_host_names(bound_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a request may give in ``Host`` (and an ``Origin`` may carry): loopback names, the address the
    server is bound to (unless a wildcard), and the operator's own (``--allow-host``)."""
    names = set(LOOPBACK_NAMES) | {h.strip().lower().strip("[]") for h in extra if h.strip()}
    if bound_host not in WILDCARD_HOSTS:
        names.add(bound_host.lower().strip("[]"))
    return frozenset(names)


def _host_name(value: str) -> str:
    """``example.org:8080`` → ``example.org``; ``[::1]:80`` → ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """Wraps the app. ``routes``: what it serves; ``token``: the bearer token; ``max_body``: the body cap;
    ``hosts``: the names ``Host`` and ``Origin`` may carry; ``open_paths``: paths served without the token;
    ``max_serving``/``max_anonymous``: serving slots for requests with and without the token; ``max_queued``: places
    in the request queue (submits and restores with the token, running or waiting)."""

    def __init__(
        self,
        app: ASGIApp,
        routes: list[Route],
        *,
        token: str,
        max_body: int,
        on_request: Callable[[], None],
        hosts: frozenset[str] = LOOPBACK_NAMES,
        open_paths: frozenset[str] = frozenset(),
        max_serving: int = 64,
        max_anonymous: int = 8,
        max_queued: int = 1024,
        trusted: set[tuple[str, int]] | None = None,
    ) -> None:
        self.app, self.routes, self.token, self.max_body, self.on_request = app, routes, token, max_body, on_request
        self.hosts, self.open_paths = hosts, open_paths
        self.max_serving, self.max_anonymous = max_serving, max_anonymous
        self.max_queued = max_queued
        self.serving = {True: 0, False: 0}  # requests being answered, by whether they showed the token
        self.queued = 0  # submits and restores in the request queue (running or waiting for capacity)
        # Shared with the protocol (same event loop): connections that showed the token are kept between requests.
        self.trusted = trusted if trusted is not None else set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.on_request()
        raw_headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw_headers}
        has_body = bool(headers.get("transfer-encoding")) or headers.get("content-length", "0").strip() not in ("", "0")
        slot: bool | None = None
        queued = False
        try:
            self._check_head(scope, raw_headers, headers)
            r = self._route(scope["method"], scope["path"])
            self._check_query(r, scope.get("query_string") or b"")
            authed = self._authenticated(headers)
            if authed and scope.get("client"):
                host, port = scope["client"]
                self.trusted.add((str(host), int(port)))
            if not authed and r.auth and scope["path"] not in self.open_paths:
                raise Refusal(
                    401,
                    "unauthorized",
                    "missing or wrong admin token",
                    hint="pass --token or BSR_TOKEN (the embedded engine's token is in its state directory)",
                )
            if r.queued and authed:
                queued = self._take_queue_place()
            else:
                slot = self._take_slot(authed)
            raw = await self._read_body(headers, receive)
            if raw is None:
                return  # the client went away mid-body: nobody to answer
            if raw:
                self._check_media_type(headers)
            if r.json_body:
                raw = raw or b"{}"  # no body is an empty object, as it always was
                check_json(raw)
            scope["headers"] = [(k, v) for k, v in raw_headers if k.lower() != b"content-type"] + [
                (b"content-type", b"application/json")
            ]
            await self.app(scope, _replay(raw, receive), send)
        except Refusal as e:
            # An unread body must never be parsed as the next request: close the connection after answering (the
            # protocol reads and drops what the client still sends after the answer, so the close does not reset
            # the connection under the answer: protocol.Lingering).
            extra_headers = {"Allow": ", ".join(e.body.allowed)} if e.status == 405 else None
            if e.status == 503:
                extra_headers = {"Retry-After": f"{RETRY_AFTER_S}"}
            await send_json(send, e.status, e.body.to_wire(), close=has_body, headers=extra_headers)
        finally:
            if slot is not None:
                self.serving[slot] -= 1
            if queued:
                self.queued -= 1

    def _check_head(self, scope: Scope, raw: list[tuple[bytes, bytes]], headers: dict[str, str]) -> None:
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
        size += sum(len(k) + len(v) + 4 for k, v in raw)
        if size > MAX_HEAD_BYTES:
            raise Refusal(431, "bad-request", f"request head of {size:,} bytes is over the limit of {MAX_HEAD_BYTES:,}")
        names = [k.lower() for k, _ in raw]
        for single in _SINGLE:
            if names.count(single) > 1:
                raise Refusal(400, "bad-request", f"the {single.decode()} header is given more than once")
        host = headers.get("host")
        if host is not None and _host_name(host) not in self.hosts:
            raise Refusal(
                403,
                "forbidden-host",
                f"this engine does not answer to the host name {host[:80]!r}",
                hint="use a loopback address, or start the engine with --allow-host NAME",
            )
        origin = headers.get("origin")
        if origin is not None:
            scheme, sep, rest = origin.strip().lower().partition("://")
            if not sep or scheme not in ("http", "https") or _host_name(rest.split("/", 1)[0]) not in self.hosts:
                raise Refusal(
                    403,
                    "forbidden-origin",
                    f"requests from the web origin {origin[:80]!r} are not served",
                    hint="the admin API serves tools, not web pages of other sites",
                )

    def _check_query(self, r: Route, raw: bytes) -> None:
        """Only the route's own query parameters, each at most once (never "the last one wins") unless it takes a
        list."""
        seen: set[str] = set()
        for name, _ in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
            if name not in r.query:
                known = ", ".join(sorted(r.query)) or "none"
                raise Refusal(
                    400, "invalid-input", f"unknown query parameter {name[:40]!r} (this route takes: {known})"
                )
            if name in seen and name not in r.repeatable:
                raise Refusal(400, "invalid-input", f"the query parameter {name!r} is given more than once")
            seen.add(name)

    def _check_media_type(self, headers: dict[str, str]) -> None:
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media not in _JSON_TYPES:
            raise Refusal(
                415,
                "bad-request",
                f"a body must be sent as application/json, not {media or 'without a Content-Type'}",
                hint="send Content-Type: application/json",
            )

    def _take_slot(self, authed: bool) -> bool:
        cap = self.max_serving if authed else self.max_anonymous
        if self.serving[authed] >= cap:
            who = "with" if authed else "without"
            hint = f"retry after {RETRY_AFTER_S}s, or keep fewer than {cap} requests in flight at once"
            raise Refusal(503, "busy", f"all {cap} serving slots for requests {who} the token are in use", hint)
        self.serving[authed] += 1
        return authed

    def _take_queue_place(self) -> bool:
        if self.queued >= self.max_queued:
            raise Refusal(
                503,
                "busy",
                f"the engine's request queue is full: {self.max_queued} submits and restores are running or "
                "waiting for capacity",
                f"retry after {RETRY_AFTER_S}s, or keep fewer than {self.max_queued} submits and restores in flight",
            )
        self.queued += 1
        return True

    def _route(self, method: str, path: str) -> Route:
        if path != "/metrics":
            m = _VERSIONED.fullmatch(path)
            if not m:
                raise Refusal(404, "not-found", f"no route {path}")
            if m.group(1) != API_VERSION:
                raise Refusal(
                    404,
                    "version-mismatch",
                    f"this engine speaks {API_VERSION}, not {m.group(1)}",
                    supported=[API_VERSION],
                )
        same_path = [r for r in self.routes if r.pattern.fullmatch(path)]
        for r in same_path:
            if r.method == method:
                return r
        if same_path:
            allowed = sorted(r.method for r in same_path)
            raise Refusal(405, "method-not-allowed", f"{path} does not serve {method}", allowed=allowed)
        if method not in SERVED_METHODS:
            raise Refusal(405, "method-not-allowed", f"method {method!r} is not served here", allowed=SERVED_METHODS)
        raise Refusal(404, "not-found", f"no route {method} {path}")

    def _authenticated(self, headers: dict[str, str]) -> bool:
        got = headers.get("authorization", "")
        return hmac.compare_digest(got.encode(errors="replace"), f"Bearer {self.token}".encode())

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes | None:
        """The whole body, once the route and the token are known good: strangers cannot make the engine buffer."""
        if headers.get("transfer-encoding"):
            raise Refusal(411, "bad-request", "chunked bodies are not accepted: send Content-Length")
        length = _content_length(headers)
        if length is None:
            raise Refusal(400, "bad-request", f"bad Content-Length {headers['content-length'].strip()[:40]!r}")
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
