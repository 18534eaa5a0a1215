"""The admin API's server: the FastAPI app behind guard.Guard, served by uvicorn in a daemon thread.

A host (the embedded engine, the LMCache host, a vLLM worker) builds an ``AdminServer`` over its Coordinator,
calls ``start()`` (the port is bound in the constructor, so ``url`` is known at once) and ``stop()`` at the end.
Loopback by default. The defences: host and origin checks, the token on every route but /health and a body cap
before a body is read, serving slots kept apart for requests with and without the token, and a request queue of
their own for submits and restores, which may wait for capacity (guard.py; their work runs on threads of its own,
app.py); a short deadline for a request's head, caps on connections still waiting to send one (per client and in
all, the oldest closed first, never one whose head has arrived), a deadline for the body, an idle timeout and a
lingering close after a refusal that left a body unread (protocol.py). The operator's guarantee and what was
measured are in docs/admin-api.md ("The operator is always answered").
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import threading
import time
from collections.abc import Callable, Sequence

import anyio.to_thread
import uvicorn

from bsr_cli.runtime.coordinator import Coordinator
from bsr_cli.server import openapi
from bsr_cli.server.app import PREFIX, create_app, routes_of
from bsr_cli.server.guard import Guard, allowed_host_names
from bsr_cli.server.metrics import Exposition
from bsr_cli.server.models import OpenAPIDocument
from bsr_cli.server.protocol import HARD_CAP_FACTOR, GuardedH11Protocol, protocol_class

# A body never needs more than the longest prompt as JSON token ids plus room for the other fields: an id is at most
# 10 digits, and pretty-printed JSON adds a comma, a newline and indentation ("4294967295,\n    " is 16 bytes).
BODY_BYTES_PER_TOKEN = 24
BODY_OVERHEAD = 64 << 10
REQUEST_DEADLINE_S = 30.0  # request line, headers and body must all arrive within this
IDLE_TIMEOUT_S = 10.0  # no byte for this long (between requests, or mid-request) closes the connection
MAX_CONNECTIONS = 64  # requests with the token being answered at once
MAX_ANONYMOUS = 8  # requests without the token (/health, refusals) being answered at once
MAX_QUEUED = 1024  # submits and restores held at once, running or waiting for destination KV or room in B
HEAD_DEADLINE_S = 5.0  # a request's line and headers must arrive within this (before anything is known of it)
MAX_WAITING = 2048  # connections that have not sent a request head yet, all clients together...
MAX_WAITING_PER_CLIENT = 16  # ...and from one client address; past either the oldest is closed
MIN_WAITING = 16  # however few open files the process may have (the same for the queue)
MIN_QUEUED = 16
LISTEN_BACKLOG = 4096  # connections the kernel queues before the server accepts them (clamped to somaxconn)
FD_RESERVE = 512  # open files kept for the engine's own (logs, pipes to the ranks, the event store, tiers)
START_TIMEOUT_S = 30.0
QUEUED_ROUTE_THREADS = 16  # worker threads beside the serving slots' for submits' and restores' first step

__all__ = [
    "HEAD_DEADLINE_S",
    "IDLE_TIMEOUT_S",
    "MAX_ANONYMOUS",
    "MAX_CONNECTIONS",
    "MAX_QUEUED",
    "MAX_WAITING",
    "MAX_WAITING_PER_CLIENT",
    "PREFIX",
    "REQUEST_DEADLINE_S",
    "AdminServer",
]


def room_for_connections(connections: int) -> int:
    """How many sockets this process can hold beside its own files: its soft limit on open files is raised first
    towards ``connections`` + FD_RESERVE, as far as the hard limit allows (a server whose accept fails for want of a
    descriptor stops accepting for a second, the operator's connection with everyone else's)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return connections if soft == resource.RLIM_INFINITY else max(0, soft - FD_RESERVE)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _uvicorn_config(app: Guard, protocol: type[GuardedH11Protocol], idle_timeout_s: float) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=protocol,
        ws="none",
        lifespan="off",
        backlog=LISTEN_BACKLOG,  # uvicorn listens again with its own (2,048 by default)
        loop="asyncio",
        timeout_keep_alive=max(1, round(idle_timeout_s)),
        timeout_graceful_shutdown=2,
        log_config=None,
        log_level="warning",
        access_log=False,
        server_header=False,
        # h11's cap on a request's line and headers while they arrive: past it the request is a 400 (a head that
        # arrives whole is measured by the guard: 431 past the same 16 KiB).
        h11_max_incomplete_event_size=16 * 1024,
    )


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
        head_deadline_s: float = HEAD_DEADLINE_S,
        max_anonymous: int = MAX_ANONYMOUS,
        max_waiting: int = MAX_WAITING,
        max_waiting_per_client: int = MAX_WAITING_PER_CLIENT,
        max_queued: int = MAX_QUEUED,
        allowed_hosts: Sequence[str] = (),
        open_metrics: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.token = token
        self._max_connections = max_connections
        self.on_shutdown = on_shutdown
        self.max_body = BODY_OVERHEAD + BODY_BYTES_PER_TOKEN * max(coordinator.settings.max_tokens, 0)
        self._document: OpenAPIDocument | None = None  # this engine's OpenAPI document, built on first request
        self.counters = {"http_requests": 0}
        self._metrics = Exposition(coordinator)
        app = self._fastapi = create_app(self)
        self._max_anonymous = max_anonymous
        trusted: set[tuple[str, int]] = set()  # connections that showed the token (guard and protocol share it)
        # Every connection the caps let in must find a descriptor: those being served, the queued requests' and the
        # waiting ones up to their hard cap. Where the process cannot hold them all, fewer queue and fewer wait.
        serving = max_connections + max_anonymous
        left = room_for_connections(serving + max_queued + HARD_CAP_FACTOR * max_waiting) - serving
        self.max_queued = max(MIN_QUEUED, min(max_queued, left // 2))
        self.max_waiting = max(MIN_WAITING, min(max_waiting, (left - self.max_queued) // HARD_CAP_FACTOR))
        self.guard = Guard(
            app,
            routes_of(app),
            token=token,
            max_body=self.max_body,
            on_request=self._count,
            hosts=allowed_host_names(host, allowed_hosts),
            open_paths=frozenset({"/metrics"}) if open_metrics else frozenset(),
            max_serving=max_connections,
            max_anonymous=max_anonymous,
            max_queued=self.max_queued,
            trusted=trusted,
        )
        self.app = self.guard
        self._sock = _listen(host, port)
        self.host, self.port = str(self._sock.getsockname()[0]), int(self._sock.getsockname()[1])
        self._protocol = protocol_class(
            request_deadline_s=request_deadline_s,
            idle_timeout_s=idle_timeout_s,
            head_deadline_s=head_deadline_s,
            max_waiting=self.max_waiting,
            max_waiting_per_client=max_waiting_per_client,
            trusted=trusted,
        )
        self._server = uvicorn.Server(_uvicorn_config(self.app, self._protocol, idle_timeout_s))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def metrics_text(self) -> str:
        return self._metrics.text()

    def openapi_document(self) -> OpenAPIDocument:
        """docs/openapi.json with this engine's own bounds, built on first request."""
        if self._document is None:
            doc = openapi.narrow(openapi.build(self._fastapi), openapi.limits_of(self.coordinator))
            self._document = OpenAPIDocument.from_wire(doc)
        return self._document

    def _count(self) -> None:
        self.counters["http_requests"] += 1

    def serve_forever(self) -> None:
        async def serve() -> None:
            # Sync routes run in anyio's worker threads (40 by default): one per serving slot, as each request
            # holding one may hold a thread (a long-polled /events), so no request waits for another's thread; and
            # a few more for a submit's or restore's first step (its body checked), before its work moves to a
            # thread of its own (app._OwnThread) where it may wait for capacity as long as its deadline allows.
            limiter = anyio.to_thread.current_default_thread_limiter()
            limiter.total_tokens = max(40, self._max_connections + self._max_anonymous + QUEUED_ROUTE_THREADS)
            await self._server.serve(sockets=[self._sock])

        asyncio.run(serve())

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="bsr-admin", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the admin server stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the admin server did not start within {START_TIMEOUT_S:g}s")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self._sock.close()
        self._protocol.lingering.close_all()
