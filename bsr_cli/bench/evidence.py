"""The evidence bundle every experiment writes, and the measurement they share.

Every experiment takes an `AdminClient` (the ladder takes an engine factory instead: it must change the pool
capacity, which only an engine restart can do) and returns a `Bundle` whose wire form validates against
docs/bench-schema.json (`bsr_cli.bench.bundle`): a run id (``br-<tag>-`` + 12 hex), the salt (the synthetic
prompt seed), the registration identity, the engine's settings (``/info``), machine facts, timestamps, one row
per measurement, a summary and the targets it was measured against.

Rows are evidence, not timings to assert: each carries its acceptance checks and a status ``pass`` / ``fail``, or
``interrupted`` when it could not finish (Ctrl-C, an engine error). Interrupted rows stay in the bundle, marked,
and are never counted in a summary. After Ctrl-C the experiment stops, asks the engine to abort the restore in
flight, restores the settings it changed and still returns its bundle.

Experiments change engine settings (the admission budget B, the filesystem load concurrency) through
``POST /settings`` and put them back afterwards; they never restart an engine, except the ladder through its
factory. `Run` is one experiment block (envelope, rows, the restore in flight); `Run.restore` is the one
measurement every experiment shares.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import secrets
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import Field, dataclass, fields, replace
from dataclasses import field as dataclass_field
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, Self, TypeVar, cast

from bsr_cli import __version__
from bsr_cli.core import accounting, wire
from bsr_cli.core.evidence import Outcome, RankState
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import SubmitResult
from bsr_cli.core.stage_costs import StageCosts
from bsr_cli.core.status import EngineInfo, PoolEntry
from bsr_cli.errors import (
    AlreadyEnded,
    BadRequest,
    CapacityError,
    EngineError,
    HostOverloaded,
    InvalidInput,
    RankRestarting,
    ServiceError,
)

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


BUNDLE_SCHEMA = "bsr.bench/1"

T = TypeVar("T")
UNKNOWN_OUTCOME = "unknown"  # a restore answer without an outcome (bench/models.py spells it in the schema too)


class RowStatus(StrEnum):
    """A bundle row's status: only completed rows (pass or fail) are evidence a summary may count."""

    PASS = "pass"
    FAIL = "fail"
    INTERRUPTED = "interrupted"  # Ctrl-C or an engine error: kept in the bundle, marked, never counted


class Interruption(StrEnum):
    """Why an experiment block stopped early."""

    OPERATOR = "operator"  # Ctrl-C
    ERROR = "error"  # an engine or service error


# -- small helpers ---------------------------------------------------------------------------------------------


def new_run_id(tag: str) -> str:
    return f"br-{tag}-{secrets.token_hex(6)}"


def new_salt() -> int:
    return secrets.randbelow(1 << 31)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class MachineInfo:
    """Facts about the machine running the benchmark (the engine's, when it is the embedded one)."""

    cpu_count: int
    memory_bytes: int
    python: str
    torch: str | None
    mooncake: str | None
    platform: str
    loadavg: list[float]  # other work on the machine skews timings: how busy it was at the start

    to_wire = wire.writer()
    from_wire = wire.reader()


def machine_info() -> MachineInfo:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return MachineInfo(
        cpu_count=os.cpu_count() or 0,
        memory_bytes=int(memory),
        python=platform.python_version(),
        torch=_dist_version("torch"),
        mooncake=_dist_version("mooncake-transfer-engine-non-cuda") or _dist_version("mooncake-transfer-engine"),
        platform=platform.platform(),
        loadavg=load,
    )


@dataclass(frozen=True)
class RegistrationIdentity:
    """The registration a bundle was measured with: its identity and the sizes every byte count derives from."""

    identity: str
    model: str
    tp_size: int
    chunk_size: int
    bytes_per_token: int
    bytes_per_chunk: int
    aux_bytes: int
    groups: dict[str, int]  # bytes per chunk per rank, by KV group

    to_wire = wire.writer()
    from_wire = wire.reader()


