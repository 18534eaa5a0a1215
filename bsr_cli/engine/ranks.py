"""TP ranks as processes: the embedded engine's implementation of the runtime's RankClient (bsr_cli.api.ranks):
the typed request objects travel over the pipe as they are (pickled), and so do the typed results."""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import select
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.context import ForkServerContext
from typing import Any, TypeVar

from bsr_cli.api.pipe import Abort, Call, Reply, Shutdown
from bsr_cli.api.ranks import RankRequest
from bsr_cli.core.events import Event
from bsr_cli.engine.config import RankConfig, RankInfo
from bsr_cli.engine.worker import worker_main
from bsr_cli.errors import RankDied, ServerError, ServiceError

READY_TIMEOUT_S = 180.0
R = TypeVar("R")


# What the fork server imports once for every rank: torch and the modules a rank imports as it starts. Not Mooncake's
# client library: importing it starts a thread, and a fork keeps only the thread that forks.
RANK_PRELOAD = [
    "torch",
    "bsr_cli.engine.worker",
    "bsr_cli.runtime.paged_kv",
    "bsr_cli.runtime.pool",
    "bsr_cli.runtime.restore",
    "bsr_cli.runtime.scrub",
    "bsr_cli.tiers.fs",
    "bsr_cli.tiers.mooncake",
]


_RESTARTS = "the engine starts a rank that died again; `bsr engine status` shows its restarts"


def _rank_context() -> ForkServerContext:
    """Where rank processes come from: a fork server, itself a fresh interpreter that has imported torch and the
    worker once. Each rank is forked from it, so it starts with no thread, lock or CUDA state of the engine's own
    (as a spawned one would) but without paying torch's import again: a rank's start, and its restart during an
    incident, cost the rank's own set-up (its tier clients and tensors), not another ~1.5 CPU-seconds of imports."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


class ProcessRank:
    """One rank process behind a pipe. Calls return futures; a reader thread matches replies and forwards events.

    Constructing one starts the process; ``ready()`` waits for its hello, so that an engine starts all its ranks
    first and their set-ups (tier clients, tensors) overlap."""

    def __init__(self, rank: int, cfg: RankConfig, on_event: Callable[[Event], None]) -> None:
        self.rank = rank
        ctx = _rank_context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, cfg), name=f"bsr-rank{rank}", daemon=True)
        self.process.start()
        child.close()
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Any]] = {}
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._last_heard = time.monotonic()

    def ready(self) -> ProcessRank:
        """Wait for the rank's hello (its tiers connected, its KV and pool allocated), then start reading it.
        Raises ServiceError if it fails or does not start within READY_TIMEOUT_S."""
        rank = self.rank
        if not self._conn.poll(READY_TIMEOUT_S):
            self.process.kill()
            raise ServiceError(
                f"rank {rank} did not start within {READY_TIMEOUT_S:.0f}s",
                hint="the machine may be overloaded; the rank's log in the state directory's logs/ says more",
            )
        try:
            hello = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise ServiceError(
                f"rank {rank} exited during start-up (exit code {self.process.exitcode})",
                hint="the rank's log in the state directory's logs/ says why",
            ) from None
        if not hello.get("ready"):
            self.process.join(5)
            raise ServiceError(
                f"rank {rank} failed to start: {hello.get('error')}",
                hint="the rank's log in the state directory's logs/ says more",
            )
        self.info: RankInfo = hello["info"]
        self._last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"bsr-rank{rank}-reader", daemon=True)
        self._reader.start()
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    @property
    def down_reason(self) -> str | None:
        """Why this rank no longer runs (``killed by SIGKILL``, ``exited with code 1``, ``pipe closed``); None while
        it runs."""
        if self.alive():
            return None
        return self.exit_reason()

    def heartbeat_age(self) -> float:
        """Seconds since this rank last said anything (it beats every few hundred ms while it runs)."""
        return time.monotonic() - self._last_heard

    def unread(self) -> bool:
        """Whether the rank has said something this side has not read yet (heartbeats queued in the pipe while
        the coordinator itself did not run): the rank is not silent, whatever ``heartbeat_age`` says."""
        try:
            ready, _, _ = select.select([self._conn.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(ready)

    def submit(self, request: RankRequest[R]) -> Future[R]:
        fut: Future[R] = Future()
        if not self.alive():
            fut.set_exception(
                RankDied(f"rank {self.rank} is not running: {self._dead or 'process exited'}", hint=_RESTARTS)
            )
            return fut
        msg_id = next(self._ids)
        with self._lock:
            self._pending[msg_id] = fut
            try:
                self._conn.send(Call(msg_id, request))
            except (OSError, ValueError) as e:
                self._pending.pop(msg_id, None)
                fut.set_exception(RankDied(f"rank {self.rank} is unreachable: {e}", hint=_RESTARTS))
        return fut

    def abort(self, request: str) -> None:
        if self.alive():
            with self._lock, contextlib.suppress(OSError, ValueError):
                self._conn.send(Abort(request))

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            self._last_heard = time.monotonic()
            if isinstance(msg, dict):
                if "event" in msg:
                    # A listener bug must not kill the rank's reader.
                    with contextlib.suppress(Exception):
                        self._on_event(msg["event"])
                continue  # a heartbeat
            if not isinstance(msg, Reply):
                continue
            with self._lock:
                fut = self._pending.pop(msg.id, None)
            if fut is None:
                continue
            if msg.refused is not None:
                fut.set_exception(msg.refused)
            elif msg.error is not None:
                fut.set_exception(
                    ServerError(
                        f"rank {self.rank}: {msg.error}",
                        hint=f"the rank's log (logs/bsr-rank{self.rank}.log in the state directory) says more",
                    )
                )
            else:
                fut.set_result(msg.result)
        self._dead = "pipe closed" if self.process.is_alive() else self.exit_reason()
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RankDied(f"rank {self.rank} died ({self._dead})", hint=_RESTARTS))

    def exit_reason(self) -> str:
        """Why the process went, once it has: the signal that killed it, or its exit code (before it is reaped,
        what the reader saw)."""
        code = self.process.exitcode
        if code is None:
            return self._dead or "process exited"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"

    def close(self, timeout: float = 10.0) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._conn.send(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2)
