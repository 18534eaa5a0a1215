"""The evidence bundle as pydantic models: the rules every bundle obeys, and the JSON Schema generated from them.

One model per experiment's bundle (picked by ``experiment``), and per row kind: a row is picked by its ``status``
(an interrupted row needs only its ``reason``; a completed one, ``pass`` or ``fail``, its checks and evidence) and,
where an experiment mixes kinds of rows (fs-concurrency, store), by its ``kind``. Every object allows fields beyond
the ones named here (a newer bsr may add evidence); the named ones are typed strictly: an integer is never a float
or a boolean, a count or a time is never negative.

Imported only by :mod:`bsr_cli.bench.bundle`, itself imported lazily by the bench commands, so `bsr --help` never
builds these models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter

from bsr_cli.core.evidence import Outcome, RestoreBound, SegmentLossCause

EXPERIMENTS = ("ladder", "sweep", "wlaw", "fs-concurrency", "store", "failures", "peer", "cpu-bound", "trace")

NonNegInt = Annotated[StrictInt, Field(ge=0)]
PosInt = Annotated[StrictInt, Field(ge=1)]
NonNegNum = Annotated[StrictFloat, Field(ge=0)]
Time = Annotated[StrictStr, Field(pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")]
RunId = Annotated[StrictStr, Field(pattern=r"^br-[a-z0-9]+-[0-9a-f]{12}$")]
Checks = Annotated[dict[str, StrictBool], Field(min_length=1, description="each check of the row, by name")]


def _absent() -> Any:
    """An optional field: it may be left out, but when present it has the field's type (null only where the type
    says so). The default is never validated nor published (see bundle._Generator)."""
    return Field(default=None)


class _Obj(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- rows --------------------------------------------------------------------------------------------------------


class StoreLost(_Obj):
    """A segment the store lost with every object on it (bsr_cli/core/store_loss.py): whose, when, how, how much."""

    segment: StrictStr
    client_id: StrictStr
    cause: Literal[SegmentLossCause.HOLDER_GONE, SegmentLossCause.UNMOUNTED, SegmentLossCause.REMOUNTED_EMPTY]
    lost_at: NonNegNum
    last_seen_at: NonNegNum | None
    objects_lost: NonNegInt | None
    bytes_lost: NonNegInt | None


class Interrupted(_Obj):
    """A row that produced no evidence (Ctrl-C, an engine error, the store lost the objects it would read):
    excluded from the summary."""

    status: Literal["interrupted"]
    reason: StrictStr
    store_lost: StoreLost = _absent()


class _Completed(_Obj):
    status: Literal["pass", "fail"]
    checks: Checks


class StageCost(_Obj):
    wall_s: NonNegNum
    cpu_s: NonNegNum


class StageCosts(_Obj):
    """Wall and CPU seconds by stage of a restore (bsr_cli/core/stage_costs.py), and its process's CPU."""

    fetch: StageCost
    verify: StageCost
    install: StageCost
    wait: StageCost
    process_cpu_s: NonNegNum


class Rank(_Obj):
    rank: NonNegInt
    pool_peak_bytes: NonNegInt
    peak_live_bytes: NonNegInt = _absent()
    bytes_restored: NonNegInt
    seconds: NonNegNum
    fetch_seconds: NonNegNum
    install_seconds: NonNegNum
    gbps: NonNegNum = _absent()
    stages: StageCosts = _absent()


class Restore(_Obj):
    """One restore's evidence: what was committed, in how many windows, and the pool's peak against the bound."""

    # Every Outcome, or "unknown" when the engine's answer named none (bench/evidence.py UNKNOWN_OUTCOME).
    outcome: Literal[
        Outcome.COMMITTED,
        Outcome.FAILED_CLOSED,
        Outcome.REFUSED,
        Outcome.ABORTED,
        Outcome.NOTHING_TO_RESTORE,
        "unknown",
    ]
    tiers: list[StrictStr] = _absent()
    committed_tokens: NonNegInt
    chunks: NonNegInt
    windows: NonNegInt
    expected_windows: NonNegInt
    seconds: NonNegNum
    gbps: NonNegNum
    gbps_per_rank: NonNegNum = _absent()
    peak_pool_bytes: NonNegInt
    predicted_peak_bytes: NonNegInt
    rws_bytes: StrictInt | None = _absent()
    whole_plan_bytes: NonNegInt
    ranks: Annotated[list[Rank], Field(min_length=1)]
    hash_ok: StrictBool | None
    healthy: StrictBool


class RestoreRow(_Completed, Restore):
    """sweep, wlaw (and a bundle's repeat): one restore of ``tokens`` with window ``W``."""

    tokens: PosInt
    W: StrictInt


class FsWarmRow(_Completed):
    kind: Literal["warm"]


