"""Each part of the coordinator on its own, over the in-memory fake ranks: rank calls, observation, allocation,
admission, the armed faults and orchestration, each built from the shared context and what it is handed (never the
facade)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from bsr_cli.api.ranks import ProbeRequest, RankRequest
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.events import Event, Failure, WindowStepped
from bsr_cli.core.evidence import CapacityCause, EventKind, FailureKind, MarkerClearCause, Outcome, Stage, WindowStep
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.status import ActiveRestore
from bsr_cli.errors import BadRequest, CapacityError, FaultsDisabled
from bsr_cli.runtime.admission import Admission
from bsr_cli.runtime.allocation import Allocation
from bsr_cli.runtime.armed_faults import ArmedFaults
from bsr_cli.runtime.coordinator_state import CoordinatorContext, EngineSettings
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.observation import Observation
from bsr_cli.runtime.orchestration import Orchestration
from bsr_cli.runtime.rank_calls import RankCalls
from unit.fakes import FakeRankOps, FakeTier, InProcessRank, small_registration
from unit.fixtures import STEP_DEADLINE_S

R = TypeVar("R")


@dataclass
class Parts:
    ctx: CoordinatorContext
    ranks: list[InProcessRank]
    # Where the fake ranks' events go (the part under test, once built).
    on_event: list[Any] = field(default_factory=list)


@pytest.fixture
def parts() -> Iterator[Parts]:
    reg = small_registration(2)
    tiers = {"mooncake": FakeTier("mooncake"), "fs": FakeTier("fs")}
    out = Parts(ctx=None, ranks=[])  # type: ignore[arg-type]

    def emit(ev: Event) -> None:
        for listener in out.on_event:
            listener(ev)

    out.ranks = [InProcessRank(FakeRankOps(reg, r, tiers, 8, None, emit)) for r in range(2)]
    settings = EngineSettings(
        w=2,
        max_tokens=4096,
        kv_tokens=256,
        kv_wait_s=0.0,
        pool_bytes=8 * reg.bytes_per_chunk,
        budget_bytes=8 * reg.bytes_per_chunk,
        fetch_timeout_s=STEP_DEADLINE_S,
        admit_timeout_s=STEP_DEADLINE_S,
        call_timeout_s=10.0,
        faults_enabled=True,
    )
    out.ctx = CoordinatorContext.build(reg, out.ranks, settings, EventLog())
    try:
        yield out
    finally:
        for r in out.ranks:
            r.close()


class RecordedRefusals:
    """Allocation's RefusalRecorder: what it was told, kept."""

    def __init__(self) -> None:
        self.ended: list[dict[str, Any]] = []

    def restore_ended(
        self, *, request: str, outcome: Outcome, kind: FailureKind | None, fails: Sequence[Failure], w: int
    ) -> None:
        self.ended.append({"request": request, "outcome": outcome, "kind": kind, "fails": list(fails), "w": w})


class DirectCaller:
    """Admission's RankCaller over the fake ranks, keeping every request it sent."""

    def __init__(self, ranks: Sequence[InProcessRank]) -> None:
        self.ranks, self.sent = ranks, []

    def call_all(self, request: RankRequest[R], timeout_s: float | None = None) -> list[R]:
        self.sent.append(request)
        return [r.submit(request).result(timeout=timeout_s or 10) for r in self.ranks]


def test_allocation_refuses_through_its_recorder_and_holds_a_stuck_requests_blocks(parts: Parts) -> None:
    refusals = RecordedRefusals()
    alloc = Allocation(parts.ctx, refusals=refusals)
    full = alloc.allocators["full"]
    with pytest.raises(CapacityError, match="can never fit"):
        alloc.allocate(parts.ctx.settings.kv_tokens + 1, "req-big")
    [ended] = refusals.ended
    [fail] = ended["fails"]
    assert (ended["request"], ended["outcome"], ended["kind"]) == ("req-big", Outcome.REFUSED, FailureKind.CAPACITY)
    assert (fail.stage, fail.cause) == (Stage.ADMISSION, CapacityCause.NO_DESTINATION_BLOCKS)

    free = full.free_blocks
    tables, waited = alloc.allocate(64, "req-1")
    assert waited == 0.0 and full.free_blocks == free - len(tables["full"])
    stuck: Future[None] = Future()  # a rank call still running after the restore failed
    alloc.hold_until_done("req-1", stuck)
    alloc.release("req-1", tables)
    assert full.free_blocks == free - len(tables["full"]), "blocks reused while a rank call may still write them"
    stuck.set_result(None)
    assert full.free_blocks == free


