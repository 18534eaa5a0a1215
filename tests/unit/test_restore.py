"""The window loop of one rank (RankRestorer) over a fake tier, pool and destination: windows, the budget,
completeness, integrity, injected faults, aborts, and the fail-closed scrub."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
from bsr_cli.core.plan import windows_for
from bsr_cli.runtime import failures
from bsr_cli.runtime.checksum import object_checksum
from bsr_cli.runtime.faulty import ArmedFaults
from bsr_cli.runtime.restore import ObjectRef, RankRestorer, RestoreJob, WindowJob
from bsr_cli.runtime.tiers import TIMED_OUT, UNAVAILABLE, StagingSlice
from unit.fakes import FakeDestination, FakeTier, make_pool, small_registration, synthetic

REG = small_registration(tp=1)
TOKENS = 10 * REG.chunk_size + 5  # 11 chunks, the last one partial


def _tokens(c: int) -> int:
    return min((c + 1) * REG.chunk_size, TOKENS) - c * REG.chunk_size


class Delays:
    """Stands in for the rank's own /proc figures, which a fetch that times out is judged by: between the fetch's
    start and its deadline the rank's threads ran ``ran_s`` and waited ``waited_s``. A fake because the fast lane's
    own process is starved or not as the machine's load has it, and a test must not depend on that."""

    def __init__(self, ran_s: float, waited_s: float) -> None:
        from bsr_cli.runtime.liveness import Pressure

        self.ran_ns, self.waited_ns = int(ran_s * 1e9), int(waited_s * 1e9)
        self.reader = type("Reader", (), {"pressure": lambda _self: Pressure(None, None, None)})()

    def recent(self) -> Any:
        from bsr_cli.runtime.liveness import RunDelays

        return RunDelays(0.0, {1: (0, 0)})

    def now(self) -> Any:
        from bsr_cli.runtime.liveness import RunDelays

        return RunDelays(1.0, {1: (self.ran_ns, self.waited_ns)})


