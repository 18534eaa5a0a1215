"""The engine's admin HTTP API (``/bsr/v1/...``), served by any host of the BSR runtime.

Standard library only (``http.server``), one thread per connection. Loopback by default; every state-changing
route needs ``Authorization: Bearer <token>``, checked before a byte of the body is read; every body is validated
strictly and answered with a clear 4xx JSON error (a malformed body is never a 5xx). The server defends itself:
a body size cap that follows from the prompt limit, a deadline for a request's line, headers and body, an idle
timeout between requests, a cap on open connections, and 405 (JSON) for methods it does not serve.
Long operations (restore, submit) can stream NDJSON progress: one JSON object per line, the last being the
result. The routes are documented in docs/admin-api.md and docs/openapi.json.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import queue
import re
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bsr_cli import API_VERSION
from bsr_cli.core import limits
from bsr_cli.core.commit import COMMITTED, FAILED_CLOSED
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.errors import BadRequest, BsrError, CapacityError, FaultsDisabled, InvalidInput
from bsr_cli.runtime.coordinator import Coordinator

# A body never needs more than the longest prompt as JSON token ids plus room for the other fields: an id is at most
# 10 digits, and pretty-printed JSON adds a comma, a newline and indentation ("4294967295,\n    " is 16 bytes).
BODY_BYTES_PER_TOKEN = 24
BODY_OVERHEAD = 64 << 10
REQUEST_DEADLINE_S = 30.0  # request line, headers and body must all arrive within this
IDLE_TIMEOUT_S = 10.0  # no byte for this long (between requests, or mid-request) closes the connection
MAX_CONNECTIONS = 64
PREFIX = f"/bsr/{API_VERSION}"
_VERSIONED = re.compile(r"^/bsr/(v\d+)(/.*)?$")


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str, hint: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.hint, self.extra = status, kind, message, hint, extra


def _status_for(e: BsrError) -> int:
    if isinstance(e, FaultsDisabled):
        return HTTPStatus.FORBIDDEN
    if isinstance(e, CapacityError):
        return HTTPStatus.CONFLICT
    if isinstance(e, InvalidInput | BadRequest):
        return HTTPStatus.BAD_REQUEST
    return HTTPStatus.INTERNAL_SERVER_ERROR


def tokens_from_body(body: dict[str, Any], max_tokens: int) -> list[int]:
    has_t, has_s = "tokens" in body, "synthetic" in body
    if has_t == has_s:
        raise InvalidInput("give exactly one of 'tokens' or 'synthetic'")
    if has_s:
        syn = body["synthetic"]
        if not isinstance(syn, dict) or set(syn) - {"n", "seed"} or not isinstance(syn.get("n"), int):
            raise InvalidInput('\'synthetic\' must be {"n": int, "seed": int}')
        n, seed = syn["n"], syn.get("seed", 0)
        if not isinstance(seed, int) or n <= 0:
            raise InvalidInput("synthetic n must be positive and seed an integer")
        if n > max_tokens:
            raise BadRequest(f"prompt of {n:,} tokens exceeds this engine's limit of {max_tokens:,}")
        return synthetic_tokens(n, seed)
    toks = body["tokens"]
    if not isinstance(toks, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in toks
    ):
        raise InvalidInput("'tokens' must be a list of integers in [0, 2^32)")
    if not toks:
        raise InvalidInput("'tokens' must not be empty")
    if len(toks) > max_tokens:
        raise BadRequest(f"prompt of {len(toks):,} tokens exceeds this engine's limit of {max_tokens:,}")
    return toks


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _flag(q: dict[str, str], key: str, default: bool) -> bool:
    v = q.get(key)
    if v is None:
        return default
    if v not in ("0", "1"):
        raise InvalidInput(f"?{key}= must be 0 or 1")
    return v == "1"


def _opt_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise InvalidInput(f"'{key}' must be true or false")
    return v


def _exclude_tiers(body: dict[str, Any], tiers: tuple[str, ...] | list[str]) -> list[str]:
    v = body.get("exclude_tiers")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v) or set(v) - set(tiers):
        raise InvalidInput(f"exclude_tiers must be a list naming tiers of this engine: {list(tiers)}")
    return v


def _fields(body: dict[str, Any], allowed: set[str]) -> None:
    extra = set(body) - allowed
    if extra:
        raise InvalidInput(f"unknown field(s): {', '.join(sorted(extra))}")


def _opt_int(body: dict[str, Any], key: str, minimum: int = 0) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise InvalidInput(f"'{key}' must be an integer >= {minimum}")
    return v


class _Server(ThreadingHTTPServer):
    """A threading HTTP server with a cap on open connections and a reaper for requests past their deadline."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._dl_lock = threading.Lock()
        self._stopping = threading.Event()
        self.refused = 0

    # -- the connection cap: past it a connection gets one 503 line and is closed, without a thread ------------
    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.clear_deadline(request)
            self._slots.release()

    # -- request deadlines: a slow or half-sent request is cut off, however it trickles its bytes --------------
    def set_deadline(self, sock: socket.socket, seconds: float) -> None:
        with self._dl_lock:
            self._deadlines[sock] = time.monotonic() + seconds

    def clear_deadline(self, sock: socket.socket) -> None:
        with self._dl_lock:
            self._deadlines.pop(sock, None)

    def reap(self) -> None:
        while not self._stopping.wait(0.25):
            now = time.monotonic()
            with self._dl_lock:
                late = [sk for sk, dl in self._deadlines.items() if dl <= now]
                for sk in late:
                    del self._deadlines[sk]
            for sk in late:
                with contextlib.suppress(OSError):
                    sk.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns EOF and it ends

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()


