"""The host beneath a trace plan: the CPU restores need and the cores bsr gets, beside the bandwidth.

The bandwidth-only model (bsr_cli.core.trace_sim) counts bytes over one bandwidth. On a host whose cores are busy,
a restore takes longer than its bytes do: its CPU work (fetch calls, checksums, installs, the coordinator's calls
to each rank) runs on the cores left to bsr and waits for them beside everything else the engine does. This module
adds that to the replay; the host's figures are an input (``HostModel``, measured by a calibration:
bsr_cli.bench.calibration, or given), never read here.

The model (bytes per rank; CPU for the whole host):

* A restore is admitted under B in arrival order as in the bandwidth-only model and holds its hold until its last
  byte. It is then served when one of ``restore_slots`` is free (the restore path's fetch threads, shared by every
  restore: first come, first served; every admitted restore at once when None).
* A restore moves ``s`` bytes and needs ``restore_cpu_s + restore_cpu_s_per_gb · s`` CPU seconds: what it takes
  alone (a calibration measures restores one at a time); what other work takes from it is the sharing below.
* The bandwidth is shared equally by the restores being served, and so are the cores available to bsr (``cores``:
  the host's, less what the work beside bsr takes), each restore getting at most ``job_cores`` (what one restore's
  processes and threads keep busy). A restore advances at the slower of the two: ``min(bandwidth share / s,
  CPU share / cpu)`` of its whole per second, bound at each moment by the bandwidth or by the CPU. A share a
  restore leaves unused is not handed to the others: the model errs long.
* The requests' own work (``OwnWork``: computing and storing what they did not restore, in CPU seconds) runs beside
  the restores and takes its equal share of the same cores, each piece at most ``job_cores``: a request's from the
  end of its restore, or from its arrival when it restores nothing. A restore's CPU figures are what it costs alone;
  what the work beside it takes from it is this sharing, so a restore that arrives when little else runs takes
  about its cost alone, and one in a burst of requests waits for their work.
* Its latency runs from its arrival to its last byte: its waits for B and for a slot, and its service. Its bound
  is the longest part (``restore_bound``): waiting for B is ``budget``; waiting for a slot counts for what bounds the
  restores being served meanwhile.

With no CPU cost, no slots and no own work the replay is exactly the bandwidth-only model's. The model has no
destination KV: `bsr bench trace` reports the engine's waits for it from its events.

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from bsr_cli.core import wire
from bsr_cli.core.evidence import RestoreBound
from bsr_cli.errors import InvalidInput

GB = 1e9
# Ties between the parts of a restore's latency go to the first of these (a restore that took no time at all is
# bandwidth-bound).
_BOUND_ORDER = (RestoreBound.BANDWIDTH, RestoreBound.CPU, RestoreBound.BUDGET, RestoreBound.DESTINATION_KV)
# A restore is done when less than this fraction of it is left (float drift at the instant it is due).
_DONE = 1e-12


# What to do about a host model's figure that cannot be: they come from a calibration or the flags.
_HOST_HINT = "give --cores and --cpu-per-gb as positive numbers, or calibrate again (`bsr bench trace`)"


def _number(value: object, name: str, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(f"the host's {name} must be a finite number, got {value!r}", hint=_HOST_HINT)
    if value < 0 or (positive and value == 0):
        at_least = "positive" if positive else "at least 0"
        raise InvalidInput(f"the host's {name} must be {at_least}, got {value!r}", hint=_HOST_HINT)


@dataclass(frozen=True)
class HostModel:
    """What the host gives bsr's restores beside the bandwidth, as a calibration measured it (or as given)."""

    cores: float  # cores available to bsr: the host's, less what the work beside bsr takes
    job_cores: float  # the most cores one restore keeps busy
    restore_cpu_s: float  # CPU seconds of one restore whatever its size (its calls to each rank, each window's)
    restore_cpu_s_per_gb: float  # CPU seconds per GB a restore moves per rank (fetch, verify, install)
    restore_slots: int | None = wire.field(omit_none=True, default=None)  # restores served at once; None: all
    # CPU seconds per GB a request computes and stores per rank (its own work beside its restore: prefill, storing
    # what the tiers lack): replayed beside the restores (``OwnWork``), and what ``cpu_load`` counts.
    compute_cpu_s_per_gb: float = 0.0

    to_wire = wire.writer()
    from_wire = wire.reader()

    @classmethod
    def of_cores(cls, cores: float, cpu_s_per_gb: float) -> HostModel:
        """The plain model: restores share ``cores`` (each may use them all), ``cpu_s_per_gb`` their only cost."""
        return cls(cores=cores, job_cores=cores, restore_cpu_s=0.0, restore_cpu_s_per_gb=cpu_s_per_gb)

    def check(self) -> None:
        """InvalidInput naming the first figure a replay cannot run with."""
        _number(self.cores, "cores", positive=True)
        _number(self.job_cores, "job_cores", positive=True)
        _number(self.restore_cpu_s, "restore_cpu_s", positive=False)
        _number(self.restore_cpu_s_per_gb, "restore_cpu_s_per_gb", positive=False)
        _number(self.compute_cpu_s_per_gb, "compute_cpu_s_per_gb", positive=False)
        slots = self.restore_slots
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise InvalidInput(
                f"the host's restore_slots must be a whole number ≥ 1 (or absent), got {slots!r}", hint=_HOST_HINT
            )

    def restore_cpu(self, size: int) -> float:
        """CPU seconds of a restore moving ``size`` bytes per rank."""
        return self.restore_cpu_s + self.restore_cpu_s_per_gb * size / GB


