"""Calibrating the trace planner's host model against a running embedded engine: a short run of a few seconds.

It reads the engine's own processes (its server, its ranks, its Mooncake master and segment holder) as the kernel
counts them (bsr_cli.runtime.liveness): the on-CPU time of every thread (``schedstat``), and the host's run queue
(``procs_running``) less the engine's runnable threads. In turn:

1. **The run queue beside bsr**, sampled for a second while the engine is idle: the host's runnable threads less
   the engine's own (and the sampler's).
2. **Restores alone**: prompts of 1 and of 64 chunks stored, then each restored whole (a manual restore) nine
   times, one at a time. The large one's rate is the planner's bandwidth (what its bytes take when nothing else
   runs); its CPU over its wall time is what one restore keeps busy (``job_cores``); the two sizes' seconds, at
   the cores a restore gets alone, give a restore's CPU: fixed, and per GB it moves.
3. **Steady work**: clients computing prompts no tier holds, one after another, for two seconds. bsr then has more
   work than it gets cores, and the CPU its processes got over the wall time is **the cores available to bsr**:
   the host's state, as its scheduler shares the cores between bsr and the work beside it (``cores``; the run
   queue is sampled meanwhile too). Their CPU over the chunks they computed is a request's own work per GB, which
   the model replays beside the restores.
4. **Bursts**, as a trace's requests arrive: twice, a number of requests sent at once, each restoring the chunk they
   share and computing chunks of its own, as the trace's typical burst does. A check of the model, not a figure of
   it: the model replays these restores (from when each began: the engine's ``restore_started`` events) with each
   request's own work beside them, and ``burst_stretch`` is the factor on the restores' CPU with which it would give
   them the median latency they had (1: as the model says).

Its CPU figures are the engine's and change little with the load; ``cores`` is the host's state and does: calibrate
under the load the plan is for, or give ``bsr plan --trace --cores``. An engine on another host, or a kernel without
schedstat, cannot be calibrated (CapacityError).
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bsr_cli.core.evidence import EventKind
from bsr_cli.core.host_model import (
    GB,
    CalibrationSample,
    CpuSpan,
    HostCalibration,
    HostModel,
    HostState,
    OwnWork,
    SampleKind,
    contended_cores,
    fit_stretch,
    nearest_rank,
    replay_on_host,
)
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import SubmitResult
from bsr_cli.core.trace import synthetic_token
from bsr_cli.errors import BsrError, CapacityError
from bsr_cli.runtime.liveness import NS, ProcReader, RunDelays, cpu_growth

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient

SMALL, LARGE = 1, 64  # chunks of the two prompts restored alone
# Each size restored alone this many times: beside CPU-bound work the median of three moved a restore's fixed cost
# threefold between calibrations of the same host.
TRIALS = 9
IDLE_SAMPLES = 20
QUEUE_SAMPLE_S = 0.05  # between two samples of the run queue
WORK_CLIENTS = 6
WORK_S = 2.0
WORK_MAX_REQUESTS = 48  # the steady work stops earlier after this many (what the store must hold stays bounded)
BURSTS = 2
BURST_REQUESTS_MAX, BURST_CHUNKS_MAX = 16, 64
# Restores a rank serves at once: its fetch threads (runtime/restore.py), shared by every restore on the rank.
RESTORE_SLOTS = 2
SALT_OFFSET = 1_000_003  # added to a replay's salt for the calibration's prompts, so that none is a replay's
# Keys of the synthetic prompts (negative: never a trace's block id).
SMALL_KEY, LARGE_KEY = -100, -200
_WORK_KEYS, _BURST_KEYS = -10_000, -1_000_000


# What to do when the engine the calibration runs on does not restore what it stored.
_CANNOT_RESTORE = "`bsr explain --synthetic N` says why the engine does not restore it; `bsr status` shows its tiers"


@dataclass(frozen=True)
class BurstShape:
    """The bursts the calibration sends (BURSTS of them, one after the other): ``requests`` at once, each computing
    ``chunks`` chunks of its own."""

    requests: int = 9
    chunks: int = 16


@dataclass(frozen=True)
class EngineSample:
    """The engine's processes at one moment: their threads runnable now, and every thread's CPU time and run-queue
    wait per process (those gone are left out), both of the same threads."""

    running: int
    delays: dict[int, RunDelays]


class EngineCpu:
    """The CPU seconds an engine's processes have run (every thread's, summed) and how many of their threads are
    runnable now, as the kernel counts them (bsr_cli.runtime.liveness reads /proc)."""

    def __init__(self, pids: Sequence[int], reader: ProcReader | None = None) -> None:
        self.pids = tuple(pids)
        self.reader = reader or ProcReader()
        if not self.pids or self.reader.run_delays(self.pids[0], time.monotonic()) is None:
            raise CapacityError(
                "cannot read the engine's CPU time from /proc (schedstat)",
                hint="calibrate on Linux against an engine on this host, or give the planner --cores and --cpu-per-gb",
            )

    def cpu_s(self) -> float:
        """Summed over the threads alive now (a process that ended no longer counts)."""
        total = 0
        for pid in self.pids:
            delays = self.reader.run_delays(pid, time.monotonic())
            total += sum(ran for ran, _ in delays.threads.values()) if delays is not None else 0
        return total * NS

    def sample(self) -> EngineSample:
        """Its threads runnable now and every thread's figures, from one listing of each process's threads."""
        now = time.monotonic()
        read = [(pid, self.reader.threads(pid, now)) for pid in self.pids]
        return EngineSample(
            running=sum(threads.runnable for _, threads in read if threads is not None),
            delays={pid: t.delays for pid, t in read if t is not None and t.delays is not None},
        )

    def delays(self) -> dict[int, RunDelays]:
        """Every thread's CPU time and run-queue wait now, per process (those gone are left out)."""
        now = time.monotonic()
        read = {pid: self.reader.run_delays(pid, now) for pid in self.pids}
        return {pid: d for pid, d in read.items() if d is not None}

    @staticmethod
    def span(before: dict[int, RunDelays], after: dict[int, RunDelays], seconds: float) -> CpuSpan:
        """What the processes' threads did between two ``delays()`` readings ``seconds`` apart."""
        grown = [cpu_growth(before.get(pid, RunDelays(d.at, {})), d) for pid, d in after.items()]
        return CpuSpan(seconds, sum(g.ran_s for g in grown), sum(g.waited_s for g in grown))


