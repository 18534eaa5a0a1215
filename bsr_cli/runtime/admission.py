"""The coordinator's admission layer: discovery, the force-local markers, and the external prefix's restore jobs.

Discovery is the probe-only lookup on every rank (the complete hit bitmap; no object bytes move, nothing stays
pinned). The external prefix is what every rank and group holds in a tier not excluded by the prompt's force-local
marker; ``restore_jobs`` turns it into one typed ``RestoreJob`` per rank (that rank's objects, the windows of at
most W chunks, the request's blocks and the armed faults aimed at that rank).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from bsr_cli.api.ranks import ObjectRef, ProbeRequest, RankRequest, RestoreJob, WindowJob
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.events import MarkerCleared, MarkerSet
from bsr_cli.core.evidence import MarkerClearCause
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.keys import chunk_hashes, object_key
from bsr_cli.core.markers import ClearScope, Marker, ScopeKind
from bsr_cli.core.markers import clear as clear_markers_in
from bsr_cli.core.plan import Window
from bsr_cli.core.results import TierErrors
from bsr_cli.core.status import MarkerView
from bsr_cli.errors import BadRequest
from bsr_cli.runtime.coordinator_state import CoordinatorContext

R = TypeVar("R")


class RankCaller(Protocol):
    """How admission asks every rank at once (``Observation.call_all``: with liveness, failing fast)."""

    def call_all(self, request: RankRequest[R], timeout_s: float | None = None) -> list[R]: ...


class Admission:
    """Owns what decides a request's admission: its id, the probe-only lookup, the per-rank jobs of the external
    prefix, and the force-local markers (under ``_lock``)."""

    def __init__(self, ctx: CoordinatorContext, ranks: RankCaller) -> None:
        self.reg = ctx.reg
        self.ranks = ctx.ranks
        self.settings = ctx.settings
        self.events = ctx.events
        self.counters = ctx.counters
        self._caller = ranks
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._markers: dict[str, Marker] = {}

    def continue_request_ids(self, after: int) -> None:
        """Number new requests after ``after``: an engine restarted over its own event store must never reuse a
        request id its kept evidence already names."""
        self._ids = itertools.count(max(0, after) + 1)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids):05d}"

    def check_tokens(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise BadRequest("the prompt is empty", hint="send a prompt of at least one token")
        if len(tokens) > self.settings.max_tokens:
            raise BadRequest(
                f"prompt of {len(tokens):,} tokens exceeds this engine's limit of {self.settings.max_tokens:,}",
                hint="start the engine with a larger --max-tokens",
            )

    # -- discovery ---------------------------------------------------------------------------------------------
    def probe(self, tokens: Sequence[int], hashes: list[str] | None = None) -> tuple[HitBitmap, TierErrors]:
        """Probe-only lookup on every rank: the complete hit bitmap; no object bytes move, nothing stays pinned."""
        self.check_tokens(tokens)
        hashes = hashes or chunk_hashes(tokens, self.reg.chunk_size)
        answers = self._caller.call_all(ProbeRequest(hashes=list(hashes), tiers=list(self.settings.tiers)))
        rows = {(r.rank, g): a.rows[g] for r, a in zip(self.ranks, answers, strict=True) for g in self.reg.group_names}
        errors = {f"rank{r.rank}": dict(a.errors) for r, a in zip(self.ranks, answers, strict=True) if a.errors}
        bitmap = HitBitmap(
            tiers=self.settings.tiers,
            ranks=len(self.ranks),
            groups=self.reg.group_names,
            tokens=len(tokens),
            chunk_size=self.reg.chunk_size,
            rows=rows,
            registration=self.reg.identity,
            model=self.reg.model,
        )
        return bitmap, errors

    # -- the external prefix -----------------------------------------------------------------------------------
    def objects_for(
        self, bitmap: HitBitmap, rank: int, k: int, exclude: set[str], hashes: list[str]
    ) -> dict[str, list[ObjectRef]]:
        """Rank ``rank``'s objects of the first ``k`` chunks, per group, each from the tier it is restored from."""
        cs = self.reg.chunk_size
        out: dict[str, list[ObjectRef]] = {}
        for g in self.reg.group_names:
            bpt = self.reg.group_bytes_per_chunk(g) // cs
            objs = []
            for c in range(k):
                tier = bitmap.choose_tier(rank, g, c, exclude)
                n = min((c + 1) * cs, bitmap.tokens) - c * cs
                objs.append(ObjectRef(object_key(self.reg, rank, g, hashes[c]), tier or "", n * bpt))
            out[g] = objs
        return out

    def restore_jobs(
        self,
        request: str,
        w: int,
        windows: Sequence[Window],
        objects: dict[int, dict[str, list[ObjectRef]]],
        block_tables: dict[str, list[int]],
        faults: Sequence[FaultSpec],
        *,
        prompt: str = "",
        hashes: Sequence[str] = (),
    ) -> dict[int, RestoreJob]:
        """One typed job per rank: its own objects and the armed faults aimed at it (or at every rank), with the
        prompt and all its chunk hashes (what a rank scrubs if a tier fails the restore)."""
        wins = [
            WindowJob(
                index=win.index,
                chunk_start=win.chunk_start,
                chunk_end=win.chunk_end,
                token_start=win.token_start,
                token_end=win.token_end,
                blocks={b.group: (b.start, b.end) for b in win.blocks},
            )
            for win in windows
        ]
        return {
            r.rank: RestoreJob(
                request_id=request,
                w=w,
                windows=wins,
                objects=objects[r.rank],
                block_tables=block_tables,
                faults=[f for f in faults if f.applies_to_rank(r.rank)],
                fetch_timeout_s=self.settings.fetch_timeout_s,
                admit_timeout_s=self.settings.admit_timeout_s,
                prompt=prompt,
                chunk_hashes=tuple(hashes),
            )
            for r in self.ranks
        }

    # -- force-local markers -----------------------------------------------------------------------------------
    def marker(self, prompt: str) -> Marker | None:
        """A copy of the prompt's marker (taken under the lock, so a concurrent update cannot tear it)."""
        with self._lock:
            m = self._markers.get(prompt)
            return None if m is None else dataclasses.replace(m, excluded=set(m.excluded))

    def set_marker(self, prompt: str, tiers: set[str], reason: str, request: str, *, injected: bool = False) -> Marker:
        """Mark the prompt: its next admission skips ``tiers`` (a tier's fetch or verify failed), or, with no tiers,
        recomputes it locally (a rank failed to install or synchronize: no tier is to blame, so none is excluded).
        Recomputing locally is the stronger of the two and is kept once set. ``injected``: an injected fault failed
        the restore (counted and recorded as such)."""
        with self._lock:
            m = self._markers.get(prompt)
            if m is None:
                m = self._markers[prompt] = Marker(prompt, set(tiers), reason, request)
            elif m.excluded and tiers:
                m.excluded |= tiers
                m.reason, m.request = reason, request
            elif not tiers:
                m.excluded = set()
                m.reason, m.request = reason, request
            snap = dataclasses.replace(m, excluded=set(m.excluded))
        self.counters.marker_set(injected)
        self.events.append(
            MarkerSet(
                request=request,
                prompt=prompt,
                excluded_tiers=tuple(sorted(snap.excluded)),
                reason=reason,
                injected=injected,
            )
        )
        return snap

    def clear_marker(self, prompt: str, request: str, why: MarkerClearCause) -> bool:
        with self._lock:
            m = self._markers.pop(prompt, None)
        if m is not None:
            self.events.append(MarkerCleared(request=request, prompt=prompt, why=why.value))
        return m is not None

    def markers(self) -> dict[str, Marker]:
        """Every standing marker, each a copy (a concurrent update cannot tear it)."""
        with self._lock:
            return {p: dataclasses.replace(m, excluded=set(m.excluded)) for p, m in self._markers.items()}

    def restore_markers(self, markers: Iterable[Marker]) -> None:
        """Markers kept by a previous run of this engine, standing again as they were."""
        with self._lock:
            for m in markers:
                self._markers[m.prompt] = m

    def list_markers(self) -> list[MarkerView]:
        """Every standing marker, as the engine lists it (taken under the lock: callers must not iterate
        ``markers`` while a request may set or clear one)."""
        with self._lock:
            return [MarkerView.of(m) for m in self._markers.values()]

    def clear_markers(self, scope: ClearScope | None = None) -> int:
        """The operator's clear: every marker, one prompt's, or one tier out of every marker (``ClearScope``).
        Each marker touched is a ``marker_cleared`` event naming the scope. Answers how many were touched."""
        scope = scope or ClearScope.all()
        with self._lock:
            touched = clear_markers_in(self._markers, scope)
        for c in touched:
            self.events.append(
                MarkerCleared(
                    prompt=c.prompt,
                    why=MarkerClearCause.OPERATOR.value,
                    scope=scope.kind.value,
                    tier=scope.value if scope.kind is ScopeKind.TIER else None,
                    # The tier was taken out and the rest still stands: say what the marker still excludes.
                    excluded_tiers=None if c.removed else tuple(sorted(c.remaining)),
                )
            )
        return len(touched)


__all__ = ["Admission"]
