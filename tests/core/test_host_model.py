"""The trace planner's host model (bsr_cli.core.host_model): hand-computed tiny replays with exact numbers (a
CPU-bound pair, restores queued for B, restores queued for a slot, a bandwidth-bound one), each beside what the
bandwidth-only model says of the same restores (the negative control: it cannot see the CPU), the reduction to
the bandwidth-only model when restores cost no CPU, and the pieces a calibration and `bsr bench trace` use."""

from __future__ import annotations

import math
import random

import pytest

from bsr_cli.core.evidence import RestoreBound
from bsr_cli.core.host_model import (
    CpuSpan,
    HostCalibration,
    HostModel,
    HostState,
    OwnWork,
    contended_cores,
    cpu_load,
    fit_stretch,
    replay_on_host,
    restore_bound,
    split_service,
)
from bsr_cli.core.registration import Registration
from bsr_cli.core.trace import Trace, TraceRequest, build_trace
from bsr_cli.core.trace_sim import plan_trace, replay
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import builtin_registration

MB = 1_000_000
# 4,000 CPU seconds per GB: a 1 MB restore needs 4 CPU seconds, where its bytes take 1 s at 1 MB/s.
CPU_HEAVY = 4000.0


def _host(cores: float = 1.0, job: float | None = None, per_gb: float = CPU_HEAVY, **kw: object) -> HostModel:
    return HostModel(
        cores=cores, job_cores=cores if job is None else job, restore_cpu_s=0.0, restore_cpu_s_per_gb=per_gb, **kw
    )  # type: ignore[arg-type]


def _bounds(r, arrivals) -> list[RestoreBound]:  # type: ignore[no-untyped-def]
    return [
        restore_bound(0.0, s - a, b, c) for a, s, b, c in zip(arrivals, r.starts, r.bandwidth_s, r.cpu_s, strict=True)
    ]


# -- hand-computed -----------------------------------------------------------------------------------------------


def test_two_cpu_bound_restores_share_the_cores() -> None:
    # Two 1 MB restores at t=0 on one core: each gets half a core, so 4 CPU s take 8 s; their bytes, at half the
    # bandwidth each, would take 2 s. Both end at 8 s, CPU-bound the whole time.
    arrivals, sizes = [0.0, 0.0], [MB, MB]
    r = replay_on_host(arrivals, sizes, [0, 0], MB, _host())
    assert r.finishes == pytest.approx((8.0, 8.0))
    assert r.cpu_s == pytest.approx((8.0, 8.0)) and r.bandwidth_s == (0.0, 0.0)
    assert _bounds(r, arrivals) == [RestoreBound.CPU, RestoreBound.CPU]
    # The negative control: the bandwidth-only model sees only the bytes.
    assert replay(arrivals, sizes, [0, 0], MB).finishes == pytest.approx((2.0, 2.0))


def test_a_restore_uses_at_most_job_cores() -> None:
    # Four cores, but one restore keeps at most half a core busy: 4 CPU s take 8 s alone.
    r = replay_on_host([0.0], [MB], [0], MB, _host(cores=4.0, job=0.5))
    assert r.finishes == pytest.approx((8.0,))
    # With job_cores = cores it takes 1 s: its CPU (4 CPU s on 4 cores) and its bytes (1 s) tie; bandwidth wins ties.
    r = replay_on_host([0.0], [MB], [0], MB, _host(cores=4.0))
    assert r.finishes == pytest.approx((1.0,))
    assert _bounds(r, [0.0]) == [RestoreBound.BANDWIDTH]


def test_restores_queued_for_b_are_budget_bound() -> None:
    # B holds one restore at a time: each runs alone on one core (4 s), the next waits for it.
    arrivals, sizes, holds = [0.0, 0.0, 0.0], [MB] * 3, [MB] * 3
    r = replay_on_host(arrivals, sizes, holds, MB, _host(), budget=MB)
    assert r.starts == pytest.approx((0.0, 4.0, 8.0))
    assert r.finishes == pytest.approx((4.0, 8.0, 12.0))
    assert r.peak_bytes == MB and r.peak_queued == 2
    # r2 waited 4 s and ran 4 s (a tie: CPU); r3 waited 8 s, longer than it ran.
    assert _bounds(r, arrivals) == [RestoreBound.CPU, RestoreBound.CPU, RestoreBound.BUDGET]
    # The negative control: by bandwidth alone each takes 1 s, so the waits are 1 s and 2 s.
    assert replay(arrivals, sizes, holds, MB, MB).finishes == pytest.approx((1.0, 2.0, 3.0))