class Rig:
    def __init__(self, *, pool_chunks: int = 8, budget_chunks: int | None = None) -> None:
        self.tier = FakeTier("mooncake")
        self.fs = FakeTier("fs")
        self.dest = FakeDestination(REG, 0)
        self.pool = make_pool(
            pool_chunks, REG.bytes_per_chunk, None if budget_chunks is None else budget_chunks * REG.bytes_per_chunk
        )
        self.events: list[dict[str, Any]] = []
        offsets = {"full": 0, "swa": REG.group_bytes_per_chunk("full")}
        self.restorer = RankRestorer(
            0,
            REG.group_names,
            offsets,
            self.pool,
            {"mooncake": self.tier, "fs": self.fs},
            self.dest,
            lambda ev: self.events.append(ev.to_wire()),
        )
        self.restorer.own_delays = Delays(1.0, 0.0)  # type: ignore[assignment]  # a rank that could run
        self.hashes = chunk_hashes(synthetic_tokens(TOKENS, seed=3), REG.chunk_size)
        # The tier holds every object, as a store after a prefill would.
        for c, h in enumerate(self.hashes):
            n = min((c + 1) * REG.chunk_size, TOKENS) - c * REG.chunk_size
            for g in REG.group_names:
                payload = synthetic(h, 0, g, n * self.dest.bpt[g])
                key = object_key(REG, 0, g, h)
                self.tier.objects[key] = (payload, object_checksum(key, payload))
        self.tables = {g.name: list(range(100, 100 + -(-TOKENS // g.block_size))) for g in REG.groups}

    def job(self, w: int, faults: list[FaultSpec] = (), tier: str = "mooncake", timeout_s: float = 2.0) -> RestoreJob:  # type: ignore[assignment]
        wins = windows_for(REG, w, len(self.hashes), TOKENS)
        objs = {}
        for g in REG.group_names:
            objs[g] = [
                ObjectRef(object_key(REG, 0, g, h), tier, _tokens(c) * self.dest.bpt[g])
                for c, h in enumerate(self.hashes)
            ]
        return RestoreJob(
            request_id="req-1",
            w=w,
            windows=[
                WindowJob(
                    x.index,
                    x.chunk_start,
                    x.chunk_end,
                    x.token_start,
                    x.token_end,
                    {b.group: (b.start, b.end) for b in x.blocks},
                )
                for x in wins
            ],
            objects=objs,
            block_tables=self.tables,
            faults=list(faults),
            fetch_timeout_s=timeout_s,
            admit_timeout_s=timeout_s,
        )

    def installed_ok(self) -> bool:
        """Every token of every group holds the prefill's bytes."""
        for g in REG.group_names:
            want = b"".join(
                synthetic(h, 0, g, (min((c + 1) * REG.chunk_size, TOKENS) - c * REG.chunk_size) * self.dest.bpt[g])
                for c, h in enumerate(self.hashes)
            )
            if self.dest.read(g, self.tables[g], 0, TOKENS) != want:
                return False
        return True

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.restorer.close()


def test_a_clean_restore_installs_every_window_and_returns_every_slot(rig: Rig) -> None:
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert out.ok, out.reason
    assert out.windows_done == 3  # 11 chunks in windows of 4
    assert out.valid == {"full": True, "swa": True}
    assert out.bytes_restored == sum(len(p) for p, _ in rig.tier.objects.values())
    assert rig.installed_ok()
    assert rig.types().count("window_released") == 3 and "restore_failed" not in rig.types()
    assert rig.dest.syncs == 3 and not rig.dest.invalidated
    s = rig.pool.stats()
    assert s.live_bytes == 0 and s.windows_live == 0
    # With B = the whole pool (8 chunks) two windows of 4 may be live at once (prefetch), never more.
    assert s.peak_bytes == 8 * REG.bytes_per_chunk


def test_the_outcome_counts_each_stage_and_the_cpu_a_tier_reports_for_its_transfer(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bsr_cli.runtime import restore
    from bsr_cli.runtime.stage_clock import report_call_cpu

    # The rig's checksums take microseconds, below the costs' rounding (0.1 ms): each one here also spends 1 ms of
    # its thread's CPU, so that the verify stage's CPU is there to be counted (or missed).
    checksum = restore.object_checksum_at

    def costly_checksum(*args: Any) -> int:
        end = time.thread_time() + 0.001
        while time.thread_time() < end:
            pass
        return checksum(*args)

    monkeypatch.setattr(restore, "object_checksum_at", costly_checksum)
    inner = rig.tier.get_into

    def reporting(keys: Any, dests: Any, timeout_s: float) -> Any:
        report_call_cpu(0.25)  # as MooncakeTier does for the worker thread that ran the transfer
        return inner(keys, dests, timeout_s)

    rig.tier.get_into = reporting  # type: ignore[method-assign]
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert out.ok and out.stages is not None
    st = out.stages
    # Three windows: each transfer's reported CPU is the fetch stage's (never the stage that ran next on the thread).
    assert 0.75 <= st.fetch.cpu_s < 1.0, st
    assert st.verify.cpu_s >= 0.001 and st.install.wall_s > 0 and st.fetch.wall_s > 0 and st.wait.wall_s >= 0
    assert st.process_cpu_s > 0
    # Negative control: a tier that reports nothing leaves only the fetch thread's own CPU, far below 0.75 s.
    rig.tier.get_into = inner  # type: ignore[method-assign]
    again = rig.restorer.restore(rig.job(4), threading.Event())
    assert again.ok and again.stages is not None and again.stages.fetch.cpu_s < 0.75


def test_budget_of_one_window_serializes_the_restore() -> None:
    rig = Rig(budget_chunks=4)  # B = RWS(4): one window at a time
    try:
        out = rig.restorer.restore(rig.job(4), threading.Event())
        assert out.ok and out.windows_done == 3
        assert rig.pool.stats().peak_bytes == 4 * REG.bytes_per_chunk
        assert out.peak_live_bytes <= 4 * REG.bytes_per_chunk
    finally:
        rig.restorer.close()


def test_a_window_larger_than_the_budget_is_a_capacity_failure_with_nothing_installed() -> None:
    rig = Rig(budget_chunks=2)
    try:
        out = rig.restorer.restore(rig.job(4), threading.Event())
        assert not out.ok and out.kind == failures.CAPACITY and "budget B" in out.reason
        assert out.windows_done == 0 and not rig.dest.installs
        assert rig.dest.invalidated == [rig.tables]  # still scrubbed: fail-closed whatever the kind
    finally:
        rig.restorer.close()


def test_w0_is_one_whole_plan_window_bounded_by_the_pool() -> None:
    rig = Rig(pool_chunks=16, budget_chunks=2)
    try:
        out = rig.restorer.restore(rig.job(0), threading.Event())
        assert out.ok and out.windows_done == 1 and rig.installed_ok()
    finally:
        rig.restorer.close()
    small = Rig(pool_chunks=8)
    try:
        out = small.restorer.restore(small.job(0), threading.Event())
        assert not out.ok and out.kind == failures.CAPACITY and "pool capacity" in out.reason
    finally:
        small.restorer.close()


def test_a_missing_object_fails_closed_and_scrubs_every_block(rig: Rig) -> None:
    key = object_key(REG, 0, "swa", rig.hashes[9])  # in the last window: two windows were installed already
    del rig.tier.objects[key]
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.kind == failures.TIER and out.tier == "mooncake"
    assert out.failed_window == 2 and out.windows_done == 2
    assert out.valid == {"full": True, "swa": False}
    assert "missing fetching chunk 9 group swa" in out.reason
    assert rig.dest.invalidated == [rig.tables]
    assert all(not any(b) for g in REG.group_names for b in rig.dest.blocks[g].values())  # nothing left readable
    assert rig.pool.stats().live_bytes == 0
    assert rig.types()[-1] == "restore_failed"


def test_a_short_object_fails_the_retrieve(rig: Rig) -> None:
    rig.tier.short.add(object_key(REG, 0, "full", rig.hashes[0]))
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and "short object in chunk 0 group full" in out.reason and out.failed_window == 0
    assert not rig.dest.installs


def test_a_corrupt_stored_object_is_caught_by_its_checksum(rig: Rig) -> None:
    key = object_key(REG, 0, "full", rig.hashes[5])
    payload, stored = rig.tier.objects[key]
    rig.tier.objects[key] = (bytes([payload[0] ^ 1]) + payload[1:], stored)
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.kind == failures.TIER
    assert "checksum mismatch in chunk 5 group full" in out.reason and out.failed_window == 1
    assert rig.dest.invalidated == [rig.tables]


def test_another_chunks_object_with_its_own_checksum_fails_verify_naming_chunk_key_and_tier(rig: Rig) -> None:
    """An object written under the wrong key (chunk 2's bytes and checksum under chunk 6's key, both of full length)
    matches its checksum as bytes but not as chunk 6: the checksum is bound to the key."""
    here, there = object_key(REG, 0, "full", rig.hashes[6]), object_key(REG, 0, "full", rig.hashes[2])
    rig.tier.objects[here] = rig.tier.objects[there]
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.kind == failures.TIER and out.stage == "verify" and out.tier == "mooncake"
    assert out.reason == f"checksum mismatch in chunk 6 group full (tier mooncake, key {here})"
    assert out.failed_window == 1 and rig.dest.invalidated == [rig.tables]


def test_an_unavailable_tier_names_itself(rig: Rig) -> None:
    rig.tier.down = True
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.tier == "mooncake" and "unavailable" in out.reason
    assert out.unanswered is True  # nothing came back: there is nothing of the tier's to re-read for damage


def test_a_fetch_that_got_bytes_back_is_not_marked_unanswered(rig: Rig) -> None:
    """Only a fetch the tier answered for none of its failed objects is unanswered: a short object came back with
    bytes (a re-read may find it damaged), and so did a checksum mismatch."""
    rig.tier.short.add(object_key(REG, 0, "full", rig.hashes[0]))
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.stage == "fetch" and out.unanswered is False


@pytest.mark.parametrize(
    ("kind", "window", "group", "reason"),
    [
        ("remote-unavailable", 1, None, "unavailable fetching"),
        ("corrupt", 2, "swa", "checksum mismatch"),
        ("restore-fault", 1, "full", "injected restore fault while installing group full"),
        ("timeout", None, "swa", "timeout fetching"),
    ],
)
def test_injected_faults_fire_on_their_window_and_fail_closed(
    rig: Rig, kind: str, window: int | None, group: str | None, reason: str
) -> None:
    fault = FaultSpec(kind=kind, window=window, group=group, id=7)
    if kind == "timeout":
        # One window at a time: the stalled tier answers each group at the deadline. (Two windows sharing the
        # transport: test_a_window_whose_share_of_the_transport_runs_out_fails_every_group_until_its_transfer_ends.)
        rig.restorer.close()
        rig = Rig(budget_chunks=4)
    out = rig.restorer.restore(rig.job(4, [fault], timeout_s=0.3), threading.Event())
    assert not out.ok and reason in out.reason
    assert out.fired_faults == [7]
    assert out.failed_window == (0 if window is None else window)
    assert out.windows_done == out.failed_window
    if group is not None:  # only the faulted group is invalid
        assert out.valid == {g: g != group for g in REG.group_names}
    assert rig.dest.invalidated == [rig.tables]
    assert rig.pool.stats().live_bytes == 0


def test_a_fault_for_another_rank_or_window_does_not_fire(rig: Rig) -> None:
    faults = [FaultSpec(kind="restore-fault", rank=1, id=1), FaultSpec(kind="corrupt", window=9, id=2)]
    out = rig.restorer.restore(rig.job(4, faults), threading.Event())
    assert out.ok and out.fired_faults == [] and rig.installed_ok()


def test_an_abort_during_a_stalled_fetch_ends_it_at_once_as_aborted(rig: Rig) -> None:
    abort = threading.Event()
    fault = FaultSpec(kind="timeout", window=1, id=3)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(rig.restorer.restore(rig.job(4, [fault], timeout_s=25), abort)))
    t.start()
    while "window_released" not in rig.types():  # the restore is under way: window 0 is in
        threading.Event().wait(0.01)
    abort.set()
    t.join(10)
    assert not t.is_alive(), "the abort did not cut the stalled fetch short"
    out = result[0]
    assert not out.ok and out.kind == failures.ABORTED and out.windows_done == 1
    assert rig.dest.invalidated == [rig.tables]


def test_an_abort_before_the_first_window_installs_nothing(rig: Rig) -> None:
    abort = threading.Event()
    abort.set()
    out = rig.restorer.restore(rig.job(4), abort)
    assert not out.ok and out.kind == failures.ABORTED and not rig.dest.installs
    assert rig.tier.get_calls == 0


class _AbandoningTier(FakeTier):
    """A fake of a tier that gives up at its deadline while the transfer still runs (as a Mooncake call on a worker
    thread does), for the one window ``late_window`` it serves: the transfer then lands after the restore failed."""

    def __init__(self, name: str, objects: dict[str, tuple[bytes, int]]) -> None:
        super().__init__(name)
        self.objects = objects
        self.late: Future[None] = Future()
        self.late.set_running_or_notify_cancel()
        self.abandoned = False

    def get_into(self, keys, dests, timeout_s):  # type: ignore[no-untyped-def]
        self.abandoned = True
        return [TIMED_OUT] * len(keys), [None] * len(keys)

    def pending_writes(self) -> list[Future[None]]:
        return [self.late] if self.abandoned and not self.late.done() else []


def test_a_transfer_abandoned_at_its_deadline_keeps_its_slots_until_it_returns(rig: Rig) -> None:
    """The late write: a fetch given up at its deadline may still land in its pool slots; they are not handed to
    another window (or request) until the transfer returns."""
    slow = _AbandoningTier("mooncake", rig.tier.objects)
    rig.restorer.tiers["mooncake"] = slow
    out = rig.restorer.restore(rig.job(4), threading.Event())
    assert not out.ok and out.kind == failures.TIER and "timeout" in out.reason and out.unanswered is True
    held = rig.pool.stats().live_bytes
    assert held >= 4 * REG.bytes_per_chunk, "the windows's slots stay out of the pool while the transfer may write"
    slow.late.set_result(None)
    assert rig.pool.stats().live_bytes == 0


def _fetch_window(tiers: dict[str, Any], job: RestoreJob, window: int, group: str) -> tuple[list[int], list[bytes]]:
    """Fetch one KV group's objects of one window through ``tiers`` into fresh buffers, as the loop does."""
    win = job.windows[window]
    refs = [job.objects[group][c] for c in range(win.chunk_start, win.chunk_end)]
    bufs = [bytearray(ref.size) for ref in refs]
    dests = [StagingSlice(0, memoryview(b)) for b in bufs]
    codes, _ = tiers[refs[0].tier].get_into([r.key for r in refs], dests, 1.0)
    return codes, [bytes(b) for b in bufs]


def test_armed_faults_wrap_the_tiers_and_act_only_where_they_hit(rig: Rig) -> None:
    """The fault wrapper on its own: the restore loop sees a tier that is down, or flips a byte, only in the windows
    (and groups) an armed fault hits; elsewhere the tier itself answers. No armed fault: no wrapper at all."""
    assert ArmedFaults.of(rig.job(4), 0, threading.Event()) is None
    faults = [
        FaultSpec(kind="remote-unavailable", window=1, id=1),
        FaultSpec(kind="corrupt", window=2, group="swa", id=2),
        FaultSpec(kind="restore-fault", rank=1, id=3),  # another rank's: never armed here
    ]
    job = rig.job(4, faults)
    armed = ArmedFaults.of(job, 0, threading.Event())
    assert armed is not None and [f.id for f in armed.faults] == [1, 2]
    tiers = armed.tiers(rig.restorer.tiers, job, REG.group_names)

    codes, got = _fetch_window(tiers, job, 0, "full")
    assert all(c > 0 for c in codes) and armed.fired == []
    calls = rig.tier.get_calls
    codes, _ = _fetch_window(tiers, job, 1, "full")
    assert codes == [UNAVAILABLE] * len(codes) and rig.tier.get_calls == calls  # down: the tier is never asked
    assert armed.fired == [1]

    stored = [rig.tier.objects[job.objects["swa"][c].key][0] for c in range(8, 11)]
    codes, got = _fetch_window(tiers, job, 2, "swa")
    assert all(c > 0 for c in codes)
    assert [sum(a != b for a, b in zip(g, s, strict=True)) for g, s in zip(got, stored, strict=True)] == [1, 0, 0]
    _, got_full = _fetch_window(tiers, job, 2, "full")  # the fault names swa only
    assert got_full == [rig.tier.objects[job.objects["full"][c].key][0] for c in range(8, 11)]
    assert armed.fired == [1, 2]


@pytest.mark.parametrize(("starved", "link_down"), [(True, False), (False, False), (True, True)])
def test_a_fetch_deadline_missed_while_the_rank_waited_to_run_blames_the_host_not_the_tier(
    rig: Rig, starved: bool, link_down: bool
) -> None:
    """The same fetch timing out: the rank's threads waited nearly all of it to run, so the host
    is named and no tier is blamed; the controls: they ran most of it, so the tier was late and is blamed; or they
    waited, but the rank found a link to the tier down, which is evidence of the tier's fault and outranks it."""
    rig.restorer.own_delays = Delays(0.01, 0.95) if starved else Delays(0.6, 0.3)  # type: ignore[assignment]
    if link_down:
        rig.restorer.diagnose = lambda tier: "link rank0↔holder down: 10.213.0.2:1234 unreachable"
    late = _AbandoningTier("mooncake", rig.tier.objects)  # it times out on every fetch
    rig.restorer.tiers["mooncake"] = late
    out = rig.restorer.restore(rig.job(4), threading.Event())
    late.late.set_result(None)
    assert not out.ok and out.valid == {"full": False, "swa": False} and rig.dest.invalidated  # fail-closed either way
    failure = failures.failure_of(out)
    if starved and not link_down:
        assert failure.kind is failures.HOST and failure.tier is None and failure.stage is not None
        assert failure.load is not None and failure.load.ranks[0].run_delay_s == pytest.approx(0.95)
        assert "waited to run" in failure.reason and "cpu pressure unknown" in failure.reason
        assert failures.blamed_tiers(failure.kind, [failure], ["mooncake"]) == set()
    else:
        assert failure.kind is failures.TIER and failure.tier == "mooncake" and failure.load is None
        assert ("link rank0↔holder down" in failure.reason) is link_down


def test_an_injected_stall_is_the_tiers_even_on_a_starved_rank(rig: Rig) -> None:
    """An armed fault that stalls the fetch is known evidence of the tier's fault: it outranks starvation."""
    rig.restorer.own_delays = Delays(0.01, 0.95)  # type: ignore[assignment]
    out = rig.restorer.restore(
        rig.job(4, [FaultSpec(kind="timeout", window=1, id=9)], timeout_s=0.3), threading.Event()
    )
    failure = failures.failure_of(out)
    assert failure.kind is failures.TIER and failure.tier == "mooncake" and out.fired_faults == [9]


def test_fetches_in_flight_together_each_count_their_share_of_the_transport() -> None:
    """The deadline of a fetch that shares the transport counts its time with it to itself: while two are in flight
    each one's share grows at half the clock's rate, alone at the clock's."""
    from bsr_cli.runtime.transport_share import TransportShare

    now = [0.0]
    share = TransportShare(clock=lambda: now[0])
    a = share.enter()
    now[0] = 1.0
    b = share.enter()  # a had the transport to itself for 1 s
    now[0] = 3.0
    assert share.since(a) == (2.0, 2)  # 1 alone + 2 s shared with b at half
    assert share.since(b) == (1.0, 2)
    share.leave()  # a arrives
    now[0] = 4.0
    assert share.since(b) == (2.0, 1)  # 1 shared + 1 alone
    # The control: counted on the clock, b would have used 3 s of a 2.5 s deadline.
    assert now[0] - 1.0 > 2.5 > share.since(b)[0]


def test_a_window_whose_share_of_the_transport_runs_out_fails_every_group_until_its_transfer_ends(rig: Rig) -> None:
    """B holds two windows, so their fetches share the transport: the step gives up on window 1, stalled in one
    group, when its share of the transport reaches the deadline. Nothing has come back from it, so no group of it
    is known to be whole: every group is invalid. Its transfer still runs after the restore answered, and its slots
    go back to the pool when it returns."""
    fault = FaultSpec(kind="timeout", window=1, group="swa", id=7)
    out = rig.restorer.restore(rig.job(4, [fault], timeout_s=0.3), threading.Event())
    assert not out.ok and "timeout fetching" in out.reason and out.kind == failures.TIER
    assert out.failed_window == 1 and out.windows_done == 1 and out.fired_faults == [7]
    assert out.valid == dict.fromkeys(REG.group_names, False)
    assert rig.dest.invalidated == [rig.tables]
    deadline = time.monotonic() + 30  # the stalled transfer returns at the tier's own deadline (two of 0.3 s)
    while rig.pool.stats().live_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rig.pool.stats().live_bytes == 0
