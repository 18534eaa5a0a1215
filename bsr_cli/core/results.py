"""What a request's life answers, as types: the probe-only lookup (``ProbeResult``), a submitted prompt's admission
(``SubmitResult`` with its ``AdmissionPass``es), a windowed restore across every rank (``RestoreReport``, each
rank's part a ``RankRestore``), a manual restore (``ManualRestoreResult``), an abort (``AbortAnswer``), and the admin
API's short answers (``Ok``, ``Cleared``) and its errors (``ErrorBody``).

The runtime builds them, the admin API serializes each once (``to_wire()``: the JSON the API has always answered,
key for key and in the same order, a key absent where it always was), and the client reads them back with
``from_wire()``, which ignores keys it does not know (a newer engine may add some). Renderers read attributes.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bsr_cli.core import wire
from bsr_cli.core.bitmap import PROBE_KIND, Break, HitBitmap
from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome, Stage
from bsr_cli.core.markers import Marker
from bsr_cli.core.registration import Registration
from bsr_cli.core.stage_costs import StageCosts
from bsr_cli.core.status import MarkerView

# What a host says instead of a canonical hash when the restored KV is real model data it did not compute (the
# LMCache host): the output hash is then only a checksum of the installed bytes.
HASH_NOT_APPLICABLE = "not applicable"

TierErrors = dict[str, dict[str, str]]  # per rank ("rank0"), per tier that could not answer, why


# -- the probe -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """The probe-only lookup of a prompt: the hit bitmap, the committable prefix without the excluded tiers, where
    it breaks, the tiers that could not answer and the standing markers."""

    bitmap: HitBitmap
    registration: Registration = wire.field(name="registration_spec")
    committable_chunks: int
    committable_tokens: int
    first_break: Break | None
    tier_errors: TierErrors
    # The markers as the engine lists them, with what a host adds to each (a vLLM worker: its scheduler's fields).
    markers: tuple[MarkerView, ...]

    @property
    def kind(self) -> str:
        return PROBE_KIND  # the document's kind, first, as the bitmap's own

    to_wire = wire.writer(
        order=(
            "kind",
            "bitmap",
            "registration",
            "committable_chunks",
            "committable_tokens",
            "first_break",
            "tier_errors",
            "markers",
        )
    )
    from_wire = wire.reader()


# -- one windowed restore --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InvalidCell:
    """A (rank, KV group) the commit rule found invalid."""

    rank: int
    group: str

    to_wire = wire.writer()
    from_wire = wire.reader()


# A rank writes an absent failure kind, stage or cause as "" (not null), and a reader takes "" for absent.
@dataclass(frozen=True)
class RankRestore:
    """One rank's part of a restore, as the rank reported it (the wire form of the rank's restore result)."""

    rank: int
    ok: bool
    valid: dict[str, bool]  # per KV group
    windows_done: int = 0
    bytes_restored: int = 0
    seconds: float = 0.0
    reason: str = ""
    failed_window: int | None = None
    fired_faults: tuple[int, ...] = ()
    fetch_seconds: float = 0.0
    install_seconds: float = 0.0
    peak_live_bytes: int = 0
    # A rank writes "" for a failure it does not have (its kind, stage, capacity cause).
    kind: FailureKind | None = wire.field(default=None, none_as="")
    tier: str | None = None
    stage: Stage | None = wire.field(default=None, none_as="")
    cause: CapacityCause | None = wire.field(default=None, none_as="")
    stages: StageCosts | None = wire.field(omit_none=True, default=None)  # by stage (a rank of an older build: none)

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class RestoreReport:
    """One windowed restore of a prompt's external prefix across every rank, decided by the commit rule: what was
    advertised and committed, the failures classified and blamed by stage, each rank's part, the bounds."""

    request: str
    w: int = wire.field(name="W")
    tiers: tuple[str, ...]  # the tiers it restored from
    advertised_tokens: int
    committed_tokens: int
    outcome: Outcome
    invalid: tuple[InvalidCell, ...]
    failures: tuple[Failure, ...]
    failure_kind: FailureKind | None
    failure_stage: Stage | None
    blamed_tiers: tuple[str, ...]
    blamed_ranks: tuple[int, ...]
    hint: str | None
    windows: int
    chunks: int = 0
    seconds: float = 0.0
    bytes: int = 0
    gbps: float = 0.0
    ranks: tuple[RankRestore, ...]
    rws_bytes: int | None = None
    whole_plan_bytes: int = 0
    fired_faults: tuple[int, ...] = ()

    to_wire = wire.writer()
    from_wire = wire.reader()

    def unstarted_wire(self) -> wire.JsonObject:
        """The wire form of a restore that never started (a rank stopped answering the probe): its failure and
        the empty amounts, in the order that answer has always had."""
        written = wire.write(self)
        return {key: written[key] for key in _UNSTARTED_KEYS}


