"""The coordinator's orchestration layer: a request's life, from admission to the commit rule.

A request's life, as a scheduler admits it (``submit``):

1. probe-only lookup on every rank → hit bitmap (rank × group × chunk × tier); the external prefix is what every
   rank and group holds in a tier not excluded by a force-local marker;
2. destination blocks are allocated for the whole prompt (the same block ids on every rank);
3. the external prefix is restored in windows of at most W chunks on every rank (one typed ``RestoreRequest`` per
   rank); the commit rule (every rank and every group valid) decides; any invalid cell collapses the external
   prefix to zero, every block of the request is invalidated, and a force-local marker excludes the failed tiers
   from the next pass;
4. the next pass re-runs admission without those tiers: a lower tier that holds the whole prefix, else local
   recompute. A successful admission clears the marker;
5. the rest of the prompt is computed locally; the output hash is taken (and checked against the canonical hash
   when asked); the chunks the tiers lack are stored. A request whose output hash differs from the canonical one
   ends failed: its blocks are invalidated, nothing is stored, a force-local marker makes the next admission of
   the prompt recompute it, and an ``output_mismatch`` event names it (docs/architecture.md, "Output hash").

``restore`` is the manual variant: one windowed restore of the external prefix, no fallback, nothing computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from bsr_cli.api.ranks import (
    CanonicalHashRequest,
    InvalidateRequest,
    OutputHashRequest,
    PrefillRequest,
    RankClient,
    RestoreRequest,
    RestoreResult,
    StoreRequest,
    StoreResult,
)
from bsr_cli.core import accounting, limits, trace
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.commit import CommitDecision, commit_prefix
from bsr_cli.core.events import (
    AbortRequested,
    Event,
    Failure,
    OutputMismatch,
    RequestAdmitted,
    RequestFinished,
    RestoreStarted,
    StoreFailed,
)
from bsr_cli.core.evidence import FailureKind, MarkerClearCause, Outcome, Stage
from bsr_cli.core.keys import chunk_hashes, prompt_hash
from bsr_cli.core.markers import Marker
from bsr_cli.core.plan import windows_for
from bsr_cli.core.results import (
    AdmissionPass,
    ManualRestoreResult,
    MarkerStep,
    OutputHashes,
    PrefixLookup,
    RestoreReport,
    StoreReport,
    SubmitResult,
    TierErrors,
)
from bsr_cli.core.status import ActiveRestore
from bsr_cli.errors import RankRestarting
from bsr_cli.runtime import failures
from bsr_cli.runtime.admission import Admission
from bsr_cli.runtime.allocation import Allocation
from bsr_cli.runtime.armed_faults import ArmedFaults
from bsr_cli.runtime.coordinator_state import (
    MAX_PASSES,
    POLL_S,
    CoordinatorContext,
    HostStarved,
    RankUnresponsive,
)
from bsr_cli.runtime.observation import Observation
from bsr_cli.runtime.open_requests import OpenRequests
from bsr_cli.runtime.rank_calls import RankCalls

Tables = dict[str, list[int]]  # per KV group, a request's destination block ids (the same on every rank)
# The probe-only lookup as the host runs it (a host may remember what each chunk hash stands for first).
Probe = Callable[[Sequence[int], list[str] | None], tuple[HitBitmap, TierErrors]]
# Writing the chunks each tier lacks, as the host runs it (a host may vouch for what it stored afterwards).
StoreMissing = Callable[[HitBitmap, list[str], int, Tables], StoreReport]
Progress = Callable[[Event], None]  # a progress event (the admin API streams its wire form)


@dataclass
class Admitted:
    """What ``submit``'s admission passes decided: the committed external prefix and where it came from."""

    committed: int = 0
    source: str = "recompute"
    bitmap: HitBitmap | None = None
    passes: list[AdmissionPass] = field(default_factory=list)
    marker_history: list[MarkerStep] = field(default_factory=list)


