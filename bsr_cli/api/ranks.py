"""The rank-ops contract: what the coordinator asks a TP rank, and what the rank answers. Plain data, no I/O.

Every op is a request dataclass whose ``apply`` returns its result dataclass (``ProbeRequest`` → ``ProbeResult``),
which makes it a ``RankRequest[ProbeResult]`` by its shape alone. A rank host implements ``RankOps`` (one typed
method per op); ``dispatch(ops, request)`` runs one of the requests below on a host, keyed by the request's type
(each request names its own method, so mypy checks every pair). The coordinator holds
a ``RankClient`` per rank, whose ``submit(request)`` returns a ``Future`` of that request's result type; over the
embedded engine's pipe the request object itself travels, pickled, in a ``Call`` (``bsr_cli.api.pipe``, which
sits above this module), and the ``Reply`` carries the result object back.

A host that cannot serve an op (the vLLM worker admin moves no KV) answers ``UnsupportedOp``, a ``BadRequest``:
the admin API turns it into a 400 and the CLI into one line with exit code 7.

Every type also has a JSON form (``bsr_cli.api.codec``; ``request_to_json``/``request_from_json`` for a request
tagged with its op name), strict on the way in.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from bsr_cli.api.codec import from_json, to_json
from bsr_cli.api.jobs import ObjectRef, RestoreJob, RestoreResult, WindowJob
from bsr_cli.core import wire
from bsr_cli.core.evidence import ScrubScope, TierCondition
from bsr_cli.core.scrub import QuarantinedFile, ScrubProgress
from bsr_cli.errors import BadRequest

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class UnsupportedOp(BadRequest):
    """A rank host that does not serve ``op``: one line for the user, with what to do instead."""

    def __init__(self, op: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.op = op

    def __reduce__(self) -> tuple[Any, ...]:  # keeps op and hint across a pipe
        return (_unsupported, (self.op, self.message, self.hint))


def _unsupported(op: str, message: str, hint: str | None) -> UnsupportedOp:
    return UnsupportedOp(op, message, hint=hint)


class RankRequest(Protocol[R_co]):
    """What every request is (the request dataclasses below have it without inheriting it): ``op``, its name in
    the JSON form and in error messages, and ``apply``, which calls the host's method for it."""

    op: ClassVar[str]

    def apply(self, ops: RankOps) -> R_co: ...


# -- results -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    rows: dict[str, str]  # per group, one hex digit per chunk: bit i set when tiers[i] holds the object
    errors: dict[str, str] = field(default_factory=dict)  # per tier that could not answer, why


@dataclass(frozen=True)
class StoreResult:
    objects: dict[str, int]  # per tier, objects written
    errors: dict[str, str] = field(default_factory=dict)  # per tier that refused, why


# A stored object a tier set apart after it failed its checksum (moved aside and kept for the incident bundle, or
# removed where the tier has nowhere to keep it): the core's type, which the engine reports as it is.
QuarantinedObject = QuarantinedFile


@dataclass(frozen=True)
class TierStatus:
    ok: bool
    detail: str
    condition: str = TierCondition.OK.value  # a TierCondition's value: why it is (un)healthy
    quarantined: list[QuarantinedObject] = field(default_factory=list)  # the newest objects it moved aside
    quarantined_total: int = 0  # how many lie in its quarantine directory
    scrubs: list[ScrubProgress] = field(default_factory=list)  # its scrubs running now, then the last few ended

    def __post_init__(self) -> None:
        if not self.ok and self.condition == TierCondition.OK:  # a host that names no reason: it cannot serve
            object.__setattr__(self, "condition", TierCondition.UNAVAILABLE.value)


@dataclass(frozen=True)
class StatsResult:
    rank: int
    pool: dict[str, int]
    tiers: dict[str, TierStatus] | None = None  # only when asked for health
    tp_rank: int | None = None  # a vLLM worker's real TP rank (its coordinator calls it rank 0)


@dataclass(frozen=True)
class ResetPeakResult:
    pass


@dataclass(frozen=True)
class SetBudgetResult:
    pool: dict[str, int]


@dataclass(frozen=True)
class SetFsConcurrencyResult:
    value: int


@dataclass(frozen=True)
class RemoveAllResult:
    removed: int