def registration_identity(reg: Registration) -> RegistrationIdentity:
    return RegistrationIdentity(
        identity=reg.identity,
        model=reg.model,
        tp_size=reg.tp_size,
        chunk_size=reg.chunk_size,
        bytes_per_token=reg.bytes_per_token,
        bytes_per_chunk=reg.bytes_per_chunk,
        aux_bytes=reg.aux_bytes,
        groups={g: reg.group_bytes_per_chunk(g) for g in reg.group_names},
    )


@dataclass(frozen=True, kw_only=True)
class RowMeta:
    """What every bench row carries around its measurement: its status, when it started, its acceptance checks,
    why it stopped and how long it took. A row holds one as ``meta``; each change gives a new value. A row's wire
    form (`write_row`) is its status, its labels, ``started_at``, its measurement, then the other keys of this."""

    status: RowStatus = RowStatus.INTERRUPTED  # until the row is judged
    # None only for the ladder's rows: each gathers attempts made at several rungs (no "started_at" key)
    started_at: str | None = wire.field(omit_none=True, default=None)
    checks: dict[str, bool] | None = wire.field(omit_none=True, default=None)  # None: not judged
    reason: str | None = wire.field(omit_none=True, default=None)  # why it was interrupted
    elapsed_s: float | None = wire.field(omit_none=True, default=None)  # None: the ladder's rows

    to_wire = wire.writer()
    from_wire = wire.reader()

    def judged(self, checks: dict[str, bool]) -> RowMeta:
        return replace(self, checks=checks, status=RowStatus.PASS if all(checks.values()) else RowStatus.FAIL)

    def stopped(self, reason: str) -> RowMeta:
        return replace(self, status=RowStatus.INTERRUPTED, reason=reason)

    def timed(self, elapsed_s: float) -> RowMeta:
        return replace(self, elapsed_s=elapsed_s)


class Row(Protocol):
    """What `Run` needs of an experiment's row: a frozen dataclass holding its `RowMeta` as ``meta`` (which `Run`
    replaces when the row is stopped or timed), and its wire form."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # a dataclass: `dataclasses.replace` applies

    @property
    def meta(self) -> RowMeta: ...

    def to_wire(self) -> dict[str, Any]: ...


OnRow = Callable[[Row], None]  # told of each finished row (the progress note)


class Record(Protocol):
    """An experiment's params or summary: a dataclass the codec writes (or a `SentRecord`)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


@dataclass(frozen=True)
class SentRecord:
    """Params or a summary bsr reads no type for (the experiment's type does not read every bundle back as it was
    written, or bsr has none): kept as sent and written back byte for byte."""

    fields: wire.JsonObject = wire.field(extra=True)  # free-form JSON by definition: what bsr has no type for

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class SentRow:
    """A row bsr reads no type for (an experiment it has no row reader for, or a newer bsr's): kept as sent and
    written back byte for byte; only its `RowMeta` part is read."""

    fields: wire.JsonObject = wire.field(extra=True)

    to_wire = wire.writer()
    from_wire = wire.reader()

    @property
    def meta(self) -> RowMeta:
        return RowMeta.from_wire(self.fields)


def record_wire(record: Record) -> dict[str, Any]:
    """A record's JSON, whatever its type: what a table reads of an experiment whose record is kept as sent."""
    return dict(wire.value_to_wire(record))


def record_of(cls: type[T], record: Record) -> T:
    """``record`` as its experiment's type, the one a bundle is read back as (`ExperimentTypes`) and written as."""
    if not isinstance(record, cls):
        raise TypeError(f"a {type(record).__name__} where a {cls.__name__} belongs")
    return record


@dataclass(frozen=True)
class ExperimentTypes:
    """The types a bundle of one experiment is read back as: its params' and its summary's (None: kept as sent, a
    `SentRecord`), and its rows' reader (by the row's kind where an experiment writes several; `SentRow.from_wire`:
    kept as sent). `bsr_cli.bench.bundle` lists each experiment's, above the experiments' modules, so this one
    imports none of them; only types whose wire form is every committed bundle's (tests/bench/test_schema.py)."""

    params: type | None = None
    summary: type | None = None
    read_row: Callable[[object], Row] = SentRow.from_wire