def test_restores_queued_for_a_slot_wait_first_come_first_served() -> None:
    # One slot, two cores: r1 alone gets both (2 s), r2 waits for the slot, then 2 s. Without slots they share the
    # two cores and both end at 4 s. r2's wait for the slot counts as CPU (what bound the restore served meanwhile).
    host = _host(cores=2.0)
    one_slot = replay_on_host([0.0, 0.0], [MB, MB], [0, 0], MB, HostModel(2.0, 2.0, 0.0, CPU_HEAVY, 1))
    assert one_slot.finishes == pytest.approx((2.0, 4.0))
    assert one_slot.starts == (0.0, 0.0)  # both admitted under (no) B at once
    assert one_slot.cpu_s == pytest.approx((2.0, 4.0))
    assert replay_on_host([0.0, 0.0], [MB, MB], [0, 0], MB, host).finishes == pytest.approx((4.0, 4.0))


def test_a_fixed_cpu_cost_per_restore() -> None:
    # 0.5 CPU s per restore and nothing per byte, on half a core: 1 s each, whatever its size.
    host = HostModel(cores=0.5, job_cores=0.5, restore_cpu_s=0.5, restore_cpu_s_per_gb=0.0)
    r = replay_on_host([0.0, 10.0], [1, 10 * MB], [0, 0], 100 * MB, host)
    assert [f - a for f, a in zip(r.finishes, (0.0, 10.0), strict=True)] == pytest.approx([1.0, 1.0])
    assert host.restore_cpu(10 * MB) == 0.5


def test_a_bandwidth_bound_restore_is_the_bandwidth_only_model() -> None:
    # CPU to spare (8 cores, 0.4 CPU s per MB): the bytes bind, and the figures are the bandwidth-only model's.
    arrivals, sizes = [0.0, 0.5, 0.5], [MB, 2 * MB, MB]
    r = replay_on_host(arrivals, sizes, [0, 0, 0], MB, _host(cores=8.0, per_gb=400.0))
    assert r.finishes == pytest.approx(replay(arrivals, sizes, [0, 0, 0], MB).finishes)
    assert set(_bounds(r, arrivals)) == {RestoreBound.BANDWIDTH}


# -- against the bandwidth-only model ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_host_whose_restores_cost_no_cpu_replays_as_the_bandwidth_only_model(seed: int) -> None:
    rng = random.Random(seed)
    arrivals = sorted(rng.uniform(0, 20) for _ in range(200))
    sizes = [rng.randint(1, 40) * MB for _ in arrivals]
    holds = [min(s, 8 * MB) for s in sizes]
    free = HostModel(cores=1.0, job_cores=1.0, restore_cpu_s=0.0, restore_cpu_s_per_gb=0.0)
    for budget in (None, 8 * MB, 24 * MB):
        a, b = (
            replay_on_host(arrivals, sizes, holds, 10 * MB, free, budget),
            replay(arrivals, sizes, holds, 10 * MB, budget),
        )
        assert a.finishes == pytest.approx(b.finishes) and a.starts == pytest.approx(b.starts)
        assert (a.peak_bytes, a.peak_queued) == (b.peak_bytes, b.peak_queued)
    # The negative control: a CPU cost makes them differ.
    costly = replay_on_host(arrivals, sizes, holds, 10 * MB, _host(per_gb=200.0))
    assert costly.finishes != pytest.approx(replay(arrivals, sizes, holds, 10 * MB).finishes)


def _trace(*rows: tuple[int, int, list[int]]) -> Trace:
    return build_trace(
        (f"line {n}", TraceRequest(t, length, 1, tuple(ids))) for n, (t, length, ids) in enumerate(rows, 1)
    )


