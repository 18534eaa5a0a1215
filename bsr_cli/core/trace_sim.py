"""Capacity planning from a request trace: L1 over time and restore latency, whole-plan against BSR budgets.

The model (per TP rank; every rank holds its equal share, so one rank stands for all):

* Arrivals are the trace's timestamps divided by the speed-up. A request whose hit (bsr_cli.core.trace) is at
  least one chunk starts a restore of its N hit chunks; the others restore nothing and are left out of the latency
  figures.
* Transfer is the only cost. A restore moves N · Σc_i bytes per rank; the per-rank bandwidth is shared equally by
  the restores transferring at that moment (processor sharing). Install, checksum, probe and the tier's per-call
  latency take no time; compute (prefill, decode) is not modelled and never competes for anything.
* Whole-plan path (W = 0): a restore starts at its arrival and holds its whole hit, N · Σc_i + aux, in L1 from its
  start until its last byte arrives. L1 is unbounded: its peak is the capacity the path needs never to fail.
* BSR with budget B = k · RWS(W): a restore holds at most what one restore holds at W in the runtime
  (bsr_cli/runtime/restore.py): the window being installed plus up to two windows fetched ahead, as far as B
  allows, i.e. ``min(N, a · W)`` chunks + aux with ``a = min(3, (B - aux) // (W · Σc_i))``. It is admitted, in
  arrival order (FIFO: a request never overtakes an earlier one), when that reservation fits under B beside the
  admitted ones, and keeps it until its last byte arrives (the runtime frees its last windows a little earlier:
  the model is conservative by at most a windows per restore).
* Restore latency = queue wait (arrival to admission) + transfer. Percentiles are nearest-rank.
* With a host model (bsr_cli.core.host_model: the CPU a restore needs, the cores bsr gets, the restore path's
  slots) a restore's service is the slower of its bytes at its bandwidth share and its CPU at its share of the
  cores, and the replay says which of bandwidth, CPU and B bound each restore. The requests' own work (computing
  and storing the chunks they do not restore) then runs beside the restores on the same cores: a request's from
  the end of its restore, or from its arrival when it restores nothing.

Event-driven: arrivals in order and completions from a heap keyed by the virtual (per-restore) byte clock of
processor sharing, so a replay costs O(n log n) for n restores.

Pure: no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from bsr_cli.core import accounting, wire
from bsr_cli.core.evidence import RestoreBound
from bsr_cli.core.host_model import (
    GB,
    HostModel,
    HostReplay,
    OwnWork,
    cpu_load,
    nearest_rank,
    replay_on_host,
    restore_bound,
)
from bsr_cli.core.registration import Registration
from bsr_cli.core.trace import Trace, hit_chunks, prefix_hits, restored_tokens
from bsr_cli.errors import InvalidInput

DEFAULT_BUDGETS_RWS: tuple[int, ...] = (1, 2, 4, 8)
# Windows one restore holds at most in the runtime: the one installing plus restore.py's two fetched ahead.
RUNTIME_WINDOWS_HELD = 3


class RestorePath(StrEnum):
    WHOLE_PLAN = "whole_plan"
    BSR = "bsr"


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float
    max: float

    to_wire = wire.writer()


def percentiles(values: Sequence[float]) -> Percentiles:
    xs = sorted(values)
    return Percentiles(nearest_rank(xs, 50), nearest_rank(xs, 95), nearest_rank(xs, 99), xs[-1] if xs else 0.0)


@dataclass(frozen=True)
class Replay:
    """One replay of the restores through the transfer model: per restore its admission and completion time, and
    L1 held over time as a step function ((seconds, bytes) after each change)."""

    starts: tuple[float, ...]
    finishes: tuple[float, ...]
    peak_bytes: int
    peak_in_flight: int
    peak_queued: int
    l1_series: tuple[tuple[float, int], ...]


def replay(
    arrivals: Sequence[float],
    sizes: Sequence[int],
    holds: Sequence[int],
    bandwidth: float,
    budget: int | None = None,
) -> Replay:
    """Replay restores arriving at ``arrivals`` (seconds, non-decreasing), each transferring ``sizes[i]`` bytes and
    holding ``holds[i]`` bytes of L1 while admitted, with ``bandwidth`` bytes/s shared equally among the admitted
    ones. ``budget`` (bytes) admits them FIFO while their holds fit; None admits every one at its arrival."""
    n = len(arrivals)
    if budget is not None and any(h > budget for h in holds):
        raise InvalidInput(
            "a restore's hold exceeds the budget: it could never be admitted",
            hint="raise the budget to at least RWS(W), or lower W",
        )
    starts = [0.0] * n
    finishes = [0.0] * n
    queue: deque[int] = deque()
    running: list[tuple[float, int]] = []  # (virtual finish, request index)
    now = 0.0
    virtual = 0.0  # bytes each admitted restore has received since time 0 (processor sharing's clock)
    held = peak = 0
    peak_in_flight = peak_queued = 0
    series: list[tuple[float, int]] = [(arrivals[0], 0)] if n else []
    nxt = 0

    def record() -> None:
        if series and series[-1][0] == now:
            series[-1] = (now, held)
        else:
            series.append((now, held))

    def admit_from_queue() -> None:
        nonlocal held, peak, peak_in_flight, peak_queued
        while queue and (budget is None or held + holds[queue[0]] <= budget):
            i = queue.popleft()
            starts[i] = now
            heapq.heappush(running, (virtual + sizes[i], i))
            held += holds[i]
            peak = max(peak, held)
            peak_in_flight = max(peak_in_flight, len(running))
        peak_queued = max(peak_queued, len(queue))  # those still waiting once admission has run
        record()

    while nxt < n or running:
        t_done = math.inf
        if running:
            t_done = now + max(0.0, running[0][0] - virtual) * len(running) / bandwidth
        t_arrive = arrivals[nxt] if nxt < n else math.inf
        t = min(t_done, t_arrive)
        if running:
            virtual += (t - now) * bandwidth / len(running)
        now = t
        if t_done <= t_arrive:  # a completion first: it frees room for an arrival at the same instant
            v_fin, i = heapq.heappop(running)
            virtual = max(virtual, v_fin)  # no float drift past a finish
            finishes[i] = now
            held -= holds[i]
        else:
            queue.append(nxt)
            nxt += 1
        admit_from_queue()
    return Replay(tuple(starts), tuple(finishes), peak, peak_in_flight, peak_queued, tuple(series))


@dataclass(frozen=True)
class PathRun:
    """What one restore path did over the trace."""

    path: RestorePath
    budget_rws: int | None  # B as a multiple of RWS(W); None on the whole-plan path
    budget_bytes: int | None
    windows_held: int | None  # a: windows one restore holds at most under this B
    peak_bytes: int = field(metadata=wire.meta(name="peak_bytes_per_rank"))
    latency: Percentiles = field(metadata=wire.meta(name="latency_s"))
    wait: Percentiles = field(metadata=wire.meta(name="wait_s"))
    peak_in_flight: int
    peak_queued: int
    meets_p99: bool | None  # against the target, when one was given
    # With a host model: how many restores each resource bound.
    bound_by: dict[RestoreBound, int] | None = field(default=None, metadata=wire.meta(omit_none=True))
    # For the plots only, not on the wire:
    l1_series: tuple[tuple[float, int], ...] = field(default=(), metadata=wire.meta(skip=True))
    latencies: tuple[float, ...] = field(default=(), metadata=wire.meta(skip=True))  # sorted, for a CDF

    @property
    def label(self) -> str:
        return "whole plan (W=0)" if self.path is RestorePath.WHOLE_PLAN else f"B = {self.budget_rws}·RWS"

    to_wire = wire.writer()


@dataclass(frozen=True)
class BudgetChoice:
    """A budget, as a multiple of RWS(W) and in bytes."""

    budget_rws: int | None
    budget_bytes: int | None

    to_wire = wire.writer()


@dataclass(frozen=True)
class LargestHit:
    request: int  # index in the trace
    tokens: int
    chunks: int
    bytes_per_rank: int

    to_wire = wire.writer()


@dataclass(frozen=True)
class TracePlan:
    source: str = field(metadata=wire.meta(name="trace"))
    registration: str
    model: str
    chunk_size: int
    bytes_per_chunk: int
    w: int = field(metadata=wire.meta(name="W"))
    rws_bytes: int
    bandwidth: float = field(metadata=wire.meta(name="bandwidth_bytes_per_s"))
    host: HostModel | None = field(metadata=wire.meta(omit_none=True))
    # With a host model: the share of the cores available to bsr the trace's restores and requests need on average.
    cpu_load: float | None = field(metadata=wire.meta(omit_none=True))
    speedup: float
    store_capacity: int | None = field(metadata=wire.meta(name="store_capacity_blocks"))
    requests: int
    span_s: float  # arrival span after the speed-up
    restores: int  # requests with at least one chunk to restore
    input_tokens: int
    hit_tokens: int  # tokens restored (whole chunks of the hit)
    evicted_blocks: int
    largest: LargestHit | None = field(metadata=wire.meta(name="largest_hit"))
    whole_plan: PathRun
    bsr: tuple[PathRun, ...]
    p99_target_s: float | None

    @property
    def smallest_meeting(self) -> PathRun | None:
        """The smallest budget whose p99 restore latency meets the target (None: no target, or none meets it)."""
        return next((r for r in self.bsr if r.meets_p99), None)

    @property
    def kind(self) -> str:
        return "bsr.plan.trace"

    @property
    def smallest_budget_meeting_p99(self) -> BudgetChoice | None:
        best = self.smallest_meeting
        return None if best is None else BudgetChoice(best.budget_rws, best.budget_bytes)

    # Its kind first, then the fields, then the budget that meets the target.
    to_wire = wire.writer(
        order=(
            "kind",
            "source",
            "registration",
            "model",
            "chunk_size",
            "bytes_per_chunk",
            "w",
            "rws_bytes",
            "bandwidth",
            "host",
            "cpu_load",
            "speedup",
            "store_capacity",
            "requests",
            "span_s",
            "restores",
            "input_tokens",
            "hit_tokens",
            "evicted_blocks",
            "largest",
            "whole_plan",
            "bsr",
            "p99_target_s",
            "smallest_budget_meeting_p99",
        )
    )


def windows_held(reg: Registration, w: int, budget: int) -> int:
    """Windows one restore holds at most under ``budget``: the runtime's three (one installing, two fetched
    ahead), fewer when B has room for fewer whole windows."""
    return max(1, min(RUNTIME_WINDOWS_HELD, (budget - reg.aux_bytes) // (w * reg.bytes_per_chunk)))


@dataclass(frozen=True)
class _Restores:
    """The trace's restores as the replays take them: per restoring request its arrival, bytes and chunks; and
    every request's chunks to compute, as (arrival, chunks) of those that restore nothing and per restore."""

    arrivals: tuple[float, ...]
    sizes: tuple[int, ...]
    chunks: tuple[int, ...]
    computed_after: tuple[int, ...]
    computed_alone: tuple[tuple[float, int], ...]

    def own_work(self, host: HostModel, bytes_per_chunk: int) -> OwnWork:
        """The requests' own work on ``host``, in CPU seconds."""
        per_chunk = host.compute_cpu_s_per_gb * bytes_per_chunk / GB
        return OwnWork(
            tuple(c * per_chunk for c in self.computed_after),
            tuple((a, c * per_chunk) for a, c in self.computed_alone),
        )