KEPT_AS_SENT = ExperimentTypes()  # an experiment bsr reads no type for (or a newer bsr's)


def read_record(cls: type | None, data: object) -> Record:
    if cls is None:
        return SentRecord.from_wire(data)
    record: Record = wire.read(cls, data)
    return record


def read_rows(read_row: Callable[[object], Row], rows: object) -> list[Row]:
    return [read_row(r) for r in rows] if isinstance(rows, list) else []


# -- a row's wire form: its meta and its measurement flattened among its own keys ----------------------------------
# The codec (bsr_cli.core.wire) writes a nested value under its field's key; a bench row instead writes its meta's
# keys and its measurement's keys beside its own, as bundles always have. Two field kinds say how:
_FLAT = "bench_flat"  # the key whose presence in a row says the flattened value was written
_FLAT_WRITE = "bench_flat_write"  # how the value's keys are written (default: its own wire form)
_WRITTEN_WITH = "bench_written_with"  # the field whose value being set decides whether this key is written


def flat(*, present: str, write: Callable[[Any], wire.JsonObject] | None = None) -> Any:
    """A row's measurement, None until measured: its keys are written beside the row's own when it is set and read
    back (from the whole row) when the row holds the key ``present``."""
    return dataclass_field(default=None, metadata={_FLAT: present, _FLAT_WRITE: write})


def written_with(other: str) -> Any:
    """A row's field written (null included) exactly when the field ``other`` is set (what the restore brings)."""
    return dataclass_field(default=None, metadata={_WRITTEN_WITH: other})


def write_row(row: Row) -> dict[str, Any]:
    """A row's JSON: ``status``, the row's fields in order (``meta`` gives ``started_at`` where it stands, a `flat`
    field its keys), then the meta's other keys (checks, reason, elapsed_s)."""
    meta = row.meta.to_wire()
    out = {"status": meta.pop("status")}
    spec = {f.name: f.metadata for f in fields(row)}
    for key, value in wire.write(row).items():
        if key == "meta":
            if "started_at" in meta:
                out["started_at"] = meta.pop("started_at")
        elif _FLAT in spec[key]:
            measured = getattr(row, key)
            if measured is not None:
                out |= (spec[key][_FLAT_WRITE] or wire.value_to_wire)(measured)
        elif _WRITTEN_WITH not in spec[key] or getattr(row, spec[key][_WRITTEN_WITH]) is not None:
            out[key] = value
    return out | meta


def read_row(cls: type[T], data: object) -> T:
    """A row read back from a bundle: its meta and each `flat` field read from the row's own keys."""
    d = data if isinstance(data, Mapping) else {}
    view = {**d, "meta": d}
    for f in fields(cast(Any, cls)):
        if (present := f.metadata.get(_FLAT)) is not None:
            view[f.name] = d if present in d else None
    return wire.read(cls, view)


class BenchRow:
    """A bench row's wire methods (`write_row`, `read_row`), for a frozen dataclass holding its `RowMeta` as
    ``meta``."""

    def to_wire(self) -> dict[str, Any]:
        return write_row(cast(Row, self))

    @classmethod
    def from_wire(cls, data: object) -> Self:
        return read_row(cls, data)


R = TypeVar("R", bound=Row)


def completed(rows: Sequence[R]) -> list[R]:
    """Rows that produced evidence: the only ones a summary may count."""
    return [r for r in rows if r.meta.status != RowStatus.INTERRUPTED]


def rows_of(cls: type[T], rows: Iterable[Row]) -> list[T]:
    """The rows of one row type among ``rows`` (a bundle's, read by its experiment's `ExperimentTypes`)."""
    return [r for r in rows if isinstance(r, cls)]