@dataclass(frozen=True)
class OwnWork:
    """The requests' own work a replay runs beside the restores, in CPU seconds: ``after[i]`` from the end of
    restore ``i`` (its request's), and ``alone``: (arrival, CPU seconds) of each request that restores nothing
    (arrivals non-decreasing)."""

    after: tuple[float, ...]
    alone: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class HostReplay:
    """Per restore: when it was admitted under B, when its last byte arrived, and how long its wait for a slot and
    its service were bound by bandwidth and by CPU; L1 over time as in ``trace_sim.Replay``."""

    starts: tuple[float, ...]
    finishes: tuple[float, ...]
    bandwidth_s: tuple[float, ...]
    cpu_s: tuple[float, ...]
    peak_bytes: int
    peak_in_flight: int
    peak_queued: int
    l1_series: tuple[tuple[float, int], ...] = field(repr=False)


def restore_bound(kv_wait_s: float, budget_wait_s: float, bandwidth_s: float, cpu_s: float) -> RestoreBound:
    """The part of a restore's time that was longest: its request's wait for destination KV, its wait for B, or its
    service bound by bandwidth or by CPU (ties: bandwidth, CPU, B, destination KV, in that order)."""
    parts = {
        RestoreBound.BANDWIDTH: bandwidth_s,
        RestoreBound.CPU: cpu_s,
        RestoreBound.BUDGET: budget_wait_s,
        RestoreBound.DESTINATION_KV: kv_wait_s,
    }
    return max(_BOUND_ORDER, key=lambda b: (parts[b], -_BOUND_ORDER.index(b)))


def cpu_load(host: HostModel, restored: Sequence[int], computed: int, span_s: float) -> float | None:
    """The share of the cores available to bsr that restores of ``restored`` bytes (each) and requests computing
    ``computed`` bytes in all need over ``span_s`` seconds, on average (None over no time). Near 1 the engine has no
    cores to spare, and latency depends steeply on the host's state."""
    if span_s <= 0:
        return None
    need = sum(host.restore_cpu(s) for s in restored) + host.compute_cpu_s_per_gb * computed / GB
    return need / (span_s * host.cores)


# An interval counts as contended when the engine's threads waited in the run queue this many thread-seconds per
# second on average: it had more work than it got cores.
CONTENDED_WAITING = 0.5


@dataclass(frozen=True)
class CpuSpan:
    """What an engine's threads did over an interval of ``seconds``: ran on a CPU and waited in the run queue
    (thread-seconds, summed over its threads)."""

    seconds: float
    ran_s: float
    waited_s: float


