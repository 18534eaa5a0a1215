"""The windowed, fail-closed restore of one request on one TP rank.

For each window of at most W chunks: lease pool slots (within the admission budget), fetch every object of every
KV group into them, require completeness (every object arrived, whole, with a matching checksum, before the
deadline), install into the window's slice of the destination blocks, synchronize, release the slots, advance.
Any missing key, timeout, checksum mismatch or transfer error fails the whole retrieve: every destination block of
the request is invalidated (a failed retrieve may already have installed earlier windows) and the rank reports
its groups invalid, so the commit rule collapses the external prefix to zero.

When the budget allows more than one window, the next windows' fetches (at most two in flight) overlap the current
window's install and each other, and each fetch's deadline counts its share of the transport (``_FetchQueue``). With
B = RWS(W) only one window is ever live: the paper's serialized behaviour.

The loop knows nothing of injected faults: a job that carries armed ones runs over wrapped tiers and a wrapped
install stage (``runtime/faulty.py``), exactly as it runs over the real ones.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NoReturn, Protocol

from bsr_cli.api.ranks import ObjectRef, RestoreJob, RestoreResult, WindowJob
from bsr_cli.core.events import Event, WindowFetched, WindowReleased, WindowStepped
from bsr_cli.core.events import (
    RestoreFailed as RestoreFailedEvent,
)
from bsr_cli.core.evidence import CapacityCause, Stage, TimedStage, WindowStep
from bsr_cli.errors import CapacityError
from bsr_cli.runtime import failures
from bsr_cli.runtime.checksum import object_checksum_at
from bsr_cli.runtime.faulty import ArmedFaults
from bsr_cli.runtime.judge import fetch_starved
from bsr_cli.runtime.liveness import OwnRunDelays, RunDelays
from bsr_cli.runtime.pool import Lease, RestorePool
from bsr_cli.runtime.restore_failed import RestoreFailed, aborted
from bsr_cli.runtime.stage_clock import StageClock
from bsr_cli.runtime.tiers import (
    CODE_NAMES,
    TIMED_OUT,
    UNAVAILABLE,
    AbandoningTier,
    ExplainingTier,
    StagingSlice,
    Tier,
)
from bsr_cli.runtime.transport_share import ShareTicket, TransportShare


class Destination(Protocol):
    """Where restored KV goes: the host engine's paged KV cache on this rank."""

    def install(self, group: str, block_ids: Sequence[int], token_count: int, sources: Sequence[StagingSlice]) -> None:
        """Copy ``token_count`` tokens, given as consecutive per-chunk staged objects, into ``block_ids`` (the
        window's slice of the group's block table, starting at a block boundary)."""
        ...

    def synchronize(self) -> None:
        """Wait until every install issued so far has landed (a stream sync on a GPU host)."""
        ...

    def invalidate(self, block_tables: Mapping[str, Sequence[int]]) -> None:
        """Mark every listed block invalid (scrub it) so nothing partial can be read as restored state."""
        ...


# The job and its outcome are wire types (bsr_cli.api): the coordinator sends a RestoreJob in a RestoreRequest and
# gets each rank's RestoreResult back. ``RankOutcome`` is the window loop's name for the latter.
RankOutcome = RestoreResult


Emit = Callable[[Event], None]
# Most windows with a fetch in flight at once (the budget B bounds it further).
_FETCH_AHEAD = 2