@dataclass(frozen=True)
class PrefillResult:
    computed_tokens: int


@dataclass(frozen=True)
class OutputHashResult:
    groups: dict[str, str]  # per KV group, the hash of the rank's KV of the prompt


@dataclass(frozen=True)
class CanonicalHashResult:
    groups: dict[str, str]  # per KV group, the hash a full recompute would give


@dataclass(frozen=True)
class InvalidateResult:
    pass


@dataclass(frozen=True)
class ScrubResult:
    progress: ScrubProgress  # how the rank's scrub ended
    quarantined: list[QuarantinedObject] = field(default_factory=list)  # what it moved aside


# -- requests ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeRequest:
    """Probe-only lookup: which of ``tiers`` hold each chunk's object on this rank. Moves no bytes."""

    op: ClassVar[str] = "probe"
    hashes: list[str]
    tiers: list[str]
    timeout_s: float = 10.0

    def apply(self, ops: RankOps) -> ProbeResult:
        return ops.probe(self)


@dataclass(frozen=True)
class StoreRequest:
    """Write the objects ``chunks[tier]`` (chunk indices that tier lacks) read back from the blocks."""

    op: ClassVar[str] = "store"
    hashes: list[str]
    n_tokens: int
    block_tables: dict[str, list[int]]
    chunks: dict[str, list[int]]

    def apply(self, ops: RankOps) -> StoreResult:
        return ops.store(self)


@dataclass(frozen=True)
class RestoreRequest:
    op: ClassVar[str] = "restore"
    job: RestoreJob

    def apply(self, ops: RankOps) -> RestoreResult:
        return ops.restore(self)


@dataclass(frozen=True)
class StatsRequest:
    op: ClassVar[str] = "stats"
    health: bool = False

    def apply(self, ops: RankOps) -> StatsResult:
        return ops.stats(self)


@dataclass(frozen=True)
class ResetPeakRequest:
    op: ClassVar[str] = "reset_peak"

    def apply(self, ops: RankOps) -> ResetPeakResult:
        return ops.reset_peak(self)


@dataclass(frozen=True)
class SetBudgetRequest:
    op: ClassVar[str] = "set_budget"
    budget_bytes: int

    def apply(self, ops: RankOps) -> SetBudgetResult:
        return ops.set_budget(self)


@dataclass(frozen=True)
class SetFsConcurrencyRequest:
    op: ClassVar[str] = "set_fs_concurrency"
    value: int

    def apply(self, ops: RankOps) -> SetFsConcurrencyResult:
        return ops.set_fs_concurrency(self)


@dataclass(frozen=True)
class RemoveAllRequest:
    op: ClassVar[str] = "remove_all"
    tier: str

    def apply(self, ops: RankOps) -> RemoveAllResult:
        return ops.remove_all(self)


@dataclass(frozen=True)
class ScrubRequest:
    """Read this rank's objects on ``tier`` back whole and set the damaged ones apart: the prompt's (``hashes``,
    its chunk hashes) or, with none, this rank's share of every object the tier holds (of ``shards`` ranks sharing
    it). Bounded by ``max_objects`` and ``max_bytes``; answered when it ends."""

    op: ClassVar[str] = "scrub"
    scrub: str  # the scrub's id
    tier: str
    scope: ScrubScope
    max_objects: int
    max_bytes: int
    hashes: list[str] = field(default_factory=list)
    prompt: str = ""
    shards: int = 1

    def apply(self, ops: RankOps) -> ScrubResult:
        return ops.scrub(self)


# The embedded engine's synthetic model (the test ops): compute KV, hash it, scrub it.
@dataclass(frozen=True)
class PrefillRequest:
    op: ClassVar[str] = "prefill"
    hashes: list[str]
    n_tokens: int
    first_chunk: int
    block_tables: dict[str, list[int]]

    def apply(self, ops: RankOps) -> PrefillResult:
        return ops.prefill(self)


@dataclass(frozen=True)
class OutputHashRequest:
    op: ClassVar[str] = "output_hash"
    block_tables: dict[str, list[int]]
    n_tokens: int

    def apply(self, ops: RankOps) -> OutputHashResult:
        return ops.output_hash(self)