def contended_cores(spans: Sequence[CpuSpan]) -> float | None:
    """The cores an engine got while it had more work than cores (a calibration's ``cores``, read from intervals
    of a run): its CPU over the seconds of the intervals in which its threads waited at least CONTENDED_WAITING
    thread-seconds per second for a CPU; None when none did (what it got then was all it asked for, not what the
    host had to give)."""
    busy = [s for s in spans if s.seconds > 0 and s.waited_s >= CONTENDED_WAITING * s.seconds]
    seconds = sum(s.seconds for s in busy)
    return sum(s.ran_s for s in busy) / seconds if seconds > 0 else None


def split_service(service_s: float, size: int, bandwidth: float) -> tuple[float, float]:
    """A measured restore's service (its seconds less its wait for B) as (bound by bandwidth, bound by CPU): what its
    ``size`` bytes take at ``bandwidth`` (at most the service), and the rest."""
    by_bytes = min(service_s, size / bandwidth) if bandwidth > 0 else 0.0
    return by_bytes, service_s - by_bytes


def replay_on_host(
    arrivals: Sequence[float],
    sizes: Sequence[int],
    holds: Sequence[int],
    bandwidth: float,
    host: HostModel,
    budget: int | None = None,
    work: OwnWork | None = None,
) -> HostReplay:
    """Replay restores arriving at ``arrivals`` (non-decreasing), each moving ``sizes[i]`` bytes per rank and
    holding ``holds[i]`` bytes while admitted, at ``bandwidth`` bytes/s per rank on ``host`` (see the module's
    model), the requests' own ``work`` beside them (none when None); ``budget`` (bytes) admits them FIFO while
    their holds fit, None at once."""
    host.check()
    if work is not None and len(work.after) != len(arrivals):
        raise ValueError("own work after restores must be given per restore")
    if budget is not None and any(h > budget for h in holds):
        raise InvalidInput(
            "a restore's hold exceeds the budget: it could never be admitted",
            hint="plan with a budget of at least one restore's hold (a larger multiple of RWS(W)), or a smaller W",
        )
    return _HostSim(arrivals, sizes, holds, bandwidth, host, budget, work or OwnWork((0.0,) * len(arrivals))).run()


