"""Injected faults as wrappers around a restore's parts; the faults themselves are specified in bsr_cli.core.faults.

A host's window loop runs tiers and stages. When a restore carries armed faults the host hands the loop wrapped
ones instead, and the loop runs them as it runs the real ones, knowing nothing of faults:

    FaultyTier        remote-unavailable, remote-and-ssd-absent: the tier answers nothing ("unavailable");
                      timeout: nothing more arrives before the window's deadline (an abort cuts the stall short);
                      corrupt: one byte of an arrived object flips in transit (its stored checksum catches it)
    install stage     restore-fault: the rank's install of the window fails (the rank is blamed, never a tier)
    window stage      a host whose window is one stage (the LMCache rank): a stall before it, a failed install
                      after it
    locations         where a host reads a tier from: nowhere while an armed fault takes the tier down

``ArmedFaults`` is one restore's faults on one rank: it builds the wrappers and records which faults fired.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from bsr_cli.api.ranks import RestoreJob, RestoreResult, WindowJob
from bsr_cli.core.evidence import FailureKind, Stage
from bsr_cli.core.faults import (
    CORRUPT,
    FETCH_KINDS,
    INSTALL_FAULT,
    KINDS,
    STALL,
    FaultSpec,
    any_for_group,
    window_faults,
)
from bsr_cli.runtime.restore_failed import RestoreFailed, aborted
from bsr_cli.runtime.tiers import TIMED_OUT, UNAVAILABLE, AbandoningTier, StagingSlice, Tier, TierHealth

L = TypeVar("L")  # a host's lease (what an install stage is handed besides the job and the window)
# One window of a restore as a stage: (window, the rank's outcome so far) -> the window's bytes.
WindowStage = Callable[[WindowJob, RestoreResult], int]


class ArmedFaults:
    """The armed faults of one restore on one rank (``first_window``: the first window the restore reaches, the one
    a fault without a window hits), the wrappers that make them act, and the ids of those that fired."""

    def __init__(self, faults: Sequence[FaultSpec], rank: int, first_window: int, abort: threading.Event) -> None:
        self.faults = [f for f in faults if f.applies_to_rank(rank)]
        self.rank = rank
        self.first_window = first_window
        self.abort = abort
        self._fired: set[int] = set()
        self._lock = threading.Lock()  # fetches issued ahead fire from their own threads

    @classmethod
    def of(cls, job: RestoreJob, rank: int, abort: threading.Event) -> ArmedFaults | None:
        """The job's faults on ``rank``; None when none is armed (the host then runs its parts unwrapped)."""
        first = job.windows[0].index if job.windows else 0
        armed = cls(job.faults, rank, first, abort)
        return armed if armed.faults else None

    @property
    def fired(self) -> list[int]:
        with self._lock:
            return sorted(self._fired)

    def at(self, window: int, kinds: Sequence[str], group: str | None = None) -> list[FaultSpec]:
        return window_faults(self.faults, self.rank, window, self.first_window, kinds, group)

    def fire(self, faults: Sequence[FaultSpec]) -> None:
        with self._lock:
            self._fired.update(f.id for f in faults)

    def stall(self, window: int, seconds: float) -> None:
        """The injected stall: nothing arrives for ``seconds``; an abort ends it at once, as aborted."""
        if self.abort.wait(max(0.0, seconds)):
            raise aborted(window, Stage.FETCH)

    # -- wrappers ----------------------------------------------------------------------------------------------
    def tiers(self, tiers: Mapping[str, Tier], job: RestoreJob, groups: Sequence[str]) -> dict[str, Tier]:
        """Every tier the job reads from (one the rank lacks too: it answers unavailable), wrapped."""
        where = {
            job.objects[g][c].key: (win.index, g)
            for win in job.windows
            for c in range(win.chunk_start, win.chunk_end)
            for g in groups
        }
        names = set(tiers) | {ref.tier for refs in job.objects.values() for ref in refs}
        return {name: FaultyTier(name, tiers.get(name), self, where) for name in names}

    def install(
        self, install: Callable[[RestoreJob, WindowJob, L], None], groups: Sequence[str]
    ) -> Callable[[RestoreJob, WindowJob, L], None]:
        """An install stage that fails where a restore-fault hits: before the window's first faulted group."""

        def failing_install(job: RestoreJob, win: WindowJob, lease: L) -> None:
            faults = self.at(win.index, (INSTALL_FAULT,))
            group = next((g for g in groups if any_for_group(faults, g)), None)
            if group is not None:
                self.fire(faults)
                raise _install_fault(group, win.index, [group])
            install(job, win, lease)

        return failing_install

    def window(
        self, stage: WindowStage, group: str, timeout_s: float, tier_of: Callable[[WindowJob], str | None]
    ) -> WindowStage:
        """A whole window as one stage (for the host's one KV ``group``): a stall fails it at its fetch before it
        starts (``tier_of`` names the tier blamed); a restore-fault fails it after its install."""

        def faulty_window(win: WindowJob, out: RestoreResult) -> int:
            hits = self.at(win.index, KINDS, group)
            self.fire([f for f in hits if not f.tiers_affected()])  # a tier taken down fires where it is read
            if any(f.kind == STALL for f in hits):
                self.stall(win.index, timeout_s)
                raise RestoreFailed(
                    f"timeout: window {win.index} did not arrive within {timeout_s}s",
                    win.index,
                    kind=FailureKind.TIER,
                    stage=Stage.FETCH,
                    tier=tier_of(win),
                )
            nbytes = stage(win, out)
            if any(f.kind == INSTALL_FAULT for f in hits):
                raise _install_fault(group, win.index)
            return nbytes

        return faulty_window

    def locations(self, locate: Callable[[WindowJob, str], L], nowhere: L, group: str) -> Callable[[WindowJob, str], L]:
        """Where a host reads a tier from in a window: ``nowhere`` while an armed fault there takes the tier down."""

        def located(win: WindowJob, tier: str) -> L:
            down = [f for f in self.at(win.index, KINDS, group) if tier in f.tiers_affected()]
            if not down:
                return locate(win, tier)
            self.fire(down)
            return nowhere

        return located