class FsDiskRow(_Completed):
    """The disk alone (no bsr): the concurrency speedup the restore is judged against."""

    kind: Literal["disk"]
    concurrency: PosInt
    threads: PosInt
    trial: NonNegInt
    files: NonNegInt
    bytes: NonNegInt
    seconds: NonNegNum
    gbps: NonNegNum


class FsRestoreRow(_Completed, Restore):
    kind: Literal["restore"]
    concurrency: PosInt
    cache: Literal["cold", "warm"]
    trial: NonNegInt


class StoreCopyRow(_Completed):
    """The store alone (a memcpy, a Mooncake put): what the restore's bandwidth is judged against."""

    kind: Literal["memcpy", "mooncake-set"]
    results: list[dict[str, Any]]


class StoreWarmRow(_Completed):
    kind: Literal["warm"]


class StoreRestoreRow(_Completed, Restore):
    kind: Literal["restore"]
    W: Any
    budget_bytes: Any
    trial: Any


class PeerRow(_Completed):
    kind: Literal["raw", "stock", "stock_contiguous", "bsr", "store", "setup"]
    tokens: PosInt
    l1_bytes: NonNegInt
    trial: NonNegInt
    W: StrictInt | None = _absent()
    outcome: StrictStr
    loaded_tokens: NonNegInt
    seconds: NonNegNum
    gbps_per_rank: NonNegNum
    l1_peak_bytes: NonNegInt = _absent()
    hash_ok: StrictBool | None = _absent()
    timed_out: StrictBool = _absent()
    cpu_s_per_gb: dict[str, NonNegNum] = _absent()
    stage_costs: StageCosts = _absent()


class FailureRow(_Completed):
    scenario: StrictStr
    fallback: StrictStr
    expected_fallback: StrictStr
    output_hash: Any
    canonical_hash: Any


class LadderAttempt(_Obj):
    rung: NonNegInt
    outcome: Any
    passed: StrictBool
    peak_pool_bytes: NonNegInt


class _LadderFields(_Obj):
    """A ladder row says what it measured even when interrupted."""

    tokens: PosInt
    whole_plan_bytes: NonNegInt
    predicted_rung: StrictInt | None
    first_passing_rung: StrictInt | None
    attempts: list[LadderAttempt]


class LadderInterrupted(_LadderFields, Interrupted):
    pass


class LadderRow(_LadderFields, _Completed):
    pass


class Latency(_Obj):
    """Restore-latency percentiles, seconds (nearest rank)."""

    p50: NonNegNum
    p95: NonNegNum
    p99: NonNegNum
    max: NonNegNum


BoundCounts = Annotated[
    dict[
        Literal[RestoreBound.BANDWIDTH, RestoreBound.CPU, RestoreBound.BUDGET, RestoreBound.DESTINATION_KV],
        NonNegInt,
    ],
    Field(description="restores by what bound them the longest"),
]


class TracePredicted(_Obj):
    restores: NonNegInt
    hit_tokens: NonNegInt
    peak_bytes_per_rank: NonNegInt
    latency_s: Latency
    wait_s: Latency
    whole_plan_peak_bytes_per_rank: NonNegInt
    bound_by: BoundCounts = _absent()
    bandwidth_only_latency_s: Latency = _absent()
    cpu_load: NonNegNum = _absent()


class TraceMeasured(_Obj):
    restores: NonNegInt
    hit_tokens: NonNegInt
    peak_bytes_per_rank: NonNegInt
    pool_peak_by_rank: dict[str, NonNegInt]
    latency_s: Latency
    budget_wait_s: Latency
    kv_wait_s: Latency
    bound_by: BoundCounts
    failed: NonNegInt
    first_failure: StrictStr | None


class TraceAtReplayCores(_Obj):
    """The prediction again at the cores the engine got during the replay while it had more work than cores."""

    cores: Annotated[StrictFloat, Field(gt=0)]
    latency_s: Latency
    latency_ratio: dict[str, NonNegNum | None]
    agrees: dict[str, StrictBool | None]


class TraceBudgetRow(_Completed):
    """bench trace: one budget B's replay of the slice, the planner's prediction beside the engine's measurement."""

    kind: Literal["budget"]
    budget_rws: PosInt
    budget_bytes: NonNegInt
    salt: StrictInt
    loadavg: Annotated[list[NonNegNum], Field(min_length=2, max_length=2)]
    run_queue_beside: NonNegNum | None
    pressure: dict[str, NonNegNum | None]
    predicted: TracePredicted
    measured: TraceMeasured
    committed: dict[str, NonNegInt]
    latency_ratio: dict[str, NonNegNum | None]
    agrees: dict[str, StrictBool | None]
    at_replay_cores: TraceAtReplayCores = _absent()