class RunQueue:
    """Samples the run queue beside the engine (the host's runnable threads less the engine's own and this
    sampler's) on a thread until the block ends; and between two samples, what the engine's threads ran and waited
    for a CPU (``spans``: the cores it got whenever it had more work than cores, ``cores_contended``)."""

    def __init__(self, engine: EngineCpu, every_s: float = QUEUE_SAMPLE_S) -> None:
        self.engine, self.every_s = engine, every_s
        self.samples: list[int] = []
        self.spans: list[CpuSpan] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bsr-run-queue", daemon=True)

    def _run(self) -> None:
        last, at = self.engine.delays(), time.monotonic()
        while not self._stop.wait(self.every_s):
            host = self.engine.reader.procs_running()
            now, now_at = self.engine.sample(), time.monotonic()
            if host is not None:
                self.samples.append(max(0, host - now.running - 1))
            self.spans.append(self.engine.span(last, now.delays, now_at - at))
            last, at = now.delays, now_at

    @property
    def cores_contended(self) -> float | None:
        """The cores the engine got while it had more work than cores (None: it never had)."""
        return contended_cores(self.spans)

    def __enter__(self) -> RunQueue:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0


def stored_tokens(shape: BurstShape, chunk_size: int) -> int:
    """The most tokens a calibration stores: its two prompts restored alone, the steady work, the bursts."""
    chunks = SMALL + LARGE + (WORK_MAX_REQUESTS + WORK_CLIENTS + BURSTS * shape.requests) * shape.chunks
    return chunks * chunk_size


def pressure(reader: ProcReader | None = None) -> dict[str, float | None]:
    """The host's pressure now: per resource, the share of the last 10 s some task waited for it (%)."""
    now = (reader or ProcReader()).pressure()
    return {name: (psi.some_avg10 if psi is not None else None) for name, psi in vars(now).items()}


def _tokens(salt: int, key: int, chunks: int, chunk_size: int) -> list[int]:
    return [synthetic_token(salt, key, j) for j in range(chunks * chunk_size)]


class _Calls:
    """The engine calls a calibration makes."""

    def __init__(self, client: AdminClient, cpu: EngineCpu, w: int, salt: int, chunk_size: int) -> None:
        self.client, self.cpu, self.w, self.salt, self.chunk_size = client, cpu, w, salt, chunk_size

    def compute(self, key: int, chunks: int) -> SubmitResult:
        """Submit a prompt no tier holds: computed and stored whole."""
        res = self.submit(_tokens(self.salt, key, chunks, self.chunk_size))
        if res.external_tokens:
            raise BsrError(
                "the calibration's new prompt was found in a tier: the engine is not a fresh one",
                hint="run the calibration on an engine of its own (`bench trace` starts one), not one serving others",
            )
        return res

    def submit(self, tokens: list[int]) -> SubmitResult:
        return self.client.submit(Prompt.of_tokens(tokens), w=self.w, verify=False, timeout=600)

    def restore(self, key: int, chunks: int) -> CalibrationSample:
        """A manual restore of a stored prompt (its lookup, then its restore; nothing computed), alone."""
        prompt = Prompt.of_tokens(_tokens(self.salt, key, chunks, self.chunk_size))
        c0, t0 = self.cpu.cpu_s(), time.monotonic()
        res = self.client.restore(prompt, w=self.w, verify=False, timeout=600)
        c, t = self.cpu.cpu_s() - c0, time.monotonic() - t0
        report = res.report
        if report is None or report.committed_tokens < chunks * self.chunk_size:
            raise BsrError(
                "the calibration's restore committed less than its prompt: the engine cannot restore",
                hint=_CANNOT_RESTORE,
            )
        return CalibrationSample(SampleKind.RESTORE, 1, chunks, c, t, float(report.seconds))


