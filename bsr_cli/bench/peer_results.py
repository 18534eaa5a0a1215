"""The results of `bsr bench peer` (bsr_cli/bench/peer.py runs it): what a case process reported, each row,
the summary per prefix and the bundle. Each type that reaches the bundle file writes its JSON once (``to_wire``,
the keys in the order bundles have always had them); the summary reads older bundles back (``from_wire``) for
`bsr bench show`."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from bsr_cli import __version__
from bsr_cli.bench.evidence import (
    Bundle,
    Interruption,
    MachineInfo,
    RegistrationIdentity,
    RowMeta,
    RowStatus,
    SentRecord,
    Target,
)
from bsr_cli.core import wire
from bsr_cli.core.evidence import TimedStage
from bsr_cli.core.stage_costs import OTHER_CPU, StageCosts
from bsr_cli.core.store_loss import SegmentLoss


@dataclass(frozen=True)
class PeerModel:
    """The model every case process builds its KV for (16 KiB per token per rank by default)."""

    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str = "bf16"
    block_size: int = 16
    chunk_size: int = 256

    to_wire = wire.writer()


@dataclass(frozen=True, kw_only=True)
class ModelOnRanks:
    """The model and the tensor-parallel size its KV is split over (a case's model, the run's params)."""

    model: PeerModel = wire.field(flatten=True)  # the model's keys, then tp_size
    tp_size: int

    to_wire = wire.writer()


class PeerKind(StrEnum):
    """What a row of the comparison measured."""

    RAW = "raw"  # a raw Mooncake batch_get_into of the objects LMCache stored
    STOCK = "stock"  # LMCache's own retrieve into the paged KV
    STOCK_CONTIGUOUS = "stock_contiguous"  # stock's retrieve into a contiguous destination, after its lookup
    BSR = "bsr"  # bsr's windowed restore inside LMCache
    STORE = "store"  # storing the prompt once (a row only when it failed)
    SETUP = "setup"  # the services around the cases (a row only when they failed)


MEASURED_KINDS = (PeerKind.RAW, PeerKind.STOCK, PeerKind.STOCK_CONTIGUOUS, PeerKind.BSR)

# One rank's figures as a case process reports them (flat JSON values; stock and bsr report different ones).
RankReport = dict[str, int | float | str | bool | None]


@dataclass(frozen=True)
class CaseResult:
    """What one case process reported (plugins/lmcache_bsr/peer.py prints it as JSON), or why it reported nothing."""

    ok: bool = False
    error: str | None = None
    killed: bool = False  # passed its deadline: its process group was killed
    outcome: str | None = None
    loaded_tokens: int = 0
    seconds: float = 0.0
    l1_peak_bytes: int = 0
    l1_capacity_bytes: int = 0  # 0: not reported (the row shows the case's L1 then)
    hash_ok: bool | None = None
    timed_out: bool = False
    windows: int = 0
    setup_seconds: float | None = None
    nice: int | None = None
    ranks: tuple[RankReport, ...] = ()
    stage_seconds: dict[str, float] | None = None  # stock's retrieve by stage
    destination: str | None = None
    untimed_lookup_seconds: float | None = None
    cpu: dict[str, float] | None = None  # CPU seconds by process, from /proc
    install_cpu_seconds: float = 0.0
    stage_costs: StageCosts | None = None  # wall and CPU seconds by stage (a case of an older build: none)

    @classmethod
    def from_wire(cls, data: object) -> CaseResult:
        """The case's JSON line; fields it does not report keep their defaults, ones added later are ignored. An
        empty outcome, stage map or CPU map reads as not reported, and seconds read as floats."""
        said = wire.read(cls, data)
        return replace(
            said,
            outcome=said.outcome or None,
            seconds=float(said.seconds),
            stage_seconds=said.stage_seconds or None,
            cpu=said.cpu or None,
            install_cpu_seconds=float(said.install_cpu_seconds),
        )


@dataclass(frozen=True)
class StockStages:
    """Stock's retrieve by stage (wall seconds, summed over ranks): lookup, fetch (L1 allocation + transfer),
    install (the connector's copies); what is left of the call is key hashing and bookkeeping."""

    seconds: dict[str, float] = wire.field(name="stage_seconds")
    destination: str | None = wire.field()
    # the lookup before the clock (the contiguous case only; no key when None)
    untimed_lookup_seconds: float | None = wire.field(omit_none=True)


@dataclass(frozen=True)
class CpuCost:
    """CPU seconds of a restore (case process, master, segment holder) and per GB restored."""

    seconds: dict[str, float] = wire.field(name="cpu_seconds")
    per_gb: dict[str, float] = wire.field(name="cpu_s_per_gb")  # by process, and "total"
    install_per_gb: float = wire.field(name="install_cpu_s_per_gb")


@dataclass(frozen=True)
class PeerMeasurement:
    """What a completed case measured, as its row keeps it."""

    outcome: str
    loaded_tokens: int
    seconds: float
    gbps_per_rank: float
    l1_peak_bytes: int
    l1_capacity_bytes: int
    hash_ok: bool | None
    timed_out: bool
    windows: int
    setup_seconds: float | None
    nice: int | None
    ranks: tuple[RankReport, ...]
    stages: StockStages | None  # its keys are written beside the others (so are the CPU cost's)
    cpu: CpuCost | None  # only when the whole prefix was loaded
    stage_costs: StageCosts | None = wire.field(omit_none=True, default=None)  # by stage, summed over the ranks


@dataclass(frozen=True)
class PeerRow:
    """One row of the comparison: a case (kind, prefix, L1, trial, W) and what it measured, or why it did not;
    a store or setup row (no L1) only says why the run stopped."""

    kind: PeerKind
    tokens: int
    status: RowStatus
    l1_bytes: int | None = None
    trial: int = 0
    w: int | None = None
    measured: PeerMeasurement | None = None
    reason: str | None = None
    checks: dict[str, bool] = field(default_factory=dict)
    store_lost: SegmentLoss | None = None  # the store lost the prompt's objects before this case could run

    @property
    def meta(self) -> RowMeta:
        return RowMeta(status=self.status, checks=self.checks, reason=self.reason)

    def to_wire(self) -> dict[str, Any]:
        """The row's JSON: the case, then what it measured (the stages' and the CPU cost's keys among them) and its
        checks, the status last; a row that measured nothing says only why."""
        case = {"l1_bytes": self.l1_bytes, "trial": self.trial, "W": self.w} if self.l1_bytes is not None else {}
        head = {"kind": self.kind.value, "tokens": self.tokens, **case}
        if self.measured is None:
            lost = {} if self.store_lost is None else {"store_lost": self.store_lost.to_wire()}
            return head | {"status": self.status.value, "reason": self.reason} | lost
        measured = wire.write(self.measured)
        stages, cpu = measured.pop("stages") or {}, measured.pop("cpu") or {}
        why = {} if self.reason is None else {"reason": self.reason}
        return head | measured | stages | cpu | why | {"checks": self.checks, "status": self.status.value}


@dataclass(frozen=True)
class PeerParams:
    """What the run was asked to measure."""

    tokens: tuple[int, ...]
    w: int
    tp: int
    trials: int
    deadline_s: float
    below_rung_l1_bytes: tuple[int, ...]
    bsr_windows: int
    bsr_l1_bytes: int
    model: PeerModel
    rws_bytes: int


@dataclass(frozen=True)
class PeerBundle:
    """The evidence bundle of one `bsr bench peer` run (validated against docs/bench-schema.json when written)."""

    run_id: str
    salt: int
    started_at: str
    finished_at: str
    elapsed_s: float
    registration: RegistrationIdentity
    lmcache_python: str  # the plugin venv's interpreter, shown relative to the checkout
    machine: MachineInfo
    params: PeerParams
    rows: tuple[PeerRow, ...]
    summary: PeerSummary
    targets: tuple[Target, ...]
    interrupted_by: Interruption | None = None

    @property
    def ok(self) -> bool:
        return self.interrupted_by is None and all(r.status == RowStatus.PASS for r in self.rows)

    def to_bundle(self) -> Bundle:
        p, reg = self.params, self.registration
        return Bundle(
            experiment="peer",
            run_id=self.run_id,
            salt=self.salt,
            bsr_version=__version__,
            started_at=self.started_at,
            finished_at=self.finished_at,
            elapsed_s=self.elapsed_s,
            registration=reg,
            engine={
                "url": "lmcache-host (one process per case, plugin venv)",
                "embedded": False,
                "startup_s": None,
                "info": {
                    "api": "lmcache_bsr.peer",
                    "registration": reg.identity,
                    "chunk_size": reg.chunk_size,
                    "tiers": ["mooncake"],
                    "pool_bytes": p.bsr_l1_bytes,
                    "budget_bytes": p.bsr_l1_bytes,
                    "lmcache_python": self.lmcache_python,
                },
            },
            machine=self.machine,
            params=SentRecord(  # the bundle's params: PeerParams with its model on the ranks
                {
                    "tokens": list(p.tokens),
                    "W": p.w,
                    "tp": p.tp,
                    "trials": p.trials,
                    "deadline_s": p.deadline_s,
                    "below_rung_l1_bytes": list(p.below_rung_l1_bytes),
                    "bsr_windows": p.bsr_windows,
                    "bsr_l1_bytes": p.bsr_l1_bytes,
                    "model": ModelOnRanks(model=p.model, tp_size=p.tp).to_wire(),
                    "rws_bytes": p.rws_bytes,
                }
            ),
            rows=list(self.rows),
            summary=self.summary,
            targets=self.targets,
            interrupted=self.interrupted_by is not None,
            interrupted_by=self.interrupted_by,
            ok=self.ok,
        )

    def to_wire(self) -> dict[str, Any]:
        return self.to_bundle().to_wire()


def _med(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


@dataclass(frozen=True)
class PeerSide:
    """Medians of one kind's rows at one prefix (stage seconds only where the case reported them: stock)."""

    gbps_per_rank: float | None
    seconds: float | None
    l1_peak_bytes: int | None
    loaded_tokens: int | None
    cpu_s_per_gb: float | None
    install_cpu_s_per_gb: float | None
    cpu_s_per_gb_by_process: dict[str, float | None]
    stage_seconds: dict[str, float | None] | None = None  # absent from bundles before the stock stages
    stage_costs: StageSide | None = None  # absent from bundles before the stage costs

    from_wire = wire.reader()  # a side as a bundle holds it (older bundles lack the stage seconds and costs)

    @classmethod
    def of(cls, rs: Sequence[PeerMeasurement], nbytes: int = 0) -> PeerSide:
        """Medians of ``rs``, each of which restored ``nbytes`` (every rank's bytes: the CPU per GB's divisor)."""
        staged = [r.stages.seconds for r in rs if r.stages is not None]
        costs = [r.cpu for r in rs if r.cpu is not None and r.cpu.per_gb]
        return cls(
            gbps_per_rank=_med([r.gbps_per_rank for r in rs]),
            seconds=_med([r.seconds for r in rs]),
            l1_peak_bytes=max((r.l1_peak_bytes for r in rs), default=None),
            loaded_tokens=min((r.loaded_tokens for r in rs), default=None),
            cpu_s_per_gb=_med([c.per_gb["total"] for c in costs]),
            install_cpu_s_per_gb=_med([r.cpu.install_per_gb for r in rs if r.cpu is not None]),
            cpu_s_per_gb_by_process={
                k: _med([c.per_gb.get(k) for c in costs]) for k in ("process", "master", "segment_holder")
            },
            stage_seconds={k: _med([st.get(k) for st in staged]) for k in ("lookup", "fetch", "install")}
            if staged
            else None,
            stage_costs=StageSide.of([r.stage_costs for r in rs if r.stage_costs is not None and r.cpu], nbytes),
        )


@dataclass(frozen=True)
class StageSide:
    """Medians of one kind's stage costs at one prefix (``core.stage_costs``): wall seconds per stage, and CPU
    seconds per GB restored per stage and for the rest of the process (``other``: the transport's own threads, key
    hashing, bookkeeping)."""

    wall_s: dict[str, float | None]  # by TimedStage
    cpu_s_per_gb: dict[str, float | None]  # by TimedStage, and OTHER_CPU

    from_wire = wire.reader()

    @classmethod
    def of(cls, costs: Sequence[StageCosts], nbytes: int) -> StageSide | None:
        if not costs or nbytes <= 0:
            return None
        gb = nbytes / 1e9
        per_gb = {s.value: _med([c.of(s).cpu_s / gb for c in costs]) for s in TimedStage}
        per_gb[OTHER_CPU] = _med([max(c.process_cpu_s - c.staged_cpu_s, 0.0) / gb for c in costs])
        return cls({s.value: _med([c.of(s).wall_s for c in costs]) for s in TimedStage}, per_gb)


@dataclass(frozen=True)
class BelowRung:
    """Stock LMCache at an L1 below its rung, and whether bsr committed with that L1 or less."""

    l1_bytes: int
    loaded_tokens: int
    outcome: str
    timed_out: bool
    seconds: float
    bsr_committed_at_this_l1: bool


@dataclass(frozen=True)
class PeerPrefix:
    """One prefix: medians of raw, both stock installs at their rung and bsr; ratios from the same run (of the
    medians, and per trial); below-rung outcomes. Fields in the bundle's key order."""

    tokens: int
    whole_plan_bytes: int
    stock_rung_bytes: int
    raw: PeerSide
    stock: PeerSide
    stock_contiguous: PeerSide | None  # None: a bundle from before the contiguous case
    bsr: PeerSide
    bsr_vs_stock_gbps: float | None
    bsr_vs_stock_contiguous_gbps: float | None
    bsr_vs_raw_gbps: float | None
    stock_vs_raw_gbps: float | None
    stock_contiguous_vs_raw_gbps: float | None
    per_trial: dict[str, list[float]] | None  # ratios within each trial, by pair
    bsr_vs_stock_staging: float | None
    bsr_vs_raw_cpu: float | None
    stock_vs_raw_cpu: float | None
    stock_contiguous_vs_raw_cpu: float | None
    below_rung: tuple[BelowRung, ...]


@dataclass(frozen=True)
class PeerSummary:
    by_prefix: dict[str, PeerPrefix]  # by the prefix's tokens, as a string (a JSON key)
    w: int = wire.field(name="W")
    rws_bytes: int = wire.field()

    to_wire = wire.writer()
    from_wire = wire.reader()  # a bundle's summary, older ones included (no contiguous case, no per-trial ratios)

    @property
    def top(self) -> PeerPrefix | None:
        """The largest prefix measured: what the targets are judged at."""
        return self.by_prefix[max(self.by_prefix, key=int)] if self.by_prefix else None
