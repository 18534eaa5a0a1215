"""A Mooncake segment the store lost, with every object on it: which holder's, when, how and how much. The store's
watch (``bsr_cli.mooncake.segment_watch``) finds it; the engine records it (an event, a tier condition, counters),
and `bsr status`, `bsr explain`, `bsr events` and `bsr bench peer`'s rows name it with ``line()``.

Pure: no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.core.evidence import SegmentLossCause
from bsr_cli.core.units import format_bytes

_WHY = {
    SegmentLossCause.HOLDER_GONE: "its holder process is gone; the master lists the segment until the client TTL "
    "runs out",
    SegmentLossCause.UNMOUNTED: "the master unmounted it: the holder missed its heartbeats for the client TTL",
    SegmentLossCause.REMOUNTED_EMPTY: "the master unmounted it and the holder mounted it again, empty",
}


def clock(at: float) -> str:
    """A Unix time as an operator reads the local clock (2026-12-06 02:50:22)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


@dataclass(frozen=True)
class SegmentLoss:
    """One lost segment. ``objects_lost`` and ``bytes_lost`` are None where the master did not say (several
    segments lost between two looks share one key count)."""

    segment: str  # the segment's name: its holder's transfer endpoint, host:port
    client_id: str  # the holder's Mooncake client id
    cause: SegmentLossCause
    lost_at: float  # when the watch saw it lost (Unix time)
    last_seen_at: float | None = None  # when the watch last saw it whole
    objects_lost: int | None = None
    bytes_lost: int | None = None
    holder: str = wire.field(omit_empty=True, default="")  # the holder process, where the watcher knows it
    remounted_at: float | None = wire.field(omit_none=True, default=None)  # mounted again (empty) since

    to_wire = wire.writer()
    from_wire = wire.reader()

    @property
    def who(self) -> str:
        return f"holder {self.segment}" + (f" ({self.holder})" if self.holder else "")

    def amount(self) -> str:
        """``20 objects (80.31 KiB) lost``, naming only what is known."""
        size = f" ({format_bytes(self.bytes_lost)})" if self.bytes_lost is not None else ""
        if self.objects_lost is None:
            return f"its objects{size} lost (how many, the master did not say)"
        return f"{self.objects_lost:,} object{'s' if self.objects_lost != 1 else ''}{size} lost"

    def line(self) -> str:
        """The one sentence every reader shows: whose segment, when, why, and what was lost."""
        verb = "lost" if self.cause is SegmentLossCause.HOLDER_GONE else "dropped"
        back = f"; mounted again, empty, at {clock(self.remounted_at)}" if self.remounted_at is not None else ""
        return (
            f"the store {verb} {self.who}'s segment at {clock(self.lost_at)}, {self.amount()} "
            f"({_WHY.get(self.cause, self.cause.value)}){back}"
        )


__all__ = ["SegmentLoss", "clock"]