# What a target reports as measured: a number, a phrase, or a few of them by name. The sequence comes first: the
# codec reads a list or an object under it as sent (a number or a phrase matches its own type first).
Measurement = Sequence[int | float | str] | Mapping[str, int | float | str | None] | str | int | float | bool | None


@dataclass(frozen=True)
class Target:
    """One target a bundle was measured against, and whether it was met (None: not applicable this run)."""

    name: str
    target: str
    measured: Measurement
    met: bool | None
    note: str | None = wire.field(omit_none=True, default=None)  # None: no note key (bench peer's targets)

    to_wire = wire.writer()
    from_wire = wire.reader()


def target(name: str, wanted: str, measured: Measurement, met: bool | None, note: str = "") -> Target:
    return Target(name, wanted, measured, met, note)


@dataclass(frozen=True)
class Repeat:
    """The sweep's repeat of its largest row with a fresh salt: a block of its own, with its own run id."""

    run_id: str
    salt: int
    rows: list[Row]  # the sweep's rows, as the main rows

    to_wire = wire.writer()

    @classmethod
    def from_wire(cls, data: object, read_row: Callable[[object], Row]) -> Repeat:
        """The repeat in a bundle, its rows read as the main rows (``read_row``: the experiment's)."""
        d = data if isinstance(data, Mapping) else {}
        return wire.read(cls, {**d, "rows": read_rows(read_row, d.get("rows"))})


@dataclass(frozen=True, kw_only=True)
class Bundle:
    """One experiment block's evidence bundle (docs/bench-schema.json), fields in the bundle's key order.

    Rows are each experiment's row type (`ExperimentTypes`: the rows of an experiment bsr has no reader for are kept
    as sent); the summary and params are each experiment's own records in their wire form; ``engine`` is the
    engine's /info and the facts the experiment adds about it (embedded, start-up time, settings put back), in the
    order written.
    """

    experiment: str
    run_id: str
    salt: int | None
    bsr_version: str | None = wire.field(omit_none=True)  # None: no bsr_version key (cpu-bound's)
    started_at: str
    finished_at: str
    elapsed_s: float
    registration: RegistrationIdentity
    engine: wire.JsonObject
    machine: MachineInfo
    params: Record
    rows: list[Row]
    summary: Record
    targets: tuple[Target, ...]
    interrupted: bool
    interrupted_by: Interruption | None
    ok: bool
    repeat: Repeat | None = wire.field(omit_none=True, default=None)  # the sweep's

    schema: ClassVar[str] = BUNDLE_SCHEMA
    kind: ClassVar[str] = "bsr.bench"

    def every_row(self) -> list[Row]:
        """The main rows, then the repeat's."""
        return self.rows + (self.repeat.rows if self.repeat else [])

    # The bundle's JSON: its schema and kind, then its fields.
    to_wire = wire.writer(
        order=(
            "schema",
            "kind",
            "experiment",
            "run_id",
            "salt",
            "bsr_version",
            "started_at",
            "finished_at",
            "elapsed_s",
            "registration",
            "engine",
            "machine",
            "params",
            "rows",
            "summary",
            "targets",
            "interrupted",
            "interrupted_by",
            "ok",
            "repeat",
        )
    )

    @classmethod
    def from_wire(cls, data: object, types: ExperimentTypes) -> Bundle:
        """A bundle read back from its file (validated against the schema first), its params, rows and summary as
        ``types``, its experiment's (`bsr_cli.bench.bundle.from_wire` picks them by the bundle's experiment)."""
        d = data if isinstance(data, Mapping) else {}
        repeat = d.get("repeat")
        read = {  # read by the experiment's types: the codec passes them on as they are
            "params": read_record(types.params, d.get("params")),
            "rows": read_rows(types.read_row, d.get("rows")),
            "summary": read_record(types.summary, d.get("summary")),
            "repeat": Repeat.from_wire(repeat, types.read_row) if isinstance(repeat, Mapping) else None,
        }
        return wire.read(cls, {**d, **read})