def _install_fault(group: str, window: int, groups: Sequence[str] | None = None) -> RestoreFailed:
    # The injected fault is in the rank's own install (the H2D copy): the rank is blamed, never a tier.
    return RestoreFailed(
        f"injected restore fault while installing group {group}",
        window,
        groups,
        kind=FailureKind.RANK,
        stage=Stage.INSTALL,
    )


class FaultyTier:
    """A tier as the armed fetch faults make it act in the windows they hit, and the tier itself elsewhere.
    ``inner`` None: a tier the rank does not have, which answers unavailable. ``where``: each object key of the
    restore with its window and KV group (one call fetches objects of one window)."""

    def __init__(self, name: str, inner: Tier | None, armed: ArmedFaults, where: Mapping[str, tuple[int, str]]):
        self.name = name
        self.inner = inner
        self.armed = armed
        self.where = where

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        started = time.monotonic()
        window = self.where[keys[0]][0]
        groups = [self.where[k][1] for k in keys]
        hits = self.armed.at(window, FETCH_KINDS)
        # A fault is used up only where it acts: one that takes down another tier leaves this fetch alone.
        down = [f for f in hits if self.name in f.tiers_affected()]
        self.armed.fire(down)
        codes: list[int]
        sums: list[int | None]
        if self.inner is None or down:
            codes, sums = [UNAVAILABLE] * len(keys), [None] * len(keys)
        else:
            codes, sums = self.inner.get_into(keys, dests, timeout_s)
        stalls = [f for f in hits if f.kind == STALL and any(any_for_group([f], g) for g in groups)]
        stalled = {i for i, g in enumerate(groups) if any_for_group(stalls, g)}
        if stalled:
            self.armed.fire(stalls)
            self.armed.stall(window, started + timeout_s - time.monotonic())
            codes = [TIMED_OUT if i in stalled else code for i, code in enumerate(codes)]
        for f in hits:
            if f.kind != CORRUPT:
                continue
            hit = next((i for i, g in enumerate(groups) if codes[i] > 0 and (f.group is None or f.group == g)), None)
            if hit is not None:
                self.armed.fire([f])
                view = dests[hit].view
                view[len(view) // 2] ^= 0xFF  # one flipped byte in transit
        return codes, sums

    def known_fault(self, keys: Sequence[str]) -> str:
        """The armed fetch faults that hit these keys' window (``runtime.tiers.ExplainingTier``)."""
        hits = self.armed.at(self.where[keys[0]][0], FETCH_KINDS) if keys else []
        return ", ".join(f"injected {f.kind} (fault #{f.id})" for f in hits)

    def pending_writes(self) -> list[Future[Any]]:
        # The wrapped tier's transfers abandoned at a deadline (none for a tier that abandons none).
        return self.inner.pending_writes() if isinstance(self.inner, AbandoningTier) else []

    # The rest of the tier interface is the wrapped tier's: faults act on a restore's fetches only.
    def health(self) -> TierHealth:
        return self.inner.health() if self.inner is not None else TierHealth(False, f"no {self.name} tier")

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        return self.inner.contains(keys, timeout_s) if self.inner is not None else [False] * len(keys)

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.put(keys, payloads, checksums)

    def close(self) -> None:
        """The wrapper owns nothing: the host closes its tiers."""


__all__ = ["ArmedFaults", "FaultyTier", "WindowStage"]