class _HostSim:
    """The replay's state between events: the queue for B, the queue for a slot, the restores being served with
    the fraction of each left, and the requests' own work running with the CPU seconds of each left."""

    def __init__(
        self,
        arrivals: Sequence[float],
        sizes: Sequence[int],
        holds: Sequence[int],
        bandwidth: float,
        host: HostModel,
        budget: int | None,
        work: OwnWork,
    ) -> None:
        self.arrivals, self.sizes, self.holds = arrivals, sizes, holds
        self.bandwidth, self.host, self.budget, self.work = bandwidth, host, budget, work
        self.cpu = [host.restore_cpu(s) for s in sizes]
        n = len(arrivals)
        self.starts = [0.0] * n
        self.finishes = [0.0] * n
        self.bandwidth_s = [0.0] * n
        self.cpu_s = [0.0] * n
        self.b_queue: deque[int] = deque()
        self.slot_queue: deque[int] = deque()  # admitted under B, waiting for a slot
        self.serving: dict[int, float] = {}  # restore -> fraction of it left
        # Own work running -> CPU seconds of it left: restore i's request's is i, the j-th lone request's n + j.
        self.working: dict[int, float] = {}
        self.now = 0.0
        self.held = self.peak = self.peak_in_flight = self.peak_queued = 0
        self.series: list[tuple[float, int]] = [(arrivals[0], 0)] if n else []

    def run(self) -> HostReplay:
        nxt = lone = 0
        n, alone = len(self.arrivals), self.work.alone
        while nxt < n or lone < len(alone) or self.serving or self.working:
            share = self._share()
            rates = self._rates(share)
            due = min(((left / rate, i) for i, (left, rate, _) in rates.items()), default=(math.inf, -1))
            worked = min(((left / share, j) for j, left in self.working.items()), default=(math.inf, -1))
            t_done, t_worked = self.now + due[0], self.now + worked[0]
            t_arrive = self.arrivals[nxt] if nxt < n else math.inf
            t_lone = alone[lone][0] if lone < len(alone) else math.inf
            t = min(t_done, t_worked, t_arrive, t_lone)
            self._advance(t - self.now, rates, share)
            self.now = t
            # Completions first: they free room (B, a slot, a share of the cores) for an arrival at the same instant.
            if t_done == t:
                self._complete(due[1], rates)
            elif t_worked == t:
                self._worked(worked[1])
            elif t_arrive == t:
                self.b_queue.append(nxt)
                nxt += 1
            else:
                self._start_work(n + lone, alone[lone][1])
                lone += 1
            self._admit()
        return HostReplay(
            tuple(self.starts),
            tuple(self.finishes),
            tuple(self.bandwidth_s),
            tuple(self.cpu_s),
            self.peak,
            self.peak_in_flight,
            self.peak_queued,
            tuple(self.series),
        )

    def _share(self) -> float:
        """The cores each restore being served and each piece of own work running gets now."""
        n = len(self.serving) + len(self.working)
        return min(self.host.job_cores, self.host.cores / n) if n else 0.0

    def _rates(self, share: float) -> dict[int, tuple[float, float, RestoreBound]]:
        """Per restore being served, at ``share`` cores each: the fraction left, its rate (of its whole per second),
        what bounds it now."""
        n = len(self.serving)
        out = {}
        for i, left in self.serving.items():
            by_bytes = self.bandwidth / n / self.sizes[i] if self.sizes[i] else math.inf
            by_cpu = share / self.cpu[i] if self.cpu[i] > 0 else math.inf
            bound = RestoreBound.BANDWIDTH if by_bytes <= by_cpu else RestoreBound.CPU
            out[i] = (left, min(by_bytes, by_cpu), bound)  # finite: it moves bytes or needs CPU (see _admit)
        return out

    def _advance(self, dt: float, rates: dict[int, tuple[float, float, RestoreBound]], share: float) -> None:
        if dt <= 0:
            return
        for j, left in self.working.items():
            self.working[j] = left - share * dt
        waiting_for = RestoreBound.CPU if any(b is RestoreBound.CPU for *_, b in rates.values()) else None
        for i in self.slot_queue:  # a wait for a slot counts for what bounds the restores being served
            self._bound_time(i, waiting_for or RestoreBound.BANDWIDTH, dt)
        for i, (left, rate, bound) in rates.items():
            self.serving[i] = left - rate * dt
            self._bound_time(i, bound, dt)

    def _bound_time(self, i: int, bound: RestoreBound, dt: float) -> None:
        if bound is RestoreBound.BANDWIDTH:
            self.bandwidth_s[i] += dt
        else:
            self.cpu_s[i] += dt

    def _complete(self, due: int, rates: dict[int, tuple[float, float, RestoreBound]]) -> None:
        """End the restore that was due and every other one with nothing left at the same instant."""
        for i in [due] + [k for k in rates if k != due and self.serving[k] <= _DONE]:
            del self.serving[i]
            self._finish(i)

    def _finish(self, i: int) -> None:
        """Restore ``i`` has ended: its hold is freed and its request's own work starts."""
        self.finishes[i] = self.now
        self.held -= self.holds[i]
        self._start_work(i, self.work.after[i])

    def _start_work(self, j: int, cpu_s: float) -> None:
        if cpu_s > 0:
            self.working[j] = cpu_s

    def _worked(self, due: int) -> None:
        """End the own work that was due and every other piece with nothing left at the same instant."""
        for j in [due] + [k for k, left in self.working.items() if k != due and left <= _DONE]:
            del self.working[j]

    def _admit(self) -> None:
        """Admit under B in arrival order while the holds fit, then serve in that order while slots are free."""
        while self.b_queue and (self.budget is None or self.held + self.holds[self.b_queue[0]] <= self.budget):
            i = self.b_queue.popleft()
            self.starts[i] = self.now
            self.slot_queue.append(i)
            self.held += self.holds[i]
            self.peak = max(self.peak, self.held)
        slots = self.host.restore_slots
        while self.slot_queue and (slots is None or len(self.serving) < slots):
            i = self.slot_queue.popleft()
            if self.sizes[i] or self.cpu[i] > 0:
                self.serving[i] = 1.0
            else:  # nothing to move and nothing to compute: done as it starts
                self._finish(i)
        self.peak_in_flight = max(self.peak_in_flight, len(self.serving) + len(self.slot_queue))
        self.peak_queued = max(self.peak_queued, len(self.b_queue))  # those still waiting once admission has run
        if self.series and self.series[-1][0] == self.now:
            self.series[-1] = (self.now, self.held)
        else:
            self.series.append((self.now, self.held))


