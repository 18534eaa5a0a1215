"""The coordinator's allocation layer: destination blocks, the queue of requests waiting for them, and their
quarantine while a stuck rank call may still write them.

Blocks are allocated per KV group for the whole prompt, with the same block ids on every rank (as vLLM's scheduler
does). When the blocks are short, a request waits for them as a serving scheduler keeps it waiting: in arrival
order (FIFO: the head of the queue is served first, so a large request is not starved by small ones), for at most
``EngineSettings.kv_wait_s``. Only a request that can never fit (more blocks than its group has at all) is refused
at once; one still waiting at its deadline is refused for capacity then. A restore that failed while a rank call was
still running keeps its blocks out of the free pool until that call returns, so a late install can never land in
another request's blocks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome, Stage
from bsr_cli.core.status import BlockWait
from bsr_cli.errors import CapacityError, RestoreAborted
from bsr_cli.runtime.coordinator_state import CoordinatorContext

# How long a request refused after waiting its whole kv_wait_s is told to wait before it tries again (Retry-After):
# the blocks it waited for are held by requests that have run at least that long already.
RETRY_AFTER_S = 5.0


class BlockAllocator:
    """One group's block pool: the same block ids are used on every rank, as vLLM's scheduler does."""

    def __init__(self, group: str, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise CapacityError(
                    f"KV group {self.group}: {n} blocks needed, {len(self._free)} free of {self.num_blocks}",
                    hint="wait for running requests to finish, or start the engine with more --kv-tokens",
                )
            return [self._free.popleft() for _ in range(n)]

    def take(self, n: int) -> list[int] | None:
        """``n`` blocks, or None when fewer are free (the caller waits)."""
        with self._lock:
            if n > len(self._free):
                return None
            return [self._free.popleft() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(ids)

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)


@dataclass
class BlockWaiter:
    """One request in the queue for destination blocks."""

    request: str
    tokens: int
    blocks: dict[str, int]  # per group, what it needs
    since: float = field(default_factory=time.time)
    waiting: bool = False  # it found the blocks short at least once (counted in the gauge)
    aborted: bool = False

    def view(self, now: float) -> BlockWait:
        return BlockWait(
            request=self.request,
            tokens=self.tokens,
            blocks=dict(self.blocks),
            since=self.since,
            waited_s=round(max(0.0, now - self.since), 3),
        )


class RefusalRecorder(Protocol):
    """Where a request refused for destination blocks is recorded (counted, listed, logged) as a refused restore:
    ``Observation.restore_ended``."""

    def restore_ended(
        self, *, request: str, outcome: Outcome, kind: FailureKind | None, fails: Sequence[Failure], w: int
    ) -> None: ...


class Allocation:
    """Owns the destination blocks: every group's pool, the FIFO queue of requests waiting for them, and the rank
    calls that keep a failed request's blocks out of the pool until they return."""

    def __init__(self, ctx: CoordinatorContext, refusals: RefusalRecorder) -> None:
        self.reg = ctx.reg
        self.settings = ctx.settings
        self.counters = ctx.counters
        self._refusals = refusals
        self.allocators = {
            g.name: BlockAllocator(g.name, -(-ctx.settings.kv_tokens // g.block_size)) for g in ctx.reg.groups
        }
        # Requests waiting for destination blocks, in arrival order; notified whenever blocks are freed or the
        # queue changes.
        self._blocks_changed = threading.Condition()
        self._block_queue: deque[BlockWaiter] = deque()
        # Per request, its rank calls still running after its restore was failed (under ``_lock``).
        self._lock = threading.Lock()
        self._outstanding: dict[str, list[Future[Any]]] = {}

    def allocate(self, n_tokens: int, request: str = "") -> tuple[dict[str, list[int]], float]:
        """Blocks for ``n_tokens`` in every group (all or none), and the seconds the request waited for them.

        Waits in FIFO order while the blocks are short, at most ``settings.kv_wait_s``; raises CapacityError (the
        refusal recorded as a ``restore_refused`` event) at once when the request can never fit, or at the
        deadline; RestoreAborted when the request is aborted while it waits."""
        need = {g.name: -(-n_tokens // g.block_size) for g in self.reg.groups}
        never = [(g, n) for g, n in need.items() if n > self.allocators[g].num_blocks]
        if never:
            g, n = never[0]
            total = self.allocators[g].num_blocks
            self._refuse_blocks(
                request,
                f"KV group {g}: {n} blocks needed, more than the {total} it has: this prompt can never fit",
                "start the engine with more --kv-tokens (at least the prompt's length)",
            )
        me = BlockWaiter(request, n_tokens, need)
        deadline = time.monotonic() + max(0.0, self.settings.kv_wait_s)
        short: tuple[str, int, int] = ("", 0, 0)
        with self._blocks_changed:
            self._block_queue.append(me)
            try:
                while not me.aborted:
                    if self._block_queue[0] is me:
                        tables = self._take(need)
                        if tables is not None:
                            return tables, time.time() - me.since if me.waiting else 0.0
                    if not me.waiting:
                        me.waiting = True
                        self._count_waiting()
                        self._blocks_changed.notify_all()  # one more waits: await_blocks_waiting sees it at once
                    left = deadline - time.monotonic()
                    if left <= 0:
                        short = self._shortest(need)
                        break
                    self._blocks_changed.wait(left)
            finally:
                self._block_queue.remove(me)
                self._count_waiting()
                self._blocks_changed.notify_all()  # the next in line may be served now
        if me.aborted:
            raise RestoreAborted(
                f"request {request} was aborted while it waited for destination blocks",
                hint="nothing was committed; submit the prompt again when ready",
            )
        self.counters.block_wait_gave_up.inc()
        g, n, free = short
        self._refuse_blocks(
            request,
            f"KV group {g}: {n} blocks needed, {free} free of {self.allocators[g].num_blocks} after waiting "
            f"{self.settings.kv_wait_s:g}s for running requests to free them",
            f"the engine's destination KV stayed full for the whole wait: retry after {RETRY_AFTER_S:g}s, or start "
            "the engine with more --kv-tokens or a longer --kv-wait",
            retry_after_s=RETRY_AFTER_S,
        )

    def _take(self, need: dict[str, int]) -> dict[str, list[int]] | None:
        """Every group's blocks, or none of them (called under ``_blocks_changed``)."""
        tables: dict[str, list[int]] = {}
        for g, n in need.items():
            ids = self.allocators[g].take(n)
            if ids is None:
                for got, taken in tables.items():
                    self.allocators[got].free(taken)
                return None
            tables[g] = ids
        return tables

    def _shortest(self, need: dict[str, int]) -> tuple[str, int, int]:
        """The first group without enough free blocks: (group, needed, free)."""
        for g, n in need.items():
            free = self.allocators[g].free_blocks
            if n > free:
                return g, n, free
        g, n = next(iter(need.items()))
        return g, n, self.allocators[g].free_blocks

    def _count_waiting(self) -> None:
        self.counters.block_waiting.set(sum(1 for w in self._block_queue if w.waiting))

    def _refuse_blocks(self, request: str, message: str, hint: str, retry_after_s: float | None = None) -> NoReturn:
        """A request refused for destination blocks: counted and logged as a refused restore, then raised."""
        fail = Failure(
            rank=None,
            reason=message,
            kind=FailureKind.CAPACITY,
            stage=Stage.ADMISSION,
            cause=CapacityCause.NO_DESTINATION_BLOCKS,
        )
        if request:
            self._refusals.restore_ended(
                request=request,
                outcome=Outcome.REFUSED,
                kind=FailureKind.CAPACITY,
                fails=(fail,),
                w=self.settings.w,
            )
        raise CapacityError(message, hint=hint, retry_after_s=retry_after_s)

    def blocks_waiting(self) -> list[BlockWait]:
        """The requests waiting for destination blocks now, first in line first."""
        now = time.time()
        with self._blocks_changed:
            return [w.view(now) for w in self._block_queue if w.waiting]

    def await_blocks_waiting(self, count: int, timeout_s: float) -> bool:
        """Block until exactly ``count`` requests wait for destination blocks (True), or ``timeout_s`` passes: how a
        test or a tool synchronises on the queue without sleeping."""
        with self._blocks_changed:
            return self._blocks_changed.wait_for(
                lambda: sum(1 for w in self._block_queue if w.waiting) == count, timeout_s
            )

    def abort_block_wait(self, request: str) -> bool:
        """Wake ``request`` if it waits for blocks: it ends aborted (True when it was waiting)."""
        with self._blocks_changed:
            hit = [w for w in self._block_queue if w.request == request]
            for w in hit:
                w.aborted = True
            self._blocks_changed.notify_all()
        return bool(hit)

    def _free(self, tables: dict[str, list[int]]) -> None:
        for g, ids in tables.items():
            self.allocators[g].free(ids)
        with self._blocks_changed:
            self._blocks_changed.notify_all()

    def hold_until_done(self, request: str, fut: Future[Any]) -> None:
        """A rank call still running after ``request``'s restore was failed: its blocks are not reused before the
        call returns (a late install can never land in another request's blocks)."""
        with self._lock:
            self._outstanding.setdefault(request, []).append(fut)

    def release(self, request: str, tables: dict[str, list[int]]) -> None:
        """Free a request's blocks now, or once the last of its quarantined rank calls has returned."""
        with self._lock:
            left = [f for f in self._outstanding.pop(request, []) if not f.done()]
        if not left:
            self._free(tables)
            return
        remaining = [len(left)]
        gate = threading.Lock()

        def done(_: Future[Any]) -> None:
            with gate:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._free(tables)

        for f in left:
            f.add_done_callback(done)


__all__ = ["Allocation", "BlockAllocator", "BlockWaiter", "RefusalRecorder"]