_UNSTARTED_KEYS = (
    "outcome",
    "advertised_tokens",
    "committed_tokens",
    "failures",
    "failure_kind",
    "failure_stage",
    "blamed_tiers",
    "blamed_ranks",
    "invalid",
    "tiers",
    "ranks",
    "windows",
    "hint",
)


# -- a manual restore ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixLookup:
    """The probe a manual restore starts with: the bitmap, where the prefix breaks, the tiers that did not answer."""

    tier_errors: TierErrors
    first_break: Break | None
    bitmap: HitBitmap

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class OutputHashes:
    """The hash of the KV a request ends with, and (when checked) the canonical hash it must equal."""

    output_hash: str
    canonical_hash: str | None = None
    hash_ok: bool | None = None


@dataclass(frozen=True)
class ManualRestoreResult:
    """A manual windowed restore (``bsr restore``): the probe it started from, the restore's report (None: nothing
    to restore), the hashes of a committed restore, the marker a failed one set, and the host's note when a
    canonical hash does not apply (``hash_note``).

    A restore whose KV hashed differently from the canonical (``output_mismatch``) ended failed although its
    report committed: the engine invalidated what it committed. Its JSON then says ``outcome: failed_closed`` and
    ``committed_tokens: 0``, with ``restored_tokens`` the tokens the restore had committed.

    Its JSON is one flat object whose keys depend on how far the restore got (no probe, nothing to restore, a
    report, hashes checked or not), so its two wire methods are written out around its parts' own."""

    request: str
    prompt: str
    tokens: int
    w: int
    lookup: PrefixLookup | None  # None: the probe could not run (a rank stopped answering)
    report: RestoreReport | None  # None: no tier held the first chunk
    hashes: OutputHashes | None = None
    marker: Marker | None = None
    hash_note: str | None = None

    @property
    def output_mismatch(self) -> bool:
        """The restore committed, and its KV's output hash differs from the canonical one: the engine invalidated
        it, so the request failed."""
        return self.hashes is not None and self.hashes.hash_ok is False

    @property
    def outcome(self) -> Outcome:
        if self.output_mismatch:
            return Outcome.FAILED_CLOSED
        return self.report.outcome if self.report is not None else Outcome.NOTHING_TO_RESTORE

    @property
    def committed_tokens(self) -> int:
        if self.output_mismatch:
            return 0
        return self.report.committed_tokens if self.report is not None else 0

    @property
    def first_break(self) -> Break | None:
        return self.lookup.first_break if self.lookup is not None else None

    def to_wire(self) -> dict[str, Any]:
        out: wire.JsonObject = {"request": self.request, "prompt": self.prompt, "tokens": self.tokens, "W": self.w}
        if self.lookup is None:
            if self.report is None:
                raise ValueError("a restore without a probe has a report of its failure")
            return out | self.report.unstarted_wire()
        out |= self.lookup.to_wire()
        if self.report is None:
            return out | {"outcome": Outcome.NOTHING_TO_RESTORE.value, "committed_tokens": 0, "advertised_tokens": 0}
        out |= self.report.to_wire()
        if self.hashes is not None:
            out["output_hash"] = self.hashes.output_hash
            if self.hashes.canonical_hash is not None:
                out["canonical_hash"] = self.hashes.canonical_hash
                out["hash_ok"] = self.hashes.hash_ok
        if self.marker is not None:
            out["marker"] = self.marker.to_dict()
        if self.hash_note is not None and self.hashes is not None:
            out |= _not_applicable(self.hash_note, self.hashes.output_hash) | {"canonical_hash": None, "hash_ok": None}
        if self.output_mismatch:  # what the report committed was invalidated
            out |= {
                "outcome": self.outcome.value,
                "committed_tokens": 0,
                "restored_tokens": self.report.committed_tokens,
            }
        return out

    @classmethod
    def wire_schema(cls, s: wire.Schemas) -> wire.JsonSchema:
        """Every key it may write, in one object: the request's, the probe's, the report's (a restore that never
        started writes some of them), the hashes, the marker, what an output mismatch invalidated and the host's
        note. Every answer says the request, its outcome and the tokens advertised and committed."""
        lookup, report = s.body(PrefixLookup), s.body(RestoreReport)
        text, count = s.of(str), s.of(int)
        keys = {
            **{"request": text, "prompt": text, "tokens": count, "W": count},
            **lookup["properties"],
            **report["properties"],
            **{"output_hash": text, "canonical_hash": s.of(str | None), "hash_ok": s.of(bool | None)},
            **{"marker": s.of(Marker), "restored_tokens": count, **_not_applicable_schema(s)},
        }
        always = ("request", "prompt", "tokens", "W", "outcome", "advertised_tokens", "committed_tokens")
        return wire.object_schema(keys, always)

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> ManualRestoreResult:
        nothing = d.get("outcome") == Outcome.NOTHING_TO_RESTORE
        if "restored_tokens" in d:  # an output mismatch invalidated what the report committed
            d = {**d, "outcome": Outcome.COMMITTED.value, "committed_tokens": d["restored_tokens"]}
        hashes = None
        if d.get("output_hash") is not None:
            hashes = OutputHashes(str(d["output_hash"]), _str_or_none(d, "canonical_hash"), _bool_or_none(d, "hash_ok"))
        return cls(
            request=str(d["request"]),
            prompt=str(d["prompt"]),
            tokens=wire.value_from_wire(int, d["tokens"]),
            w=wire.value_from_wire(int, d["W"]),
            lookup=PrefixLookup.from_wire(d) if "bitmap" in d else None,
            report=None if nothing else RestoreReport.from_wire(d),
            hashes=hashes,
            marker=Marker.from_dict(d["marker"]) if d.get("marker") else None,
            hash_note=_hash_note(d),
        )