def _refuse(request: Any) -> None:
    body = json.dumps({"error": "busy", "message": "too many open connections", "hint": "retry shortly"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\nX-BSR-API: {API_VERSION}\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        request.settimeout(1.0)
        request.sendall(head.encode() + body)


class AdminServer:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_shutdown: Callable[[], None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.coordinator = coordinator
        self.token = token
        self.on_shutdown = on_shutdown
        self.max_body = BODY_OVERHEAD + BODY_BYTES_PER_TOKEN * max(coordinator.settings.max_tokens, 0)
        self.request_deadline_s = request_deadline_s
        server = self

        class Handler(_Handler):
            admin = server
            timeout = idle_timeout_s  # the socket timeout: no byte for this long ends the connection

        self.httpd = _Server((host, port), Handler, max_connections)
        self.host, self.port = str(self.httpd.server_address[0]), int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self._reaper: threading.Thread | None = None
        self.counters = {COMMITTED: 0, FAILED_CLOSED: 0, "submitted": 0, "http_requests": 0}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> None:
        self._reaper = threading.Thread(target=self.httpd.reap, name="bsr-admin-reaper", daemon=True)
        self._reaper.start()
        self._thread = threading.Thread(target=self.serve_forever, name="bsr-admin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    admin: AdminServer
    _raw: bytes = b""
    _body_read = False
    protocol_version = "HTTP/1.1"
    server_version = "bsr-admin"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the event log and metrics tell what happened; per-request lines would drown the engine log

    @property
    def _server(self) -> _Server:
        return self.admin.httpd

    def handle_one_request(self) -> None:
        # The request line, the headers and the body must all arrive before the deadline; _read_body clears it.
        self._server.set_deadline(self.connection, self.admin.request_deadline_s)
        try:
            super().handle_one_request()
        except OSError:
            self.close_connection = True  # the peer went away or timed out mid-request: nothing to answer
        finally:
            self._server.clear_deadline(self.connection)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _send_json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-BSR-API", API_VERSION)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, e: HttpError) -> None:
        if not self._body_read and self._has_body():
            self.close_connection = True  # an unread body must never be parsed as the next request
        headers = {"Allow": ", ".join(e.extra["allowed"])} if e.status == HTTPStatus.METHOD_NOT_ALLOWED else None
        self._send_json(e.status, {"error": e.kind, "message": e.message, "hint": e.hint, **e.extra}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Errors the stdlib raises itself (bad request line, oversized headers, unknown methods), as JSON."""
        self.close_connection = True
        allowed = ["DELETE", "GET", "POST"]
        if code == HTTPStatus.NOT_IMPLEMENTED:  # a method no route serves
            err = HttpError(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method-not-allowed",
                f"method {self.command!r} is not served here",
                allowed=allowed,
            )
        else:
            phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
            err = HttpError(code, "bad-request", message or phrase)
        with contextlib.suppress(OSError):
            self._send_json(
                err.status,
                {"error": err.kind, "message": err.message, "hint": err.hint, **err.extra},
                {"Allow": ", ".join(allowed)} if err.status == HTTPStatus.METHOD_NOT_ALLOWED else None,
            )

    def _has_body(self) -> bool:
        return bool(self.headers.get("Transfer-Encoding")) or self.headers.get("Content-Length", "0").strip() not in (
            "",
            "0",
        )

    def _read_body(self) -> None:
        """Read the body, once the route and the token are known good: strangers cannot make the engine buffer."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise HttpError(
                HTTPStatus.LENGTH_REQUIRED, "bad-request", "chunked bodies are not accepted: send Content-Length"
            )
        text = (self.headers.get("Content-Length") or "0").strip()
        if not text.isascii() or not text.isdigit():
            self.close_connection = True
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", f"bad Content-Length {text[:40]!r}")
        length, cap = int(text), self.admin.max_body
        if length > cap:
            self.close_connection = True
            raise HttpError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "bad-request",
                f"body of {length:,} bytes is over this engine's limit of {cap:,}",
                hint="the limit follows from the engine's prompt limit (--max-tokens)",
            )
        self._raw = self.rfile.read(length) if length else b""
        if len(self._raw) < length:
            self.close_connection = True
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", "the body ended before Content-Length bytes")
        self._body_read = True
        self._server.clear_deadline(self.connection)

    def _body(self) -> dict[str, Any]:
        raw = self._raw
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", "body is not UTF-8 text") from None
        try:
            data = json.loads(text or "{}", parse_constant=_no_constant)
        except json.JSONDecodeError as e:
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", f"body is not JSON: {e.msg}") from None
        except RecursionError:
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", "body is nested too deeply") from None
        except ValueError as e:  # NaN/Infinity, or an integer with thousands of digits
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", f"body is not acceptable JSON: {e}") from None
        if not isinstance(data, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", "body must be a JSON object")
        return data

    def _auth(self) -> None:
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.admin.token}"
        if not hmac.compare_digest(got.encode(errors="replace"), want.encode()):
            raise HttpError(
                HTTPStatus.UNAUTHORIZED,
                "unauthorized",
                "missing or wrong admin token",
                hint="pass --token or BSR_TOKEN (the embedded engine's token is in its state directory)",
            )

    def _route(self, method: str) -> None:
        self.admin.counters["http_requests"] += 1
        self._raw, self._body_read = b"", False
        try:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            if url.path == "/metrics":
                if method != "GET":
                    raise HttpError(
                        HTTPStatus.METHOD_NOT_ALLOWED, "method-not-allowed", "/metrics is GET only", allowed=["GET"]
                    )
                self._read_body()
                return self._metrics()
            m = _VERSIONED.match(url.path)
            if not m:
                raise HttpError(HTTPStatus.NOT_FOUND, "not-found", f"no route {url.path}")
            if m.group(1) != API_VERSION:
                raise HttpError(
                    HTTPStatus.NOT_FOUND,
                    "version-mismatch",
                    f"this engine speaks {API_VERSION}, not {m.group(1)}",
                    supported=[API_VERSION],
                )
            pattern = _pattern(m.group(2) or "/")
            handler = ROUTES.get((method, pattern))
            if handler is None:
                allowed = sorted(mm for mm, pp in ROUTES if pp == pattern)
                if allowed:
                    raise HttpError(
                        HTTPStatus.METHOD_NOT_ALLOWED,
                        "method-not-allowed",
                        f"{url.path} does not serve {method}",
                        allowed=allowed,
                    )
                raise HttpError(HTTPStatus.NOT_FOUND, "not-found", f"no route {method} {url.path}")
            name, needs_auth = handler
            if needs_auth:
                self._auth()
            self._read_body()
            getattr(self, name)(query, m.group(2) or "/")
        except HttpError as e:
            self._error(e)
        except BsrError as e:
            self._error(HttpError(_status_for(e), e.kind, e.message, e.hint))
        except OSError:
            self.close_connection = True  # the client went away (or stopped reading): nothing to answer
        except Exception as e:  # noqa: BLE001 - the server survives any handler bug and says so
            self._error(HttpError(HTTPStatus.INTERNAL_SERVER_ERROR, "server-error", f"{type(e).__name__}: {e}"))

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    # -- streaming ---------------------------------------------------------------------------------------------
    def _stream(self, request: str, work: Callable[[Callable[[dict[str, Any]], None]], dict[str, Any]]) -> None:
        """Run ``work`` in a thread, streaming its progress events as NDJSON; a client that goes away aborts it."""
        q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["result"] = work(q.put)
            except BsrError as e:
                result["error"] = {"error": e.kind, "message": e.message, "hint": e.hint, "status": _status_for(e)}
            except Exception as e:  # noqa: BLE001 - reported in the stream
                result["error"] = {"error": "server-error", "message": f"{type(e).__name__}: {e}", "status": 500}
            finally:
                q.put(None)

        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-BSR-API", API_VERSION)
        self.end_headers()
        t = threading.Thread(target=run, name=f"bsr-{request}", daemon=True)
        t.start()
        try:
            self._chunk({"type": "accepted", "request": request})
            while True:
                ev = q.get()
                if ev is None:
                    break
                self._chunk({"type": "event", "event": ev})
            if "error" in result:
                self._chunk({"type": "error", **result["error"]})
            else:
                self._chunk({"type": "result", "result": result["result"]})
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            # The operator went away mid-restore (Ctrl-C): end it fail-closed rather than leave it running.
            self.admin.coordinator.abort(request)
            t.join(timeout=5)

    def _chunk(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, default=str) + "\n").encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # -- routes ------------------------------------------------------------------------------------------------
    def health(self, q: dict[str, str], path: str) -> None:
        h = self.admin.coordinator.health()
        self._send_json(HTTPStatus.OK if h["ok"] else HTTPStatus.SERVICE_UNAVAILABLE, h | {"api": API_VERSION})

    def info(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, self.admin.coordinator.info())

    def registration(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, self.admin.coordinator.reg.to_dict())

    def probe(self, q: dict[str, str], path: str) -> None:
        body = self._body()
        _fields(body, {"tokens", "synthetic", "exclude_tiers"})
        c = self.admin.coordinator
        tokens = tokens_from_body(body, c.settings.max_tokens)
        exclude = _exclude_tiers(body, c.settings.tiers)
        bitmap, errors = c.probe(tokens)
        brk = bitmap.first_break(exclude)
        self._send_json(
            HTTPStatus.OK,
            {
                "kind": "bsr.probe",
                "bitmap": bitmap.to_dict(),
                "registration_spec": c.reg.to_dict(),
                "committable_chunks": bitmap.prefix_chunks(exclude),
                "committable_tokens": bitmap.prefix_tokens(exclude),
                "first_break": brk.to_dict() if brk else None,
                "tier_errors": errors,
                "markers": [m.to_dict() for m in c.markers.values()],
            },
        )

    def _prompt_request(self, extra: set[str]) -> tuple[dict[str, Any], list[int], int | None, bool]:
        """The body of a request about one prompt: (body, tokens, W, verify), strictly validated."""
        body = self._body()
        _fields(body, {"tokens", "synthetic", "W", "verify", "stream"} | extra)
        tokens = tokens_from_body(body, self.admin.coordinator.settings.max_tokens)
        return body, tokens, _opt_int(body, "W"), _opt_bool(body, "verify", True)

    def submit(self, q: dict[str, str], path: str) -> None:
        body, tokens, w, verify = self._prompt_request({"store"})
        c = self.admin.coordinator
        store = _opt_bool(body, "store", True)
        stream = _opt_bool(body, "stream", False)
        self.admin.counters["submitted"] += 1
        if stream:
            rid = c.new_request_id()
            return self._stream(
                rid, lambda emit: c.submit(tokens, w=w, verify=verify, store=store, progress=emit, request=rid)
            )
        self._send_json(HTTPStatus.OK, c.submit(tokens, w=w, verify=verify, store=store))

    def restore(self, q: dict[str, str], path: str) -> None:
        body, tokens, w, verify = self._prompt_request({"exclude_tiers"})
        c = self.admin.coordinator
        exclude = _exclude_tiers(body, c.settings.tiers)
        stream = _opt_bool(body, "stream", True)
        rid = c.new_request_id()

        def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
            res = c.restore(tokens, w=w, verify=verify, exclude=exclude, progress=emit, request=rid)
            key = COMMITTED if res.get("committed_tokens") else FAILED_CLOSED
            if res.get("outcome") in (COMMITTED, FAILED_CLOSED):
                self.admin.counters[key] += 1
            return res

        if stream:
            return self._stream(rid, work)
        self._send_json(HTTPStatus.OK, work(lambda ev: None))

    def abort(self, q: dict[str, str], path: str) -> None:
        rid = path.split("/")[2]
        if not self.admin.coordinator.abort(rid):
            raise HttpError(HTTPStatus.NOT_FOUND, "unknown-request", f"no request {rid} is open on this engine")
        self._send_json(HTTPStatus.OK, {"request": rid, "aborting": True})

    def pool(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"ranks": self.admin.coordinator.pool(health=_flag(q, "health", False))})

    def reset_peak(self, q: dict[str, str], path: str) -> None:
        self.admin.coordinator.reset_peak()
        self._send_json(HTTPStatus.OK, {"ok": True})

    def settings(self, q: dict[str, str], path: str) -> None:
        body = self._body()
        _fields(body, {"budget_bytes", "fs_concurrency", "W"})
        c = self.admin.coordinator
        s = c.settings
        budget = body.get("budget_bytes", s.budget_bytes)
        fsc = body.get("fs_concurrency", s.fs_concurrency)
        w = body.get("W", s.w)
        # Validate the whole resulting set first (the same check `bsr engine up` runs): nothing is half-applied.
        limits.check_engine_settings(
            c.reg,
            w=w,
            pool_bytes=s.pool_bytes or None,
            budget_bytes=budget,
            max_tokens=s.max_tokens,
            kv_tokens=s.kv_tokens,
            fs_concurrency=fsc,
            fetch_timeout_s=s.fetch_timeout_s,
            window_within_budget=False,  # B may be set for the W of particular requests (the benchmarks do)
        )
        if "budget_bytes" in body:
            c._all("set_budget", budget_bytes=budget)
            s.budget_bytes = budget
        if "fs_concurrency" in body:
            c._all("set_fs_concurrency", value=fsc)
            s.fs_concurrency = fsc
        s.w = w
        self._send_json(HTTPStatus.OK, c.info())

    def snapshot(self, q: dict[str, str], path: str) -> None:
        since = q.get("events_since")
        if since is not None and not (since.isascii() and since.isdigit()):
            raise InvalidInput("events_since must be a non-negative integer")
        snap = self.admin.coordinator.snapshot(
            health=_flag(q, "health", True), events_since=int(since) if since is not None else None
        )
        self._send_json(HTTPStatus.OK, snap)

    def events(self, q: dict[str, str], path: str) -> None:
        try:
            since, wait = int(q.get("since", "0")), float(q.get("wait", "0"))
        except ValueError:
            raise InvalidInput("since must be an integer and wait a number of seconds") from None
        if not math.isfinite(wait) or wait < 0 or since < 0:
            raise InvalidInput("since must be a non-negative integer and wait a finite, non-negative number")
        wait = min(wait, 30.0)
        evs = self.admin.coordinator.events.since(since, wait_s=wait)
        self._send_json(HTTPStatus.OK, {"events": evs, "last_seq": self.admin.coordinator.events.last_seq})

    def faults_list(self, q: dict[str, str], path: str) -> None:
        c = self.admin.coordinator
        self._send_json(HTTPStatus.OK, {"enabled": c.settings.faults_enabled, "faults": c.list_faults()})

    def faults_inject(self, q: dict[str, str], path: str) -> None:
        f = self.admin.coordinator.inject(self._body())
        self._send_json(HTTPStatus.CREATED, f.to_dict())

    def faults_clear(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"cleared": self.admin.coordinator.clear_faults()})

    def markers_list(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"markers": [m.to_dict() for m in self.admin.coordinator.markers.values()]})

    def markers_clear(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"cleared": self.admin.coordinator.clear_markers()})

    def shutdown(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"ok": True})
        if self.admin.on_shutdown:
            threading.Thread(target=self.admin.on_shutdown, daemon=True).start()

    def _metrics(self) -> None:
        from bsr_cli.runtime import metrics

        text = metrics.exposition(self.admin.coordinator, submitted=self.admin.counters["submitted"])
        body = text.encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _pattern(path: str) -> str:
    return re.sub(r"^/restores/[^/]+/abort$", "/restores/{id}/abort", path)


# (method, path) -> (handler method, needs token)
ROUTES: dict[tuple[str, str], tuple[str, bool]] = {
    ("GET", "/health"): ("health", False),
    ("GET", "/info"): ("info", False),
    ("GET", "/registration"): ("registration", False),
    ("POST", "/probe"): ("probe", False),
    ("POST", "/requests"): ("submit", True),
    ("POST", "/restore"): ("restore", True),
    ("POST", "/restores/{id}/abort"): ("abort", True),
    ("GET", "/pool"): ("pool", False),
    ("POST", "/pool/reset-peak"): ("reset_peak", True),
    ("POST", "/settings"): ("settings", True),
    ("GET", "/snapshot"): ("snapshot", False),
    ("GET", "/events"): ("events", False),
    ("GET", "/faults"): ("faults_list", False),
    ("POST", "/faults"): ("faults_inject", True),
    ("DELETE", "/faults"): ("faults_clear", True),
    ("GET", "/markers"): ("markers_list", False),
    ("DELETE", "/markers"): ("markers_clear", True),
    ("POST", "/shutdown"): ("shutdown", True),
}