def _run(
    path: RestorePath,
    restores: _Restores,
    holds: Sequence[int],
    bandwidth: float,
    bytes_per_chunk: int,
    host: HostModel | None,
    budget: int | None,
    budget_rws: int | None,
    held: int | None,
    p99_target: float | None,
) -> PathRun:
    arrivals = restores.arrivals
    bound_by = None
    r: Replay | HostReplay
    if host is None:
        r = replay(arrivals, restores.sizes, holds, bandwidth, budget)
    else:
        work = restores.own_work(host, bytes_per_chunk)
        r = replay_on_host(arrivals, restores.sizes, holds, bandwidth, host, budget, work)
        bounds = [
            restore_bound(0.0, s - a, b, c)
            for a, s, b, c in zip(arrivals, r.starts, r.bandwidth_s, r.cpu_s, strict=True)
        ]
        bound_by = {b: bounds.count(b) for b in RestoreBound if b in bounds}
    latencies = sorted(f - a for f, a in zip(r.finishes, arrivals, strict=True))
    lat = percentiles(latencies)
    return PathRun(
        path=path,
        budget_rws=budget_rws,
        budget_bytes=budget,
        windows_held=held,
        peak_bytes=r.peak_bytes,
        latency=lat,
        wait=percentiles([s - a for s, a in zip(r.starts, arrivals, strict=True)]),
        peak_in_flight=r.peak_in_flight,
        peak_queued=r.peak_queued,
        meets_p99=None if p99_target is None else lat.p99 <= p99_target,
        bound_by=bound_by,
        l1_series=r.l1_series,
        latencies=tuple(latencies),
    )