# A row is picked by its status (and, where an experiment mixes kinds, a completed one by its kind).
AnyRestoreRow = Annotated[Interrupted | RestoreRow, Field(discriminator="status")]
AnyFsRow = Annotated[
    Interrupted | Annotated[FsWarmRow | FsDiskRow | FsRestoreRow, Field(discriminator="kind")],
    Field(discriminator="status"),
]
AnyStoreRow = Annotated[
    Interrupted | Annotated[StoreCopyRow | StoreWarmRow | StoreRestoreRow, Field(discriminator="kind")],
    Field(discriminator="status"),
]
AnyPeerRow = Annotated[Interrupted | PeerRow, Field(discriminator="status")]
AnyFailureRow = Annotated[Interrupted | FailureRow, Field(discriminator="status")]
AnyLadderRow = Annotated[LadderInterrupted | LadderRow, Field(discriminator="status")]
AnyTraceRow = Annotated[Interrupted | TraceBudgetRow, Field(discriminator="status")]


# -- the envelope ------------------------------------------------------------------------------------------------


class Registration(_Obj):
    identity: Annotated[StrictStr, Field(pattern=r"^reg-[0-9a-f]{16}$")]
    model: StrictStr
    tp_size: PosInt
    chunk_size: PosInt
    bytes_per_token: NonNegInt = _absent()
    bytes_per_chunk: PosInt
    aux_bytes: NonNegInt
    groups: dict[str, NonNegInt]


class EngineInfo(_Obj):
    """The engine's GET /info at the start of the block."""

    api: Any
    registration: Any
    chunk_size: Any
    tiers: Any
    pool_bytes: Any
    budget_bytes: Any


class Engine(_Obj):
    url: StrictStr
    info: EngineInfo
    embedded: StrictBool = _absent()
    startup_s: StrictFloat | None = _absent()
    settings_restored: StrictBool = _absent()
    restarted_per_rung: StrictBool = _absent()
    rungs: list[dict[str, Any]] = _absent()


class Machine(_Obj):
    cpu_count: NonNegInt
    memory_bytes: NonNegInt
    python: StrictStr
    torch: StrictStr | None
    mooncake: StrictStr | None = _absent()
    platform: StrictStr = _absent()
    loadavg: list[StrictFloat] = _absent()


class Repeat(_Obj):
    """The block run again with another salt (the same rows, a fresh run id)."""

    run_id: RunId
    salt: StrictInt
    rows: list[AnyRestoreRow]


class Target(_Obj):
    name: StrictStr
    target: StrictStr
    measured: Any
    met: StrictBool | None
    note: StrictStr = _absent()


class _Bundle(_Obj):
    bundle_schema: Literal["bsr.bench/1"] = Field(alias="schema")
    kind: Literal["bsr.bench"]
    run_id: RunId
    salt: StrictInt | None = Field(description="seed of the synthetic prompts (null: none used)")
    bsr_version: StrictStr = _absent()
    started_at: Time
    finished_at: Time
    elapsed_s: NonNegNum
    registration: Registration
    engine: Engine
    machine: Machine
    params: dict[str, Any]
    repeat: Repeat = _absent()
    summary: dict[str, Any]
    targets: list[Target]
    interrupted: StrictBool
    interrupted_by: Literal["operator", "error"] | None = _absent()
    ok: StrictBool


class LadderBundle(_Bundle):
    experiment: Literal["ladder"]
    rows: list[AnyLadderRow]


class SweepBundle(_Bundle):
    experiment: Literal["sweep"]
    rows: list[AnyRestoreRow]


class WlawBundle(_Bundle):
    experiment: Literal["wlaw"]
    rows: list[AnyRestoreRow]


class FsConcurrencyBundle(_Bundle):
    experiment: Literal["fs-concurrency"]
    rows: list[AnyFsRow]


class StoreBundle(_Bundle):
    experiment: Literal["store"]
    rows: list[AnyStoreRow]


class FailuresBundle(_Bundle):
    experiment: Literal["failures"]
    rows: list[AnyFailureRow]


class PeerBundle(_Bundle):
    experiment: Literal["peer"]
    rows: list[AnyPeerRow]


class CpuBoundBundle(_Bundle):
    """cpu-bound's rows are its own (one per measured step); the envelope is the same."""

    experiment: Literal["cpu-bound"]
    rows: list[Any]


class TraceBundle(_Bundle):
    """bench trace: one row per budget B; the summary carries the calibration the predictions used."""

    experiment: Literal["trace"]
    rows: list[AnyTraceRow]


Bundle = Annotated[
    LadderBundle
    | SweepBundle
    | WlawBundle
    | FsConcurrencyBundle
    | StoreBundle
    | FailuresBundle
    | PeerBundle
    | CpuBoundBundle
    | TraceBundle,
    Field(discriminator="experiment"),
]

BUNDLE: TypeAdapter[Any] = TypeAdapter(Bundle)
