"""What a request's life answers, as types: the probe-only lookup (``ProbeResult``), a submitted prompt's admission
(``SubmitResult`` with its ``AdmissionPass``es), a windowed restore across every rank (``RestoreReport``, each
rank's part a ``RankRestore``), a manual restore (``ManualRestoreResult``) and an abort (``AbortAnswer``).

The runtime builds them, the admin API serializes each once (``to_wire()``: the JSON the API has always answered,
key for key and in the same order, a key absent where it always was), and the client reads them back with
``from_wire()``, which ignores keys it does not know (a newer engine may add some). Renderers read attributes.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bsr_cli.core.bitmap import Break, HitBitmap
from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome, Stage
from bsr_cli.core.markers import Marker
from bsr_cli.core.registration import Registration

# What a host says instead of a canonical hash when the restored KV is real model data it did not compute (the
# LMCache host): the output hash is then only a checksum of the installed bytes.
HASH_NOT_APPLICABLE = "not applicable"

TierErrors = dict[str, dict[str, str]]  # per rank ("rank0"), per tier that could not answer, why


def _enum_or_none(value: Any) -> str | None:
    return value.value if value is not None else None


def _tier_errors(value: Any) -> TierErrors:
    return {str(rank): {str(t): str(e) for t, e in per.items()} for rank, per in (value or {}).items()}


# -- the probe -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """The probe-only lookup of a prompt: the hit bitmap, the committable prefix without the excluded tiers, where
    it breaks, the tiers that could not answer and the standing markers."""

    bitmap: HitBitmap
    registration: Registration
    committable_chunks: int
    committable_tokens: int
    first_break: Break | None
    tier_errors: TierErrors
    # The markers as the engine lists them (a vLLM worker adds its scheduler's fields): passed through unread.
    markers: tuple[dict[str, Any], ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": "bsr.probe",
            "bitmap": self.bitmap.to_dict(),
            "registration_spec": self.registration.to_dict(),
            "committable_chunks": self.committable_chunks,
            "committable_tokens": self.committable_tokens,
            "first_break": self.first_break.to_wire() if self.first_break else None,
            "tier_errors": self.tier_errors,
            "markers": list(self.markers),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ProbeResult:
        return cls(
            bitmap=HitBitmap.from_dict(d["bitmap"]),
            registration=Registration.from_dict(d["registration_spec"], source="probe"),
            committable_chunks=int(d["committable_chunks"]),
            committable_tokens=int(d["committable_tokens"]),
            first_break=Break.from_wire(d.get("first_break")),
            tier_errors=_tier_errors(d.get("tier_errors")),
            markers=tuple(dict(m) for m in d.get("markers") or ()),
        )


# -- one windowed restore --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InvalidCell:
    """A (rank, KV group) the commit rule found invalid."""

    rank: int
    group: str

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "group": self.group}


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
    kind: FailureKind | None = None
    tier: str | None = None
    stage: Stage | None = None
    cause: CapacityCause | None = None

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ok": self.ok,
            "valid": dict(self.valid),
            "windows_done": self.windows_done,
            "bytes_restored": self.bytes_restored,
            "seconds": self.seconds,
            "reason": self.reason,
            "failed_window": self.failed_window,
            "fired_faults": list(self.fired_faults),
            "fetch_seconds": self.fetch_seconds,
            "install_seconds": self.install_seconds,
            "peak_live_bytes": self.peak_live_bytes,
            "kind": self.kind.value if self.kind else "",
            "tier": self.tier,
            "stage": self.stage.value if self.stage else "",
            "cause": self.cause.value if self.cause else "",
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RankRestore:
        return cls(
            rank=int(d["rank"]),
            ok=bool(d["ok"]),
            valid={str(g): bool(v) for g, v in (d.get("valid") or {}).items()},
            windows_done=d.get("windows_done", 0),
            bytes_restored=d.get("bytes_restored", 0),
            seconds=d.get("seconds", 0.0),
            reason=str(d.get("reason") or ""),
            failed_window=d.get("failed_window"),
            fired_faults=tuple(d.get("fired_faults") or ()),
            fetch_seconds=d.get("fetch_seconds", 0.0),
            install_seconds=d.get("install_seconds", 0.0),
            peak_live_bytes=d.get("peak_live_bytes", 0),
            kind=FailureKind(d["kind"]) if d.get("kind") else None,
            tier=d.get("tier"),
            stage=Stage(d["stage"]) if d.get("stage") else None,
            cause=CapacityCause(d["cause"]) if d.get("cause") else None,
        )


@dataclass(frozen=True)
class RestoreReport:
    """One windowed restore of a prompt's external prefix across every rank, decided by the commit rule: what was
    advertised and committed, the failures classified and blamed by stage, each rank's part, the bounds."""

    request: str
    w: int
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
    ranks: tuple[RankRestore, ...]
    chunks: int = 0
    seconds: float = 0.0
    bytes: int = 0
    gbps: float = 0.0
    rws_bytes: int | None = None
    whole_plan_bytes: int = 0
    fired_faults: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "W": self.w,
            "tiers": list(self.tiers),
            "advertised_tokens": self.advertised_tokens,
            "committed_tokens": self.committed_tokens,
            "outcome": self.outcome.value,
            "invalid": [c.to_wire() for c in self.invalid],
            "failures": [f.to_wire() for f in self.failures],
            "failure_kind": _enum_or_none(self.failure_kind),
            "failure_stage": _enum_or_none(self.failure_stage),
            "blamed_tiers": list(self.blamed_tiers),
            "blamed_ranks": list(self.blamed_ranks),
            "hint": self.hint,
            "windows": self.windows,
            "chunks": self.chunks,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "gbps": self.gbps,
            "ranks": [r.to_wire() for r in self.ranks],
            "rws_bytes": self.rws_bytes,
            "whole_plan_bytes": self.whole_plan_bytes,
            "fired_faults": list(self.fired_faults),
        }

    def unstarted_wire(self) -> dict[str, Any]:
        """The wire form of a restore that never started (a rank stopped answering the probe): its failure and
        the empty amounts, in the order that answer has always had."""
        return {
            "outcome": self.outcome.value,
            "advertised_tokens": self.advertised_tokens,
            "committed_tokens": self.committed_tokens,
            "failures": [f.to_wire() for f in self.failures],
            "failure_kind": _enum_or_none(self.failure_kind),
            "failure_stage": _enum_or_none(self.failure_stage),
            "blamed_tiers": list(self.blamed_tiers),
            "blamed_ranks": list(self.blamed_ranks),
            "invalid": [c.to_wire() for c in self.invalid],
            "tiers": list(self.tiers),
            "ranks": [r.to_wire() for r in self.ranks],
            "windows": self.windows,
            "hint": self.hint,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> RestoreReport:
        return cls(
            request=str(d["request"]),
            w=int(d["W"]),
            tiers=tuple(d.get("tiers") or ()),
            advertised_tokens=int(d.get("advertised_tokens") or 0),
            committed_tokens=int(d.get("committed_tokens") or 0),
            outcome=Outcome(d["outcome"]),
            invalid=tuple(InvalidCell(int(x["rank"]), str(x["group"])) for x in d.get("invalid") or ()),
            failures=tuple(Failure.from_wire(f) for f in d.get("failures") or ()),
            failure_kind=FailureKind(d["failure_kind"]) if d.get("failure_kind") else None,
            failure_stage=Stage(d["failure_stage"]) if d.get("failure_stage") else None,
            blamed_tiers=tuple(d.get("blamed_tiers") or ()),
            blamed_ranks=tuple(d.get("blamed_ranks") or ()),
            hint=d.get("hint"),
            windows=int(d.get("windows") or 0),
            ranks=tuple(RankRestore.from_wire(r) for r in d.get("ranks") or ()),
            chunks=int(d.get("chunks") or 0),
            seconds=d.get("seconds", 0.0),
            bytes=int(d.get("bytes") or 0),
            gbps=d.get("gbps", 0.0),
            rws_bytes=d.get("rws_bytes"),
            whole_plan_bytes=int(d.get("whole_plan_bytes") or 0),
            fired_faults=tuple(d.get("fired_faults") or ()),
        )


# -- a manual restore ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefixLookup:
    """The probe a manual restore starts with: the bitmap, where the prefix breaks, the tiers that did not answer."""

    tier_errors: TierErrors
    first_break: Break | None
    bitmap: HitBitmap

    def to_wire(self) -> dict[str, Any]:
        return {
            "tier_errors": self.tier_errors,
            "first_break": self.first_break.to_wire() if self.first_break else None,
            "bitmap": self.bitmap.to_dict(),
        }


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
    canonical hash does not apply (``hash_note``)."""

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
    def outcome(self) -> Outcome:
        return self.report.outcome if self.report is not None else Outcome.NOTHING_TO_RESTORE

    @property
    def committed_tokens(self) -> int:
        return self.report.committed_tokens if self.report is not None else 0

    @property
    def first_break(self) -> Break | None:
        return self.lookup.first_break if self.lookup is not None else None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request": self.request, "prompt": self.prompt, "tokens": self.tokens, "W": self.w}
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
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ManualRestoreResult:
        lookup = None
        if "bitmap" in d:
            lookup = PrefixLookup(
                tier_errors=_tier_errors(d.get("tier_errors")),
                first_break=Break.from_wire(d.get("first_break")),
                bitmap=HitBitmap.from_dict(d["bitmap"]),
            )
        nothing = d.get("outcome") == Outcome.NOTHING_TO_RESTORE
        hashes = None
        if d.get("output_hash") is not None:
            hashes = OutputHashes(str(d["output_hash"]), d.get("canonical_hash"), d.get("hash_ok"))
        return cls(
            request=str(d["request"]),
            prompt=str(d["prompt"]),
            tokens=int(d["tokens"]),
            w=int(d["W"]),
            lookup=lookup,
            report=None if nothing else RestoreReport.from_wire(d),
            hashes=hashes,
            marker=Marker.from_dict(d["marker"]) if d.get("marker") else None,
            hash_note=d.get("hash_note") if d.get("hash") == HASH_NOT_APPLICABLE else None,
        )


def _not_applicable(note: str, output_hash: str) -> dict[str, Any]:
    return {"hash": HASH_NOT_APPLICABLE, "hash_note": note, "kv_checksum": output_hash}


# -- a submitted prompt ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdmissionPass:
    """One admission pass of a submitted prompt: the tiers it excluded, the external prefix it found, and the
    restore of that prefix (None: nothing external, computed locally)."""

    pass_no: int
    excluded_tiers: tuple[str, ...]
    external_tokens: int
    tier_errors: TierErrors
    restore: RestoreReport | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pass": self.pass_no,
            "excluded_tiers": list(self.excluded_tiers),
            "external_tokens": self.external_tokens,
            "tier_errors": self.tier_errors,
        }
        if self.restore is not None:
            out["restore"] = self.restore.to_wire()
            if not self.restore.committed_tokens:
                out["failure_kind"] = _enum_or_none(self.restore.failure_kind)
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> AdmissionPass:
        return cls(
            pass_no=int(d["pass"]),
            excluded_tiers=tuple(d.get("excluded_tiers") or ()),
            external_tokens=int(d.get("external_tokens") or 0),
            tier_errors=_tier_errors(d.get("tier_errors")),
            restore=RestoreReport.from_wire(d["restore"]) if d.get("restore") else None,
        )


@dataclass(frozen=True)
class MarkerStep:
    """A force-local marker as it stood at an admission pass (0: before the first)."""

    pass_no: int
    marker: Marker

    def to_wire(self) -> dict[str, Any]:
        return {"pass": self.pass_no, "marker": self.marker.to_dict()}


@dataclass(frozen=True)
class StoreReport:
    """What storing the chunks each tier lacked wrote, per rank ("rank0") and tier, and which tiers refused."""

    objects: dict[str, dict[str, int]]
    errors: dict[str, dict[str, str]]

    def to_wire(self) -> dict[str, Any]:
        return {"objects": self.objects, "errors": self.errors}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> StoreReport:
        return cls(
            objects={str(r): {str(t): int(n) for t, n in per.items()} for r, per in (d.get("objects") or {}).items()},
            errors=_tier_errors(d.get("errors")),
        )


@dataclass(frozen=True)
class SubmitResult:
    """A prompt admitted as the scheduler would: its passes, the external prefix committed and where it came from,
    what was computed locally, the marker's history, what was stored, the output hash."""

    request: str
    prompt: str
    tokens: int
    w: int
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

    def to_wire(self) -> dict[str, Any]:
        out = {
            "request": self.request,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "W": self.w,
            "external_tokens": self.external_tokens,
            "computed_tokens": self.computed_tokens,
            "source": self.source,
            "passes": [p.to_wire() for p in self.passes],
            "force_local": {"history": [h.to_wire() for h in self.marker_history], "cleared": self.marker_cleared},
            "stored": self.stored.to_wire() if self.stored is not None else {},
            "output_hash": self.output_hash,
            "canonical_hash": self.canonical_hash,
            "hash_ok": self.hash_ok,
            "seconds": self.seconds,
        }
        if self.hash_note is not None:
            out |= _not_applicable(self.hash_note, self.output_hash)
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SubmitResult:
        force_local = d.get("force_local") or {}
        return cls(
            request=str(d["request"]),
            prompt=str(d["prompt"]),
            tokens=int(d["tokens"]),
            w=int(d["W"]),
            external_tokens=int(d["external_tokens"]),
            computed_tokens=int(d["computed_tokens"]),
            source=str(d["source"]),
            passes=tuple(AdmissionPass.from_wire(p) for p in d.get("passes") or ()),
            marker_history=tuple(
                MarkerStep(int(h["pass"]), Marker.from_dict(h["marker"])) for h in force_local.get("history") or ()
            ),
            marker_cleared=bool(force_local.get("cleared")),
            stored=StoreReport.from_wire(d["stored"]) if d.get("stored") else None,
            output_hash=str(d["output_hash"]),
            canonical_hash=d.get("canonical_hash"),
            hash_ok=d.get("hash_ok"),
            seconds=d.get("seconds", 0.0),
            hash_note=d.get("hash_note") if d.get("hash") == HASH_NOT_APPLICABLE else None,
        )


# -- an abort --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AbortAnswer:
    """Whether the engine is aborting the request (False: no such request was open)."""

    request: str
    aborting: bool

    def to_wire(self) -> dict[str, Any]:
        return {"request": self.request, "aborting": self.aborting}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> AbortAnswer:
        return cls(request=str(d["request"]), aborting=bool(d.get("aborting")))


__all__ = [
    "HASH_NOT_APPLICABLE",
    "AbortAnswer",
    "AdmissionPass",
    "InvalidCell",
    "ManualRestoreResult",
    "MarkerStep",
    "OutputHashes",
    "PrefixLookup",
    "ProbeResult",
    "RankRestore",
    "RestoreReport",
    "StoreReport",
    "SubmitResult",
]