# -- fitting a calibration ---------------------------------------------------------------------------------------
_FIT_RANGE = (1e-2, 1e3)
_FIT_STEPS = 40


def fit_stretch(modelled: Callable[[float], float], measured: float) -> float:
    """The factor ``m`` for which ``modelled(m)`` (a latency that rises with ``m``) equals ``measured``: bisection on
    a log scale within [0.01, 1000], or an end of that range when even it misses."""
    lo, hi = (math.log(x) for x in _FIT_RANGE)
    if modelled(math.exp(lo)) >= measured:
        return math.exp(lo)
    if modelled(math.exp(hi)) <= measured:
        return math.exp(hi)
    for _ in range(_FIT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if modelled(math.exp(mid)) < measured else (lo, mid)
    return math.exp((lo + hi) / 2)


def nearest_rank(sorted_values: Sequence[float], p: float) -> float:
    """The p-th percentile by nearest rank: the smallest value with at least p % of the values at or below it."""
    if not sorted_values:
        return 0.0
    return sorted_values[max(0, math.ceil(p / 100 * len(sorted_values)) - 1)]


# -- a calibration, as saved and read back ---------------------------------------------------------------------
class SampleKind(StrEnum):
    """What a calibration's measurement was."""

    RESTORE = "restore"  # a manual restore of a prompt the tiers hold whole, alone
    WORK = "work"  # clients computing prompts no tier holds, one after another: bsr has more work than cores
    WORK_DONE = "work_done"  # the same until every request of it had finished: its CPU over the chunks it computed
    BURST = "burst"  # one of several requests sent at once, each restoring a shared chunk and computing the rest


@dataclass(frozen=True)
class CalibrationSample:
    """One measurement of a calibration: its requests and their chunks, the CPU seconds bsr's processes spent
    meanwhile (0 where requests overlapped), its wall seconds; for a restore, its own seconds, and (in a burst) which
    burst it was in and when its restore began after that burst was sent."""

    what: SampleKind
    requests: int
    chunks: int
    cpu_s: float
    wall_s: float
    restore_s: float = 0.0
    burst: int = 0
    start_s: float = 0.0

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class HostState:
    """How busy the host was while a calibration measured it: what bsr had beside it."""

    cpu_count: int  # the host's cores
    loadavg: tuple[float, ...]  # 1, 5 and 15 minutes, at the start
    run_queue_beside: float  # runnable threads beside bsr's own while bsr was idle (mean of samples)
    run_queue_busy: float  # the same while bsr had more work than cores
    cores_available: float  # cores bsr's processes got meanwhile: the planner's ``cores``
    # The share of the last 10 s some task waited for each resource (PSI ``some avg10``, %; None: unknown here).
    pressure: dict[str, float | None] = field(default_factory=dict)
    # The cores bsr got meanwhile read as a replay reads them (``contended_cores``): beside ``cores_available``,
    # what a replay's figure is to be compared with. None: not read (an older calibration) or never contended.
    cores_contended: float | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class HostCalibration:
    """What a calibration measured of an engine on its host, saved as JSON (``kind: bsr.calibration``) for
    `bsr plan --trace --calibration FILE`: the planner's bandwidth and host model, the host's state at the time,
    how much longer the restores of its bursts of requests took than the model gives them (``burst_stretch``: a
    check of the model, 1 where it is right; not applied), and the samples."""

    measured_at: str  # ISO 8601, UTC
    registration: str  # the identity of the registration whose chunks it measured
    chunk_size: int
    bytes_per_chunk: int
    tp_size: int
    w: int = wire.field(name="W")
    bandwidth: float = wire.field(name="bandwidth_bytes_per_s")  # per rank: one large restore alone
    host: HostModel
    burst_stretch: float
    host_state: HostState
    samples: tuple[CalibrationSample, ...]

    kind: ClassVar[str] = "bsr.calibration"

    to_wire = wire.writer(
        order=(
            "kind",
            "measured_at",
            "registration",
            "chunk_size",
            "bytes_per_chunk",
            "tp_size",
            "w",
            "bandwidth",
            "host",
            "burst_stretch",
            "host_state",
            "samples",
        )
    )
    from_wire = wire.reader()
