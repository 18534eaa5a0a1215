"""Fault injection: what an operator can break on purpose, and how each kind acts on a restore.

Faults exist only on engines started with faults enabled; the admin API refuses them otherwise. Every kind
acts *during* a restore (after the probe said "hit"), which is the case the protocol must survive:

    remote-unavailable      the remote tier (Mooncake) answers nothing: every fetch from it fails
    remote-and-ssd-absent   the remote tier and the filesystem (SSD) tier both fail: only recompute is left
    restore-fault           the install (H2D copy) of a window fails on the target rank
    timeout                 the window's fetch does not complete before its deadline
    corrupt                 a staged object arrives with flipped bytes; its stored checksum catches it
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

KINDS = ("remote-unavailable", "remote-and-ssd-absent", "restore-fault", "timeout", "corrupt")
TIER_DOWN_KINDS = ("remote-unavailable", "remote-and-ssd-absent")  # a tier answers nothing
STALL = "timeout"  # nothing arrives before the window's deadline
CORRUPT = "corrupt"  # one byte flipped in transit
INSTALL_FAULT = "restore-fault"  # the rank's own install fails
FETCH_KINDS = (*TIER_DOWN_KINDS, STALL, CORRUPT)  # the faults that act on a window's fetch
# Every fault has a bounded life: it fires on at most MAX_COUNT restores (count 0: until cleared or expired) and
# expires TTL_S after it was armed (at most MAX_TTL_S), so one aimed at a window no prompt reaches cannot stay armed.
MAX_COUNT = 1000
TTL_S = 3600
MAX_TTL_S = 86_400
_ids = itertools.count(1)


@dataclass(frozen=True)
class FaultRequest:
    """A fault an operator asks an engine to arm (`bsr inject-fault`, `bsr top`'s f key, the admin API's fault body):
    the engine checks it against its ranks, groups and windows (``FaultSpec.parse``) and arms it."""

    kind: str
    rank: int | None = wire.field(default=None, omit_none=True)  # None: every rank
    # 0-based (G1 = 0); None: the first window a restore reaches
    window: int | None = wire.field(default=None, omit_none=True)
    group: str | None = wire.field(default=None, omit_none=True)  # None: every KV group
    count: int = 1  # restores it fires on; 0 = until cleared (or expired)
    # None: the engine's default life (TTL_S)
    ttl_s: int | None = wire.field(default=None, omit_none=True)

    to_wire = wire.writer()  # the admin API's fault body: the fields given, nothing for those left to the engine


@dataclass(frozen=True)
class FaultSpec:
    """An armed fault, as an engine holds and lists it (its wire form: ``id`` first, every field, null included;
    a reader takes what an engine sends, ``count`` 1 when it does not say)."""

    id: int = field(default=0, kw_only=True)  # first on the wire; given by name (the engine numbers its faults)
    kind: str
    rank: int | None = None  # None: every rank
    window: int | None = None  # None: the first window a restore reaches (windows are 0-based here, G1 = 0)
    group: str | None = None  # None: every KV group
    count: int = 1  # how many restores it fires on; 0 = until cleared (or expired)
    fired: int = 0
    expires_at: float | None = None  # wall-clock time after which it no longer fires

    to_wire = wire.writer()
    from_wire = wire.reader()

    @classmethod
    def parse(
        cls, data: dict[str, Any], *, ranks: int, groups: tuple[str, ...], max_window: int | None = None
    ) -> FaultSpec:
        """``max_window``: the last window (0-based) of the engine's longest prompt at W=1; a window past it can
        never be reached."""
        allowed = {"kind", "rank", "window", "group", "count", "ttl_s"}
        extra = set(data) - allowed
        if extra:
            raise InvalidInput(
                f"unknown fault field(s): {', '.join(sorted(extra))}",
                hint="a fault takes kind, rank, window, group, count and ttl_s",
            )
        kind = data.get("kind")
        if kind not in KINDS:
            raise InvalidInput(f"unknown fault kind {kind!r}", hint=f"kinds: {', '.join(KINDS)}")
        rank, window, group, count = data.get("rank"), data.get("window"), data.get("group"), data.get("count", 1)
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < ranks):
            raise InvalidInput(
                f"rank must be in 0..{ranks - 1}, got {rank!r}",
                hint="`bsr status` lists the engine's ranks; omit the rank to hit every rank",
            )
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
            raise InvalidInput(
                f"window must be a non-negative integer, got {window!r}",
                hint="windows are counted from 1 on the command line (--window 1 is G1), from 0 in the API",
            )
        if window is not None and max_window is not None and window > max_window:
            raise InvalidInput(
                f"window {window} is beyond the last window of this engine's longest prompt ({max_window}, 0-based)",
                hint="windows are counted from 0 here (G1 = 0); `bsr plan` shows a prompt's windows",
            )
        if group is not None and group not in groups:
            raise InvalidInput(
                f"unknown KV group {group!r}; the engine has {list(groups)}",
                hint=f"groups: {', '.join(groups)}; omit the group to hit every group",
            )
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_COUNT:
            raise InvalidInput(
                f"count must be an integer in 0..{MAX_COUNT}, got {count!r}",
                hint="--count 1 fires once; --count 0 until cleared",
            )
        ttl = data.get("ttl_s", TTL_S)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S:
            raise InvalidInput(
                f"ttl_s must be an integer in 1..{MAX_TTL_S}, got {ttl!r}", hint=f"a fault lives at most {MAX_TTL_S} s"
            )
        return cls(
            kind=kind,
            rank=rank,
            window=window,
            group=group,
            count=count,
            id=next(_ids),
            expires_at=time.time() + ttl,
        )

    def applies_to_rank(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def exhausted(self) -> bool:
        """It fired its count, or its life is over."""
        expired = self.expires_at is not None and time.time() >= self.expires_at
        return expired or (self.count != 0 and self.fired >= self.count)

    def after_firing(self) -> FaultSpec:
        return replace(self, fired=self.fired + 1)

    def hits(self, window: int, first_window: int) -> bool:
        target = first_window if self.window is None else self.window
        return window == target

    def tiers_affected(self) -> tuple[str, ...]:
        return {"remote-unavailable": ("mooncake",), "remote-and-ssd-absent": ("mooncake", "fs")}.get(self.kind, ())


def window_faults(
    faults: Sequence[FaultSpec], rank: int, window: int, first: int, kinds: Sequence[str], group: str | None = None
) -> list[FaultSpec]:
    """The armed faults of ``kinds`` that hit ``window`` on ``rank`` (and, when given, KV group ``group``): the one
    targeting rule every host applies. ``first`` is the first window the restore reaches."""
    return [
        f
        for f in faults
        if f.kind in kinds
        and f.applies_to_rank(rank)
        and f.hits(window, first)
        and (group is None or f.group is None or f.group == group)
    ]


def any_for_group(faults: Sequence[FaultSpec], group: str) -> bool:
    """One of ``faults`` acts on KV group ``group`` (a fault that names no group acts on every group)."""
    return any(f.group is None or f.group == group for f in faults)


def check_fault_target(rank: int | None, window: int | None, *, ranks: int, chunk_size: int, max_tokens: int) -> None:
    """InvalidInput (exit 2) for a fault aimed at a rank the engine does not have (``ranks``; 0: not said) or at a
    window (1-based) past its longest prompt's last at W=1 (``max_tokens`` in chunks of ``chunk_size``; 0: not
    said): the engine could never fire it."""
    if rank is not None and ranks and rank >= ranks:
        raise InvalidInput(
            f"--rank {rank}: this engine has {ranks} rank(s), 0..{ranks - 1}",
            hint="`bsr status` lists the ranks; omit --rank to arm it on every rank",
        )
    if window is not None and chunk_size:
        last = max(1, -(-max_tokens // chunk_size))
        if window > last:
            raise InvalidInput(
                f"--window {window}: this engine's longest prompt has at most {last} windows (at W=1)",
                hint="`bsr plan` shows a prompt's windows",
            )
