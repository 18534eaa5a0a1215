"""Finding every damaged object at once: a rank's scrubs of its tiers (the types are core/scrub.py's).

A restore stops at the first window that fails, so the re-read of that window's objects (``quarantine_damaged``)
finds only the damage that window read: with damage in k windows of a prompt it would take k failed restores, each
a forced recompute, before every bad object was set apart. So when a tier fails a restore at fetch or verify, the
rank also scrubs the rest of the prompt's objects on that tier, in the background: each is read back whole by the
tier itself (``RepairableTier.check_stored``) and the damaged ones are moved aside, so that the next store rewrites
them all. An operator's `bsr scrub` runs the same scrub on demand, over a prompt or every object a tier holds.

``Scrubber`` is one rank's: it runs at most ``max_concurrent`` scrubs at once (another is skipped, and says so),
bounds each by its ``ScrubLimits`` (objects and bytes read), keeps each running scrub's progress for `bsr status`
and emits ``scrub_started``/``scrub_finished`` (and ``object_quarantined`` per object it moves aside).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from bsr_cli.api.ranks import QuarantinedObject, ScrubRequest, ScrubResult, UnsupportedOp
from bsr_cli.core.events import Event, ObjectQuarantined
from bsr_cli.core.evidence import ScrubScope, ScrubState
from bsr_cli.core.keys import chunk_hashes, prompt_hash
from bsr_cli.core.scrub import MAX_CONCURRENT, ScrubLimits, ScrubProgress, ScrubReport
from bsr_cli.errors import InvalidInput
from bsr_cli.runtime.admission import Admission
from bsr_cli.runtime.rank_calls import RankCalls
from bsr_cli.runtime.tiers import RepairableTier, StoredCheck, Tier, TierUnavailable

log = logging.getLogger(__name__)

Emit = Callable[[Event], None]
KEEP_ENDED = 4  # ended scrubs a rank still reports (per rank, newest first), for `bsr status`


@dataclass(frozen=True)
class ScrubTarget:
    """One object of a prompt a scrub reads back: its key, and which chunk and group it is (for its note)."""

    key: str
    chunk: int
    group: str


def quarantine_damaged(tier: RepairableTier, suspects: Mapping[str, str]) -> list[QuarantinedObject]:
    """Re-read each suspect object (key → what it is and why it is suspect) and move aside the ones whose stored
    bytes fail their check. An object that reads back intact stays: what failed was the transfer, not the tier."""
    moved = []
    for key, context in suspects.items():
        found = tier.check_stored(key)
        if found.damage is not None and (q := tier.set_aside(found, f"{found.damage}: {context}")) is not None:
            moved.append(q)
    return moved


@dataclass
class _Run:
    """One scrub while it runs: what it reads, its progress so far, and what it set apart."""

    progress: ScrubProgress
    checks: Iterator[tuple[ScrubTarget | None, StoredCheck]]
    tier: RepairableTier
    limits: ScrubLimits
    context: str  # what each quarantine note adds: the rank, the scrub, the failed restore
    moved: list[QuarantinedObject]


class Scrubber:
    """One rank's scrubs of its tiers (see the module's docstring). ``stop()`` ends the running ones at their next
    object (the rank is going away)."""

    def __init__(self, rank: int, tiers: Mapping[str, Tier], emit: Emit, *, max_concurrent: int = MAX_CONCURRENT):
        self.rank = rank
        self.tiers = tiers
        self.emit = emit
        self.max_concurrent = max_concurrent
        self._lock = threading.Lock()
        self._running: dict[str, ScrubProgress] = {}  # by scrub id, under ``_lock``
        self._ended: deque[ScrubProgress] = deque(maxlen=KEEP_ENDED)
        self._ids = itertools.count(1)
        self._stop = threading.Event()

    def new_id(self) -> str:
        return f"scrub-{self.rank}-{next(self._ids)}"

    def progress(self, tier: str) -> list[ScrubProgress]:
        """The scrubs of ``tier`` running now, then the last ones that ended (newest first)."""
        with self._lock:
            running = [p for p in self._running.values() if p.tier == tier]
            ended = [p for p in reversed(self._ended) if p.tier == tier]
        return running + ended

    def stop(self) -> None:
        self._stop.set()

    # -- starting one ------------------------------------------------------------------------------------------------
    def scrub_prompt(
        self,
        tier_name: str,
        targets: Sequence[ScrubTarget],
        *,
        prompt: str,
        limits: ScrubLimits,
        request: str | None = None,
        scrub: str | None = None,
        background: bool = False,
    ) -> ScrubResult | None:
        """Scrub ``targets`` (a prompt's objects) on ``tier_name``: now, answering how it ended, or in the
        background (``background``: answers None at once; the events and `bsr status` say how it goes)."""
        tier = self._repairable(tier_name)
        progress = self._progress(scrub, tier_name, ScrubScope.PROMPT, prompt, request, objects=len(targets))
        checks = ((t, tier.check_stored(t.key)) for t in targets)
        context = f"on rank {self.rank}; {progress.scrub}" + (f" after restore {request} failed" if request else "")
        run = _Run(progress, checks, tier, limits, context, [])
        if not background:
            return self._run(run)
        if self._admit(run):
            threading.Thread(target=self._scrub, args=(run,), name=f"bsr-{progress.scrub}", daemon=True).start()
        return None

    def scrub_all(self, tier_name: str, *, shards: int, limits: ScrubLimits, scrub: str | None = None) -> ScrubResult:
        """Scrub this rank's share of every object ``tier_name`` holds (one of ``shards``), answering how it ended."""
        tier = self._repairable(tier_name)
        progress = self._progress(scrub, tier_name, ScrubScope.ALL, "", None, objects=0)
        checks = ((None, found) for found in tier.check_all(self.rank % max(shards, 1), shards))
        return self._run(_Run(progress, checks, tier, limits, f"on rank {self.rank}; {progress.scrub}", []))

    def _repairable(self, tier_name: str) -> RepairableTier:
        tier = self.tiers.get(tier_name)
        if not isinstance(tier, RepairableTier):
            raise UnsupportedOp(
                "scrub",
                f"tier {tier_name!r} cannot check its own objects on rank {self.rank}"
                if tier is not None
                else f"rank {self.rank} has no tier {tier_name!r}",
                hint="scrub a tier that can verify its objects (fs, mooncake)",
            )
        return tier

    def _progress(
        self, scrub: str | None, tier: str, scope: ScrubScope, prompt: str, request: str | None, objects: int
    ) -> ScrubProgress:
        return ScrubProgress(
            scrub=scrub or self.new_id(),
            rank=self.rank,
            tier=tier,
            scope=scope,
            state=ScrubState.RUNNING,
            started_at=time.time(),
            prompt=prompt,
            request=request,
            objects=objects,
        )

    def _run(self, run: _Run) -> ScrubResult:
        if not self._admit(run):
            return ScrubResult(run.progress)
        return self._scrub(run)

    def _admit(self, run: _Run) -> bool:
        """Count the scrub in, unless the rank already runs as many as it allows, or this prompt's scrub of the same
        tier; a scrub not admitted ends at once as skipped (and says why)."""
        p = run.progress
        with self._lock:
            same = next(
                (q.scrub for q in self._running.values() if p.prompt and (q.tier, q.prompt) == (p.tier, p.prompt)),
                None,
            )
            why = (
                f"{same} already scrubs this prompt on tier {p.tier}"
                if same
                else f"rank {self.rank} already runs {len(self._running)} scrub(s), its limit"
                if len(self._running) >= self.max_concurrent
                else ""
            )
            if not why:
                self._running[p.scrub] = p
        if why:
            self._end(run, ScrubState.SKIPPED, why, started=False)
            return False
        self._send(p.started_event())
        return True

    # -- running one -------------------------------------------------------------------------------------------------
    def _scrub(self, run: _Run) -> ScrubResult:
        state, why = ScrubState.COMPLETE, ""
        try:
            state, why = self._walk(run)
        except TierUnavailable as e:
            state, why = ScrubState.FAILED, str(e)
        except Exception as e:  # a scrub that breaks ends failed, and says why; the rank goes on
            log.exception("rank %d: %s failed", self.rank, run.progress.scrub)
            state, why = ScrubState.FAILED, f"{type(e).__name__}: {e}"
        self._end(run, state, why)
        return ScrubResult(run.progress, run.moved)

    def _walk(self, run: _Run) -> tuple[ScrubState, str]:
        """Read every object in scope back, until the end or a limit; set the damaged ones apart."""
        lim = run.limits
        while True:
            p = run.progress
            if self._stop.is_set():
                return ScrubState.FAILED, f"rank {self.rank} is stopping"
            if p.checked >= lim.max_objects:
                return ScrubState.CUT, f"stopped at its limit of {lim.max_objects:,} objects"
            if p.bytes >= lim.max_bytes:
                return ScrubState.CUT, f"stopped at its limit of {lim.max_bytes:,} bytes"
            item = next(run.checks, None)
            if item is None:
                return ScrubState.COMPLETE, ""
            target, found = item
            moved = self._set_aside(run, target, found) if found.damage is not None else None
            self._advance(
                run,
                replace(
                    p,
                    checked=p.checked + found.held,
                    missing=p.missing + (not found.held),
                    bytes=p.bytes + found.bytes,
                    damaged=p.damaged + (found.damage is not None),
                    quarantined=p.quarantined + (moved is not None),
                ),
            )

    def _set_aside(self, run: _Run, target: ScrubTarget | None, found: StoredCheck) -> QuarantinedObject | None:
        p = run.progress
        what = f"chunk {target.chunk} group {target.group} " if target is not None else ""
        moved = run.tier.set_aside(found, f"{found.damage}: {what}{run.context}")
        if moved is None:
            return None
        run.moved.append(moved)
        self._send(
            ObjectQuarantined(
                rank=self.rank,
                tier=p.tier,
                key=moved.key,
                file=moved.file,
                reason=moved.reason,
                request=p.request,
                chunk=target.chunk if target is not None else None,
                group=target.group if target is not None else None,
                scrub=p.scrub,
            )
        )
        return moved

    def _advance(self, run: _Run, progress: ScrubProgress) -> None:
        run.progress = progress
        with self._lock:
            self._running[run.progress.scrub] = run.progress

    def _end(self, run: _Run, state: ScrubState, why: str, *, started: bool = True) -> None:
        p = run.progress.ended(state, time.time() - run.progress.started_at, why)
        run.progress = p
        with self._lock:
            if started:
                self._running.pop(p.scrub, None)
            self._ended.append(p)
        self._send(p.finished_event())

    def _send(self, event: Event) -> None:
        with contextlib.suppress(OSError, ValueError):  # the coordinator is gone (the rank is stopping)
            self.emit(event)


# How long the ranks' answers to an operator's scrub are waited for: it is bounded by its limits, not by this.
SCRUB_CALL_S = 600.0


def scrub_ranks(
    calls: RankCalls, admission: Admission, tier: str, tokens: Sequence[int] | None, limits: ScrubLimits
) -> ScrubReport:
    """An operator's scrub across every rank (the coordinator's side): one ``ScrubRequest`` to each rank, their
    answers joined into the report `bsr scrub` prints."""
    settings = calls.settings
    if tier not in settings.tiers:
        raise InvalidInput(f"this engine has no tier {tier!r}", hint=f"its tiers: {', '.join(settings.tiers)}")
    prompt, hashes = "", []
    if tokens is not None:
        admission.check_tokens(tokens)
        prompt, hashes = prompt_hash(tokens), chunk_hashes(tokens, calls.reg.chunk_size)
    scope = ScrubScope.ALL if tokens is None else ScrubScope.PROMPT
    request = ScrubRequest(
        scrub=f"scrub-{uuid.uuid4().hex[:8]}",
        tier=tier,
        scope=scope,
        max_objects=limits.max_objects,
        max_bytes=limits.max_bytes,
        hashes=hashes,
        prompt=prompt,
        shards=len(calls.ranks),
    )
    answers = calls.call_all(request, timeout_s=SCRUB_CALL_S)
    return ScrubReport(
        tier=tier,
        scope=scope,
        ranks=tuple(a.progress for a in answers),
        prompt=prompt,
        quarantined=tuple(q for a in answers for q in a.quarantined),
    )


__all__ = ["SCRUB_CALL_S", "ScrubTarget", "Scrubber", "quarantine_damaged", "scrub_ranks"]