def test_admission_probes_through_its_rank_caller_and_keeps_its_markers(parts: Parts) -> None:
    caller = DirectCaller(parts.ranks)
    adm = Admission(parts.ctx, ranks=caller)
    with pytest.raises(BadRequest, match="empty"):
        adm.probe([])
    assert caller.sent == []
    tokens = synthetic_tokens(64, 1)
    bitmap, errors = adm.probe(tokens)
    [sent] = caller.sent
    assert isinstance(sent, ProbeRequest) and len(sent.hashes) == bitmap.chunks == 64 // parts.ctx.reg.chunk_size
    assert bitmap.prefix_tokens(set()) == 0 and errors == {}

    adm.set_marker("p", {"mooncake"}, "checksum mismatch", "req-1")
    assert adm.marker("p").excluded == {"mooncake"}  # type: ignore[union-attr]
    adm.set_marker("p", set(), "rank 1 failed at install", "req-2")  # recompute locally: the stronger one
    adm.set_marker("p", {"fs"}, "timeout", "req-3")
    assert adm.marker("p").excluded == set()  # type: ignore[union-attr]
    kinds = [e.kind for e in parts.ctx.events.recent(10)]
    assert kinds.count(EventKind.MARKER_SET) == 3
    assert adm.clear_marker("p", "req-4", MarkerClearCause.ADMITTED) and adm.markers() == {}


def test_armed_faults_fire_out_and_refuse_when_disabled(parts: Parts) -> None:
    faults = ArmedFaults(parts.ctx)
    f = faults.inject(FaultRequest("timeout", rank=1, window=2, count=2))
    assert [a.id for a in faults.armed()] == [f.id]
    assert faults.fire(rank=0, window=2) is None and faults.fire(rank=1, window=1) is None
    assert faults.fire(rank=1, window=2).fired == 1  # type: ignore[union-attr]
    assert faults.fire(rank=1, window=2).fired == 2  # type: ignore[union-attr]
    assert faults.armed() == [] and faults.listed() == []  # its count is spent
    parts.ctx.settings.faults_enabled = False
    with pytest.raises(FaultsDisabled):
        faults.inject(FaultRequest("timeout"))


def test_rank_calls_watch_a_restores_progress_and_a_stuck_rank_call(parts: Parts) -> None:
    calls = RankCalls(parts.ctx)
    obs = Observation(parts.ctx, calls=calls, armed_faults=list)  # where the ranks' progress events arrive
    obs.on_rank_event(WindowStepped(step=WindowStep.WAITING, request="req-1", rank=1, window=0))
    assert calls.last_progress("req-1", 1) is None  # a restore not watched is not tracked
    obs.restore_began("req-1", ActiveRestore("req-1", 2, 1, 256, ("fs",), 0.0, {0: 0, 1: 0}, {0: 0, 1: 0}))
    assert obs.is_restoring("req-1") and calls.last_progress("req-1", 1)[1] is None  # type: ignore[index]
    obs.on_rank_event(WindowStepped(step=WindowStep.WAITING, request="req-1", rank=1, window=0))
    assert calls.last_progress("req-1", 1)[1] is EventKind.WINDOW_WAITING  # type: ignore[index]
    obs.restore_over("req-1")
    assert not obs.is_restoring("req-1") and calls.last_progress("req-1", 1) is None

    call: Future[None] = Future()
    calls.note_stuck(1, "req-1", call)
    health = {h.rank: h for h in calls.rank_health()}
    assert health[0].healthy and not health[1].healthy and "req-1" in (health[1].reason or "")
    call.set_result(None)
    assert all(h.healthy for h in calls.rank_health())


def test_orchestration_probes_through_the_hosts_probe_on_every_path(parts: Parts) -> None:
    """A host's probe (the LMCache host remembers the tokens behind each hash there) runs for submit and restore."""
    faults = ArmedFaults(parts.ctx)
    calls = RankCalls(parts.ctx)
    obs = Observation(parts.ctx, calls=calls, armed_faults=faults.armed)
    parts.on_event.append(obs.on_rank_event)
    adm = Admission(parts.ctx, ranks=calls)
    probed: list[int] = []

    def host_probe(tokens: Sequence[int], hashes: list[str] | None) -> tuple[HitBitmap, dict[str, Any]]:
        probed.append(len(tokens))
        return adm.probe(tokens, hashes)

    orch = Orchestration(
        parts.ctx,
        calls=calls,
        observation=obs,
        allocation=Allocation(parts.ctx, refusals=obs),
        admission=adm,
        faults=faults,
        probe=host_probe,
    )
    tokens = synthetic_tokens(96, 3)
    first = orch.submit(tokens)
    assert first.source == "recompute" and first.hash_ok is True
    again = orch.restore(tokens)
    assert again.outcome is Outcome.COMMITTED and again.committed_tokens == 96
    assert probed == [96, 96]
