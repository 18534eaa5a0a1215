"""The coordinator's per-window progress deadline, for a rank whose process still runs (and would still beat) but
whose restore makes no progress.

A rank process cannot be made to hang one call while it keeps beating with real parts (SIGSTOP freezes the whole
process, and that path is tested against the real engine in tests/engine/test_diagnosis.py), so these ranks are
in-process stand-ins behind the RankClient interface (serving the RankOps contract): rank 0 restores at once,
rank 1 hangs until released."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import pytest

from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    RankRequest,
    RestoreRequest,
    RestoreResult,
    StatsRequest,
    StatsResult,
    UnsupportedOps,
    dispatch,
)
from bsr_cli.core.bitmap import encode_row
from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.errors import ServerError
from bsr_cli.loaders import builtin_registration
from bsr_cli.runtime.coordinator import Coordinator, EngineSettings
from bsr_cli.runtime.events import EventLog

pytestmark = pytest.mark.timeout(60)
REG = builtin_registration("demo")
FETCH_TIMEOUT_S = 0.5
R = TypeVar("R")


class StandInRank(UnsupportedOps):
    """A rank that holds every chunk in "fs"; its restore either answers at once or hangs until ``release``."""

    def __init__(self, rank: int, hang: bool) -> None:
        self.rank = rank
        self.hang = hang
        self.release = threading.Event()
        self.aborted: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=4)

    def submit(self, request: RankRequest[R]) -> Future[R]:
        return self._pool.submit(dispatch, self, request)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def alive(self) -> bool:
        return True

    def probe(self, req: ProbeRequest) -> ProbeResult:
        row = encode_row({"fs": [True] * len(req.hashes)}, req.tiers, len(req.hashes))
        return ProbeResult(dict.fromkeys(REG.group_names, row))

    def restore(self, req: RestoreRequest) -> RestoreResult:
        if self.hang:
            self.release.wait(30)
        return RestoreResult(
            rank=self.rank, ok=True, valid=dict.fromkeys(REG.group_names, True), windows_done=len(req.job.windows)
        )

    def stats(self, req: StatsRequest) -> StatsResult:
        return StatsResult(self.rank, {})

    def close(self) -> None:
        self.release.set()
        self._pool.shutdown(wait=True)


def test_a_restore_without_progress_fails_as_a_rank_fault_and_keeps_its_blocks_until_the_rank_returns() -> None:
    ranks = [StandInRank(0, hang=False), StandInRank(1, hang=True)]
    settings = EngineSettings(w=4, tiers=("fs",), max_tokens=4096, kv_tokens=4096, fetch_timeout_s=FETCH_TIMEOUT_S)
    coord = Coordinator(REG, ranks, settings, EventLog())
    free_before = {g: a.free_blocks for g, a in coord.allocators.items()}
    try:
        t0 = time.monotonic()
        res = coord.restore(list(range(2048)), verify=False)
        elapsed = time.monotonic() - t0
        report = res.report
        assert report is not None
        assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
        assert report.failure_kind is FailureKind.RANK and report.blamed_tiers == () and res.marker is None
        bad = [f for f in report.failures if f.kind is FailureKind.RANK]
        assert [f.rank for f in bad] == [1] and "no restore progress" in bad[0].reason
        assert elapsed < 20  # the window deadline (2 × 0.5 s), not a multi-minute budget
        assert ranks[0].aborted == ranks[1].aborted == [res.request]
        health = coord.health()
        assert health.ok is False and health.unhealthy_ranks == [1]
        assert "still running past its deadline" in (health.ranks[1].reason or "")
        # The hung call still holds the request's blocks: none may be handed to another request yet.
        assert any(coord.allocators[g].free_blocks < free_before[g] for g in free_before)
        ranks[1].release.set()
        end = time.monotonic() + 20
        while time.monotonic() < end and not coord.health().ok:
            time.sleep(0.05)
        assert coord.health().ok is True
        assert {g: a.free_blocks for g, a in coord.allocators.items()} == free_before
    finally:
        for r in ranks:
            r.close()


def test_other_calls_on_a_silent_rank_fail_at_once_naming_it() -> None:
    """A rank client that reports its heartbeat: once silent past the stall time, a probe fails at once."""

    class Silent(StandInRank):
        def heartbeat_age(self) -> float:
            return 99.0

        def probe(self, req: ProbeRequest) -> ProbeResult:
            self.release.wait(30)
            return super().probe(req)

    ranks = [StandInRank(0, hang=False), Silent(1, hang=True)]
    settings = EngineSettings(w=4, tiers=("fs",), max_tokens=4096, kv_tokens=4096, fetch_timeout_s=FETCH_TIMEOUT_S)
    coord = Coordinator(REG, ranks, settings, EventLog())
    try:
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="rank 1 is not responding: no heartbeat"):
            coord.probe(list(range(512)))
        assert time.monotonic() - t0 < 20
        assert coord.rank_health()[1].healthy is False
        assert coord.rank_faults[1].reason.startswith("no heartbeat")
    finally:
        for r in ranks:
            r.close()