@dataclass(frozen=True)
class CanonicalHashRequest:
    op: ClassVar[str] = "canonical_hash"
    hashes: list[str]
    n_tokens: int

    def apply(self, ops: RankOps) -> CanonicalHashResult:
        return ops.canonical_hash(self)


@dataclass(frozen=True)
class InvalidateRequest:
    op: ClassVar[str] = "invalidate"
    block_tables: dict[str, list[int]]

    def apply(self, ops: RankOps) -> InvalidateResult:
        return ops.invalidate(self)


REQUESTS: dict[str, type[RankRequest[Any]]] = {
    t.op: t
    for t in (
        ProbeRequest,
        StoreRequest,
        RestoreRequest,
        StatsRequest,
        ResetPeakRequest,
        SetBudgetRequest,
        SetFsConcurrencyRequest,
        RemoveAllRequest,
        ScrubRequest,
        PrefillRequest,
        OutputHashRequest,
        CanonicalHashRequest,
        InvalidateRequest,
    )
}
_REQUEST_TYPES = frozenset(REQUESTS.values())
RESULTS: dict[str, type] = {
    "probe": ProbeResult,
    "store": StoreResult,
    "restore": RestoreResult,
    "stats": StatsResult,
    "reset_peak": ResetPeakResult,
    "set_budget": SetBudgetResult,
    "set_fs_concurrency": SetFsConcurrencyResult,
    "remove_all": RemoveAllResult,
    "scrub": ScrubResult,
    "prefill": PrefillResult,
    "output_hash": OutputHashResult,
    "canonical_hash": CanonicalHashResult,
    "invalidate": InvalidateResult,
}


# -- the two sides of the seam ---------------------------------------------------------------------------------------
class RankOps(Protocol):
    """What a rank host serves: one typed method per op (plus ``abort``, a signal rather than a call)."""

    def probe(self, req: ProbeRequest) -> ProbeResult: ...

    def store(self, req: StoreRequest) -> StoreResult: ...

    def restore(self, req: RestoreRequest) -> RestoreResult: ...

    def stats(self, req: StatsRequest) -> StatsResult: ...

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult: ...

    def set_budget(self, req: SetBudgetRequest) -> SetBudgetResult: ...

    def set_fs_concurrency(self, req: SetFsConcurrencyRequest) -> SetFsConcurrencyResult: ...

    def remove_all(self, req: RemoveAllRequest) -> RemoveAllResult: ...

    def scrub(self, req: ScrubRequest) -> ScrubResult: ...

    def prefill(self, req: PrefillRequest) -> PrefillResult: ...

    def output_hash(self, req: OutputHashRequest) -> OutputHashResult: ...

    def canonical_hash(self, req: CanonicalHashRequest) -> CanonicalHashResult: ...

    def invalidate(self, req: InvalidateRequest) -> InvalidateResult: ...

    def abort(self, request_id: str) -> None:
        """End request ``request_id``'s restore fail-closed (now, or as soon as its job arrives)."""
        ...


class UnsupportedOps:
    """A base for hosts that serve only some ops: every op it does not override answers ``UnsupportedOp``."""

    host_name = "this host"

    def unsupported(self, op: str) -> UnsupportedOp:
        return UnsupportedOp(
            op, f"op {op!r} is not supported by {self.host_name}", hint="`bsr status` says what this engine serves"
        )

    def probe(self, req: ProbeRequest) -> ProbeResult:
        raise self.unsupported(req.op)

    def store(self, req: StoreRequest) -> StoreResult:
        raise self.unsupported(req.op)

    def restore(self, req: RestoreRequest) -> RestoreResult:
        raise self.unsupported(req.op)

    def stats(self, req: StatsRequest) -> StatsResult:
        raise self.unsupported(req.op)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        raise self.unsupported(req.op)

    def set_budget(self, req: SetBudgetRequest) -> SetBudgetResult:
        raise self.unsupported(req.op)

    def set_fs_concurrency(self, req: SetFsConcurrencyRequest) -> SetFsConcurrencyResult:
        raise self.unsupported(req.op)

    def remove_all(self, req: RemoveAllRequest) -> RemoveAllResult:
        raise self.unsupported(req.op)

    def scrub(self, req: ScrubRequest) -> ScrubResult:
        raise self.unsupported(req.op)

    def prefill(self, req: PrefillRequest) -> PrefillResult:
        raise self.unsupported(req.op)

    def output_hash(self, req: OutputHashRequest) -> OutputHashResult:
        raise self.unsupported(req.op)

    def canonical_hash(self, req: CanonicalHashRequest) -> CanonicalHashResult:
        raise self.unsupported(req.op)

    def invalidate(self, req: InvalidateRequest) -> InvalidateResult:
        raise self.unsupported(req.op)

    def abort(self, request_id: str) -> None:
        return None