def test_a_trace_plan_on_a_host_says_what_bound_its_restores() -> None:
    demo: Registration = builtin_registration("demo")  # 256-token chunks, 1 MiB per chunk per rank
    c = demo.bytes_per_chunk
    # Two requests at t=0 restoring 4 and 6 chunks, at one chunk per second of bandwidth, on a host where a chunk
    # needs 2 CPU s on one core: CPU-bound, sharing the core: r1's 8 CPU s end at 16 s, then r2's last 4 at 20 s.
    t = _trace((0, 1024, [1, 2]), (0, 1536, [1, 2, 3]), (0, 2048, [1, 2, 3, 4]))
    host = HostModel(cores=1.0, job_cores=1.0, restore_cpu_s=0.0, restore_cpu_s_per_gb=2.0 * 1e9 / c)
    p = plan_trace(t, demo, 2, bandwidth=c, budgets_rws=(8,), host=host)
    assert p.whole_plan.latencies == pytest.approx((16.0, 20.0))
    assert p.whole_plan.bound_by == {RestoreBound.CPU: 2}
    wire = p.to_wire()
    assert wire["host"]["restore_cpu_s_per_gb"] == pytest.approx(2.0 * 1e9 / c)
    assert wire["whole_plan"]["bound_by"] == {"cpu": 2}
    # Without a host (the negative control): the bytes alone, sharing the bandwidth: r1's 4 chunks by 8 s, r2's last
    # 2 alone by 10 s; and no host or bound keys (its JSON as before).
    plain = plan_trace(t, demo, 2, bandwidth=c, budgets_rws=(8,))
    assert plain.whole_plan.latencies == pytest.approx((8.0, 10.0))
    assert "host" not in plain.to_wire() and "bound_by" not in plain.to_wire()["whole_plan"]


def test_a_requests_own_work_shares_the_cores_with_a_restore() -> None:
    # One core; a 1 MB restore needs 4 CPU s. A request restoring nothing arrives with it, with 2 CPU s of its own
    # work: each gets half the core, so the work ends at 4 s and the restore, 2 CPU s left then, at 6 s.
    work = OwnWork(after=(0.0,), alone=((0.0, 2.0),))
    r = replay_on_host([0.0], [MB], [0], MB, _host(), work=work)
    assert r.finishes == pytest.approx((6.0,))
    assert _bounds(r, [0.0]) == [RestoreBound.CPU]
    # The negative control: without the work the restore has the core to itself.
    assert replay_on_host([0.0], [MB], [0], MB, _host()).finishes == pytest.approx((4.0,))


def test_a_requests_own_work_starts_when_its_restore_ends() -> None:
    # Restore 0 (4 CPU s) ends at 4 s and its request then computes for 2 CPU s; restore 1 arrives then and shares
    # the core with that work until 8 s (2 CPU s each at half a core), then runs alone: its last 2 CPU s by 10 s.
    r = replay_on_host([0.0, 4.0], [MB, MB], [0, 0], MB, _host(), work=OwnWork(after=(2.0, 0.0)))
    assert r.finishes == pytest.approx((4.0, 10.0))
    # The work after the last restore delays nothing (control: the same replay with it moved there).
    r = replay_on_host([0.0, 4.0], [MB, MB], [0, 0], MB, _host(), work=OwnWork(after=(0.0, 2.0)))
    assert r.finishes == pytest.approx((4.0, 8.0))


def test_a_trace_plan_replays_the_requests_own_work() -> None:
    demo: Registration = builtin_registration("demo")  # 256-token chunks, 1 MiB per chunk per rank
    c = demo.bytes_per_chunk
    # As above (a chunk restored needs 2 CPU s on one core), and a chunk computed 1 CPU s: the first request restores
    # nothing and computes its 4 chunks from t=0, beside r1 (8 CPU s) and r2 (12 CPU s): a third of the core each
    # until the work's 4 CPU s end at 12 s; then r1 and r2 at half: r1 ends at 20 s and its request computes its 2
    # chunks beside r2 until 24 s; r2's last 2 CPU s alone, by 26 s.
    t = _trace((0, 1024, [1, 2]), (0, 1536, [1, 2, 3]), (0, 2048, [1, 2, 3, 4]))
    cpu = {"restore_cpu_s_per_gb": 2.0 * 1e9 / c}
    host = HostModel(cores=1.0, job_cores=1.0, restore_cpu_s=0.0, compute_cpu_s_per_gb=1.0 * 1e9 / c, **cpu)
    p = plan_trace(t, demo, 2, bandwidth=c, budgets_rws=(8,), host=host)
    assert p.whole_plan.latencies == pytest.approx((20.0, 26.0))
    # The negative control: the same host with requests that compute for free gives the restores alone.
    free = plan_trace(t, demo, 2, bandwidth=c, budgets_rws=(8,), host=HostModel(1.0, 1.0, 0.0, **cpu))
    assert free.whole_plan.latencies == pytest.approx((16.0, 20.0))


# -- the pieces a calibration and the replay use ----------------------------------------------------------------


def test_restore_bound_is_the_longest_part_ties_in_a_fixed_order() -> None:
    assert restore_bound(0.0, 0.0, 0.0, 0.0) is RestoreBound.BANDWIDTH
    assert restore_bound(0.1, 0.2, 0.3, 0.4) is RestoreBound.CPU
    assert restore_bound(0.5, 0.2, 0.3, 0.4) is RestoreBound.DESTINATION_KV
    assert restore_bound(0.0, 0.4, 0.1, 0.4) is RestoreBound.CPU  # a tie: CPU before B
    assert restore_bound(0.4, 0.4, 0.0, 0.0) is RestoreBound.BUDGET  # a tie: B before destination KV