def _str_or_none(d: Mapping[str, wire.JsonValue], key: str) -> str | None:
    value = d.get(key)
    return value if isinstance(value, str) else None


def _bool_or_none(d: Mapping[str, wire.JsonValue], key: str) -> bool | None:
    value = d.get(key)
    return value if isinstance(value, bool) else None


def _hash_note(d: Mapping[str, wire.JsonValue]) -> str | None:
    """The host's note, in an answer that says no canonical hash applies."""
    return _str_or_none(d, "hash_note") if d.get("hash") == HASH_NOT_APPLICABLE else None


def _not_applicable(note: str, output_hash: str) -> dict[str, str]:
    return {"hash": HASH_NOT_APPLICABLE, "hash_note": note, "kv_checksum": output_hash}


def _not_applicable_schema(s: wire.Schemas) -> dict[str, wire.JsonSchema]:
    """The keys ``_not_applicable`` adds (only where the host says a canonical hash does not apply)."""
    return {"hash": {"const": HASH_NOT_APPLICABLE}, "hash_note": s.of(str), "kv_checksum": s.of(str)}


# -- a submitted prompt ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AdmissionPass:
    """One admission pass of a submitted prompt: the tiers it excluded, the external prefix it found, and the
    restore of that prefix (None: nothing external, computed locally)."""

    pass_no: int = wire.field(name="pass")
    excluded_tiers: tuple[str, ...]
    external_tokens: int
    tier_errors: TierErrors
    restore: RestoreReport | None = wire.field(omit_none=True, default=None)  # None: nothing external

    def to_wire(self) -> wire.JsonObject:
        out: wire.JsonObject = wire.write(self)
        if self.restore is not None and not self.restore.committed_tokens:  # why this pass's restore failed
            out["failure_kind"] = wire.value_to_wire(self.restore.failure_kind)
        return out

    @classmethod
    def wire_schema(cls, s: wire.Schemas) -> wire.JsonSchema:
        """The codec's, and the failure kind of a restore that committed nothing (only then)."""
        written = s.written(cls)
        written["properties"]["failure_kind"] = s.of(FailureKind | None)
        return written

    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class MarkerStep:
    """A force-local marker as it stood at an admission pass (0: before the first)."""

    pass_no: int = wire.field(name="pass")
    marker: Marker

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class StoreReport:
    """What storing the chunks each tier lacked wrote, per rank ("rank0") and tier, and which tiers refused."""

    objects: dict[str, dict[str, int]]
    errors: TierErrors

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class SubmitResult:
    """A prompt admitted as the scheduler would: its passes, the external prefix committed and where it came from,
    what was computed locally, the marker's history, what was stored, the output hash.

    Its JSON nests the marker's history under ``force_local``, writes no store as ``{}`` and adds the host's
    note only when there is one, so its two wire methods are written out around the codec's fields."""

    request: str
    prompt: str
    tokens: int
    w: int = wire.field(name="W")
    external_tokens: int
    computed_tokens: int
    source: str  # the tiers the committed prefix came from ("fs+mooncake"), or "recompute"
    passes: tuple[AdmissionPass, ...]
    marker_history: tuple[MarkerStep, ...]
    marker_cleared: bool  # the admission cleared a standing marker
    stored: StoreReport | None  # None: nothing was stored
    output_hash: str
    canonical_hash: str | None
    hash_ok: bool | None
    seconds: float
    hash_note: str | None = None  # the host's: why no canonical hash applies

    def to_wire(self) -> wire.JsonObject:
        fields = wire.write(self)
        out: wire.JsonObject = {key: fields[key] for key in _SUBMIT_HEAD}
        out["force_local"] = {"history": fields["marker_history"], "cleared": fields["marker_cleared"]}
        out["stored"] = fields["stored"] if self.stored is not None else {}
        out |= {key: fields[key] for key in _SUBMIT_TAIL}
        if self.hash_note is not None:
            out |= _not_applicable(self.hash_note, self.output_hash)
        return out

    @classmethod
    def wire_schema(cls, s: wire.Schemas) -> wire.JsonSchema:
        """The fields' schemas in the JSON's layout: the marker's history under ``force_local``, no store as ``{}``,
        and the host's note where it has one."""
        fields = s.written(cls)["properties"]
        history = {"history": fields["marker_history"], "cleared": fields["marker_cleared"]}
        keys = {
            **{key: fields[key] for key in _SUBMIT_HEAD},
            "force_local": wire.object_schema(history, tuple(history)),
            "stored": wire.any_of([s.of(StoreReport), {"type": "object", "maxProperties": 0}]),
            **{key: fields[key] for key in _SUBMIT_TAIL},
            **_not_applicable_schema(s),
        }
        return wire.object_schema(keys, (*_SUBMIT_HEAD, "force_local", "stored", *_SUBMIT_TAIL))

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> SubmitResult:
        force_local = d.get("force_local")
        history = wire.read(_ForceLocal, force_local)
        return dataclasses.replace(
            wire.read(cls, {key: d[key] for key in (*_SUBMIT_HEAD, *_SUBMIT_TAIL) if key in d}),
            marker_history=history.history,
            marker_cleared=history.cleared,
            stored=StoreReport.from_wire(d["stored"]) if d.get("stored") else None,
            hash_note=_hash_note(d),
        )


