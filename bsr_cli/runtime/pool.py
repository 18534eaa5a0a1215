"""The L1 restore pool: one preallocated buffer, accounted in chunk slots, with an admission budget.

The host allocates the buffer once at start (a pinned torch tensor on a GPU host, a plain one here) and hands the
pool its address and a memoryview; the pool never allocates again. Every staged object occupies part of a slot
(one slot = one chunk of every group on this rank = Σ c_i bytes), so live bytes are exact and observable.

Admission: a window may stage only while this rank's live bytes stay within the budget B. B = RWS(W) reproduces the
paper's single global restore lock (one window at a time); a larger B lets several requests' windows, or a
request's next window (prefetch), be live at once. The legacy whole-plan path (W = 0) is bounded by capacity only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bsr_cli.core.evidence import CapacityCause
from bsr_cli.runtime.failures import WindowRefused
from bsr_cli.runtime.tiers import StagingSlice


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    budget_bytes: int
    slot_bytes: int
    live_bytes: int
    peak_bytes: int
    windows_live: int
    waiters: int

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Lease:
    """Slots held by one window until released (always released: use as a context manager)."""

    def __init__(self, pool: RestorePool, slots: list[int]) -> None:
        self._pool = pool
        self.slots = slots
        self.released = False
        self._writers: list[Future[Any]] = []

    def slot(self, i: int, offset: int, size: int) -> StagingSlice:
        return self._pool.staging(self.slots[i], offset, size)

    def hold_until(self, writers: Iterable[Future[Any]]) -> None:
        """Transfers a tier abandoned at its deadline may still write these slots: once released, the slots go back
        to the pool only after every one of them has returned (until then they stay live, and count against B)."""
        self._writers.extend(w for w in writers if not w.done())

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        writers = [w for w in self._writers if not w.done()]
        if not writers:
            self._pool._release(self.slots)
            return
        left = [len(writers)]
        lock = threading.Lock()

        def one_returned(_: Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._pool._release(self.slots)

        for w in writers:
            w.add_done_callback(one_returned)  # runs at once for a call that returned meanwhile

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RestorePool:
    """``slot_stride``: where each slot starts, when the host lays slots out with room beyond their accounted
    ``slot_bytes`` (a few bytes after each staged object for a tier's trailer, ``tail``). Live bytes, the budget and
    the capacity are counted in ``slot_bytes``: that room is not staging, and stays out of every bound."""

    def __init__(
        self,
        base_ptr: int,
        view: memoryview,
        slot_bytes: int,
        budget_bytes: int | None = None,
        *,
        slot_stride: int | None = None,
        tail: int = 0,
    ) -> None:
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        self.base_ptr = base_ptr
        self.view = view.cast("B") if view.format != "B" else view
        self.slot_bytes = slot_bytes
        self.slot_stride = slot_stride or slot_bytes
        if self.slot_stride < slot_bytes:
            raise ValueError("slot_stride must hold a slot")
        self.tail = tail
        self.slots_total = len(self.view) // self.slot_stride
        self.capacity_bytes = self.slots_total * slot_bytes if slot_stride else len(self.view)
        self.budget_bytes = self.capacity_bytes if budget_bytes is None else min(budget_bytes, self.capacity_bytes)
        self._free = list(range(self.slots_total - 1, -1, -1))  # pop() hands out low slots first
        self._live_slots = 0
        self._peak_slots = 0
        self._windows = 0
        self._waiters = 0
        self._cond = threading.Condition()

    # -- accounting --------------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                budget_bytes=self.budget_bytes,
                slot_bytes=self.slot_bytes,
                live_bytes=self._live_slots * self.slot_bytes,
                peak_bytes=self._peak_slots * self.slot_bytes,
                windows_live=self._windows,
                waiters=self._waiters,
            )

    def reset_peak(self) -> None:
        with self._cond:
            self._peak_slots = self._live_slots

    def set_budget(self, budget_bytes: int) -> None:
        with self._cond:
            self.budget_bytes = min(budget_bytes, self.capacity_bytes)
            self._cond.notify_all()

    # -- leasing -----------------------------------------------------------------------------------------------
    def acquire(self, n_slots: int, *, timeout_s: float, bounded: bool = True, wait: bool = True) -> Lease | None:
        """Lease ``n_slots`` slots. ``bounded`` windows respect the budget B; the whole-plan path only capacity.

        Returns None when ``wait`` is False and the slots are not available now (a prefetch that must not block).
        Raises CapacityError when the request can never fit, or when the deadline passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._waiters += 1
            try:
                while True:
                    # Checked on every wake-up too: a budget cut while this window waits can make it never fit.
                    limit_slots = self._never_fits(n_slots, bounded)
                    if self._live_slots + n_slots <= limit_slots and len(self._free) >= n_slots:
                        break
                    if not wait:
                        return None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise WindowRefused(
                            f"timed out after {timeout_s:.1f}s waiting for {n_slots} pool slots",
                            cause=CapacityCause.ADMISSION_TIMEOUT,
                            hint="other restores held the budget: lower W, raise the budget B, or retry later",
                        )
                    self._cond.wait(left)
                slots = [self._free.pop() for _ in range(n_slots)]
                self._live_slots += n_slots
                self._peak_slots = max(self._peak_slots, self._live_slots)
                self._windows += 1
                return Lease(self, slots)
            finally:
                self._waiters -= 1

    def _never_fits(self, n_slots: int, bounded: bool) -> int:
        """The slot limit that applies (the budget B, or the capacity for the whole-plan path); raises
        CapacityError when ``n_slots`` can never fit under it."""
        limit_slots = (self.budget_bytes if bounded else self.capacity_bytes) // self.slot_bytes
        if n_slots > limit_slots:
            what = "budget B" if bounded else "pool capacity"
            raise WindowRefused(
                f"a window of {n_slots} chunks needs {n_slots * self.slot_bytes:,} bytes; "
                f"the {what} is {limit_slots * self.slot_bytes:,} bytes",
                cause=CapacityCause.WINDOW_OVER_BUDGET if bounded else CapacityCause.WINDOW_OVER_POOL,
                hint="lower W, or start the engine with a larger pool (--pool) or budget (--budget)",
            )
        return limit_slots

    def _release(self, slots: list[int]) -> None:
        with self._cond:
            # Pushed back in reverse so the next lease pops them in ascending order again: a window's slots stay
            # one contiguous run, which lets the host install a whole window per tensor in one copy.
            self._free.extend(reversed(slots))
            self._live_slots -= len(slots)
            self._windows -= 1
            self._cond.notify_all()

    def staging(self, slot: int, offset: int, size: int) -> StagingSlice:
        if offset + size + self.tail > self.slot_stride:
            raise ValueError("object does not fit its slot")
        start = slot * self.slot_stride + offset
        return StagingSlice(self.base_ptr + start, self.view[start : start + size], self.tail)