class RankClient(Protocol):
    """The coordinator's handle on one rank: ``submit`` runs a request there and returns a future of its result.
    The embedded engine's is a process behind a pipe; a plugin's can run the rank's ops on threads."""

    rank: int

    def submit(self, request: RankRequest[R]) -> Future[R]: ...

    def abort(self, request: str) -> None: ...

    def alive(self) -> bool: ...

    # Optional: ``heartbeat_age() -> float``, seconds since the rank last showed a sign of life (a rank in another
    # process beats on its own), ``pid: int``, the rank's own process (the judge reads its state and run-queue delay
    # from /proc), and ``unread() -> bool``, whether it said something not read yet. Rank clients without them
    # (in-process ranks) are judged by progress alone, their run-queue delay being the coordinator's own
    # (runtime/judge.py).


def dispatch(ops: RankOps, request: RankRequest[R]) -> R:
    """Run ``request`` on a host: the one dispatcher every host uses (keyed by the request's type)."""
    if type(request) not in _REQUEST_TYPES:
        raise BadRequest(
            f"not a rank request: {type(request).__name__}",
            hint="a host serves only the requests of bsr_cli.api.ranks (REQUESTS)",
        )
    return request.apply(ops)


# -- the JSON form ---------------------------------------------------------------------------------------------------
def request_to_json(req: RankRequest[Any]) -> wire.JsonObject:
    return {"op": req.op, "args": to_json(req)}


def request_from_json(data: Any) -> RankRequest[Any]:
    """A request from its JSON form ``{"op", "args"}``; ``BadRequest`` for an unknown op or malformed args."""
    if not isinstance(data, Mapping) or set(data) - {"op", "args"} or not isinstance(data.get("op"), str):
        raise BadRequest(
            'malformed rank request: expected {"op": <name>, "args": {...}}',
            hint="the host and the coordinator speak different versions of the rank API: run one bsr version on both",
        )
    cls = REQUESTS.get(data["op"])
    if cls is None:
        raise BadRequest(f"unknown rank op {data['op']!r}", hint=f"ops: {', '.join(REQUESTS)}")
    return from_json(cls, data.get("args") or {}, what=f"{cls.op} request")


def result_from_json(op: str, data: Any) -> Any:
    cls = RESULTS.get(op)
    if cls is None:
        raise BadRequest(
            f"unknown rank op {op!r}",
            hint="the host and the coordinator speak different versions of the rank API: run one bsr version on both",
        )
    return from_json(cls, data, what=f"{op} result")


__all__ = [
    "REQUESTS",
    "RESULTS",
    "CanonicalHashRequest",
    "CanonicalHashResult",
    "InvalidateRequest",
    "InvalidateResult",
    "ObjectRef",
    "OutputHashRequest",
    "OutputHashResult",
    "PrefillRequest",
    "PrefillResult",
    "ProbeRequest",
    "ProbeResult",
    "QuarantinedObject",
    "RankClient",
    "RankOps",
    "RankRequest",
    "RemoveAllRequest",
    "RemoveAllResult",
    "ResetPeakRequest",
    "ResetPeakResult",
    "RestoreJob",
    "RestoreRequest",
    "RestoreResult",
    "ScrubRequest",
    "ScrubResult",
    "SetBudgetRequest",
    "SetBudgetResult",
    "SetFsConcurrencyRequest",
    "SetFsConcurrencyResult",
    "StatsRequest",
    "StatsResult",
    "StoreRequest",
    "StoreResult",
    "TierStatus",
    "UnsupportedOp",
    "UnsupportedOps",
    "WindowJob",
    "dispatch",
    "request_from_json",
    "request_to_json",
    "result_from_json",
]