@dataclass(frozen=True)
class BundleFiles:
    """The files a printed bundle was written to: the bundle and the plots drawn from it."""

    bundle: str
    plots: list[str]

    to_wire = wire.writer()


@dataclass(frozen=True, kw_only=True)
class PublishedBundle:
    """A bundle as `bsr bench` prints it: with the files it was written to and the plots drawn from it."""

    bundle: Bundle = wire.field(flatten=True)  # the bundle's keys, then its files
    files: BundleFiles

    to_wire = wire.writer()


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def gbps(nbytes: float, seconds: float) -> float:
    """GB/s, to four places (0 for no time)."""
    return round(nbytes / seconds / 1e9, 4) if seconds > 0 else 0.0


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


# How long a bench waits for every rank to report its restore pool (a rank restarting, starved or stopped reports
# none): a rank started again after a crash answers within it.
POOL_REPORT_WAIT_S = 20.0


def pool_capacity(client: AdminClient, wait_s: float = POOL_REPORT_WAIT_S) -> int:
    """The smallest restore pool of the engine's ranks, as each reports it. A rank that reports none leaves the
    capacity unknown, never 0: waited for up to ``wait_s``, then refused naming the rank and why it is silent."""
    end = time.monotonic() + wait_s
    while True:
        ranks = client.pool()
        silent = [r for r in ranks if "capacity_bytes" not in (r.pool or {})]
        if not silent:
            return min((int((r.pool or {})["capacity_bytes"]) for r in ranks), default=0)
        if time.monotonic() >= end:
            raise _pool_not_reported(silent[0])
        time.sleep(0.5)  # polls the ranks' reports


def _pool_not_reported(rank: PoolEntry) -> EngineError:
    """The refusal for a rank that did not report its pool: the host's when it is starved, a restart's when its
    process is gone, else the engine's (a rank stopped, hung, or not answering)."""
    why = rank.error or rank.reason or f"its state is {rank.state.value}"
    message = f"rank {rank.rank} did not report its restore pool ({why}): the bench cannot size its prompts"
    hint = "run the bench again once `bsr status` shows every rank healthy"
    if rank.state is RankState.STARVED:
        return HostOverloaded(message, hint=hint)
    if rank.state is RankState.DEAD or (not rank.alive and rank.error is None):  # no process, not a failed call
        return RankRestarting(message, hint=hint, rank=rank.rank)
    return EngineError(message, hint=hint)


def require_tokens(info: EngineInfo, tokens: int) -> None:
    if info.host_fields.get("serves_restores") is False:  # e.g. a vLLM worker: KV moves only through vLLM there
        raise BadRequest(
            f"the bench is not served from {info.engine or 'this engine'}: it submits and restores, which this "
            "endpoint refuses (not served from a vLLM worker: KV moves only through vLLM's scheduler)",
            hint="run the bench against the embedded engine or the LMCache host (--embedded)",
        )
    if tokens > info.max_tokens or tokens > info.kv_tokens:
        raise InvalidInput(
            f"the engine accepts prompts up to {info.max_tokens:,} tokens with {info.kv_tokens:,} KV "
            f"tokens; this experiment needs {tokens:,}",
            hint=f"restart it with --max-tokens {tokens} --kv-tokens {tokens}, or run the bench with --embedded",
        )


def require_pool(client: AdminClient, need: int, what: str) -> int:
    cap = pool_capacity(client)
    if cap < need:
        raise InvalidInput(
            f"{what} needs a restore pool of {need:,} bytes per rank; the engine's holds {cap:,}",
            hint="restart the engine with a larger --pool, or run the bench with --embedded",
        )
    return cap


def isolate(info: EngineInfo, tier: str | None) -> tuple[str, list[str]]:
    """The tier to restore from and the tiers to exclude so nothing else can serve (tier isolation)."""
    tiers = list(info.tiers)
    chosen = tier or (tiers[0] if tiers else "")
    if chosen not in tiers:
        raise InvalidInput(
            f"the engine has no tier {chosen!r} (it has {', '.join(tiers) or 'none'})",
            hint=f"pass --tier {' or --tier '.join(tiers) or 'TIER'}; `bsr settings show` lists the engine's tiers",
        )
    return chosen, [t for t in tiers if t != chosen]