def run_windows(
    *,
    rank: int,
    groups: Sequence[str],
    request: str,
    windows: Sequence[WindowJob],
    abort: threading.Event,
    step: Callable[[WindowJob, RankOutcome], int],
    scrub: Callable[[], None],
    emit: Emit,
    pool_stats: Callable[[], dict[str, int]],
    prepare: Callable[[], None] | None = None,
    cleanup: Callable[[], None] | None = None,
    fired: Callable[[], list[int]] | None = None,
) -> RankOutcome:
    """The window loop of one rank's retrieve, shared by every host: the abort check before each window, the
    host's ``step`` (lease, fetch, check, install, sync, release: returns the window's bytes), the outcome's
    accounting and the ``window_released`` event, then fail-closed on any failure: the failure classified on the
    outcome (``RestoreFailed`` with its kind and tier, ``CapacityError`` as capacity, anything else as a tier
    transfer error), every destination block scrubbed, ``restore_failed`` emitted.

    ``windows`` are the host's window objects, each with an ``index``; ``prepare`` runs first inside the same
    failure handling, ``cleanup`` always runs last (e.g. giving back fetches issued ahead); ``fired`` names the
    injected faults that fired (the outcome's ``fired_faults``; a failure with one is marked ``injected``)."""
    started = time.monotonic()
    out = RankOutcome(rank, ok=False, valid=dict.fromkeys(groups, False))
    try:
        if prepare is not None:
            prepare()
        for win in windows:
            if abort.is_set():
                raise aborted(win.index)
            nbytes = step(win, out)
            out.windows_done += 1
            out.bytes_restored += nbytes
            emit(
                WindowReleased(
                    request=request,
                    rank=rank,
                    window=win.index,
                    windows=len(windows),
                    bytes=nbytes,
                    pool=pool_stats(),
                )
            )
        out.ok = True
        out.valid = dict.fromkeys(groups, True)
    except RestoreFailed as e:
        out.reason, out.failed_window, out.kind, out.tier, out.load = e.reason, e.window, e.kind, e.tier, e.load
        out.unanswered = e.unanswered
        out.stage = e.stage.value if e.stage is not None else ""
        out.failed_chunks = next(((w.chunk_start, w.chunk_end) for w in windows if w.index == e.window), None)
        bad = set(e.groups or groups)
        out.valid = {g: g not in bad for g in groups}
    except CapacityError as e:
        out.reason, out.failed_window, out.kind = f"capacity: {e.message}", None, failures.CAPACITY
        out.stage = Stage.ADMISSION.value
        # A host's own refusal without a cause is a window over its budget (the only one a host raises).
        out.cause = (e.cause if isinstance(e, failures.WindowRefused) else CapacityCause.WINDOW_OVER_BUDGET).value
    except Exception as e:  # noqa: BLE001 - any transfer exception fails the retrieve, closed
        # Install and synchronize failures are raised as RestoreFailed by the host's step; what is left is a
        # transfer from a tier.
        out.reason, out.kind = f"transfer error: {type(e).__name__}: {e}", failures.TIER
        out.stage = Stage.FETCH.value
    finally:
        if cleanup is not None:
            cleanup()
        out.seconds = time.monotonic() - started
    if fired is not None:
        out.fired_faults = fired()
    if not out.ok:
        # Fail closed: a failed retrieve may have installed earlier windows; invalidate every block.
        scrub()
        emit(_failed_event(request, out))
    return out


def _failed_event(request: str, out: RankOutcome) -> RestoreFailedEvent:
    """The rank's ``restore_failed``: its failure as classified, marked injected when an injected fault fired."""
    event = RestoreFailedEvent.of(request, out.rank, failures.failure_of(out))
    return dataclasses.replace(event, injected=bool(out.fired_faults))


Fetched = tuple[Lease, float, list[tuple[str, int, StagingSlice, int | None]]]
# The install stage of one window: (job, window, the window's lease) -> None; raises RestoreFailed.
_Install = Callable[[RestoreJob, WindowJob, Lease], None]


@dataclasses.dataclass(frozen=True)
class _Issued:
    """One window's fetch: the lease its bytes land in, when it was issued, its future, its place in the share of
    the transport, and this process's run delays at its issue (for the starvation judge, should it be late)."""

    lease: Lease
    at: float
    future: Future[Fetched]
    ticket: ShareTicket
    began: RunDelays | None


