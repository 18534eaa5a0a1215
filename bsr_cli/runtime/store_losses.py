"""The segments a tier's store lost, as the engine's store watch reports them: each recorded once (a
``segment_lost`` event, the lost-segment counters), and kept as the tier's ``segment_lost`` condition while the
segment is gone and for ``TIER_FAILURE_TTL_S`` after the loss (a segment mounted again is empty: what was stored
on it is still lost)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from bsr_cli.core.events import SegmentLost
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.runtime.coordinator_state import TIER_FAILURE_TTL_S
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.metrics import RuntimeCounters

KEPT_PER_TIER = 100  # the newest losses a tier remembers


class StoreLosses:
    """Owns the losses per tier under its own lock."""

    def __init__(self, events: EventLog, counters: RuntimeCounters) -> None:
        self.events, self.counters = events, counters
        self._lock = threading.Lock()
        self._losses: dict[str, list[SegmentLoss]] = {}

    def record(self, tier: str, losses: Sequence[SegmentLoss]) -> list[SegmentLoss]:
        """Take what the watch knows of ``tier``'s store (every loss it saw, any order, repeats welcome): a loss not
        seen before is recorded and announced, one seen before takes the newer word (mounted again since).
        Returns the new ones."""
        new: list[SegmentLoss] = []
        with self._lock:
            known = self._losses.setdefault(tier, [])
            where = {(x.segment, x.lost_at): i for i, x in enumerate(known)}
            for loss in losses:
                i = where.get((loss.segment, loss.lost_at))
                if i is None:
                    known.append(loss)
                    new.append(loss)
                elif loss.remounted_at is not None:
                    known[i] = loss
            del known[:-KEPT_PER_TIER]
        for loss in new:
            self.counters.segment_lost(tier, loss.cause, loss.objects_lost)
            self.events.append(SegmentLost.of(tier, loss))
        return new

    def standing(self, now: float | None = None) -> dict[str, list[SegmentLoss]]:
        """Per tier, the losses that keep it unhealthy now: a segment still gone, or lost in the last
        ``TIER_FAILURE_TTL_S``. Oldest first."""
        at = time.time() if now is None else now
        with self._lock:
            out = {
                tier: [x for x in losses if x.remounted_at is None or at - x.lost_at <= TIER_FAILURE_TTL_S]
                for tier, losses in self._losses.items()
            }
        return {tier: losses for tier, losses in out.items() if losses}


__all__ = ["KEPT_PER_TIER", "StoreLosses"]