def put_back(client: AdminClient, original: dict[str, int]) -> bool:
    """Put back the engine settings an experiment changed (by name); False when the engine refused."""
    try:
        client.update_settings(**original)
        return True
    except EngineError:
        return False


def prompt_of(tokens: int, salt: int) -> Prompt:
    # Synthetic prompts with one seed are prefixes of each other, so rows of one salt share their leading chunks.
    return Prompt.synthetic_of(tokens, salt)


@dataclass(frozen=True)
class WarmEvidence:
    """The submit that stored the prompt before it was restored (a row's ``warm``)."""

    request: str | None
    seconds: float
    external_tokens: int
    computed_tokens: int
    hash_ok: bool | None
    store_errors: dict[str, dict[str, str]]  # by rank, by tier: why a tier did not take the chunks

    to_wire = wire.writer()
    from_wire = wire.reader()


def warm_evidence(res: SubmitResult) -> WarmEvidence:
    """The evidence of the engine's answer ``res`` to a submit."""
    return WarmEvidence(
        request=res.request,
        seconds=round(float(res.seconds), 4),
        external_tokens=res.external_tokens,
        computed_tokens=res.computed_tokens,
        hash_ok=res.hash_ok,
        store_errors=res.stored.errors if res.stored is not None else {},
    )


@dataclass(frozen=True, kw_only=True)
class WarmRow(BenchRow):
    """The submit that stores an experiment's prompt before its restores (fs-concurrency and store rows)."""

    kind: str = "warm"
    tokens: int
    W: int | None = wire.field(omit_none=True, default=None)  # None: no "W" key (store's warm row)
    meta: RowMeta
    warm: WarmEvidence | None = wire.field(omit_none=True, default=None)  # None: interrupted before the answer

    @classmethod
    def begun(cls, tokens: int, w: int | None = None) -> Callable[[str], WarmRow]:
        return lambda started_at: cls(tokens=tokens, W=w, meta=RowMeta(started_at=started_at))


@dataclass(frozen=True)
class RankEvidence:
    """One rank's part of a restore: its pool peak (what the bound is judged on) and its times."""

    rank: int
    pool_peak_bytes: int
    peak_live_bytes: int
    bytes_restored: int
    seconds: float
    fetch_seconds: float
    install_seconds: float
    gbps: float
    ok: bool
    # Wall and CPU seconds by stage, and the rank process's CPU (a rank of an older build reports none).
    stages: StageCosts | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class RestoreEvidence:
    """The evidence of one restore (`Run.restore`): what was committed, in how many windows, and every rank's pool
    peak against the bound. Fields in the bundle's key order."""

    request: str | None
    outcome: Outcome | None  # None: the answer named none ("unknown" in the bundle)
    tiers: list[str]
    excluded_tiers: list[str]
    advertised_tokens: int
    committed_tokens: int
    chunks: int
    windows: int
    expected_windows: int
    seconds: float
    total_bytes: int = wire.field(name="bytes")
    gbps: float
    gbps_per_rank: float  # request-level: what one rank receives over the whole request's time
    peak_pool_bytes: int
    predicted_peak_bytes: int
    rws_bytes: int | None  # None for the whole-plan path (W=0)
    whole_plan_bytes: int
    ranks: tuple[RankEvidence, ...]
    output_hash: str | None
    canonical_hash: str | None
    hash_ok: bool | None
    healthy: bool
    failure: str | None  # the first failure's reason

    def to_wire(self) -> wire.JsonObject:
        return wire.write(self) | {"outcome": self.outcome or UNKNOWN_OUTCOME}

    @classmethod
    def from_wire(cls, data: object) -> RestoreEvidence:
        """The evidence in a bundle's row (its keys beside the row's own); an outcome it does not know reads None."""
        d = data if isinstance(data, Mapping) else {}
        return wire.read(cls, {**d, "outcome": _outcome(d.get("outcome"))})