def test_split_service_gives_the_bytes_their_time_and_the_rest_to_cpu() -> None:
    assert split_service(1.0, MB, 4 * MB) == pytest.approx((0.25, 0.75))
    assert split_service(0.1, MB, MB) == pytest.approx((0.1, 0.0))  # never more than the service itself
    assert split_service(0.5, 0, MB) == (0.0, 0.5)


def test_fit_stretch_finds_the_factor_or_an_end_of_its_range() -> None:
    assert fit_stretch(lambda m: 0.1 * m, 0.35) == pytest.approx(3.5, rel=1e-6)
    assert fit_stretch(lambda m: 0.1 * m, 1e-9) == pytest.approx(0.01)
    assert fit_stretch(lambda m: 0.1 * m, 1e9) == pytest.approx(1000.0)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"cores": 0.0}, "cores must be positive"),
        ({"cores": math.nan}, "cores must be a finite number"),
        ({"job_cores": True}, "job_cores must be a finite number"),
        ({"restore_cpu_s": -1.0}, "restore_cpu_s must be at least 0"),
        ({"restore_slots": 0}, "restore_slots must be a whole number"),
    ],
)
def test_a_host_model_that_cannot_run_is_refused(change: dict[str, object], needle: str) -> None:
    fields = {"cores": 1.0, "job_cores": 1.0, "restore_cpu_s": 0.0, "restore_cpu_s_per_gb": 1.0} | change
    with pytest.raises(InvalidInput, match=needle):
        replay_on_host([0.0], [MB], [0], MB, HostModel(**fields))  # type: ignore[arg-type]


def test_a_calibration_round_trips_through_its_json() -> None:
    cal = HostCalibration(
        measured_at="2025-01-01T00:00:00.000Z",
        registration="reg-0123456789abcdef",
        chunk_size=64,
        bytes_per_chunk=65536,
        tp_size=2,
        w=8,
        bandwidth=2.5e7,
        host=HostModel(0.45, 0.8, 0.012, 70.0, 2),
        burst_stretch=3.2,
        host_state=HostState(2, (11.0, 10.5, 9.8), 9.5, 8.0, 0.45),
        samples=(),
    )
    wire = cal.to_wire()
    assert list(wire)[:2] == ["kind", "measured_at"] and wire["kind"] == "bsr.calibration" and wire["W"] == 8
    assert HostCalibration.from_wire(wire) == cal


def test_cpu_load_is_what_the_trace_needs_of_the_cores_available() -> None:
    host = HostModel(cores=0.5, job_cores=0.5, restore_cpu_s=0.1, restore_cpu_s_per_gb=1.0, compute_cpu_s_per_gb=2.0)
    # Restores of 1 GB and of 0.5 GB (0.1 CPU s each and 1 per GB) and 1 GB computed (2 CPU s), over 10 s on half a
    # core: (1.1 + 0.6 + 2.0) / 5 = 0.74.
    assert cpu_load(host, [1_000_000_000, 500_000_000], 1_000_000_000, 10.0) == pytest.approx(0.74)
    assert cpu_load(host, [], 0, 0.0) is None


def test_the_cores_an_engine_got_are_read_where_it_had_more_work_than_cores() -> None:
    # Four quarter-second intervals: in two the engine's threads waited for a CPU (1 and 0.5 thread-seconds per
    # second: contended) and got 0.3 and 0.5 cores; in the other two it got all it asked for (0.1 core, no wait).
    spans = [
        CpuSpan(0.25, 0.075, 0.25),
        CpuSpan(0.25, 0.025, 0.0),
        CpuSpan(0.25, 0.125, 0.125),
        CpuSpan(0.25, 0.025, 0.01),
    ]
    assert contended_cores(spans) == pytest.approx(0.4)
    # The negative control: the engine's CPU over the whole run (what an engine that was not always short of cores
    # used, not what the host had to give it) reads lower.
    assert sum(s.ran_s for s in spans) / sum(s.seconds for s in spans) == pytest.approx(0.25)
    # Never short of cores, or no time at all: unknown, not a figure.
    assert contended_cores(spans[1::2]) is None
    assert contended_cores([CpuSpan(0.0, 0.0, 0.0)]) is None and contended_cores([]) is None
