"""The engine's admin HTTP API (``/bsr/v1/...``), served by any host of the BSR runtime.

Standard library only (``http.server``), one thread per connection. Loopback by default; every state-changing
route needs ``Authorization: Bearer <token>``; every body is validated strictly and answered with a clear 4xx.
Long operations (restore, submit) can stream NDJSON progress: one JSON object per line, the last being the
result. The routes are documented in docs/admin-api.md and docs/openapi.json.
"""

from __future__ import annotations

import hmac
import json
import queue
import re
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bsr_cli import API_VERSION
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.errors import BadRequest, BsrError, CapacityError, FaultsDisabled, InvalidInput
from bsr_cli.runtime.coordinator import Coordinator

MAX_BODY = 64 << 20
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
    return toks


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


class AdminServer:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        on_shutdown: Callable[[], None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.token = token
        self.on_shutdown = on_shutdown
        server = self

        class Handler(_Handler):
            admin = server

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = str(self.httpd.server_address[0]), int(self.httpd.server_address[1])
        self._thread: threading.Thread | None = None
        self.counters = {"committed": 0, "failed_closed": 0, "submitted": 0, "http_requests": 0}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="bsr-admin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    admin: AdminServer
    _raw: bytes = b""
    protocol_version = "HTTP/1.1"
    server_version = "bsr-admin"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the event log and metrics tell what happened; per-request lines would drown the engine log

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _send_json(self, status: int, data: Any) -> None:
        body = json.dumps(data, default=str).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-BSR-API", API_VERSION)
        self.end_headers()
        self.wfile.write(body)

    def _error(self, e: HttpError) -> None:
        self._send_json(e.status, {"error": e.kind, "message": e.message, "hint": e.hint, **e.extra})

    def _read_body(self) -> None:
        # Read every body up front, even on routes that ignore it: a keep-alive connection must never carry
        # unread bytes into the next request.
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            raise HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "bad-request", f"body over {MAX_BODY} bytes")
        self._raw = self.rfile.read(length) if length else b""

    def _body(self) -> dict[str, Any]:
        raw = self._raw
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", f"body is not JSON: {e.msg}") from None
        if not isinstance(data, dict):
            raise HttpError(HTTPStatus.BAD_REQUEST, "bad-request", "body must be a JSON object")
        return data

    def _auth(self) -> None:
        got = self.headers.get("Authorization", "")
        want = f"Bearer {self.admin.token}"
        if not hmac.compare_digest(got.encode(), want.encode()):
            raise HttpError(
                HTTPStatus.UNAUTHORIZED,
                "unauthorized",
                "missing or wrong admin token",
                hint="pass --token or BSR_TOKEN (the embedded engine's token is in its state directory)",
            )

    def _route(self, method: str) -> None:
        self.admin.counters["http_requests"] += 1
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self._raw = b""
        try:
            if method in ("POST", "DELETE", "PUT"):
                self._read_body()
            if url.path == "/metrics" and method == "GET":
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
            handler = ROUTES.get((method, _pattern(m.group(2) or "/")))
            if handler is None:
                raise HttpError(HTTPStatus.NOT_FOUND, "not-found", f"no route {method} {url.path}")
            name, needs_auth = handler
            if needs_auth:
                self._auth()
            getattr(self, name)(query, m.group(2) or "/")
        except HttpError as e:
            self._error(e)
        except BsrError as e:
            self._error(HttpError(_status_for(e), e.kind, e.message, e.hint))
        except (BrokenPipeError, ConnectionResetError):
            pass
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
        except (BrokenPipeError, ConnectionResetError):
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
        exclude = body.get("exclude_tiers") or []
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
        return body, tokens, _opt_int(body, "W"), bool(body.get("verify", True))

    def submit(self, q: dict[str, str], path: str) -> None:
        body, tokens, w, verify = self._prompt_request({"store"})
        c = self.admin.coordinator
        store = bool(body.get("store", True))
        self.admin.counters["submitted"] += 1
        if body.get("stream"):
            rid = c.new_request_id()
            return self._stream(
                rid, lambda emit: c.submit(tokens, w=w, verify=verify, store=store, progress=emit, request=rid)
            )
        self._send_json(HTTPStatus.OK, c.submit(tokens, w=w, verify=verify, store=store))

    def restore(self, q: dict[str, str], path: str) -> None:
        body, tokens, w, verify = self._prompt_request({"exclude_tiers"})
        c = self.admin.coordinator
        exclude = body.get("exclude_tiers") or []
        if not isinstance(exclude, list) or set(exclude) - set(c.settings.tiers):
            raise InvalidInput(f"exclude_tiers must name tiers of this engine: {list(c.settings.tiers)}")
        rid = c.new_request_id()

        def work(emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
            res = c.restore(tokens, w=w, verify=verify, exclude=exclude, progress=emit, request=rid)
            key = "committed" if res.get("committed_tokens") else "failed_closed"
            if res.get("outcome") in ("committed", "failed_closed"):
                self.admin.counters[key] += 1
            return res

        if body.get("stream", True):
            return self._stream(rid, work)
        self._send_json(HTTPStatus.OK, work(lambda ev: None))

    def abort(self, q: dict[str, str], path: str) -> None:
        rid = path.split("/")[2]
        if not self.admin.coordinator.abort(rid):
            raise HttpError(HTTPStatus.NOT_FOUND, "unknown-request", f"no request {rid} is open on this engine")
        self._send_json(HTTPStatus.OK, {"request": rid, "aborting": True})

    def pool(self, q: dict[str, str], path: str) -> None:
        self._send_json(HTTPStatus.OK, {"ranks": self.admin.coordinator.pool(health=q.get("health") == "1")})

    def reset_peak(self, q: dict[str, str], path: str) -> None:
        self.admin.coordinator.reset_peak()
        self._send_json(HTTPStatus.OK, {"ok": True})

    def settings(self, q: dict[str, str], path: str) -> None:
        body = self._body()
        _fields(body, {"budget_bytes", "fs_concurrency", "W"})
        c = self.admin.coordinator
        if (b := _opt_int(body, "budget_bytes", 1)) is not None:
            c._all("set_budget", budget_bytes=b)
            c.settings.budget_bytes = b
        if (n := _opt_int(body, "fs_concurrency", 1)) is not None:
            c._all("set_fs_concurrency", value=n)
            c.settings.fs_concurrency = n
        if (w := _opt_int(body, "W", 0)) is not None:
            c.settings.w = w
        self._send_json(HTTPStatus.OK, c.info())

    def snapshot(self, q: dict[str, str], path: str) -> None:
        since = q.get("events_since")
        if since is not None and not since.isdigit():
            raise InvalidInput("events_since must be a non-negative integer")
        snap = self.admin.coordinator.snapshot(
            health=q.get("health", "1") == "1", events_since=int(since) if since is not None else None
        )
        self._send_json(HTTPStatus.OK, snap)

    def events(self, q: dict[str, str], path: str) -> None:
        try:
            since, wait = int(q.get("since", "0")), min(float(q.get("wait", "0")), 30.0)
        except ValueError:
            raise InvalidInput("since must be an integer and wait a number of seconds") from None
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