def _outcome(value: object) -> Outcome | None:
    try:
        return Outcome(str(value))
    except ValueError:
        return None


# -- one experiment block ----------------------------------------------------------------------------------------


@dataclass
class RowSlot(Generic[R]):
    """The row being measured: the body replaces ``row`` as it goes (partial evidence survives an interruption)."""

    row: R


class Run(Generic[R]):
    """One experiment block: its envelope and rows (of the experiment's row type), and the restore in flight
    (aborted on Ctrl-C)."""

    def __init__(
        self,
        experiment: str,
        tag: str,
        client: AdminClient,
        params: Record,  # the experiment's parameters, written into the bundle when it finishes
        *,
        salt: int | None = None,
        on_row: OnRow | None = None,
        engine_meta: dict[str, bool | float | None] | None = None,  # embedded, startup_s, restarted_per_rung
    ) -> None:
        self.client = client
        self.on_row = on_row
        self.request: str | None = None
        self.stopped = False
        self._t0 = time.monotonic()
        self.info = client.info()
        self.reg = client.registration()
        self.experiment = experiment
        self.run_id = new_run_id(tag)
        self.salt = salt
        self.params = params
        self.started_at = now()
        # The engine's facts in the bundle: experiments add to them (settings_restored, the ladder's rungs).
        self.engine: wire.JsonObject = {"url": client.url, "info": self.info.to_wire(), **(engine_meta or {})}
        self.machine = machine_info()
        self.rows: list[R] = []
        self.repeat: Repeat | None = None
        self.interrupted_by: Interruption | None = None

    def accepted(self, request: str) -> None:
        self.request = request

    def interrupt(self, by: Interruption) -> None:
        self.stopped = True
        self.interrupted_by = self.interrupted_by or by

    def abort_inflight(self) -> None:
        if self.request:
            with contextlib.suppress(EngineError, AlreadyEnded):
                self.client.abort(self.request)

    @contextlib.contextmanager
    def row(self, start: Callable[[str], R], rows: list[R] | None = None) -> Iterator[RowSlot[R]]:
        """Collect one row, begun as ``start(started_at)`` (interrupted until the body judges it). Ctrl-C or an
        engine error inside marks it interrupted, with the evidence gathered so far, and stops the block."""
        started_at = now()
        slot = RowSlot(start(started_at))
        t0 = time.monotonic()
        try:
            yield slot
        except KeyboardInterrupt:
            self.abort_inflight()
            slot.row = replace(slot.row, meta=slot.row.meta.stopped("interrupted by the operator (Ctrl-C)"))
            self.interrupt(Interruption.OPERATOR)
        except (EngineError, ServiceError, CapacityError) as e:
            slot.row = replace(slot.row, meta=slot.row.meta.stopped(f"{e.kind}: {e.message}"))
            self.interrupt(Interruption.ERROR)
        finally:
            row = replace(slot.row, meta=slot.row.meta.timed(round(time.monotonic() - t0, 3)))
            self.request = None
            self.add(row, rows)

    def add(self, row: R, rows: list[R] | None = None) -> None:
        """Keep a finished row (in ``rows``, default the block's) and report it."""
        (self.rows if rows is None else rows).append(row)
        if self.on_row:
            self.on_row(row)

    def finish(
        self,
        summary: Record,
        targets: Sequence[Target],
        rows: Sequence[R] | None = None,
    ) -> Bundle:
        """The block's bundle; ``rows`` are the rows its ``ok`` is judged on (default: the main rows)."""
        every = list(self.rows if rows is None else rows)
        return Bundle(
            experiment=self.experiment,
            run_id=self.run_id,
            salt=self.salt,
            bsr_version=__version__,
            started_at=self.started_at,
            finished_at=now(),
            elapsed_s=round(time.monotonic() - self._t0, 3),
            registration=registration_identity(self.reg),
            engine=self.engine,
            machine=self.machine,
            params=self.params,
            rows=list(self.rows),
            summary=summary,
            targets=tuple(targets),
            interrupted=self.interrupted_by is not None,
            interrupted_by=self.interrupted_by,
            ok=bool(every) and self.interrupted_by is None and all(r.meta.status == RowStatus.PASS for r in every),
            repeat=self.repeat,
        )

    # -- the measurement every experiment shares ---------------------------------------------------------------
    def restore(
        self,
        prompt: Prompt,
        tokens: int,
        w: int,
        *,
        exclude: Sequence[str] = (),
        verify: bool = True,
    ) -> RestoreEvidence:
        """reset the pool peak, restore, read the pool and health: the evidence of one restore."""
        c, reg = self.client, self.reg
        c.reset_peak()
        res = c.restore(
            prompt, w=w, verify=verify, exclude_tiers=list(exclude) or None, on_accepted=self.accepted
        ).to_wire()
        self.request = None
        pool = c.pool()
        health = c.health()
        chunks = accounting.chunks_for_tokens(tokens, reg.chunk_size)
        outcomes = {int(o["rank"]): o for o in res.get("ranks", [])}
        ranks = []
        for p in pool:
            o = outcomes.get(p.rank, {})
            secs = float(o.get("seconds", 0.0))
            nbytes = int(o.get("bytes_restored", 0))
            ranks.append(
                RankEvidence(
                    rank=p.rank,
                    pool_peak_bytes=int((p.pool or {}).get("peak_bytes", 0)),
                    peak_live_bytes=int(o.get("peak_live_bytes", 0)),
                    bytes_restored=nbytes,
                    seconds=round(secs, 4),
                    fetch_seconds=round(float(o.get("fetch_seconds", 0.0)), 4),
                    install_seconds=round(float(o.get("install_seconds", 0.0)), 4),
                    gbps=gbps(nbytes, secs),
                    ok=bool(o.get("ok", False)),
                    stages=StageCosts.from_wire(o["stages"]) if isinstance(o.get("stages"), dict) else None,
                )
            )
        seconds = float(res.get("seconds", 0.0))
        total = int(res.get("bytes", 0))
        failures = res.get("failures") or []
        return RestoreEvidence(
            request=res.get("request"),
            outcome=_outcome(res.get("outcome")),
            tiers=list(res.get("tiers") or []),
            excluded_tiers=list(exclude),
            advertised_tokens=int(res.get("advertised_tokens", 0)),
            committed_tokens=int(res.get("committed_tokens", 0)),
            chunks=chunks,
            windows=int(res.get("windows", 0)),
            expected_windows=accounting.num_windows(chunks, w),
            seconds=round(seconds, 4),
            total_bytes=total,
            gbps=gbps(total, seconds),
            gbps_per_rank=gbps(total / max(len(ranks), 1), seconds),
            peak_pool_bytes=max((r.pool_peak_bytes for r in ranks), default=0),
            predicted_peak_bytes=accounting.peak_bytes(reg, w, chunks),
            rws_bytes=accounting.rws_bytes(reg, w) if w else None,
            whole_plan_bytes=accounting.whole_plan_bytes(reg, chunks),
            ranks=tuple(ranks),
            output_hash=res.get("output_hash"),
            canonical_hash=res.get("canonical_hash"),
            hash_ok=res.get("hash_ok"),
            healthy=health.ok,
            failure=failures[0]["reason"] if failures else None,
        )


def restore_checks(ev: RestoreEvidence, tokens: int, *, peak: int | None, verified: bool = True) -> dict[str, bool]:
    checks = {
        "committed_all": ev.outcome == Outcome.COMMITTED and ev.committed_tokens == tokens,
        "windows": ev.windows == ev.expected_windows,
        "ranks_healthy": ev.healthy,
    }
    if peak is not None:
        checks["peak_equals_bound"] = bool(ev.ranks) and all(r.pool_peak_bytes == peak for r in ev.ranks)
    if verified:
        checks["hash_canonical"] = ev.hash_ok is True
    return checks
