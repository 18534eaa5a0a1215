"""The coordinator over in-process fake ranks: probe-only lookup, admission with its force-local fallback, the
commit rule across ranks and groups, the failure taxonomy (tier / capacity / rank / aborted) and the markers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from bsr_cli.core.events import Event, FaultEvent, RestoreEnded, WindowReleased
from bsr_cli.core.evidence import FaultAct, Outcome, Stage
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.results import InvalidCell, ManualRestoreResult, RestoreReport
from bsr_cli.errors import AlreadyEnded, ExitCode, RankRestarting
from bsr_cli.runtime import failures
from unit.fakes import RestartSchedule
from unit.fixtures import FakeEngine, build_engine

PROMPT = synthetic_tokens(9 * 16 + 3, seed=11)  # 10 chunks, the last partial


def _report(out: ManualRestoreResult) -> RestoreReport:
    """The restore report of a manual restore that ran (or failed before it could)."""
    assert out.report is not None, out
    return out.report


def _warm(fake_engine: FakeEngine) -> None:
    """Compute the prompt once and store its chunks in both tiers."""
    out = fake_engine.coordinator.submit(PROMPT)
    assert out.external_tokens == 0 and out.source == "recompute"
    assert out.stored is not None and out.stored.objects


def test_probe_moves_no_bytes_and_reports_every_rank_and_group(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    before = {n: t.bytes_read for n, t in fake_engine.tiers.items()}
    bitmap, errors = fake_engine.coordinator.probe(PROMPT)
    assert errors == {}
    assert bitmap.prefix_tokens(set()) == len(PROMPT)  # every chunk, the partial last one too, in both tiers
    assert bitmap.prefix_tokens({"mooncake"}) == len(PROMPT)
    assert {n: t.bytes_read for n, t in fake_engine.tiers.items()} == before
    assert all(t.get_calls == 0 for t in fake_engine.tiers.values())


def test_a_warm_admission_restores_the_prefix_in_windows_and_matches_the_recompute(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    seen: list[Event] = []
    out = fake_engine.coordinator.submit(PROMPT, progress=seen.append)
    assert out.source == "mooncake"
    assert (out.external_tokens, out.computed_tokens) == (len(PROMPT), 0)
    assert out.hash_ok is True  # restored + computed KV equals a full recompute, byte for byte
    restore = out.passes[0].restore
    assert restore is not None
    assert restore.outcome is Outcome.COMMITTED and restore.windows == 5  # 10 chunks, W=2
    released = [e for e in seen if isinstance(e, WindowReleased)]
    assert len(released) == restore.windows * len(fake_engine.ranks)  # every rank ran every window
    assert fake_engine.tiers["fs"].get_calls == 0


def test_a_tier_fault_sets_a_marker_and_the_next_pass_restores_from_the_lower_tier(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    fake_engine.coordinator.inject(FaultRequest("remote-unavailable"))
    out = fake_engine.coordinator.submit(PROMPT)
    first, second = out.passes[0], out.passes[1]
    assert first.restore is not None and second.restore is not None
    assert first.restore.outcome is Outcome.FAILED_CLOSED and first.restore.failure_kind is failures.TIER
    assert first.to_wire()["failure_kind"] == failures.TIER
    assert first.restore.blamed_tiers == ("mooncake",) and first.restore.committed_tokens == 0
    assert second.excluded_tiers == ("mooncake",) and second.restore.outcome is Outcome.COMMITTED
    assert out.source == "fs" and out.hash_ok is True
    assert out.marker_cleared is True and fake_engine.coordinator.markers == {}
    types = [e.kind for e in fake_engine.events.recent(500)]
    assert types.index("marker_set") < types.index("marker_cleared")
    assert fake_engine.coordinator.list_faults() == []  # count=1: it fired once and is gone


def test_one_invalid_group_on_one_rank_collapses_the_whole_prefix(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    fake_engine.coordinator.inject(FaultRequest("restore-fault", rank=1, group="swa", window=1))
    out = fake_engine.coordinator.restore(PROMPT)
    report = _report(out)
    assert out.outcome is Outcome.FAILED_CLOSED and out.committed_tokens == 0
    assert report.advertised_tokens > 0
    assert report.invalid == (InvalidCell(1, "swa"),)
    # The fault is in rank 1's install: the rank is blamed, never the tier it restored from.
    assert report.failure_kind is failures.RANK and report.failure_stage is Stage.INSTALL
    assert report.blamed_tiers == () and report.blamed_ranks == (1,)
    assert out.marker is not None and out.marker.excluded == set()  # no tier excluded: recompute it locally
    # Rank 1 scrubbed every block of the request, including the window it had installed before the fault.
    assert fake_engine.ranks[1].ops.kv.invalidated
    assert not fake_engine.ranks[0].ops.kv.invalidated  # rank 0 restored its part; the commit rule still says no
    assert [m.excluded_tiers for m in fake_engine.coordinator.list_markers()] == [()]
    fake_engine.coordinator.clear_markers()
    assert fake_engine.coordinator.markers == {} and fake_engine.coordinator.list_markers() == []


def test_a_window_over_the_budget_is_a_capacity_failure_without_a_marker() -> None:
    eng = build_engine(pool_chunks=4, budget_chunks=2)
    try:
        _warm(eng)
        out = eng.coordinator.restore(PROMPT, w=3)
        report = _report(out)
        assert out.outcome is Outcome.REFUSED and report.failure_kind is failures.CAPACITY
        assert report.blamed_tiers == () and out.marker is None and "marker" not in out.to_wire()
        assert "--W 2" in (report.hint or "")
        assert eng.coordinator.markers == {}
    finally:
        for r in eng.ranks:
            r.close()


def test_a_rank_that_stops_making_progress_fails_the_restore_as_a_rank_fault() -> None:
    eng = build_engine(fetch_timeout_s=0.5)  # window progress deadline: 2 x 0.5 s
    try:
        _warm(eng)
        free_before = eng.coordinator.allocators["full"].free_blocks
        eng.ranks[1].hang.add("restore")
        out = eng.coordinator.restore(PROMPT)
        report = _report(out)
        assert out.outcome is Outcome.FAILED_CLOSED and report.failure_kind is failures.RANK
        assert out.committed_tokens == 0 and out.marker is None
        assert 1 in eng.coordinator.rank_faults
        assert any(f.rank == 1 and f.kind is failures.RANK for f in report.failures)
        assert "no restore progress" in eng.coordinator.rank_faults[1].reason
        # The stalled rank's call still runs: the request's blocks stay allocated until it returns, so a late
        # install can never land in another request's blocks.
        alloc = eng.coordinator.allocators["full"]
        assert alloc.free_blocks < free_before
        eng.ranks[1].release.set()
        deadline = time.monotonic() + 10
        while alloc.free_blocks < free_before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alloc.free_blocks == free_before
        assert eng.ranks[1].ops.kv.invalidated  # the late call ended fail-closed (it was told to abort)
    finally:
        for r in eng.ranks:
            r.close()


def test_a_dead_rank_that_is_restarting_refuses_the_restore_before_any_window() -> None:
    """A host that starts dead ranks again: the restore is recorded failed closed, naming the rank and its restart,
    and refused with when to retry (503 rank-restarting in the admin API); no rank installs anything."""
    eng = build_engine()
    try:
        _warm(eng)
        eng.coordinator.restart_ranks_with(RestartSchedule(2.4))
        eng.ranks[0].dead = True
        with pytest.raises(RankRestarting, match=r"rank 0 is down .*starts it again in 3s") as e:
            eng.coordinator.restore(PROMPT)
        assert (e.value.rank, e.value.retry_after_s, e.value.exit_code) == (0, 3, ExitCode.RANK_RESTARTING)
        assert "restore" not in eng.ranks[1].calls and all(not r.ops.kv.installs for r in eng.ranks)
        ended = [
            ev for ev in eng.events.recent() if (isinstance(ev, RestoreEnded) and ev.outcome is Outcome.FAILED_CLOSED)
        ]
        assert ended and ended[-1].failures[0].rank == 0 and "starts it again" in ended[-1].failures[0].reason
    finally:
        for r in eng.ranks:
            r.close()


def test_a_dead_rank_nobody_restarts_fails_the_restore_closed_before_any_window() -> None:
    eng = build_engine()
    try:
        _warm(eng)
        eng.ranks[0].dead = True
        out = eng.coordinator.restore(PROMPT)
        report = _report(out)
        assert out.outcome is Outcome.FAILED_CLOSED and report.blamed_ranks == (0,)
        assert "its process is not running" in report.failures[0].reason
        assert "restore" not in eng.ranks[1].calls and all(not r.ops.kv.installs for r in eng.ranks)
    finally:
        for r in eng.ranks:
            r.close()


def test_an_operator_abort_ends_the_restore_fail_closed_without_blame(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    fake_engine.coordinator.inject(FaultRequest("timeout", window=1))
    started = threading.Event()

    def progress(ev: Event) -> None:
        if isinstance(ev, WindowReleased):
            started.set()

    result: list[dict[str, Any]] = []
    t = threading.Thread(
        target=lambda: result.append(fake_engine.coordinator.restore(PROMPT, request="r-abort", progress=progress))
    )
    t.start()
    assert started.wait(10), "the restore never released its first window"
    assert fake_engine.coordinator.abort("r-abort") is True
    t.join(10)
    assert not t.is_alive()
    out = result[0]
    report = _report(out)
    assert out.outcome is Outcome.ABORTED and report.failure_kind is failures.ABORTED
    assert report.blamed_tiers == () and out.marker is None
    with pytest.raises(AlreadyEnded) as ended:  # finished: an abort now is too late, and says how it ended
        fake_engine.coordinator.abort("r-abort")
    assert ended.value.outcome == Outcome.ABORTED and ended.value.exit_code == ExitCode.ALREADY_ENDED


def test_blocks_are_returned_after_every_request(fake_engine: FakeEngine) -> None:
    free = {g: a.free_blocks for g, a in fake_engine.coordinator.allocators.items()}
    _warm(fake_engine)
    fake_engine.coordinator.inject(FaultRequest("corrupt"))
    fake_engine.coordinator.restore(PROMPT)
    assert {g: a.free_blocks for g, a in fake_engine.coordinator.allocators.items()} == free


def test_a_request_aborted_before_its_work_starts_still_ends_aborted(fake_engine: FakeEngine) -> None:
    """The admin API opens a streamed request when it hands out its id: a client that goes away before the worker
    thread runs aborts it, and the restore that follows ends at once, aborted, nothing committed."""
    _warm(fake_engine)
    c = fake_engine.coordinator
    c.open_request("r-early")
    assert c.abort("r-early") is True  # known although nothing has run yet
    out = c.restore(PROMPT, request="r-early")
    assert out.outcome is Outcome.ABORTED and out.committed_tokens == 0
    assert _report(out).failure_kind is failures.ABORTED
    with pytest.raises(AlreadyEnded, match="already ended aborted"):  # finished: nothing left to abort
        c.abort("r-early")
    assert c.abort("r-never") is False  # a request the engine never had


def test_an_abort_that_comes_after_every_rank_installed_but_before_the_commit_wins(
    fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit point and an abort are one race with one winner: an abort asked once every rank has installed its
    windows, but before the commit rule ran, ends the restore aborted (the operator was told it would), scrubs the
    installed blocks, and commits nothing."""
    _warm(fake_engine)
    orch = fake_engine.coordinator.orchestration
    every_rank_answered = orch._await_restore
    asked: list[bool] = []

    def then_abort(request: str, futures: Any) -> Any:
        outcomes = every_rank_answered(request, futures)
        assert all(o.ok for o in outcomes)  # every rank installed every window
        asked.append(orch.abort(request))
        return outcomes

    monkeypatch.setattr(orch, "_await_restore", then_abort)
    out = fake_engine.coordinator.restore(PROMPT, request="r-at-commit")
    assert asked == [True]
    assert out.outcome is Outcome.ABORTED and out.committed_tokens == 0 and out.hashes is None
    report = _report(out)
    assert report.failure_kind is failures.ABORTED and report.blamed_tiers == () and out.marker is None
    assert {f.stage for f in report.failures} == {Stage.COMMIT}
    assert all("invalidate" in r.calls for r in fake_engine.ranks)  # what they installed is scrubbed