class _FetchQueue:
    """A restore's fetches issued ahead, in window order, and the deadline each is held to.

    Where the budget lets two windows' fetches run at once they share the transport, and each one's deadline counts
    its share of it (runtime/transport_share.py), as when one fetch is in flight at a time. The tier is then given
    two deadlines (a fetch's share grows at least half as fast as the clock), and the step gives up on a fetch when
    its share runs out."""

    def __init__(self, job: RestoreJob) -> None:
        self.timeout_s = job.fetch_timeout_s
        self.ahead: deque[_Issued] = deque()
        self.issued = 0
        self.shared = False  # set once B has held two of the restore's windows at once
        self.share = TransportShare()
        self.ended = threading.Event()  # the restore is over: a fetch still running reports nothing more

    def tier_timeout_s(self) -> float:
        return self.timeout_s * (2 if self.shared else 1)

    def issue(self, item: _Issued) -> None:
        self.ahead.append(item)
        self.issued += 1

    def take(self) -> Fetched:
        fetched = self.ahead[0].future.result()
        self.ahead.popleft()
        return fetched

    def close(self) -> None:
        """The restore is over. A fetch not started yet is cancelled and gives its slots back; one running gets
        until a deadline from its issue, then gives them back when the tier returns (until then its bytes may still
        land there), so a failed restore answers without waiting out a tier that hangs."""
        self.ended.set()
        for item in self.ahead:
            if item.future.cancel():
                item.lease.release()
            else:
                wait([item.future], timeout=max(0.0, item.at + self.timeout_s - time.monotonic()))
                item.future.add_done_callback(_give_back)


def _give_back(future: Future[Fetched]) -> None:
    # A failed fetch gave its slots back itself (_fetch_owned).
    if not future.cancelled() and future.exception() is None:
        future.result()[0].release()


