"""The scheduler side of the BSR runtime: discovery, admission, the commit rule, force-local markers, faults.

Engine-agnostic: it drives TP ranks through the typed rank-ops contract (bsr_cli.api.ranks: a ``RankClient`` per
rank whose ``submit(request)`` returns a future of that request's result; the embedded engine's ranks are processes
behind pipes, a plugin's ranks can be in-process objects) and never touches tensors itself.

``Coordinator`` is the facade the admin API, the plugins and the tests call. It composes one part per concern, each
owning its own state under its own lock, built over the shared ``CoordinatorContext`` and usable alone:

- ``calls`` (``RankCalls``): every rank asked at once with liveness (heartbeats, progress, stuck calls), rank
  health, the settings every rank applies;
- ``observation`` (``Observation``): tier health, pool/stats aggregation, the live view of running restores, each
  restore's recorded report;
- ``allocation`` (``Allocation``): destination blocks, and their quarantine while a stuck rank call may still
  write them;
- ``admission`` (``Admission``): request ids, discovery (the probe-only lookup), force-local markers, the external
  prefix's per-rank jobs;
- ``orchestration`` (``Orchestration``): a request's life (``submit`` with its fallback passes, the manual
  ``restore``, ``abort``), over the parts above;
- ``armed_faults`` (``ArmedFaults``): the operator's injected faults.

A host extends the facade by overriding its public methods; ``probe`` and ``_store_missing`` are the hooks
orchestration calls back, so a host's version runs on every path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from bsr_cli.api.ranks import RankClient
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.events import Event, FaultsCleared
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.core.markers import ClearScope, Marker
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import ManualRestoreResult, StoreReport, SubmitResult, TierErrors
from bsr_cli.core.scrub import ScrubLimits, ScrubReport
from bsr_cli.core.status import (
    BlockWait,
    EngineInfo,
    Health,
    MarkerView,
    PoolEntry,
    RankFault,
    RankHealth,
    RecentRestore,
    Snapshot,
)
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.runtime.admission import Admission
from bsr_cli.runtime.allocation import Allocation, BlockAllocator
from bsr_cli.runtime.armed_faults import ArmedFaults
from bsr_cli.runtime.coordinator_state import (
    HEALTH_WAIT_S,
    MAX_PASSES,
    POLL_S,
    TIER_FAILURE_TTL_S,
    CoordinatorContext,
    EngineSettings,
    RankRestarts,
    RankUnresponsive,
)
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.metrics import RuntimeCounters
from bsr_cli.runtime.observation import Observation
from bsr_cli.runtime.orchestration import Orchestration
from bsr_cli.runtime.rank_calls import RankCalls
from bsr_cli.runtime.scrub import scrub_ranks

Progress = Callable[[Event], None]  # a progress event (the admin API streams its wire form)


class Coordinator:
    def __init__(
        self, reg: Registration, ranks: Sequence[RankClient], settings: EngineSettings, events: EventLog
    ) -> None:
        ctx = CoordinatorContext.build(reg, ranks, settings, events)
        self.context = ctx
        self.armed_faults = ArmedFaults(ctx)
        self.calls = RankCalls(ctx)
        self.observation = Observation(ctx, calls=self.calls, armed_faults=self.armed_faults.armed)
        self.allocation = Allocation(ctx, refusals=self.observation)
        self.admission = Admission(ctx, ranks=self.calls)
        self.orchestration = Orchestration(
            ctx,
            calls=self.calls,
            observation=self.observation,
            allocation=self.allocation,
            admission=self.admission,
            faults=self.armed_faults,
            probe=self.probe,
            store_missing=self._store_missing,
        )

    # -- what every part shares ------------------------------------------------------------------------------------
    @property
    def reg(self) -> Registration:
        return self.context.reg

    @property
    def ranks(self) -> list[RankClient]:
        return self.context.ranks

    @property
    def settings(self) -> EngineSettings:
        return self.context.settings

    @property
    def events(self) -> EventLog:
        return self.context.events

    @property
    def counters(self) -> RuntimeCounters:
        return self.context.counters

    @property
    def started_at(self) -> float:
        return self.observation.started_at

    def replace_rank(self, index: int, rank: RankClient) -> None:
        """A restarted rank takes its predecessor's place (every part sees the one list of ranks) once it holds the
        engine's settings (raises when it does not confirm them)."""
        self.calls.adopt(index, rank)

    def restart_ranks_with(self, restarts: RankRestarts) -> None:
        """The host starts dead ranks again: a request that meets one is refused with when to retry (503)."""
        self.calls.restarts = restarts

    def restart_retry_after(self) -> int | None:
        """Seconds until a dead rank is next tried (None: the host does not restart ranks)."""
        return self.calls.restart_retry_after()

    def settle_settings(self) -> None:
        """Put ranks out of step (one that did not confirm a settings change or its put-back) back in step."""
        self.calls.settle()

    # -- requests (orchestration) ----------------------------------------------------------------------------------
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
        return self.orchestration.submit(tokens, w=w, verify=verify, store=store, progress=progress, request=request)

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
        return self.orchestration.restore(
            tokens, w=w, verify=verify, exclude=exclude, progress=progress, request=request
        )

    def open_request(self, request: str) -> None:
        self.orchestration.open_request(request)

    def abort(self, request: str) -> bool:
        return self.orchestration.abort(request)

    def _store_missing(
        self, bitmap: HitBitmap, hashes: list[str], n_tokens: int, tables: dict[str, list[int]]
    ) -> StoreReport:
        return self.orchestration.store_missing(bitmap, hashes, n_tokens, tables)

    # -- admission -------------------------------------------------------------------------------------------------
    def probe(self, tokens: Sequence[int], hashes: list[str] | None = None) -> tuple[HitBitmap, TierErrors]:
        """Probe-only lookup on every rank: the complete hit bitmap; no object bytes move, nothing stays pinned."""
        return self.admission.probe(tokens, hashes)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        self.admission.check_tokens(tokens)

    def new_request_id(self) -> str:
        return self.admission.new_request_id()

    def continue_request_ids(self, after: int) -> None:
        self.admission.continue_request_ids(after)

    @property
    def markers(self) -> dict[str, Marker]:
        """The standing force-local markers by prompt (copies)."""
        return self.admission.markers()

    def restore_markers(self, markers: Iterable[Marker]) -> None:
        self.admission.restore_markers(markers)

    def list_markers(self) -> list[MarkerView]:
        """Every standing marker, as the engine lists it."""
        return [MarkerView.of(m) for m in self.admission.markers().values()]

    def clear_markers(self, scope: ClearScope | None = None) -> int:
        return self.admission.clear_markers(scope)

    # -- destination blocks (allocation) ---------------------------------------------------------------------------
    @property
    def allocators(self) -> dict[str, BlockAllocator]:
        return self.allocation.allocators

    def blocks_waiting(self) -> list[BlockWait]:
        return self.allocation.blocks_waiting()

    def await_blocks_waiting(self, count: int, timeout_s: float) -> bool:
        return self.allocation.await_blocks_waiting(count, timeout_s)

    # -- ranks and their settings (calls), health and what a monitor draws (observation) ---------------------------
    def on_rank_event(self, event: Event) -> None:
        self.observation.on_rank_event(event)

    def record_store_losses(self, tier: str, losses: Sequence[SegmentLoss]) -> list[SegmentLoss]:
        """What a store watch knows of the segments ``tier``'s store lost (repeats welcome): each new one becomes a
        ``segment_lost`` event, counts, and keeps the tier unhealthy (``segment_lost``). Returns the new ones."""
        return self.observation.store_losses.record(tier, losses)

    def update_settings(
        self, *, budget_bytes: int | None = None, fs_concurrency: int | None = None, w: int | None = None
    ) -> None:
        self.calls.update_settings(budget_bytes=budget_bytes, fs_concurrency=fs_concurrency, w=w)

    def set_budget(self, budget_bytes: int) -> None:
        self.calls.set_budget(budget_bytes)

    def set_fs_concurrency(self, value: int) -> None:
        self.calls.set_fs_concurrency(value)

    def reset_peak(self) -> None:
        self.calls.reset_peak()

    def rank_health(self) -> list[RankHealth]:
        return self.calls.rank_health()

    @property
    def rank_faults(self) -> dict[int, RankFault]:
        return self.calls.rank_faults()

    @property
    def recent(self) -> list[RecentRestore]:
        return self.observation.recent()

    def health(self) -> Health:
        return self.observation.health()

    def info(self) -> EngineInfo:
        return self.observation.info()

    def pool(self, health: bool = False) -> list[PoolEntry]:
        return self.observation.pool(health=health)

    def snapshot(self, health: bool = True, events_since: int | None = None) -> Snapshot:
        """Everything a monitor draws at once: the observation's view, with the engine's info (as this host tells
        it), the markers, the armed faults and the queue for destination blocks."""
        snap = self.observation.snapshot(health=health, events_since=events_since)
        waiting = self.allocation.blocks_waiting()
        admission = replace(
            snap.admission,
            waiting_for_blocks=len(waiting),
            kv_wait_s=self.settings.kv_wait_s,
            blocks_waiting=tuple(waiting),
        )
        return replace(
            snap,
            info=self.info(),
            admission=admission,
            markers=tuple(self.list_markers()),
            faults=tuple(self.armed_faults.current()),
        )

    # -- faults ----------------------------------------------------------------------------------------------------
    @property
    def faults(self) -> list[FaultSpec]:
        """The faults held now (fired-out or expired ones until the next ``list_faults``)."""
        return self.armed_faults.current()

    def inject(self, request: FaultRequest) -> FaultSpec:
        return self.armed_faults.inject(request)

    def list_faults(self) -> list[FaultSpec]:
        return self.armed_faults.listed()

    def clear_faults(self) -> int:
        n = self.armed_faults.clear()
        self.observation.forget_injected_tier_failures()
        self.events.append(FaultsCleared(count=n))
        return n

    # -- scrubs ----------------------------------------------------------------------------------------------------
    def scrub(self, tier: str, tokens: Sequence[int] | None, limits: ScrubLimits) -> ScrubReport:
        """An operator's scrub of ``tier``: every rank reads its objects back whole (the prompt's, or with no
        tokens its share of every object the tier holds), sets the damaged ones apart, and answers how it ended."""
        return scrub_ranks(self.calls, self.admission, tier, tokens, limits)


__all__ = [
    "HEALTH_WAIT_S",
    "MAX_PASSES",
    "POLL_S",
    "TIER_FAILURE_TTL_S",
    "BlockAllocator",
    "Coordinator",
    "EngineSettings",
    "Progress",
    "RankClient",
    "RankRestarts",
    "RankUnresponsive",
]