def test_an_abort_that_comes_after_the_commit_is_refused_as_too_late(
    fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the commit and the end of the request (its output-hash check) an abort cannot undo the commit: it is
    refused with exit 18, naming what was committed, and the restore's result stands."""
    _warm(fake_engine)
    orch = fake_engine.coordinator.orchestration
    hashing = orch._output_hash
    refused: list[AlreadyEnded] = []

    def abort_while_hashing(tables: Any, n_tokens: int) -> str:
        with pytest.raises(AlreadyEnded) as too_late:
            orch.abort("r-committed")
        refused.append(too_late.value)
        return hashing(tables, n_tokens)

    monkeypatch.setattr(orch, "_output_hash", abort_while_hashing)
    out = fake_engine.coordinator.restore(PROMPT, request="r-committed")
    assert out.outcome is Outcome.COMMITTED and out.committed_tokens == len(PROMPT)  # the partial chunk too
    assert len(refused) == 1 and refused[0].outcome == Outcome.COMMITTED
    assert f"already committed {out.committed_tokens:,} tokens" in refused[0].message
    assert not any(e.kind == "abort_requested" for e in fake_engine.events.recent(500))


def test_a_fault_armed_for_a_tier_is_used_up_only_by_a_fetch_from_that_tier(fake_engine: FakeEngine) -> None:
    """A remote-unavailable fault takes Mooncake down: a restore served from fs alone leaves it armed (nothing
    fired, no fault_fired event); the next restore that reads Mooncake meets it, fails closed, and uses it up, with a
    fault_fired event naming that request."""
    _warm(fake_engine)
    c = fake_engine.coordinator
    armed = c.inject(FaultRequest("remote-unavailable"))
    from_fs = c.restore(PROMPT, exclude=("mooncake",), request="r-fs")
    assert from_fs.outcome is Outcome.COMMITTED and _report(from_fs).tiers == ("fs",)
    assert [(f.id, f.fired) for f in c.list_faults()] == [(armed.id, 0)]  # still armed: it never acted
    assert not [e for e in fake_engine.events.recent(500) if isinstance(e, FaultEvent) and e.act is FaultAct.FIRED]
    from_mooncake = c.restore(PROMPT, request="r-mooncake")
    assert from_mooncake.outcome is Outcome.FAILED_CLOSED and _report(from_mooncake).blamed_tiers == ("mooncake",)
    assert c.list_faults() == []
    fired = [e for e in fake_engine.events.recent(500) if isinstance(e, FaultEvent) and e.act is FaultAct.FIRED]
    assert [(e.fault_id, e.fault, e.fired, e.request) for e in fired] == [
        (armed.id, "remote-unavailable", 1, "r-mooncake")
    ]


def _miswrite(fake_engine: FakeEngine, chunk: int) -> str:
    """Rank 0's object of ``chunk`` (group full) in Mooncake replaced by another chunk's bytes with a checksum
    computed for this key: what a writer that stored the wrong KV under the right key leaves. Every checksum holds,
    so only the output hash can tell."""
    from bsr_cli.core.keys import chunk_hashes, object_key
    from bsr_cli.runtime.checksum import object_checksum

    reg = fake_engine.reg
    hashes = chunk_hashes(PROMPT, reg.chunk_size)
    key = object_key(reg, 0, "full", hashes[chunk])
    wrong, _ = fake_engine.tiers["mooncake"].objects[object_key(reg, 0, "full", hashes[chunk + 1])]
    fake_engine.tiers["mooncake"].objects[key] = (wrong, object_checksum(key, wrong))
    return key


def test_a_restore_whose_output_hash_is_not_canonical_is_invalidated_and_marked(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    _miswrite(fake_engine, 3)
    c = fake_engine.coordinator
    invalidated_before = [len(r.ops.kv.invalidated) for r in fake_engine.ranks]
    out = c.restore(PROMPT, exclude=["fs"])
    report = _report(out)
    assert report.outcome is Outcome.COMMITTED  # the commit rule passed: every checksum held...
    assert out.hashes is not None and out.hashes.hash_ok is False  # ...but the KV is not the prompt's
    assert out.output_mismatch and out.outcome is Outcome.FAILED_CLOSED and out.committed_tokens == 0
    # Undone: every rank invalidated the request's blocks, and a marker recomputes the prompt next time.
    assert [len(r.ops.kv.invalidated) for r in fake_engine.ranks] == [n + 1 for n in invalidated_before]
    assert out.marker is not None and out.marker.excluded == set()
    (ev,) = [e for e in fake_engine.events.recent(500) if e.kind == "output_mismatch"]
    assert ev.request == out.request and ev.external_tokens == len(PROMPT) and ev.source == "mooncake" and ev.marker
    # The next admission recomputes it (the marker), and its hash is the canonical one.
    again = c.submit(PROMPT)
    assert again.source == "recompute" and again.hash_ok is True and again.marker_cleared


def test_a_submit_whose_output_hash_is_not_canonical_stores_nothing_and_is_marked(fake_engine: FakeEngine) -> None:
    _warm(fake_engine)
    key = _miswrite(fake_engine, 3)
    del fake_engine.tiers["fs"].objects[key]  # the fs tier lacks the chunk: a clean request would store it there
    out = fake_engine.coordinator.submit(PROMPT)
    assert out.source == "mooncake" and out.hash_ok is False
    assert out.stored is None and key not in fake_engine.tiers["fs"].objects  # wrong KV is never written
    mine = [e for e in fake_engine.events.recent(500) if getattr(e, "request", None) == out.request]
    kinds = [e.kind for e in mine]
    assert kinds.index("output_mismatch") < kinds.index("request_finished") == len(kinds) - 1
    assert fake_engine.coordinator.markers  # the next admission recomputes it