@dataclass
class OpenRequest:
    """A request accepted and not yet finished: its W, id, prompt hash, chunk hashes, ``close``, and the ranks it
    started with (a rank started again meanwhile holds none of its KV)."""

    w: int
    request: str
    prompt: str
    hashes: list[str]
    close: Callable[[], None]
    ranks: tuple[RankClient, ...]


class Orchestration:
    """Runs a request's life over the other parts: ``calls`` (every rank asked at once, with liveness),
    ``observation`` (the live view, the restore's report), ``allocation`` (destination blocks), ``admission``
    (probe, markers, per-rank jobs) and ``faults`` (the armed ones each job carries). ``probe`` and
    ``store_missing`` are the host's (default: admission's probe and this part's own store), so a host that wraps
    them is used on every path."""

    def __init__(
        self,
        ctx: CoordinatorContext,
        *,
        calls: RankCalls,
        observation: Observation,
        allocation: Allocation,
        admission: Admission,
        faults: ArmedFaults,
        probe: Probe | None = None,
        store_missing: StoreMissing | None = None,
    ) -> None:
        self.reg = ctx.reg
        self.ranks = ctx.ranks
        self.settings = ctx.settings
        self.events = ctx.events
        self.counters = ctx.counters
        self.calls = calls
        self.observation = observation
        self.allocation = allocation
        self.admission = admission
        self.faults = faults
        self._probe: Probe = probe or admission.probe
        self._store_missing: StoreMissing = store_missing or self.store_missing
        self._requests = OpenRequests()  # accepted and not yet finished: abortable until they commit

    # -- one windowed restore across every rank ----------------------------------------------------------------
    def _restore_external(
        self,
        request: str,
        bitmap: HitBitmap,
        hashes: list[str],
        exclude: set[str],
        w: int,
        block_tables: Tables,
        prompt: str = "",
        pass_no: int = 1,
    ) -> RestoreReport:
        """One windowed restore of the external prefix on every rank (admission pass ``pass_no`` of its request:
        every event of it says which)."""
        k = bitmap.prefix_chunks(exclude)
        ext_tokens = bitmap.prefix_tokens(exclude)
        windows = windows_for(self.reg, w, k, ext_tokens)
        objects = {r.rank: self.admission.objects_for(bitmap, r.rank, k, exclude, hashes) for r in self.ranks}
        tiers_used = {o.tier for objs in objects.values() for refs in objs.values() for o in refs}
        jobs = self.admission.restore_jobs(
            request, w, windows, objects, block_tables, self.faults.armed(), prompt=prompt, hashes=hashes
        )
        started = time.monotonic()
        self.observation.restore_began(
            request,
            ActiveRestore(
                request=request,
                w=w,
                windows=len(windows),
                tokens=ext_tokens,
                tiers=tuple(sorted(tiers_used)),
                started=time.time(),
                done={r.rank: 0 for r in self.ranks},
                bytes={r.rank: 0 for r in self.ranks},
            ),
            pass_no,
        )
        self.events.append(
            RestoreStarted(
                request=request,
                prompt=prompt,
                W=w,
                windows=len(windows),
                tokens=ext_tokens,
                tiers=tuple(sorted(tiers_used)),
                pass_no=pass_no,
            )
        )
        futures = [r.submit(RestoreRequest(jobs[r.rank])) for r in self.ranks]
        try:
            outcomes = self._await_restore(request, futures)
        finally:
            self.observation.restore_over(request)
        decision, outcomes = self._commit(request, ext_tokens, outcomes, block_tables)
        fired = {fid for o in outcomes for fid in o.fired_faults}
        self.faults.record_fired(fired, request)
        return self.observation.report_restore(
            request=request,
            w=w,
            k=k,
            windows=len(windows),
            ext_tokens=ext_tokens,
            committed_tokens=decision.committed_tokens,
            invalid=decision.invalid,
            outcomes=outcomes,
            tiers_used=tiers_used,
            fired=fired,
            seconds=time.monotonic() - started,
        )

    def _commit(
        self, request: str, ext_tokens: int, outcomes: list[RestoreResult], block_tables: Tables
    ) -> tuple[CommitDecision, list[RestoreResult]]:
        """The commit rule at the commit point, which an abort races: an abort asked before it ends the restore
        aborted even when every rank installed its windows (they are scrubbed, nothing is committed); one asked
        after it is refused as too late (``OpenRequests``)."""
        ranks, groups = [r.rank for r in self.ranks], self.reg.group_names
        decision = commit_prefix(ext_tokens, _validity(outcomes), ranks, groups)
        if not decision.committed_tokens or self._requests.commit(request, decision.committed_tokens):
            return decision, outcomes
        self.calls.call_all(InvalidateRequest(block_tables))  # fail closed: nothing installed stays readable
        aborted = [_aborted_at_commit(o, groups) for o in outcomes]
        return commit_prefix(ext_tokens, _validity(aborted), ranks, groups), aborted

    def _await_restore(self, request: str, futures: Sequence[Future[RestoreResult]]) -> list[RestoreResult]:
        """Every rank's restore outcome, with liveness: a rank judged dead, stopped or hung (no heartbeat, or no
        progress within its window deadline, derived from the fetch timeout) fails the restore as a rank fault
        within seconds; one the host starves has its deadlines stretched up to the overload ceiling, past which the
        restore fails as the host's (``runtime/judge.py``). Then every rank is told to abort; a call that is still
        running keeps its blocks allocated (see ``Allocation.hold_until_done``)."""
        start = time.monotonic()
        by_rank = {r.rank: r for r in self.ranks}
        pending = {r.rank: f for r, f in zip(self.ranks, futures, strict=True)}
        outcomes: dict[int, RestoreResult] = {}
        stalled: dict[int, Failure] = {}
        while pending and not stalled:
            wait(list(pending.values()), timeout=POLL_S, return_when=FIRST_COMPLETED)
            self._collect(pending, outcomes, stalled)
            for rk in pending:
                verdict = self.calls.liveness(by_rank[rk])
                if not verdict.final:
                    verdict = self.calls.judge_progress(request, by_rank[rk])
                if verdict.final:
                    stalled[rk] = failures.quiet_rank_failure(rk, verdict.state, verdict.reason, verdict.load)
        if not stalled:
            return [outcomes[r.rank] for r in self.ranks]
        for r in self.ranks:
            r.abort(request)
        for rk, fail in stalled.items():
            if fail.kind is FailureKind.RANK:
                self.calls.rank_fault(rk, fail.reason, request)
        # The other ranks end their own restore fail-closed (abort); give them a short grace to say so.
        grace_end = time.monotonic() + min(5.0, self.calls.stall_s)
        for rk, f in list(pending.items()):
            if rk not in stalled:
                wait([f], timeout=max(0.0, grace_end - time.monotonic()))
        self._collect({rk: f for rk, f in pending.items() if rk not in stalled}, outcomes, stalled)
        kind = failures.classify(stalled.values()) or FailureKind.RANK
        for rk, f in pending.items():
            if not f.done():
                # Still running: the rank is unhealthy (starved, when the host made it late) and the request's
                # blocks are not reused until it returns.
                self.calls.note_stuck(rk, request, f, kind)
                self.allocation.hold_until_done(request, f)
        elapsed = time.monotonic() - start
        for rk in by_rank:
            if rk in stalled:
                outcomes[rk] = self._stalled_result(rk, stalled[rk], elapsed)
            elif rk not in outcomes:
                why = (
                    f"still running when the host overloaded rank(s) {sorted(stalled)}"
                    if kind is FailureKind.HOST_OVERLOADED
                    else f"still running after rank(s) {sorted(stalled)} stopped responding"
                )
                outcomes[rk] = self._stalled_result(rk, Failure(rank=rk, reason=why, kind=FailureKind.ABORTED), elapsed)
        return [outcomes[r.rank] for r in self.ranks]

    @staticmethod
    def _collect(
        pending: dict[int, Future[RestoreResult]], outcomes: dict[int, RestoreResult], stalled: dict[int, Failure]
    ) -> None:
        """Move each finished call out of ``pending``: its outcome, or a rank fault when the call itself broke."""
        for rk, f in list(pending.items()):
            if f.done():
                del pending[rk]
                try:
                    outcomes[rk] = f.result()
                except Exception as e:  # noqa: BLE001 - a rank whose call broke is a rank fault
                    stalled[rk] = Failure(rank=rk, reason=f"its restore call failed: {e}", kind=FailureKind.RANK)

    def _stalled_result(self, rank: int, fail: Failure, elapsed: float) -> RestoreResult:
        return RestoreResult(
            rank=rank,
            ok=False,
            valid=dict.fromkeys(self.reg.group_names, False),
            seconds=elapsed,
            reason=fail.reason,
            kind=fail.kind.value,
            load=fail.load,
        )

    # -- requests ----------------------------------------------------------------------------------------------
    def _combined_hash(self, per_rank: Sequence[dict[str, str]]) -> str:
        h = hashlib.sha256()
        for r, groups in enumerate(per_rank):
            for g in self.reg.group_names:
                h.update(f"{r}:{g}:{groups[g]};".encode())
        return h.hexdigest()[:32]

    def _output_hash(self, tables: dict[str, list[int]], n_tokens: int) -> str:
        return self._combined_hash([a.groups for a in self.calls.call_all(OutputHashRequest(tables, n_tokens))])

    def _canonical_hash(self, hashes: list[str], n_tokens: int) -> str:
        return self._combined_hash([a.groups for a in self.calls.call_all(CanonicalHashRequest(hashes, n_tokens))])

    def _open(
        self, tokens: Sequence[int], w: int | None, request: str | None, progress: Progress | None
    ) -> OpenRequest:
        """What every request starts with: a checked prompt, its W, id, prompt hash, chunk hashes, and the
        progress listener (``close`` removes it and ends the request)."""
        request = request or self.admission.new_request_id()
        # Open from acceptance (the client learns the id then; the admin API opens a streamed request before its
        # work starts, see ``open_request``) to the end: an abort in between, before its windows start, still ends
        # it fail-closed (each rank keeps the abort for the job that follows).
        self._requests.open(request)
        try:
            self.admission.check_tokens(tokens)
            if w is None:
                w = self.settings.w
            else:
                limits.check_request_window(self.reg, accounting.check_window(w), self.settings.max_tokens)
        except BaseException:
            self._close_request(request)
            raise
        unlisten = self.events.listen(request, progress) if progress else (lambda: None)

        def close() -> None:
            unlisten()
            self._close_request(request)

        prompt, hashes = prompt_hash(tokens), chunk_hashes(tokens, self.reg.chunk_size)
        return OpenRequest(w, request, prompt, hashes, close, tuple(self.ranks))

    def _lost_rank(self, req: OpenRequest, res: RestoreReport) -> RankRestarting | RankUnresponsive | None:
        """The error for a restore that lost a rank (it stopped answering: no stage), from the rank the request
        used: ``RankRestarting`` (503, when to retry) when its process is gone and the host starts it again."""
        for f in res.failures:
            if f.kind is FailureKind.RANK and f.stage is None and f.rank is not None:
                used = next((r for r in req.ranks if r.rank == f.rank), None)
                return RankUnresponsive(f.rank, f.reason) if used is None else self.calls.unavailable(used, f.reason)
        return None

    def _keep_ranks(self, req: OpenRequest) -> None:
        """A rank started again during the request holds none of the KV the request restored or computed there:
        the request fails (503, retry) rather than answer with hashes of a fresh rank's KV."""
        for used, now in zip(req.ranks, self.ranks, strict=True):
            if used is not now:
                raise self.calls.unavailable(used, "it was started again during this request")

    def _close_request(self, request: str) -> None:
        self._requests.close(request)

    def submit(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        store: bool = True,
        progress: Progress | None = None,
        request: str | None = None,
    ) -> SubmitResult:
        """Admit a prompt as the scheduler would: restore the external prefix (with fallback), compute the rest."""
        req = self._open(tokens, w, request, progress)
        started = time.monotonic()
        self.counters.submitted.inc()
        try:
            # Waits (FIFO, up to kv_wait_s) while running requests hold the destination blocks.
            tables, queued_s = self.allocation.allocate(len(tokens), req.request)
        except BaseException:
            req.close()
            raise
        try:
            self.events.append(
                RequestAdmitted(
                    request=req.request,
                    prompt=req.prompt,
                    tokens=len(tokens),
                    queued_s=round(queued_s, 6),
                    block_ids=trace.block_ids(req.hashes, len(tokens), self.reg.chunk_size),
                )
            )
            admitted = self._admit(tokens, req, tables)
            # Successful admission (RUNNING): the marker has served its purpose.
            cleared = self.admission.clear_marker(req.prompt, req.request, MarkerClearCause.ADMITTED)
            computed = len(tokens) - admitted.committed
            if computed > 0:
                first_chunk = admitted.committed // self.reg.chunk_size
                self.calls.call_all(PrefillRequest(req.hashes, len(tokens), first_chunk, tables))
            output_hash = self._output_hash(tables, len(tokens))
            canonical = self._canonical_hash(req.hashes, len(tokens)) if verify else None
            self._keep_ranks(req)
            hash_ok = None if canonical is None else canonical == output_hash
            source = admitted.source if admitted.committed else "recompute"
            if hash_ok is False:  # checked before the store: KV known to be wrong is never written to a tier
                checked = OutputHashes(output_hash, canonical, hash_ok)
                self._output_mismatch(req, tables, len(tokens), admitted.committed, source, checked)
            stored = self._store(admitted.bitmap, req, len(tokens), tables) if store and hash_ok is not False else None
            self.events.append(
                RequestFinished(
                    request=req.request,
                    external_tokens=admitted.committed,
                    computed_tokens=computed,
                    source=source,
                    hash_ok=hash_ok,
                )
            )
            return SubmitResult(
                request=req.request,
                prompt=req.prompt,
                tokens=len(tokens),
                w=req.w,
                external_tokens=admitted.committed,
                computed_tokens=computed,
                source=source,
                passes=tuple(admitted.passes),
                marker_history=tuple(admitted.marker_history),
                marker_cleared=cleared,
                stored=stored,
                output_hash=output_hash,
                canonical_hash=canonical,
                hash_ok=hash_ok,
                seconds=time.monotonic() - started,
            )
        finally:
            self.allocation.release(req.request, tables)  # teardown
            req.close()

    def _admit(self, tokens: Sequence[int], req: OpenRequest, tables: Tables) -> Admitted:
        """Up to MAX_PASSES admissions of the prompt, each without the tiers the last one blamed, until one commits
        its external prefix or there is nothing left to restore (the rest is computed locally)."""
        marker = self.admission.marker(req.prompt)
        exclude = set(marker.excluded) if marker else set()
        # A marker that excludes no tier says "recompute locally" (a rank failed to install it last time).
        local = marker is not None and not marker.excluded
        out = Admitted(marker_history=[MarkerStep(pass_no=0, marker=marker)] if marker else [])
        for pass_no in range(1, MAX_PASSES + 1):
            out.bitmap, tier_errors = self._probe(tokens, req.hashes)
            ext = 0 if local else out.bitmap.prefix_tokens(exclude)
            entry = AdmissionPass(
                pass_no=pass_no, excluded_tiers=tuple(sorted(exclude)), external_tokens=ext, tier_errors=tier_errors
            )
            if ext == 0:
                out.passes.append(entry)
                break
            res = self._restore_external(
                req.request, out.bitmap, req.hashes, exclude, req.w, tables, req.prompt, pass_no
            )
            out.passes.append(dataclasses.replace(entry, restore=res))
            if res.committed_tokens:
                out.committed, out.source = res.committed_tokens, "+".join(res.tiers)
                break
            next_exclude = self._after_failed_pass(req, res, pass_no, out)
            if next_exclude is None:
                break
            exclude = next_exclude
        return out

    def _after_failed_pass(
        self, req: OpenRequest, res: RestoreReport, pass_no: int, admitted: Admitted
    ) -> set[str] | None:
        """Fail closed: every block of the request is invalid now (each rank scrubbed its own). A tier fault sets a
        marker excluding that tier (answered: the next pass skips what it excludes); a rank that failed to install
        or synchronize sets one that excludes no tier (the prompt is recomputed locally); a stalled rank ends the
        request (raises), as does a rank the host starved past the overload ceiling; a capacity refusal, an abort
        or a fetch deadline missed while the host starved the rank blames nobody. None: no further pass, the rest is
        computed locally."""
        kind = res.failure_kind
        if kind is FailureKind.HOST_OVERLOADED:
            bad = next(f for f in res.failures if f.kind is kind)
            if bad.stage is None and bad.rank is not None:  # the coordinator named the host: a rank is still busy
                raise HostStarved(bad.rank, bad.reason, bad.load)
            return None  # a rank's own fetch deadline ran out while it was starved: no marker, computed locally
        if kind is FailureKind.RANK:
            lost = self._lost_rank(req, res)
            if lost is not None:  # it stopped answering, or its process is gone: nothing can run
                raise lost
            m = self._mark(req, set(), res)
            admitted.marker_history.append(MarkerStep(pass_no=pass_no, marker=m))
            return None
        if kind is not FailureKind.TIER:
            return None
        m = self._mark(req, set(res.blamed_tiers), res)
        admitted.marker_history.append(MarkerStep(pass_no=pass_no, marker=m))
        return set(m.excluded)

    def _mark(self, req: OpenRequest, tiers: set[str], res: RestoreReport) -> Marker:
        """The force-local marker a failed restore leaves on the prompt (excluding ``tiers``; none: recompute)."""
        return self.admission.set_marker(
            req.prompt, tiers, failures.summary(res), req.request, injected=bool(res.fired_faults)
        )

    def _store(self, bitmap: HitBitmap | None, req: OpenRequest, n_tokens: int, tables: Tables) -> StoreReport | None:
        """The chunks each tier lacks written back; a tier that refused is a ``store_failed`` event."""
        if bitmap is None:
            return None
        stored = self._store_missing(bitmap, req.hashes, n_tokens, tables)
        for rank_name, per_tier in stored.errors.items():
            for tier, err in per_tier.items():
                rank = int(rank_name.removeprefix("rank"))
                self.events.append(StoreFailed(rank=rank, tier=tier, error=err, request=req.request))
        return stored

    def store_missing(self, bitmap: HitBitmap, hashes: list[str], n_tokens: int, tables: Tables) -> StoreReport:
        """Write the chunks each tier lacks (a chunk quarantined as damaged counts as lacking, so this rewrites it
        from the KV just restored or computed). A tier that refuses writes does not fail the request, which has
        its KV: submit records a ``store_failed`` event naming the request, the tier turns unhealthy with the
        reason, and the CLI warns on stderr."""
        futures: list[Future[StoreResult]] = []
        for r in self.ranks:
            chunks: dict[str, list[int]] = {}
            for i, tier in enumerate(bitmap.tiers):
                lacking = [
                    c
                    for c in range(bitmap.chunks)
                    if any(not (bitmap.mask(r.rank, g, c) >> i) & 1 for g in bitmap.groups)
                ]
                if lacking:
                    chunks[tier] = lacking
            futures.append(r.submit(StoreRequest(hashes, n_tokens, tables, chunks)))
        errors: dict[str, dict[str, str]] = {}
        objects: dict[str, dict[str, int]] = {}
        for r, fut in zip(self.ranks, futures, strict=True):
            try:
                res = fut.result(timeout=self.settings.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - a tier that cannot take writes loses reuse, not the request
                res = StoreResult({}, {"*": str(e)})
            objects[f"rank{r.rank}"] = dict(res.objects)
            for tier, err in res.errors.items():
                errors.setdefault(f"rank{r.rank}", {})[tier] = err
        return StoreReport(objects=objects, errors=errors)

    def restore(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        exclude: Sequence[str] = (),
        progress: Progress | None = None,
        request: str | None = None,
    ) -> ManualRestoreResult:
        """A manual windowed restore of a prompt's external prefix (no fallback, nothing computed)."""
        req = self._open(tokens, w, request, progress)
        try:
            try:
                bitmap, tier_errors = self._probe(tokens, req.hashes)
            except RankUnresponsive as e:
                fail = Failure(rank=e.rank, reason=e.reason, kind=FailureKind.RANK)  # no stage: it stopped answering
                return self._probe_failed(req, len(tokens), fail, e.hint)
            except HostStarved as e:
                fail = Failure(rank=e.rank, reason=e.reason, kind=FailureKind.HOST_OVERLOADED, load=e.load)
                return self._probe_failed(req, len(tokens), fail, e.hint)
            except RankRestarting as e:
                fail = Failure(rank=e.rank, reason=e.message, kind=FailureKind.RANK)  # its process is gone
                self._probe_failed(req, len(tokens), fail, e.hint)  # recorded failed closed, naming the restart
                raise  # ... and refused: the admin API answers 503 rank-restarting with when to retry
            excl = set(exclude)
            ext = bitmap.prefix_tokens(excl)
            base = ManualRestoreResult(
                request=req.request,
                prompt=req.prompt,
                tokens=len(tokens),
                w=req.w,
                lookup=PrefixLookup(tier_errors, bitmap.first_break(excl), bitmap),
                report=None,
            )
            if ext == 0:
                self.observation.restore_ended(
                    request=req.request, outcome=Outcome.NOTHING_TO_RESTORE, kind=None, fails=(), w=req.w
                )
                return base
            tables, _ = self.allocation.allocate(ext, req.request)
            try:
                res = self._restore_external(req.request, bitmap, req.hashes, excl, req.w, tables, req.prompt)
                lost = self._lost_rank(req, res)
                if isinstance(lost, RankRestarting):
                    raise lost  # recorded failed closed; the caller is told when to retry
                result = self._after_manual_restore(req, dataclasses.replace(base, report=res), ext, tables, verify)
                self._keep_ranks(req)
                return result
            finally:
                self.allocation.release(req.request, tables)
        finally:
            req.close()

    def _after_manual_restore(
        self, req: OpenRequest, result: ManualRestoreResult, ext: int, tables: Tables, verify: bool
    ) -> ManualRestoreResult:
        """A committed restore's hashes; a failed one's marker (a tier's fault excludes that tier; a rank that
        failed at its own stage has the next admission recompute the prompt, no tier excluded: none is to blame)."""
        res = result.report
        if res is None:
            return result
        if res.committed_tokens:
            output_hash = self._output_hash(tables, ext)
            if not verify:
                return dataclasses.replace(result, hashes=OutputHashes(output_hash))
            canonical = self._canonical_hash(req.hashes[: -(-ext // self.reg.chunk_size)], ext)
            hashes = OutputHashes(output_hash, canonical, canonical == output_hash)
            result = dataclasses.replace(result, hashes=hashes)
            if hashes.hash_ok:
                return result
            marker = self._output_mismatch(req, tables, ext, res.committed_tokens, "+".join(res.tiers), hashes)
            return dataclasses.replace(result, marker=marker)
        if res.failure_kind is FailureKind.TIER:
            marker = self._mark(req, set(res.blamed_tiers), res)
            return dataclasses.replace(result, marker=marker)
        if res.failure_kind is FailureKind.RANK and res.failure_stage is not None:
            marker = self._mark(req, set(), res)
            return dataclasses.replace(result, marker=marker)
        return result

    def _output_mismatch(
        self, req: OpenRequest, tables: Tables, n_tokens: int, external: int, source: str, hashes: OutputHashes
    ) -> Marker | None:
        """A request whose KV hashed differently from the canonical KV of its prompt ends failed. Its commit has
        happened (the hash is taken over committed blocks), so it is undone: every block of the request is
        invalidated on every rank, and when part of the KV came from a tier a marker that excludes no tier makes
        the next admission of the prompt recompute it (every object passed its checksum, so no tier is known to be
        at fault: what was stored was wrong when it was written). The ``output_mismatch`` event names it."""
        self.calls.call_all(InvalidateRequest(tables))
        marker = None
        if external:
            why = (
                f"output hash {hashes.output_hash} != canonical {hashes.canonical_hash} after {external:,} tokens "
                f"from {source}: the request's KV was invalidated"
            )
            marker = self.admission.set_marker(req.prompt, set(), why, req.request)
        self.events.append(
            OutputMismatch(
                request=req.request,
                prompt=req.prompt,
                tokens=n_tokens,
                external_tokens=external,
                source=source,
                output_hash=hashes.output_hash,
                canonical_hash=hashes.canonical_hash or "",
                marker=marker is not None,
            )
        )
        return marker

    def _probe_failed(self, req: OpenRequest, n_tokens: int, fail: Failure, hint: str | None) -> ManualRestoreResult:
        """A manual restore that could not start because a rank stopped answering or its process is gone (blamed on
        the rank) or the host starved it past the overload ceiling (the host's): failed closed (nothing was restored
        or committed), no marker."""
        self.observation.restore_ended(
            request=req.request, outcome=Outcome.FAILED_CLOSED, kind=fail.kind, fails=(fail,), w=req.w
        )
        report = RestoreReport(
            request=req.request,
            w=req.w,
            tiers=(),
            advertised_tokens=0,
            committed_tokens=0,
            outcome=Outcome.FAILED_CLOSED,
            invalid=(),
            failures=(fail,),
            failure_kind=fail.kind,
            failure_stage=None,
            blamed_tiers=(),
            blamed_ranks=tuple(failures.blamed_ranks((fail,))),
            hint=hint,
            windows=0,
            ranks=(),
        )
        return ManualRestoreResult(req.request, req.prompt, n_tokens, req.w, lookup=None, report=report)

    def open_request(self, request: str) -> None:
        """Make ``request`` abortable from now on. The admin API calls it when it hands the id to a streaming
        client, before the request's work is scheduled: a client that goes away at once still aborts it."""
        self._requests.open(request)

    def abort(self, request: str) -> bool:
        """Abort ``request``: True when it will end aborted, False when no such request is known. Raises
        ``AlreadyEnded`` when the abort lost the race: its restore already committed, or it already ended."""
        if not self._requests.abort(request, self.events) and not self.observation.is_restoring(request):
            return False
        self.allocation.abort_block_wait(request)  # one still waiting for destination blocks ends now
        for r in self.ranks:
            r.abort(request)
        self.events.append(AbortRequested(request=request))
        return True


def _validity(outcomes: Sequence[RestoreResult]) -> dict[tuple[int, str], bool]:
    return {(o.rank, g): v for o in outcomes for g, v in o.valid.items()}


def _aborted_at_commit(outcome: RestoreResult, groups: Sequence[str]) -> RestoreResult:
    """A rank's outcome when the operator's abort came before the commit: its windows are not committed."""
    if not outcome.ok:
        return outcome
    return dataclasses.replace(
        outcome,
        ok=False,
        valid=dict.fromkeys(groups, False),
        reason="aborted by the operator before the commit",
        kind=FailureKind.ABORTED.value,
        stage=Stage.COMMIT.value,
    )


__all__ = ["Orchestration"]