@dataclass(frozen=True)
class _ForceLocal:
    """A submit's ``force_local``: the marker's history, and whether the admission cleared it."""

    history: tuple[MarkerStep, ...] = ()
    cleared: bool = False


_SUBMIT_HEAD = ("request", "prompt", "tokens", "W", "external_tokens", "computed_tokens", "source", "passes")
_SUBMIT_TAIL = ("output_hash", "canonical_hash", "hash_ok", "seconds")


# -- an abort --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AbortAnswer:
    """Whether the engine is aborting the request (False: no such request was open)."""

    request: str
    aborting: bool

    to_wire = wire.writer()
    from_wire = wire.reader()


# -- the admin API's short answers and its errors ---------------------------------------------------------------------
@dataclass(frozen=True)
class Ok:
    """An action done: the engine stops (``POST /shutdown``), the pools' peaks are reset (``POST
    /pool/reset-peak``)."""

    ok: bool = True

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Cleared:
    """How many armed faults or force-local markers a clear removed (or, for a tier, touched)."""

    cleared: int

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class ErrorBody:
    """Every error the admin API answers: ``error`` is its kind (unauthorized, forbidden-host, forbidden-origin,
    bad-request, invalid-input, not-found, unknown-request, method-not-allowed, busy, faults-disabled, capacity,
    aborted, already-ended, rank-restarting, rank-unresponsive, host-overloaded, server-error, or another runtime
    error's own), ``message`` says what happened, ``hint`` what to do (null: nothing to say)."""

    error: str
    message: str
    hint: str | None = None
    # rank-restarting, rank-unresponsive: the rank that cannot answer
    rank: int | None = wire.field(default=None, omit_none=True)
    # rank-restarting, or a capacity refusal the same request may get past later: seconds to wait (Retry-After)
    retry_after_s: int | None = wire.field(default=None, omit_none=True)
    # already-ended: how the request had ended when the abort came
    outcome: Outcome | None = wire.field(default=None, omit_none=True)
    # method-not-allowed: the methods the path serves (the Allow header)
    allowed: tuple[str, ...] = wire.field(default=(), omit_empty=True)
    # version-mismatch: the API versions this engine speaks
    supported: tuple[str, ...] = wire.field(default=(), omit_empty=True)

    to_wire = wire.writer()
    from_wire = wire.reader()


__all__ = [
    "HASH_NOT_APPLICABLE",
    "AbortAnswer",
    "AdmissionPass",
    "Cleared",
    "ErrorBody",
    "InvalidCell",
    "ManualRestoreResult",
    "MarkerStep",
    "Ok",
    "OutputHashes",
    "PrefixLookup",
    "ProbeResult",
    "RankRestore",
    "RestoreReport",
    "StoreReport",
    "SubmitResult",
]