def _alone(calls: _Calls) -> list[CalibrationSample]:
    out = []
    for key, size in ((SMALL_KEY, SMALL), (LARGE_KEY, LARGE)):
        calls.compute(key, size)
        out += [calls.restore(key, size) for _ in range(TRIALS)]
    return out


def _steady_work(calls: _Calls, chunks: int) -> list[CalibrationSample]:
    """WORK_CLIENTS clients computing prompts of ``chunks`` chunks one after another for WORK_S seconds: the CPU
    bsr's processes got meanwhile (every client still had a request in flight when it was read); and, once every
    request has finished, the CPU all of them took over the chunks they computed and stored."""
    stop = threading.Event()
    keys = itertools.count(_WORK_KEYS, -1)
    started, done = itertools.count(), itertools.count()

    def client_loop() -> None:
        while not stop.is_set() and next(started) < WORK_MAX_REQUESTS:
            calls.compute(next(keys), chunks)
            next(done)

    with ThreadPoolExecutor(WORK_CLIENTS, thread_name_prefix="bsr-calibration") as pool:
        c0, t0 = calls.cpu.cpu_s(), time.monotonic()
        loops = [pool.submit(client_loop) for _ in range(WORK_CLIENTS)]
        stop.wait(WORK_S)  # the work runs this long (pacing, not synchronisation)
        c, t = calls.cpu.cpu_s() - c0, time.monotonic() - t0
        stop.set()
        for f in loops:
            f.result()
        total, wall = calls.cpu.cpu_s() - c0, time.monotonic() - t0
    n = next(done)
    return [
        CalibrationSample(SampleKind.WORK, WORK_CLIENTS, n * chunks, c, t),
        CalibrationSample(SampleKind.WORK_DONE, n, n * chunks, total, wall),
    ]


def _burst(calls: _Calls, requests: int, chunks: int, number: int) -> list[CalibrationSample]:
    """``requests`` submits sent at once, each restoring the small stored prompt's chunk and computing ``chunks``
    chunks of its own; each sample's start is when its restore began after the burst was sent."""
    shared = _tokens(calls.salt, SMALL_KEY, SMALL, calls.chunk_size)
    first_key = _BURST_KEYS - 1000 * number
    prompts = [shared + _tokens(calls.salt, first_key - i, chunks, calls.chunk_size) for i in range(requests)]
    sent = time.time()
    with ThreadPoolExecutor(requests, thread_name_prefix="bsr-calibration") as pool:
        results = list(pool.map(calls.submit, prompts))
    events, _ = calls.client.held_wire(kinds=[EventKind.RESTORE_STARTED.value], after=sent - 1)
    began = {str(e.get("request")): float(e.get("time", 0.0)) for e in events}
    out = []
    for res in results:
        restore = next((p.restore for p in res.passes if p.restore and p.restore.committed_tokens), None)
        if restore is None or res.request not in began:
            raise BsrError(
                "a request of the calibration's burst restored nothing: the engine cannot restore", hint=_CANNOT_RESTORE
            )
        start = max(0.0, began[res.request] - sent)
        out.append(
            CalibrationSample(
                SampleKind.BURST,
                requests,
                SMALL + chunks,
                0.0,
                float(res.seconds),
                float(restore.seconds),
                number,
                start,
            )
        )
    return sorted(out, key=lambda s: s.start_s)


def _median(samples: Sequence[CalibrationSample], chunks: int, attr: str) -> float:
    return statistics.median(getattr(s, attr) for s in samples if s.what is SampleKind.RESTORE and s.chunks == chunks)


