"""The fast lane's engine over in-memory fakes: a real Coordinator driving in-process fake ranks (tests/unit/fakes.py)
that share fake tiers. Importable helpers live here; tests/unit/conftest.py keeps only pytest hooks and fixtures."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from bsr_cli.core.events import Event
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.registration import Registration
from bsr_cli.runtime.coordinator import Coordinator, EngineSettings
from bsr_cli.runtime.events import EventLog
from unit.fakes import FakeRankOps, FakeTier, InProcessRank, small_registration


@dataclass
class FakeEngine:
    reg: Registration
    coordinator: Coordinator
    ranks: list[InProcessRank]
    tiers: dict[str, FakeTier]  # shared by every rank, as a Mooncake store is
    events: EventLog


# The fetch and admission deadlines (and the window progress deadline, derived from them) of an engine whose test
# does not test deadlines: far above any step of a test, so a host running the suite beside other stacks cannot turn
# a late in-memory fetch or a slow neighbour's window into a failed restore. Tests of a deadline pass their own.
STEP_DEADLINE_S = 30.0


def build_engine(
    *,
    w: int = 2,
    pool_chunks: int = 8,
    budget_chunks: int | None = None,
    fetch_timeout_s: float = STEP_DEADLINE_S,
    tp: int = 2,
    kv_tokens: int = 8192,
    kv_wait_s: float = 60.0,
    call_timeout_s: float = 10.0,
    events: EventLog | None = None,
) -> FakeEngine:
    reg = small_registration(tp)
    tiers = {"mooncake": FakeTier("mooncake"), "fs": FakeTier("fs")}
    events = events or EventLog()
    holder: list[Coordinator] = []
    budget = None if budget_chunks is None else budget_chunks * reg.bytes_per_chunk

    def emit(ev: Event) -> None:
        holder[0].on_rank_event(ev)

    ranks = [InProcessRank(FakeRankOps(reg, r, tiers, pool_chunks, budget, emit)) for r in range(tp)]
    settings = EngineSettings(
        w=w,
        max_tokens=4096,
        kv_tokens=kv_tokens,
        kv_wait_s=kv_wait_s,
        pool_bytes=pool_chunks * reg.bytes_per_chunk,
        budget_bytes=budget if budget is not None else pool_chunks * reg.bytes_per_chunk,
        fetch_timeout_s=fetch_timeout_s,
        admit_timeout_s=STEP_DEADLINE_S,
        call_timeout_s=call_timeout_s,
        faults_enabled=True,
    )
    coord = Coordinator(reg, ranks, settings, events)
    holder.append(coord)
    return FakeEngine(reg, coord, ranks, tiers, events)


# An engine whose destination KV a request can fill (``kv_engine`` in conftest.py): the "full" group has 1,024 blocks
# of 4 tokens, "swa" 512 of 8. The holder's probe hangs until the test releases it; the rank-call deadline stays far
# above any step of a test, so a busy machine cannot turn the hang into "rank not responding" before the release.
KV_TOKENS = 4096
KV_HOLDER = synthetic_tokens(3000, seed=1)  # holds 750 "full" blocks while its probe hangs
HANG_DEADLINE_S = 120.0


def hold_blocks(eng: FakeEngine) -> tuple[threading.Thread, dict[str, Any]]:
    """A request that has its blocks and then hangs in its probe on rank 0 until ``release`` is set (its result
    lands in the dict's "res")."""
    eng.ranks[0].hang.add("probe")
    admitted = threading.Event()
    out: dict[str, Any] = {}

    def run() -> None:
        out["res"] = eng.coordinator.submit(KV_HOLDER, request="req-holder", progress=lambda ev: admitted.set())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    # Its blocks are allocated before its first event (request_admitted): from then on it holds them.
    assert admitted.wait(10), "the holder was never admitted"
    return t, out