class RankRestorer:
    """Runs restore jobs for one rank against its pool, tiers and destination."""

    def __init__(
        self,
        rank: int,
        group_order: Sequence[str],
        group_slot_offsets: Mapping[str, int],
        pool: RestorePool,
        tiers: Mapping[str, Tier],
        destination: Destination,
        emit: Emit,
    ) -> None:
        self.rank = rank
        self.group_order = list(group_order)
        self.group_offsets = dict(group_slot_offsets)
        self.pool = pool
        self.tiers = dict(tiers)
        self.destination = destination
        self.emit = emit
        self._fetcher = ThreadPoolExecutor(max_workers=_FETCH_AHEAD, thread_name_prefix=f"bsr-fetch-{rank}")
        self._verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"bsr-verify-{rank}")
        # What a host knows about a tier's failure beyond its error codes (e.g. which network link is down):
        # called with the tier's name when a fetch from it fails, its answer is added to the failure's reason.
        self.diagnose: Callable[[str], str] | None = None
        # This process's threads' run-queue delays: a fetch deadline that runs out while the rank waited to run
        # is the host's, not the tier's.
        self.own_delays = OwnRunDelays()

    # -- public ------------------------------------------------------------------------------------------------
    def restore(self, job: RestoreJob, abort: threading.Event) -> RankOutcome:
        tiers: Mapping[str, Tier] = self.tiers
        install: _Install = self._install
        # Armed faults act through wrapped parts (runtime/faulty.py): the window loop runs them as the real ones.
        armed = ArmedFaults.of(job, self.rank, abort)
        if armed is not None:
            tiers, install = armed.tiers(self.tiers, job, self.group_order), armed.install(install, self.group_order)
        windows = list(job.windows)
        bounded = job.w > 0
        clock = StageClock()
        queue = _FetchQueue(job)

        def fetch_ahead(*, block: bool) -> None:
            # Issue the next windows' fetches while the budget has room for them: with B = RWS(W) only the
            # window being consumed is ever live; with more, the next fetches overlap its install (and each
            # other, hiding the tier's per-call latency). Waits for admission only when asked to and nothing
            # is in flight (never while this restore holds a lease it would wait on itself). The leases come
            # first, so that fetches that will share the transport are all issued knowing it.
            leases: list[Lease] = []
            while queue.issued + len(leases) < len(windows) and len(queue.ahead) + len(leases) < _FETCH_AHEAD:
                win = windows[queue.issued + len(leases)]
                lease = self._lease(job, win, bounded, wait=block and not queue.ahead and not leases)
                if lease is None:
                    break
                leases.append(lease)
                if not bounded:
                    break  # the whole-plan path is one window
            queue.shared = queue.shared or len(queue.ahead) + len(leases) > 1
            for lease in leases:
                ticket, at, began = queue.share.ticket(), time.monotonic(), self.own_delays.recent()
                future = self._fetcher.submit(
                    self._fetch_owned, job, windows[queue.issued], lease, ticket, tiers, clock, queue
                )
                queue.issue(_Issued(lease, at, future, ticket, began))

        def step(win: WindowJob, out: RankOutcome) -> int:
            fetch_ahead(block=True)
            with clock.timing(TimedStage.WAIT):
                lease, fetch_s, arrived = self._taken(job, win, tiers, queue)
            out.fetch_seconds += fetch_s
            out.peak_live_bytes = max(out.peak_live_bytes, self.pool.stats().live_bytes)
            # Every object arrived whole; its checksum is verified while the window installs (both release the
            # GIL: the install's torch copies, and CRC32C over each object, runtime/checksum.py). A mismatch fails
            # the retrieve before the window is released, and a failed retrieve scrubs every block of the
            # request, so bytes installed unverified are never committed.
            verified = self._verifier.submit(self._verify_timed, job, win, arrived, clock)
            try:
                fetch_ahead(block=False)
                out.install_seconds += self._install_timed(install, job, win, lease, clock)
                with clock.timing(TimedStage.WAIT):
                    verified.result()
            finally:
                wait([verified])  # the staged bytes stay leased until their check is over
                lease.release()
            return self._window_bytes(job, win)

        out = run_windows(
            rank=self.rank,
            groups=self.group_order,
            request=job.request_id,
            windows=windows,
            abort=abort,
            step=step,
            scrub=lambda: self.destination.invalidate(job.block_tables),
            emit=self.emit,
            pool_stats=lambda: self.pool.stats().to_dict(),
            cleanup=queue.close,
            fired=(lambda: armed.fired) if armed is not None else None,
        )
        out.stages = clock.costs()
        return out

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._verifier.shutdown(wait=False, cancel_futures=True)

    # -- steps -------------------------------------------------------------------------------------------------
    def _window_bytes(self, job: RestoreJob, win: WindowJob) -> int:
        return sum(job.objects[g][c].size for g in self.group_order for c in range(win.chunk_start, win.chunk_end))

    def _lease(self, job: RestoreJob, win: WindowJob, bounded: bool, *, wait: bool) -> Lease | None:
        n = win.chunk_end - win.chunk_start
        lease = self.pool.acquire(n, timeout_s=job.admit_timeout_s, bounded=bounded, wait=False)
        if lease is not None or not wait:
            return lease
        # Waiting for admission (other windows hold the budget) is progress of a kind: say so, so the
        # coordinator's per-window progress deadline allows for the admission deadline instead.
        self.emit(WindowStepped(step=WindowStep.WAITING, request=job.request_id, rank=self.rank, window=win.index))
        return self.pool.acquire(n, timeout_s=job.admit_timeout_s, bounded=bounded, wait=True)

    def _taken(self, job: RestoreJob, win: WindowJob, tiers: Mapping[str, Tier], queue: _FetchQueue) -> Fetched:
        """The next window's fetch once it arrived. Where fetches share the transport it is held to its share
        (_FetchQueue): when that runs out first it has timed out, judged as a tier's timeout is (_check_arrival)."""
        item = queue.ahead[0]
        if queue.shared and not queue.share.wait(item.future, item.ticket, queue.timeout_s):
            self._late(job, win, tiers, item)
        return queue.take()

    def _late(self, job: RestoreJob, win: WindowJob, tiers: Mapping[str, Tier], item: _Issued) -> NoReturn:
        by_tier: dict[str, list[tuple[str, int, StagingSlice]]] = {}
        for g, c, s in self._staging(job, win, item.lease):
            by_tier.setdefault(job.objects[g][c].tier, []).append((g, c, s))
        for name, items in by_tier.items():
            tier = tiers.get(name)
            known = (
                tier.known_fault([job.objects[g][c].key for g, c, _ in items])
                if isinstance(tier, ExplainingTier)
                else ""
            )
            timed_out = [TIMED_OUT] * len(items)
            self._check_arrival(win, name, items, timed_out, [None] * len(items), None if known else item.began)
        raise AssertionError("a window with no objects cannot be late")

    def _fetch_owned(
        self,
        job: RestoreJob,
        win: WindowJob,
        lease: Lease,
        ticket: ShareTicket,
        tiers: Mapping[str, Tier],
        clock: StageClock,
        queue: _FetchQueue,
    ) -> Fetched:
        try:
            with ticket, clock.timing(TimedStage.FETCH):
                seconds, arrived = self._fetch(job, win, lease, tiers, queue.tier_timeout_s(), queue.ended)
            return lease, seconds, arrived
        except BaseException:
            lease.release()
            raise

    @staticmethod
    def _install_timed(install: _Install, job: RestoreJob, win: WindowJob, lease: Lease, clock: StageClock) -> float:
        """The window's install stage, timed; any failure but a classified one is the rank's, at install. Returns
        its wall seconds."""
        t0 = time.monotonic()
        try:
            with clock.timing(TimedStage.INSTALL):
                install(job, win, lease)
        except RestoreFailed:
            raise
        except Exception as e:
            raise RestoreFailed(
                f"install failed: {type(e).__name__}: {e}", win.index, kind=failures.RANK, stage=Stage.INSTALL
            ) from e
        return time.monotonic() - t0

    def _verify_timed(
        self,
        job: RestoreJob,
        win: WindowJob,
        arrived: Sequence[tuple[str, int, StagingSlice, int | None]],
        clock: StageClock,
    ) -> None:
        with clock.timing(TimedStage.VERIFY):
            self._verify(job, win, arrived)

    def _staging(self, job: RestoreJob, win: WindowJob, lease: Lease) -> list[tuple[str, int, StagingSlice]]:
        out = []
        for i, c in enumerate(range(win.chunk_start, win.chunk_end)):
            for g in self.group_order:
                ref = job.objects[g][c]
                out.append((g, c, lease.slot(i, self.group_offsets[g], ref.size)))
        return out

    def _fetch(
        self,
        job: RestoreJob,
        win: WindowJob,
        lease: Lease,
        tiers: Mapping[str, Tier],
        timeout_s: float,
        ended: threading.Event,
    ) -> tuple[float, list[tuple[str, int, StagingSlice, int | None]]]:
        """Transfer every object of the window into its slots and require that each arrived whole within
        ``timeout_s``. Returns the seconds taken and the objects with their stored checksums, for _verify; reports
        the window fetched unless the restore is already over (``ended``)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        began = self.own_delays.recent()
        staged = self._staging(job, win, lease)
        by_tier: dict[str, list[tuple[str, int, StagingSlice]]] = {}
        for g, c, s in staged:
            by_tier.setdefault(job.objects[g][c].tier, []).append((g, c, s))
        arrived: list[tuple[str, int, StagingSlice, int | None]] = []
        for tier_name, items in by_tier.items():
            keys = [job.objects[g][c].key for g, c, _ in items]
            dests = [s for _, _, s in items]
            left = deadline - time.monotonic()
            tier = tiers.get(tier_name)
            codes: list[int]
            sums: list[int | None]
            if left <= 0:
                codes, sums = [TIMED_OUT] * len(keys), [None] * len(keys)
            elif tier is None:
                codes, sums = [UNAVAILABLE] * len(keys), [None] * len(keys)
            else:
                codes, sums = tier.get_into(keys, dests, left)
                if isinstance(tier, AbandoningTier) and any(c in (TIMED_OUT, UNAVAILABLE) for c in codes):
                    # A transfer given up at the deadline may still land in these slots: keep them out of
                    # the pool until it returns, so a late write can never reach another window's bytes.
                    lease.hold_until(tier.pending_writes())
            known = tier.known_fault(keys) if isinstance(tier, ExplainingTier) else ""
            arrived.extend(self._check_arrival(win, tier_name, items, codes, sums, began if not known else None))
        if ended.is_set():
            return time.monotonic() - t0, arrived
        self.emit(
            WindowFetched(
                request=job.request_id,
                rank=self.rank,
                window=win.index,
                bytes=self._window_bytes(job, win),
                seconds=time.monotonic() - t0,
                tiers=tuple(sorted(by_tier)),
                pool=self.pool.stats().to_dict(),
            )
        )
        return time.monotonic() - t0, arrived

    def _check_arrival(
        self,
        win: WindowJob,
        tier: str,
        items: Sequence[tuple[str, int, StagingSlice]],
        codes: Sequence[int],
        sums: Sequence[int | None],
        began: RunDelays | None = None,
    ) -> list[tuple[str, int, StagingSlice, int | None]]:
        """Completeness: every object arrived, whole, before the deadline (else the retrieve fails: the tier's
        fault, or the host's when the deadline ran out while this rank waited to run since ``began``; None: a fault
        the tier knows of explains it, or its start is not known)."""
        bad_groups: list[str] = []
        first_reason = ""
        unanswered = True  # no failed object came back with anything (every one timed out or found the tier down)
        for (g, c, s), code in zip(items, codes, strict=True):
            if code == len(s.view):
                continue
            unanswered = unanswered and code in (TIMED_OUT, UNAVAILABLE)
            if code >= 0:
                reason = f"short object in chunk {c} group {g}: {code} of {len(s.view)} bytes"
            else:
                reason = f"{CODE_NAMES.get(code, f'error {code}')} fetching chunk {c} group {g}"
            first_reason = first_reason or reason
            if g not in bad_groups:
                bad_groups.append(g)
        if bad_groups:
            # What the host knows of the tier (a link found down) is evidence of a fault: it outranks starvation.
            found = self.diagnose(tier) if self.diagnose is not None else ""
            load = None
            if TIMED_OUT in codes and not found and began is not None:
                load = fetch_starved(self.rank, began, self.own_delays.now(), self.own_delays.reader.pressure())
            if load is not None:
                raise RestoreFailed(
                    f"the fetch deadline ran out while this rank waited to run ({first_reason}): {load.describe()}",
                    win.index,
                    bad_groups,
                    kind=failures.HOST,
                    stage=Stage.FETCH,
                    load=load,
                )
            raise RestoreFailed(
                f"{first_reason} ({found})" if found else first_reason,
                win.index,
                bad_groups,
                kind=failures.TIER,
                stage=Stage.FETCH,
                tier=tier or None,
                unanswered=unanswered,
            )
        return [(g, c, s, stored) for (g, c, s), stored in zip(items, sums, strict=True)]

    def _verify(
        self, job: RestoreJob, win: WindowJob, arrived: Sequence[tuple[str, int, StagingSlice, int | None]]
    ) -> None:
        """Integrity: each object's checksum, computed over the key it was asked for, its length and the bytes that
        arrived, equals the one stored with it (so bytes stored under another chunk's key fail too)."""
        bad = [
            (g, c)
            for g, c, s, stored in arrived
            if stored is None or object_checksum_at(job.objects[g][c].key, s.ptr, len(s.view)) != stored
        ]
        if bad:
            g, c = bad[0]
            ref = job.objects[g][c]
            raise RestoreFailed(
                f"checksum mismatch in chunk {c} group {g} (tier {ref.tier}, key {ref.key})",
                win.index,
                sorted({b[0] for b in bad}),
                kind=failures.TIER,
                stage=Stage.VERIFY,
                tier=ref.tier or None,
            )

    def _install(self, job: RestoreJob, win: WindowJob, lease: Lease) -> None:
        for g in self.group_order:
            b0, b1 = win.blocks[g]
            sources = [
                lease.slot(i, self.group_offsets[g], job.objects[g][c].size)
                for i, c in enumerate(range(win.chunk_start, win.chunk_end))
            ]
            self.destination.install(g, job.block_tables[g][b0:b1], win.token_end - win.token_start, sources)
        try:
            self.destination.synchronize()
        except Exception as e:
            raise RestoreFailed(
                f"synchronize failed: {type(e).__name__}: {e}", win.index, kind=failures.RANK, stage=Stage.SYNCHRONIZE
            ) from e
        self.emit(WindowStepped(step=WindowStep.INSTALLED, request=job.request_id, rank=self.rank, window=win.index))


__all__ = [
    "Destination",
    "ObjectRef",
    "RankOutcome",
    "RankRestorer",
    "RestoreFailed",
    "RestoreJob",
    "RestoreResult",
    "WindowJob",
    "aborted",
    "run_windows",
]