def fit_host(samples: Sequence[CalibrationSample], bytes_per_chunk: int) -> tuple[HostModel, float, float]:
    """The host model, the bandwidth and the burst stretch the samples give (see the module's steps)."""
    work = next(s for s in samples if s.what is SampleKind.WORK)
    cores = work.cpu_s / work.wall_s
    large = [s for s in samples if s.what is SampleKind.RESTORE and s.chunks == LARGE]
    job_cores = max(statistics.median(s.cpu_s / s.wall_s for s in large), 0.01)
    # A restore's CPU in the model's terms: its seconds alone at the cores it gets alone, so that the model gives a
    # restore alone the time it took (its many short steps wait for the cores as much as they use them).
    alone = min(cores, job_cores)
    seconds = [_median(samples, n, "restore_s") for n in (SMALL, LARGE)]
    gb = [n * bytes_per_chunk / GB for n in (SMALL, LARGE)]
    per_gb = max(0.0, (seconds[1] - seconds[0]) * alone / (gb[1] - gb[0]))
    fixed = max(0.0, seconds[0] * alone - per_gb * gb[0])
    bandwidth = LARGE * bytes_per_chunk / max(seconds[1], 1e-6)
    done = next((s for s in samples if s.what is SampleKind.WORK_DONE and s.chunks), None)
    compute_per_gb = done.cpu_s / (done.chunks * bytes_per_chunk / GB) if done is not None else 0.0
    host = HostModel(
        cores=round(cores, 4),
        job_cores=round(job_cores, 4),
        restore_cpu_s=round(fixed, 6),
        restore_cpu_s_per_gb=round(per_gb, 4),
        restore_slots=RESTORE_SLOTS,
        compute_cpu_s_per_gb=round(compute_per_gb, 4),
    )
    bursts = [s for s in samples if s.what is SampleKind.BURST]
    stretch = burst_stretch(host, bandwidth, bursts, bytes_per_chunk) if bursts else 1.0
    return host, bandwidth, round(stretch, 3)


def burst_stretch(
    host: HostModel, bandwidth: float, bursts: Sequence[CalibrationSample], bytes_per_chunk: int
) -> float:
    """How much longer the bursts' restores took than the model gives them, with each request's own work replayed
    beside them (each burst apart, each restore from when it began): the factor on the restores' CPU figures that
    gives them the median latency they had. A check of the model, not applied to it: 1 where the bursts took what
    it predicts."""
    size = SMALL * bytes_per_chunk
    own = host.compute_cpu_s_per_gb * bytes_per_chunk / GB  # a chunk's own work, CPU seconds

    def modelled(m: float) -> float:
        stretched = replace(
            host, restore_cpu_s=host.restore_cpu_s * m, restore_cpu_s_per_gb=host.restore_cpu_s_per_gb * m
        )
        latencies: list[float] = []
        for number in sorted({s.burst for s in bursts}):
            burst = sorted((s for s in bursts if s.burst == number), key=lambda s: s.start_s)
            starts = [s.start_s for s in burst]
            work = OwnWork(tuple((s.chunks - SMALL) * own for s in burst))
            r = replay_on_host(starts, [size] * len(starts), [0] * len(starts), bandwidth, stretched, work=work)
            latencies += [f - a for f, a in zip(r.finishes, starts, strict=True)]
        return nearest_rank(sorted(latencies), 50)

    return fit_stretch(modelled, nearest_rank(sorted(s.restore_s for s in bursts), 50))


def calibrate_host(
    client: AdminClient,
    pids: Sequence[int],
    reg: Registration,
    *,
    w: int,
    salt: int,
    measured_at: str,
    burst: BurstShape = BurstShape(),
) -> HostCalibration:
    """Measure the engine behind ``client`` (its processes ``pids``, on this host): see the module's steps."""
    cpu = EngineCpu(pids)
    loadavg = tuple(round(x, 2) for x in os.getloadavg())
    with RunQueue(cpu) as idle:
        while len(idle.samples) < IDLE_SAMPLES:
            time.sleep(QUEUE_SAMPLE_S)  # sampling the idle run queue (pacing, not synchronisation)
    calls = _Calls(client, cpu, w, salt, reg.chunk_size)
    samples = _alone(calls)
    with RunQueue(cpu) as busy:
        samples += _steady_work(calls, burst.chunks)
    for number in range(1, BURSTS + 1):
        samples += _burst(calls, burst.requests, burst.chunks, number)
    host, bandwidth, stretch = fit_host(samples, reg.bytes_per_chunk)
    return HostCalibration(
        measured_at=measured_at,
        registration=reg.identity,
        chunk_size=reg.chunk_size,
        bytes_per_chunk=reg.bytes_per_chunk,
        tp_size=reg.tp_size,
        w=w,
        bandwidth=bandwidth,
        host=host,
        burst_stretch=stretch,
        host_state=HostState(
            cpu_count=os.cpu_count() or 1,
            loadavg=loadavg,
            run_queue_beside=round(idle.mean, 2),
            run_queue_busy=round(busy.mean, 2),
            cores_available=host.cores,
            pressure=pressure(cpu.reader),
            cores_contended=round(c, 4) if (c := busy.cores_contended) is not None else None,
        ),
        samples=tuple(samples),
    )
