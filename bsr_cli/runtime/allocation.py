"""The coordinator's allocation layer: destination blocks, and their quarantine while a stuck rank call may still
write them.

Blocks are allocated per KV group for the whole prompt, with the same block ids on every rank (as vLLM's scheduler
does). A restore that failed while a rank call was still running keeps its blocks out of the free pool until that
call returns, so a late install can never land in another request's blocks.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from bsr_cli.api.ranks import RankClient
from bsr_cli.core.registration import Registration
from bsr_cli.errors import CapacityError
from bsr_cli.runtime.coordinator_state import EngineSettings
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.observation import Observation


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

    def free(self, ids: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(ids)

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return len(self._free)


class Allocation(Observation):
    def __init__(
        self, reg: Registration, ranks: Sequence[RankClient], settings: EngineSettings, events: EventLog
    ) -> None:
        super().__init__(reg, ranks, settings, events)
        self.allocators = {g.name: BlockAllocator(g.name, -(-settings.kv_tokens // g.block_size)) for g in reg.groups}

    def _allocate(self, n_tokens: int) -> dict[str, list[int]]:
        """Blocks for ``n_tokens`` in every group (all or none)."""
        tables: dict[str, list[int]] = {}
        try:
            for g in self.reg.groups:
                tables[g.name] = self.allocators[g.name].allocate(-(-n_tokens // g.block_size))
        except CapacityError:
            self._free(tables)
            raise
        return tables

    def _free(self, tables: dict[str, list[int]]) -> None:
        for g, ids in tables.items():
            self.allocators[g].free(ids)

    def _quarantine(self, request: str, rank: int, fut: Future[Any]) -> None:
        """A rank call still running after its restore was failed: the rank is unhealthy until it returns, and
        the request's blocks are not reused before then."""
        with self._lock:
            self._outstanding.setdefault(request, []).append(fut)
            self._stuck.setdefault(rank, set()).add(request)

        def done(_: Future[Any]) -> None:
            with self._lock:
                self._stuck.get(rank, set()).discard(request)

        fut.add_done_callback(done)

    def _release_tables(self, request: str, tables: dict[str, list[int]]) -> None:
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


__all__ = ["Allocation", "BlockAllocator"]