def _restores_of(trace: Trace, reg: Registration, chunks: Sequence[int], speedup: float) -> _Restores:
    """The restores of ``trace`` (``chunks`` hit per request): their arrivals after the speed-up, bytes, chunks."""
    t0 = trace.requests[0].arrival_ms
    arrivals = [(r.arrival_ms - t0) / 1000 / speedup for r in trace.requests]
    computed = _computed(trace, reg, chunks)
    restoring = [i for i, c in enumerate(chunks) if c > 0]
    return _Restores(
        tuple(arrivals[i] for i in restoring),
        tuple(chunks[i] * reg.bytes_per_chunk for i in restoring),
        tuple(chunks[i] for i in restoring),
        tuple(computed[i] for i in restoring),
        tuple((arrivals[i], computed[i]) for i, c in enumerate(chunks) if c == 0),
    )


def _computed(trace: Trace, reg: Registration, chunks: Sequence[int]) -> list[int]:
    """Per request, the chunks it computes and stores: those of its prompt it does not restore."""
    return [max(0, -(-r.input_length // reg.chunk_size) - c) for r, c in zip(trace.requests, chunks, strict=True)]


def _cpu_load(
    trace: Trace, reg: Registration, chunks: Sequence[int], restores: _Restores, host: HostModel | None, speedup: float
) -> float | None:
    """The share of the host's cores for bsr the trace needs (``host_model.cpu_load``): its restores, and every
    request computing and storing the chunks it does not restore."""
    if host is None:
        return None
    computed = sum(_computed(trace, reg, chunks))
    load = cpu_load(host, restores.sizes, computed * reg.bytes_per_chunk, trace.span_ms / 1000 / speedup)
    return None if load is None else round(load, 4)


def check_rate(bandwidth: float, speedup: float) -> None:
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise InvalidInput(
            f"the bandwidth must be a positive, finite rate, got {bandwidth!r}", hint="e.g. --bandwidth 10.31GB/s"
        )
    if not (math.isfinite(speedup) and speedup > 0):
        raise InvalidInput(f"the speed-up must be a positive, finite factor, got {speedup!r}", hint="e.g. --speedup 10")


def plan_trace(
    trace: Trace,
    reg: Registration,
    w: int,
    *,
    bandwidth: float,
    speedup: float = 1.0,
    budgets_rws: Sequence[int] = DEFAULT_BUDGETS_RWS,
    store_capacity: int | None = None,
    p99_target_s: float | None = None,
    host: HostModel | None = None,
) -> TracePlan:
    """Simulate ``trace`` on the whole-plan path and under each budget ``k · RWS(W)`` (see the module's model), on
    ``host`` when given (bsr_cli.core.host_model)."""
    accounting.check_window(w)
    if w == 0:
        raise InvalidInput(
            "a trace plan compares BSR at W ≥ 1 with the whole-plan path; W=0 leaves nothing to compare",
            hint="give --W 1 or more, e.g. --W 32",
        )
    check_rate(bandwidth, speedup)
    if not budgets_rws or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in budgets_rws):
        raise InvalidInput(
            "budgets are positive whole multiples of RWS(W), e.g. 1,2,4,8", hint="e.g. --budgets 1,2,4,8"
        )
    if p99_target_s is not None and not (math.isfinite(p99_target_s) and p99_target_s > 0):
        raise InvalidInput(
            f"the p99 target must be a positive number of seconds, got {p99_target_s!r}", hint="e.g. --p99 0.8"
        )
    if host is not None:
        host.check()
    bpc, aux = reg.bytes_per_chunk, reg.aux_bytes
    hits = prefix_hits(trace, store_capacity)
    per_block = trace.block_tokens
    chunks = [hit_chunks(r, b, reg.chunk_size, per_block) for r, b in zip(trace.requests, hits.blocks, strict=True)]
    restoring = [i for i, c in enumerate(chunks) if c > 0]
    restores = _restores_of(trace, reg, chunks, speedup)
    rws = accounting.rws_bytes(reg, w)

    whole_holds = [s + aux for s in restores.sizes]
    whole = _run(RestorePath.WHOLE_PLAN, restores, whole_holds, bandwidth, bpc, host, None, None, None, p99_target_s)
    runs = []
    for k in sorted(set(budgets_rws)):
        budget = k * rws
        a = windows_held(reg, w, budget)
        holds = [min(c, a * w) * bpc + aux for c in restores.chunks]
        runs.append(_run(RestorePath.BSR, restores, holds, bandwidth, bpc, host, budget, k, a, p99_target_s))

    largest = None
    if restoring:
        i = max(restoring, key=lambda j: (chunks[j], -j))
        req = trace.requests[i]
        largest = LargestHit(i, restored_tokens(req, chunks[i], reg.chunk_size), chunks[i], chunks[i] * bpc + aux)
    return TracePlan(
        source=trace.source,
        registration=reg.identity,
        model=reg.model,
        chunk_size=reg.chunk_size,
        bytes_per_chunk=bpc,
        w=w,
        rws_bytes=rws,
        bandwidth=bandwidth,
        host=host,
        cpu_load=_cpu_load(trace, reg, chunks, restores, host, speedup),
        speedup=speedup,
        store_capacity=store_capacity,
        requests=len(trace),
        span_s=trace.span_ms / 1000 / speedup,
        restores=len(restoring),
        input_tokens=trace.input_tokens,
        hit_tokens=sum(restored_tokens(trace.requests[i], chunks[i], reg.chunk_size) for i in restoring),
        evicted_blocks=hits.evicted,
        largest=largest,
        whole_plan=whole,
        bsr=tuple(runs),
        p99_target_s=p99_target_s,
    )
