"""`bsr bench trace`: replay a slice of a request trace against a dedicated embedded engine, at the trace's arrival
times with concurrent clients, and print the planner's prediction for the same slice beside the measurement.

The slice is scaled to fit the machine, and both scales are printed: time by ``speedup`` (arrivals divided by it),
tokens by ``block_tokens`` per 512-token block (every length scaled by block_tokens / 512, rounded up, so each
request keeps its blocks). Prompts are synthesized from the block ids (``core.trace.prompt_tokens``): equal leading
ids give an equal token prefix, so the engine's own chunk hashes find exactly the prefixes the trace shares.

Each request is one ``submit`` (the scheduler's path: probe, restore the external prefix in windows under B,
compute the rest, store what the tiers lack). Measured per request: the committed external tokens, the restore's
seconds (its waits for B included), and from the engine's events its wait for destination KV and for B; per rank:
the pool's peak. Predicted: ``core.trace_sim.plan_trace`` on the same scaled slice with the engine's W and B, on
the host model a calibration measured here first (bsr_cli.bench.calibration; or one saved before), beside what
the bandwidth alone predicts. Each budget B is replayed on its own (the same engine, B set before, a salt of its
own so that it finds nothing of the others'). Each restore's bound (bandwidth, CPU, B, destination KV) is the
longest part of its time, on both sides (``core.host_model.restore_bound``).

The engine stores a request's blocks after its own restore and prefill, where the planner's model stores them at
arrival: a request that shares a prefix with one still in flight can commit less than predicted. Those requests
are counted apart.

Stock LMCache replays the same scaled slice afterwards (``replay_stock``): the same synthesized prompts (same salt),
the same arrival times and number of clients, the same bytes per token and chunk size, through LMCache 0.5.6's own
retrieve and store in a process of the plugin venv (plugins/lmcache_bsr/trace_replay.py) against a Mooncake master
and segment of its own. Its L1 is sized from the planner's whole-plan peak (``stock_l1_bytes``); what it measures
is the allocator's high-water, not that size.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from bsr_cli.bench.evidence import BenchRow, RowMeta
from bsr_cli.core import accounting, wire
from bsr_cli.core.evidence import EventKind, RestoreBound
from bsr_cli.core.host_model import HostCalibration, HostModel, nearest_rank, restore_bound, split_service
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import KVGroup, Registration, TensorSpec
from bsr_cli.core.trace import Trace, hit_chunks, prefix_hits, prompt_tokens, restored_tokens
from bsr_cli.core.trace_sim import PathRun, Percentiles, percentiles, plan_trace
from bsr_cli.errors import BsrError, CapacityError, InvalidInput, ServiceError

if TYPE_CHECKING:
    from bsr_cli.bench.calibration import BurstShape
    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions

# The replay's default registration: 1 KiB per token per rank in one KV group, 64-token chunks, so with the default
# 64 tokens per block one chunk is one block of the trace (64 KiB per rank): 500 requests of the conversation trace
# store about 1.8 GB.
REPLAY_REGISTRATION = Registration(
    model="bsr-trace-replay",
    tp_size=2,
    chunk_size=64,
    aux_bytes=0,
    groups=(KVGroup("kv", block_size=16),),
    tensors=(
        TensorSpec("layers.0.attn.kv", "bf16", (2, 1, 128), "kv"),
        TensorSpec("layers.1.attn.kv", "bf16", (2, 1, 128), "kv"),
    ),
    source="bench trace",
)
# Clients in flight at most (a burst beyond this waits for a free client: counted in its latency): as many as the
# engine's request queue holds (server/admin.py MAX_QUEUED), so every request is sent at its arrival; one that
# finds the engine's destination KV full waits for it there, as it would in a serving engine.
MAX_CLIENTS = 1024
# Requests whose prompts the replay's destination KV holds at once (of the slice's mean length).
KV_REQUESTS = 48
# Chunks of the calibration's largest prompt (bench/calibration.py LARGE).
CALIBRATION_CHUNKS = 64
# The Mooncake segment must hold every object the slice stores (nothing is evicted during the replay).
MAX_SEGMENT = 8 << 30

# What to do when stock LMCache's side of a replay cannot run: a smaller replay, or the engine's side alone.
_STOCK_TOO_BIG = "replay fewer requests (-n) or skip the stock run (--no-stock)"
_STOCK_FAILED = "rerun with --no-stock to replay bsr alone; the error names what stock LMCache refused"


def replay_registration() -> Registration:
    return REPLAY_REGISTRATION


@dataclass(frozen=True)
class Sizing:
    """What the slice needs of the engine."""

    max_tokens: int
    kv_tokens: int
    segment_bytes: int
    stored_bytes: int


def sizing(trace: Trace, reg: Registration, replays: int = 1, calibration_tokens: int = 0) -> Sizing:
    longest = max(max(r.input_length for r in trace.requests), CALIBRATION_CHUNKS * reg.chunk_size)
    max_tokens = -(-longest // reg.chunk_size) * reg.chunk_size
    # Destination KV for the requests running at once: room for KV_REQUESTS prompts of the slice's mean length, and
    # at least two of its longest (more requests in flight wait for room, FIFO).
    mean = sum(r.input_length for r in trace.requests) // len(trace)
    kv = max(2 * max_tokens, KV_REQUESTS * mean)
    kv = -(-kv // reg.chunk_size) * reg.chunk_size
    # Every replay (one per budget) stores the slice anew under its own salt, and a calibration its prompts.
    stored = replays * sum(r.input_length for r in trace.requests) * reg.bytes_per_token * reg.tp_size
    stored += calibration_tokens * reg.bytes_per_token * reg.tp_size
    segment = max(256 << 20, stored + stored // 2)  # headroom for the allocator
    if segment > MAX_SEGMENT:
        raise InvalidInput(
            f"the slice stores {stored:,} bytes; the replay's Mooncake segment is capped at {MAX_SEGMENT:,}",
            hint="replay fewer requests (--requests), fewer budgets or fewer tokens per block (--block-tokens)",
        )
    return Sizing(max_tokens, kv, segment, stored)


def burst_shape(trace: Trace, reg: Registration) -> BurstShape:
    """The trace's typical burst, for the calibration to send: the median number of requests arriving together with
    a restoring request, each computing the median chunks a request of the trace computes (each within the
    calibration's bounds)."""
    from bsr_cli.bench.calibration import BURST_CHUNKS_MAX, BURST_REQUESTS_MAX, BurstShape

    hits = expected_hits(trace, reg)
    together = Counter(r.arrival_ms for r in trace.requests)
    sizes = sorted(together[r.arrival_ms] for r, hit in zip(trace.requests, hits, strict=True) if hit) or [1]
    computed = [-(-(r.input_length - hit) // reg.chunk_size) for r, hit in zip(trace.requests, hits, strict=True)]
    return BurstShape(
        requests=max(2, min(BURST_REQUESTS_MAX, int(nearest_rank(sizes, 50)))),
        chunks=max(1, min(BURST_CHUNKS_MAX, int(statistics.median(computed)))),
    )


def engine_options(reg: Registration, w: int, budget_rws: int, size: Sizing) -> EngineOptions:
    from bsr_cli.engine.supervisor import EngineOptions

    budget = budget_rws * accounting.rws_bytes(reg, w)
    return EngineOptions(
        reg,
        w=w,
        pool_bytes=budget,
        budget_bytes=budget,
        max_tokens=size.max_tokens,
        kv_tokens=size.kv_tokens,
        segment_bytes=size.segment_bytes,
        fetch_timeout_s=60.0,
    )


@dataclass
class Measured:
    """One request's replay."""

    index: int
    arrival_s: float  # after the speed-up
    started_s: float  # when its client sent it (later than its arrival when every client was busy)
    committed_tokens: int = 0
    restore_seconds: float | None = None  # None: no restore ran (no external prefix)
    seconds: float = 0.0
    error: str | None = None
    request: str = ""  # the engine's request id
    kv_wait_s: float = 0.0  # its wait for destination KV (its request_admitted event's queued_s)
    budget_wait_s: float = 0.0  # its restore's wait for B: the slowest rank's, summed over its windows


def budget_waits(events: Sequence[Mapping[str, object]]) -> dict[str, float]:
    """Per request, its restore's wait for room under B, from its ``window_waiting`` and ``window_fetched`` events:
    a window waited from its ``window_waiting`` until its fetch began (its ``window_fetched`` less the fetch's
    seconds); a rank's waits add up over its windows, and the request's is its slowest rank's."""
    waiting: dict[tuple[str, int, int], float] = {}
    per_rank: dict[tuple[str, int], float] = {}
    for e in events:
        key = (str(e.get("request")), _int(e.get("rank")), _int(e.get("window")))
        if e.get("type") == EventKind.WINDOW_WAITING.value:
            waiting[key] = _float(e.get("time"))
        elif e.get("type") == EventKind.WINDOW_FETCHED.value and key in waiting:
            began = _float(e.get("time")) - _float(e.get("seconds"))
            per_rank[key[:2]] = per_rank.get(key[:2], 0.0) + max(0.0, began - waiting.pop(key))
    out: dict[str, float] = {}
    for (request, _), wait in per_rank.items():
        out[request] = max(out.get(request, 0.0), wait)
    return out


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else -1


def _float(value: object) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


WAIT_EVENTS = (EventKind.REQUEST_ADMITTED, EventKind.WINDOW_WAITING, EventKind.WINDOW_FETCHED)


def read_waits(client: AdminClient, measured: Sequence[Measured], since: float) -> None:
    """Each request's waits for destination KV and for B, from the engine's events since ``since`` (Unix time)."""
    events, _ = client.held_wire(kinds=[k.value for k in WAIT_EVENTS], after=since)
    queued = {
        str(e.get("request")): _float(e.get("queued_s"))
        for e in events
        if e.get("type") == EventKind.REQUEST_ADMITTED.value
    }
    waits = budget_waits(events)
    for m in measured:
        m.kv_wait_s = queued.get(m.request, 0.0)
        m.budget_wait_s = min(waits.get(m.request, 0.0), m.restore_seconds or 0.0)


def measured_bound(m: Measured, reg: Registration, bandwidth: float) -> RestoreBound:
    """What bound a measured restore: its request's wait for destination KV, its wait for B, or its service (its
    seconds less that wait), split into what its bytes take at ``bandwidth`` and the rest (CPU)."""
    size = -(-m.committed_tokens // reg.chunk_size) * reg.bytes_per_chunk
    service = max(0.0, (m.restore_seconds or 0.0) - m.budget_wait_s)
    by_bytes, by_cpu = split_service(service, size, bandwidth)
    return restore_bound(m.kv_wait_s, m.budget_wait_s, by_bytes, by_cpu)


def replay(
    client: AdminClient,
    trace: Trace,
    *,
    w: int,
    speedup: float,
    salt: int,
    stop: threading.Event | None = None,
    on_done: Callable[[Measured], None] | None = None,
) -> list[Measured]:
    """Send every request of ``trace`` at its (sped-up) arrival time, each from its own client thread (with a
    connection of its own: ``client``'s engine and token, MAX_CLIENTS connections)."""
    from bsr_cli.client import AdminClient

    stop = stop or threading.Event()
    prompts = [prompt_tokens(r, trace.block_tokens, salt, i) for i, r in enumerate(trace.requests)]
    t_first = trace.requests[0].arrival_ms
    out = [Measured(i, (r.arrival_ms - t_first) / 1000 / speedup, 0.0) for i, r in enumerate(trace.requests)]
    origin = time.monotonic()

    def one(m: Measured) -> None:
        m.started_s = time.monotonic() - origin
        try:
            res = clients.submit(Prompt.of_tokens(prompts[m.index]), w=w, verify=False, timeout=600)
        except BsrError as e:
            m.error = e.message
        else:
            m.committed_tokens = res.external_tokens
            m.request = res.request
            restores = [p.restore for p in res.passes if p.restore]
            if restores:
                m.restore_seconds = sum(float(r.seconds) for r in restores)
            m.seconds = float(res.seconds)
        if on_done is not None:
            on_done(m)

    futures: list[Future[None]] = []
    clients = AdminClient(client.url, client.token, timeout_s=client.timeout_s, connections=MAX_CLIENTS)
    with clients, ThreadPoolExecutor(max_workers=MAX_CLIENTS, thread_name_prefix="bsr-trace-client") as pool:
        for m in out:
            # Pacing the arrivals (not synchronisation): wait until this request's time, or until stopped.
            if stop.wait(max(0.0, m.arrival_s - (time.monotonic() - origin))):
                break
            futures.append(pool.submit(one, m))
        for f in futures:
            f.result()
    return out[: len(futures)]


@dataclass(frozen=True)
class PredictedReplay:
    """The planner's model of the replayed requests (``core.trace_sim.plan_trace``) at one B: on the host model
    when there is one, with what bound each restore, and what the bandwidth alone predicts."""

    restores: int
    hit_tokens: int
    peak_bytes_per_rank: int
    latency_s: Percentiles
    wait_s: Percentiles
    whole_plan_peak_bytes_per_rank: int  # stock LMCache stages every restore's whole plan: this is its model
    bound_by: dict[RestoreBound, int] | None = wire.field(omit_none=True, default=None)  # with a host model
    bandwidth_only_latency_s: Percentiles | None = wire.field(omit_none=True, default=None)  # with a host model
    cpu_load: float | None = wire.field(omit_none=True, default=None)  # the share of bsr's cores the slice needs

    to_wire = wire.writer()


@dataclass(frozen=True)
class MeasuredReplay:
    """What the engine did with the replayed requests at one B."""

    restores: int
    hit_tokens: int
    pool_peak_by_rank: dict[int, int]  # by rank, in rank order
    latency_s: Percentiles
    budget_wait_s: Percentiles  # the restores' waits for B (the engine's events)
    kv_wait_s: Percentiles  # the restoring requests' waits for destination KV, before their restores
    bound_by: dict[RestoreBound, int]
    failed: int
    first_failure: str | None

    @property
    def peak_bytes_per_rank(self) -> int:
        return max(self.pool_peak_by_rank.values(), default=0)

    to_wire = wire.writer(
        order=(
            "restores",
            "hit_tokens",
            "peak_bytes_per_rank",
            "pool_peak_by_rank",
            "latency_s",
            "budget_wait_s",
            "kv_wait_s",
            "bound_by",
            "failed",
            "first_failure",
        )
    )


@dataclass(frozen=True)
class CommittedCounts:
    """Requests that loaded exactly the tokens the trace lets them, fewer, or more; and of those with more, how
    many loaded more than any request sent before they ended could have stored (``unstored``: bsr's fault; the rest
    of ``more`` found a later turn's store done before their lookup, an order a loaded host may change)."""

    exact: int
    fewer: int
    more: int
    unstored: int | None = wire.field(omit_none=True, default=None)  # None: not checked (stock LMCache's replay)

    to_wire = wire.writer()


@dataclass(frozen=True)
class StockNotRun:
    """Why stock LMCache's replay of the slice did not run."""

    reason: str

    run: ClassVar[bool] = False

    to_wire = wire.writer(order=("run", "reason"))
    from_wire = wire.reader()


def read_stock(data: object) -> StockSummary | StockNotRun | None:
    """Stock LMCache's side of a replay as written (``run`` says which record it is; None: not recorded)."""
    if not isinstance(data, Mapping):
        return None
    return StockSummary.from_wire(data) if data.get("run") else StockNotRun.from_wire(data)


# A prediction agrees with the engine when the measured latency is within this fraction of it (p50 and p99).
AGREEMENT = 0.25


@dataclass(frozen=True)
class AtReplayCores:
    """The planner's prediction on the calibration's host model with one figure changed: the cores available to
    bsr, as the engine got them during the replay whenever it had more work than cores. The host's state is the
    model's input; this is the model given the host the replay actually had."""

    cores: float
    latency_s: Percentiles
    latency_ratio: dict[str, float | None]  # measured over this prediction, by percentile
    agrees: dict[str, bool | None]

    to_wire = wire.writer()


@dataclass(frozen=True, kw_only=True)
class BudgetRun(BenchRow):
    """One budget B's replay of the slice: the planner's prediction beside what the engine did (a row of the
    replay's bundle: its checks are the engine's, its agreement with the prediction is reported, not checked)."""

    kind: str = "budget"
    budget_rws: int
    budget_bytes: int
    salt: int
    meta: RowMeta
    loadavg: tuple[float, float]  # the host's 1-minute load average as the replay began and as it ended
    run_queue_beside: float | None  # runnable threads beside the engine's own while it replayed (None: not sampled)
    pressure: dict[str, float | None]  # the host's PSI (some avg10, %) per resource as the replay ended
    predicted: PredictedReplay
    measured: MeasuredReplay
    committed: CommittedCounts
    latency_ratio: dict[str, float | None]  # measured over predicted, by percentile
    agrees: dict[str, bool | None]  # measured within AGREEMENT of predicted, by percentile (None: none predicted)
    # The prediction again on the host model with the cores the engine got during this replay (None: no host model,
    # or the engine never had more work than cores while it replayed).
    at_replay_cores: AtReplayCores | None = wire.field(omit_none=True, default=None)

    @property
    def checks(self) -> dict[str, bool]:
        return dict(self.meta.checks or {})


@dataclass(frozen=True, kw_only=True)
class TraceReplay:
    """`bsr bench trace`: the planner's prediction beside the engine's measurement for the same slice, per budget B,
    the calibration the prediction used, and stock LMCache's replay of the slice (``stock``, set once it ran or was
    skipped)."""

    trace: str
    requests: int
    speedup: float
    block_tokens: int
    registration: str
    model: str
    bytes_per_chunk: int
    w: int = wire.field(name="W")
    bandwidth_bytes_per_s: float
    calibration: HostCalibration | None  # None: a bandwidth alone was given
    calibration_file: str | None  # where the calibration was saved (or read from)
    runs: tuple[BudgetRun, ...]
    bundle: str | None = wire.field(omit_none=True, default=None)  # the evidence bundle written
    skip: int | None = wire.field(omit_none=True, default=None)
    stock: StockSummary | StockNotRun | None = wire.field(omit_none=True, default=None)

    kind: ClassVar[str] = "bsr.bench.trace"

    @property
    def token_scale(self) -> float:
        return self.block_tokens / 512

    @property
    def checks(self) -> dict[str, bool]:
        """Every run's checks, each failing when any run failed it."""
        out: dict[str, bool] = {}
        for run in self.runs:
            for name, ok in run.checks.items():
                out[name] = out.get(name, True) and ok
        return out

    to_wire = wire.writer(
        order=(
            "kind",
            "trace",
            "requests",
            "speedup",
            "block_tokens",
            "token_scale",
            "registration",
            "model",
            "bytes_per_chunk",
            "w",
            "bandwidth_bytes_per_s",
            "calibration",
            "calibration_file",
            "runs",
            "checks",
            "bundle",
            "skip",
            "stock",
        )
    )


@dataclass(frozen=True)
class BudgetReplayed:
    """What one budget's replay measured, as `compare` takes it."""

    budget_rws: int
    salt: int
    measured: list[Measured]
    pool_peaks: dict[int, int]
    loadavg: tuple[float, float]
    started_at: str
    elapsed_s: float
    run_queue_beside: float | None = None  # None: not sampled
    pressure: dict[str, float | None] = field(default_factory=dict)
    cores_contended: float | None = None  # the cores the engine got while it had more work than cores (None: never)


def _ratios(latencies: Sequence[float], predicted: Percentiles) -> dict[str, float | None]:
    """Measured over predicted, at p50 and p99 (None where nothing was predicted)."""
    return {
        p: (nearest_rank(latencies, q) / getattr(predicted, p) if getattr(predicted, p) else None)
        for p, q in (("p50", 50), ("p99", 99))
    }


def compare(
    trace: Trace,
    reg: Registration,
    replayed: BudgetReplayed,
    *,
    w: int,
    bandwidth: float,
    speedup: float,
    host: HostModel | None = None,
) -> BudgetRun:
    """The planner's prediction for the replayed requests at one B beside what the engine did."""
    measured = replayed.measured
    done = trace.head(len(measured))
    plan = plan_trace(done, reg, w, bandwidth=bandwidth, speedup=speedup, budgets_rws=(replayed.budget_rws,), host=host)
    (predicted,) = plan.bsr
    alone = at_replay = None
    if host is not None:
        (alone,) = plan_trace(
            done, reg, w, bandwidth=bandwidth, speedup=speedup, budgets_rws=(replayed.budget_rws,)
        ).bsr
        if replayed.cores_contended:
            at_host = replace(host, cores=replayed.cores_contended)
            (at_replay,) = plan_trace(
                done, reg, w, bandwidth=bandwidth, speedup=speedup, budgets_rws=(replayed.budget_rws,), host=at_host
            ).bsr
    want = expected_hits(done, reg)
    could = storable_hits(done, reg, measured)
    counts = CommittedCounts(
        exact=sum(1 for m in measured if m.error is None and m.committed_tokens == want[m.index]),
        fewer=sum(1 for m in measured if m.error is None and m.committed_tokens < want[m.index]),
        more=sum(1 for m in measured if m.error is None and m.committed_tokens > want[m.index]),
        unstored=sum(1 for m in measured if m.error is None and m.committed_tokens > could[m.index]),
    )
    failed = [m for m in measured if m.error is not None]
    restored = [m for m in measured if m.restore_seconds is not None]
    latencies = sorted(m.restore_seconds or 0.0 for m in restored)
    bounds = [measured_bound(m, reg, bandwidth) for m in restored]
    budget = predicted.budget_bytes or 0
    ratio = _ratios(latencies, predicted.latency)

    checks = {
        "pool_within_budget": all(v <= budget for v in replayed.pool_peaks.values()),
        "no_failures": not failed,
        "no_more_than_stored": not counts.unstored,
    }
    return BudgetRun(
        budget_rws=replayed.budget_rws,
        budget_bytes=budget,
        salt=replayed.salt,
        meta=RowMeta(started_at=replayed.started_at, elapsed_s=replayed.elapsed_s).judged(checks),
        loadavg=replayed.loadavg,
        run_queue_beside=replayed.run_queue_beside,
        pressure=replayed.pressure,
        predicted=PredictedReplay(
            restores=plan.restores,
            hit_tokens=plan.hit_tokens,
            peak_bytes_per_rank=predicted.peak_bytes,
            latency_s=predicted.latency,
            wait_s=predicted.wait,
            whole_plan_peak_bytes_per_rank=plan.whole_plan.peak_bytes,
            bound_by=predicted.bound_by,
            bandwidth_only_latency_s=alone.latency if alone is not None else None,
            cpu_load=plan.cpu_load,
        ),
        measured=MeasuredReplay(
            restores=len(restored),
            hit_tokens=sum(m.committed_tokens for m in measured),
            pool_peak_by_rank=dict(sorted(replayed.pool_peaks.items())),
            latency_s=percentiles(latencies),
            budget_wait_s=percentiles([m.budget_wait_s for m in restored]),
            kv_wait_s=percentiles([m.kv_wait_s for m in restored]),
            bound_by={b: bounds.count(b) for b in RestoreBound if b in bounds},
            failed=len(failed),
            first_failure=failed[0].error if failed else None,
        ),
        committed=counts,
        latency_ratio=ratio,
        agrees=_agrees(ratio),
        at_replay_cores=_at_replay_cores(replayed.cores_contended, at_replay, latencies),
    )


def _agrees(ratio: dict[str, float | None]) -> dict[str, bool | None]:
    return {p: None if r is None else abs(r - 1) <= AGREEMENT for p, r in ratio.items()}


def _at_replay_cores(cores: float | None, predicted: PathRun | None, latencies: list[float]) -> AtReplayCores | None:
    if cores is None or predicted is None:
        return None
    ratio = _ratios(latencies, predicted.latency)
    return AtReplayCores(round(cores, 4), predicted.latency, ratio, _agrees(ratio))


# -- stock LMCache on the same slice -------------------------------------------------------------------------------
STOCK_RESULT_PREFIX = "BSR-TRACE-RESULT "
STOCK_PROGRESS_PREFIX = "BSR-TRACE-PROGRESS "
# LMCache's blocking_timeout_secs for the stock replay: a retrieve that cannot get L1 for its whole plan gives up
# after this long and loads nothing (counted as a failure).
STOCK_DEADLINE_S = 30.0
STOCK_MIN_L1 = 64 << 20


def stock_model(reg: Registration) -> dict[str, str | int]:
    """The plugin host's model for this registration (the same bytes per token, chunk and block size), or
    CapacityError naming why LMCache cannot hold it (LMCache keeps one [2, heads, head_size] layout per engine)."""
    shapes = {t.shape for t in reg.tensors}
    dtypes = {t.dtype for t in reg.tensors}
    if len(reg.groups) != 1 or len(shapes) != 1 or len(dtypes) != 1:
        raise CapacityError(
            "LMCache keeps one KV layout per engine; this registration has several",
            hint="replay with a registration of one KV group and one tensor shape (e.g. -r demo)",
        )
    (shape,) = shapes
    if len(shape) != 3 or shape[0] != 2:
        raise CapacityError(
            f"LMCache's paged layout needs [2, kv_heads, head_size] tensors, not {list(shape)}",
            hint="replay with a registration whose tensors are [2, kv_heads, head_size] (e.g. -r demo)",
        )
    return {
        "name": reg.model,
        "layers": len(reg.tensors),
        "kv_heads": int(shape[1]),
        "head_size": int(shape[2]),
        "dtype": next(iter(dtypes)),
        "block_size": reg.groups[0].block_size,
        "chunk_size": reg.chunk_size,
        "tp_size": reg.tp_size,
    }


def stock_l1_bytes(trace: Trace, reg: Registration, whole_plan_peak: int) -> int:
    """Stock LMCache's L1 per rank: the power-of-two rung over twice the planner's whole-plan peak plus the
    largest prompt (a store stages its chunks there too), at least 64 MiB. Generous on purpose: what is compared is
    the allocator's measured high-water, and an L1 too small would make stock's retrieves fail, not its peak drop."""
    from bsr_cli.bench.peer import rung_for

    largest = max(r.input_length for r in trace.requests) * reg.bytes_per_token
    return max(STOCK_MIN_L1, rung_for(2 * (whole_plan_peak + largest)))


@dataclass(frozen=True)
class StockRequest:
    """One request of the stock replay, as its process reported it."""

    index: int
    loaded_tokens: int = 0
    loaded_by_rank: tuple[int, ...] = ()
    restore_seconds: float = 0.0
    error: str | None = None  # LMCache raised

    @classmethod
    def from_wire(cls, data: object) -> StockRequest:
        """A request of the process's JSON; what it reports beyond these is ignored (an empty error is none)."""
        said = wire.read(cls, data)
        return replace(said, restore_seconds=float(said.restore_seconds), error=said.error or None)


@dataclass(frozen=True)
class StockRun:
    """What the stock replay process reported (its result line), and whether it ran serially."""

    requests: tuple[StockRequest, ...]
    l1_peak_by_rank: dict[int, int]
    l1_bytes: int = wire.field(name="l1_capacity_bytes")
    elapsed_s: float = wire.field()
    setup_s: float = wire.field(name="setup_seconds")
    lmcache_version: str = wire.field()
    serial: bool = False  # the case's: not reported by the process
    ok: bool = False
    error: str | None = None  # why it failed, when not ok

    @classmethod
    def from_wire(cls, data: object) -> StockRun:
        """The process's result line; seconds read as floats."""
        said = wire.read(cls, data)
        return replace(said, elapsed_s=float(said.elapsed_s), setup_s=float(said.setup_s))


@dataclass
class StockCase:
    """Everything the stock replay process needs (written as its case file)."""

    trace: Trace
    reg: Registration
    speedup: float
    salt: int
    l1_bytes: int
    kv_tokens: int
    segment_bytes: int
    deadline_s: float = STOCK_DEADLINE_S
    max_clients: int = MAX_CLIENTS
    serial: bool = False  # each rank's engine serves one request at a time (vLLM's worker), else calls overlap


def stock_available() -> str | None:
    """None when the plugin venv with LMCache is there; else the one-line reason stock cannot run."""
    from bsr_cli.bench.peer import plugin_python

    try:
        plugin_python()
    except BsrError as e:
        return e.message
    return None


def replay_stock(case: StockCase, workdir: Path, on_progress: Callable[[int], None] | None = None) -> StockRun:
    """Replay the slice through stock LMCache in a process of the plugin venv, against a Mooncake master and
    segment holder started here for it (stopped afterwards). ServiceError/CapacityError with one line on failure."""
    from bsr_cli.bench.peer import CASE_SETUP_S, _kill_group, case_env, mem_available, plugin_python
    from bsr_cli.mooncake import services

    python, plugins = plugin_python()
    reg = case.reg
    model = stock_model(reg)
    need = reg.tp_size * (case.l1_bytes + case.kv_tokens * reg.bytes_per_token + (600 << 20)) + case.segment_bytes
    avail = mem_available()
    if avail and need > avail:
        needed = f"~{need >> 20:,} MiB, {avail >> 20:,} MiB available"
        raise CapacityError(f"stock LMCache's replay needs {needed}", hint=_STOCK_TOO_BIG)
    workdir.mkdir(parents=True, exist_ok=True)
    t_first = case.trace.requests[0].arrival_ms
    deadline = CASE_SETUP_S + case.trace.span_ms / 1000 / case.speedup + 600.0
    master = holder = None
    try:
        master = services.start_master(workdir / "mooncake")
        holder = services.start_segment_holder(workdir / "mooncake", master, case.segment_bytes)
        spec = {
            "model": model,
            "master": {"rpc_address": master.rpc_address, "metadata_url": master.metadata_url},
            "l1_bytes": case.l1_bytes,
            "kv_tokens": case.kv_tokens,
            "deadline_s": case.deadline_s,
            "max_clients": case.max_clients,
            "serial": case.serial,
            "salt": case.salt,
            "speedup": case.speedup,
            "block_tokens": case.trace.block_tokens,
            "requests": [
                {"arrival_ms": r.arrival_ms - t_first, "input_length": r.input_length, "hash_ids": list(r.hash_ids)}
                for r in case.trace.requests
            ],
        }
        path = workdir / "stock-trace-case.json"
        path.write_text(json.dumps(spec))
        log = workdir / "stock-trace-case.log"
        result: StockRun | None = None
        with log.open("w") as err:
            proc = subprocess.Popen(
                [str(python), "-m", "lmcache_bsr.trace_replay", str(path)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=case_env(plugins),
                cwd=str(workdir),
                start_new_session=True,
                text=True,
            )
            # The replay's deadline: its process group is killed when it passes (the read below then ends).
            timer = threading.Timer(deadline, _kill_group, args=(proc,))
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.startswith(STOCK_PROGRESS_PREFIX) and on_progress is not None:
                        on_progress(int(line[len(STOCK_PROGRESS_PREFIX) :]))
                    elif line.startswith(STOCK_RESULT_PREFIX):
                        result = StockRun.from_wire(json.loads(line[len(STOCK_RESULT_PREFIX) :]))
            finally:
                timer.cancel()
                _kill_group(proc)  # nothing it started may outlive it (it runs in its own session)
        if result is None:
            tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:]
            raise ServiceError(
                f"stock LMCache's replay exited {proc.returncode} without a result"
                + (f" within {deadline:.0f}s" if proc.returncode and proc.returncode < 0 else "")
                + (f": {tail[0]}" if tail else ""),
                hint=f"its log ({log}) says why; rerun with --no-stock to replay bsr alone",
            )
        if not result.ok:
            raise ServiceError(f"stock LMCache's replay failed: {result.error}", hint=_STOCK_FAILED)
    finally:
        if holder is not None:
            services.stop(holder, timeout=10)
        if master is not None:
            services.stop(master, timeout=10)
    return replace(result, serial=case.serial)


def expected_hits(trace: Trace, reg: Registration) -> list[int]:
    """Per request, the tokens the trace's shared prefix lets a restore commit (the planner's hit)."""
    blocks = prefix_hits(trace).blocks
    return [
        restored_tokens(r, hit_chunks(r, b, reg.chunk_size, trace.block_tokens), reg.chunk_size)
        for r, b in zip(trace.requests, blocks, strict=True)
    ]


def storable_hits(trace: Trace, reg: Registration, measured: Sequence[Measured]) -> list[int]:
    """Per request, the most tokens its restore could commit from what was stored before it ended: the prefix its
    blocks share with every request before it in the trace (``expected_hits``) or with any request after it whose
    client sent it before this one ended (under load the engine may store a later turn before it looks this one
    up). A request not measured gets its planner's hit."""
    reqs = trace.requests
    arrived = {m.index: m.arrival_s for m in measured}
    sent = {m.index: m.started_s for m in measured}
    ended = {m.index: m.started_s + m.seconds for m in measured}
    seen: set[int] = set()
    out = []
    for i, r in enumerate(reqs):
        held = seen
        if i in ended:
            later = []
            for j in range(i + 1, len(reqs)):
                if arrived.get(j, math.inf) >= ended[i]:
                    break  # sent no earlier than it arrived, and arrivals are in order: none after it either
                if sent[j] < ended[i]:
                    later.append(reqs[j].hash_ids)
            held = seen.union(*later) if later else seen
        blocks = next((k for k, b in enumerate(r.hash_ids) if b not in held), len(r.hash_ids))
        out.append(restored_tokens(r, hit_chunks(r, blocks, reg.chunk_size, trace.block_tokens), reg.chunk_size))
        seen.update(r.hash_ids)
    return out


class StockCalls(StrEnum):
    """How stock LMCache's replay called each rank's engine."""

    SERIAL = "serial"  # one request at a time per rank, as vLLM's worker calls it
    CONCURRENT = "concurrent"  # every client calls it, retrieves overlap


@dataclass(frozen=True)
class StockSummary:
    """Stock LMCache's replay of the slice against the simulated hits (``stock`` in the report)."""

    lmcache: str
    calls: StockCalls
    l1_bytes: int
    deadline_s: float
    restores: int
    hit_tokens: int
    expected_hit_tokens: int  # the hits' full chunks: what LMCache can load
    partial_chunk_tokens: int  # hit tokens in partial chunks, which LMCache does not store by default
    l1_peak_by_rank: dict[int, int]
    latency_s: Percentiles
    failed: int
    first_failure: str  # "" when none failed
    ranks_disagree: int
    committed: CommittedCounts
    elapsed_s: float
    setup_s: float

    run: ClassVar[bool] = True

    @property
    def serial(self) -> bool:
        return self.calls is StockCalls.SERIAL

    @property
    def peak_bytes_per_rank(self) -> int:
        return max(self.l1_peak_by_rank.values(), default=0)

    to_wire = wire.writer(
        order=(
            "run",
            "lmcache",
            "calls",
            "l1_bytes",
            "deadline_s",
            "restores",
            "hit_tokens",
            "expected_hit_tokens",
            "partial_chunk_tokens",
            "peak_bytes_per_rank",
            "l1_peak_by_rank",
            "latency_s",
            "failed",
            "first_failure",
            "ranks_disagree",
            "committed",
            "elapsed_s",
            "setup_s",
        )
    )
    from_wire = wire.reader()


def stock_summary(trace: Trace, reg: Registration, run: StockRun, deadline_s: float = STOCK_DEADLINE_S) -> StockSummary:
    """Stock LMCache's replay against the simulated hits. LMCache stores full chunks only (``save_unfull_chunk`` is
    off by default), so a request whose whole input is a hit can load at most its full chunks: that is what it is
    held to (``expected_hit_tokens``), and the partial chunks it cannot load are counted apart."""
    cs = reg.chunk_size
    want = expected_hits(trace, reg)
    full = [w // cs * cs for w in want]
    rows = run.requests
    # Failed: LMCache raised, or its retrieve ran into the blocking timeout (no L1 for the whole plan) short of the hit.
    failed = [r for r in rows if r.error or (r.restore_seconds >= deadline_s and r.loaded_tokens < full[r.index])]
    failed_ids = {r.index for r in failed}
    ok = [r for r in rows if r.index not in failed_ids]
    loaded = {r.index: r.loaded_tokens for r in rows}
    # A retrieve counts as a restore when LMCache loaded something or the trace says there was a prefix to load.
    latencies = sorted(r.restore_seconds for r in rows if loaded[r.index] > 0 or full[r.index] > 0)
    disagree = sum(1 for r in rows if len(set(r.loaded_by_rank or (0,))) > 1)
    return StockSummary(
        lmcache=run.lmcache_version,
        calls=StockCalls.SERIAL if run.serial else StockCalls.CONCURRENT,
        l1_bytes=run.l1_bytes,
        deadline_s=deadline_s,
        restores=sum(1 for v in loaded.values() if v > 0),
        hit_tokens=sum(loaded.values()),
        expected_hit_tokens=sum(full[r.index] for r in rows),
        partial_chunk_tokens=sum(want[r.index] - full[r.index] for r in rows),
        l1_peak_by_rank=dict(sorted(run.l1_peak_by_rank.items())),
        latency_s=percentiles(latencies),
        failed=len(failed),
        first_failure=str(failed[0].error or f"no L1 for its whole plan within {deadline_s:g}s") if failed else "",
        ranks_disagree=disagree,
        committed=CommittedCounts(
            exact=sum(1 for r in ok if loaded[r.index] == full[r.index]),
            fewer=sum(1 for r in ok if loaded[r.index] < full[r.index]),
            more=sum(1 for r in ok if loaded[r.index] > full[r.index]),
        ),
        elapsed_s=run.elapsed_s,
        setup_s=run.setup_s,
    )
