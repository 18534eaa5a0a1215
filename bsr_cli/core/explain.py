"""`bsr explain`: why a prompt was (not) reused, as one verdict with its evidence chain. Pure: the command gathers
the facts (an engine's probe, health, markers, faults and events; or a Mooncake store's probe with its diagnosis
and holder liveness) and this module joins them.

Findings, in the order the verdict picks them (the first is what blocks reuse now; the rest are listed too):

    rank-unhealthy       a rank is down, stopped or stuck past a deadline: every restore fails until it is back
    window-over-budget   RWS(W) exceeds the budget B (W=0: the whole plan exceeds the pool): never admitted
    force-local-marker   a failed restore set a marker: the next admission skips the blamed tier(s)
    fault-armed          an injected fault will fail the next restore
    holder-gone          the store lists the chunks, but the process holding them is gone
    segment-lost         the engine's store lost a holder's segment (its holder missed the master's client TTL, or
                         died), and this prompt's chunks on that tier with it
    key-format-mismatch  the store holds this prompt under another key format (world size, dtype, tags, hash seed)
    never-stored         no tier holds any chunk of the prompt
    rank-skew            the prefix breaks on some ranks (or KV groups) only: the others hold the chunk
    quarantined          the last restore found a chunk damaged on a tier (checksum mismatch) and moved it aside:
                         the tier no longer holds it until the next submit rewrites it
    evicted              a chunk is missing in every tier while later chunks are held: it was evicted
    partial              the tiers hold a prefix and nothing after it (the rest was never stored, or evicted)
    restorable           every rank and group holds the whole prompt: it will be restored
    held                 every rank and group holds the whole prompt, but a finding before it decides the next
                         admission (a marker, a fault, a rank): ``restorable`` is only ever the verdict
    repaired             a chunk the last restore quarantined has been stored again since (information)
    tier-unhealthy       a tier is unhealthy: the verdict when every tier holding the whole prompt is unhealthy
                         (the restore would likely fail closed), otherwise listed as information; a restore failure
                         older than the prompt's last restore is dated, and dropped when that restore read the tier
                         without it failing
    unverified           held chunks carry no checksum bound to their chunk (stored by stock LMCache, or an older
                         bsr): bsr's connector refuses them unless told to load them (information)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from bsr_cli.core import accounting, wire
from bsr_cli.core import events as ev
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.evidence import FailureKind, Outcome, SegmentLossCause, TierCondition
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.registration import Registration
from bsr_cli.core.status import EngineInfo, Health, MarkerView, TierHealth
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.core.store_probe import Diagnosis, HolderState, KeyFormatValue, Liveness, StoreProbe
from bsr_cli.errors import ServerError


class FindingKind(StrEnum):
    """What a finding says (and, for the first finding, the verdict). A prompt's findings come first, in the order
    the verdict picks them; a request's verdicts follow."""

    RANK_UNHEALTHY = "rank-unhealthy"
    WINDOW_OVER_BUDGET = "window-over-budget"
    FORCE_LOCAL_MARKER = "force-local-marker"
    FAULT_ARMED = "fault-armed"
    HOLDER_GONE = "holder-gone"
    SEGMENT_LOST = "segment-lost"
    KEY_FORMAT_MISMATCH = "key-format-mismatch"
    NEVER_STORED = "never-stored"
    RANK_SKEW = "rank-skew"
    QUARANTINED = "quarantined"
    EVICTED = "evicted"
    PARTIAL = "partial"
    RESTORABLE = "restorable"
    HELD = "held"  # information: the whole prompt is held, but the verdict decides what the next admission does
    REPAIRED = "repaired"
    TIER_UNHEALTHY = "tier-unhealthy"  # information, after `restorable`, unless every tier holding it is unhealthy
    UNVERIFIED = "unverified"  # information
    # How a request ended (`bsr explain REQ`).
    RESTORE_COMMITTED = "restore-committed"
    RESTORE_ABORTED = "restore-aborted"
    RESTORE_FAILED_CAPACITY = "restore-failed-capacity"
    RESTORE_FAILED_RANK = "restore-failed-rank"
    RESTORE_FAILED_TIER = "restore-failed-tier"
    RESTORE_FAILED_HOST = "restore-failed-host"  # a deadline ran out while the host starved the engine
    ADMITTED = "admitted"
    RUNNING = "running"


# A prompt's findings, in the order the verdict picks them (a request's verdicts are never sorted).
ORDER = tuple(FindingKind)[: list(FindingKind).index(FindingKind.UNVERIFIED) + 1]


@dataclass(frozen=True)
class Finding:
    """One thing that explains (or blocks) reuse: what it is, the evidence for it, the fix and the next command."""

    # A tier-unhealthy finding's: whether it is the verdict (every full tier unhealthy). First on the wire, when
    # it is said; given by name.
    blocks: bool | None = dataclasses.field(default=None, kw_only=True, metadata=wire.meta(omit_none=True))
    kind: FindingKind
    summary: str
    evidence: tuple[str, ...]
    fix: str
    next: str
    # What the probe saw, without the cause the summary gives for it ("chunk 3 is missing in every tier while 2
    # later chunk(s) are held"): what a finding that names another cause restates. Part of the summary, not on the
    # wire; empty where the finding is no such observation.
    observed: str = dataclasses.field(default="", kw_only=True, compare=False, metadata=wire.meta(skip=True))

    to_wire = wire.writer()


def _finding(kind: FindingKind, summary: str, evidence: Sequence[str], fix: str, next_cmd: str) -> Finding:
    return Finding(kind, summary, tuple(evidence), fix, next_cmd)


def _observation(
    kind: FindingKind, observed: str, cause: str, evidence: Sequence[str], fix: str, next_cmd: str
) -> Finding:
    """A finding whose summary is what the probe saw and, after a colon, the cause it gives for it."""
    return Finding(kind, f"{observed}: {cause}", tuple(evidence), fix, next_cmd, observed=observed)


@dataclass(frozen=True)
class TierPrefix:
    """On one tier and rank: the leading chunks that tier alone holds for every group, and the chunks it holds."""

    tier: str
    rank: int
    prefix_chunks: int
    held_chunks: int


@dataclass(frozen=True)
class RankWindows:
    """One rank's part of a restore: the windows it released and their bytes."""

    rank: int
    windows_released: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class QuarantinedChunk:
    """A chunk a restore found damaged on a tier and set apart (moved aside, or removed: ``file`` is then "")."""

    rank: int
    tier: str
    chunk: int
    group: str
    file: str
    reason: str
    key: str = ""


@dataclass(frozen=True)
class RestoreMarker:
    """The force-local marker a failed restore left."""

    excluded_tiers: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class FoldedRestore:
    """One restore's events folded into per-rank, per-window facts (`fold_restore`). ``outcome`` None: running.
    ``started``/``ended``: whether its start and end were seen (the wire names their facts only then);
    ``arrived`` keeps the order the optional facts first came in, which the wire form keeps."""

    request: str
    outcome: Outcome | None = None
    windows: int | None = None
    W: int | None = None
    failures: tuple[ev.Failure, ...] = ()
    tiers: tuple[str, ...] = ()
    tokens: int = 0
    committed_tokens: int = 0
    failure_kind: FailureKind | None = None
    marker: RestoreMarker | None = None
    quarantined: tuple[QuarantinedChunk, ...] = ()
    ranks: tuple[RankWindows, ...] = ()
    arrived: tuple[str, ...] = ()  # of "started", "ended", "marker", "quarantined"
    started_at: float | None = None  # when its (last pass's) restore started: not on the wire, dates other evidence

    @property
    def started(self) -> bool:
        return "started" in self.arrived

    @property
    def ended(self) -> bool:
        return "ended" in self.arrived

    def to_wire(self) -> wire.JsonObject:
        # A failure as a folded restore names it: its kind, stage and tier, not its cause.
        failures: list[wire.JsonValue] = [
            {
                "rank": f.rank,
                "window": f.window,
                "kind": f.kind.value,
                "stage": f.stage.value if f.stage else None,
                "tier": f.tier,
                "reason": f.reason,
            }
            for f in self.failures
        ]
        head: wire.JsonObject = {
            "request": self.request,
            "outcome": self.outcome.value if self.outcome is not None else "running",
            "windows": self.windows,
            "W": self.W,
            "failures": failures,
        }
        return head | dict(self._optional_facts()) | {"ranks": [dataclasses.asdict(r) for r in self.ranks]}

    def _optional_facts(self) -> Iterator[tuple[str, wire.JsonValue]]:
        """The wire's optional facts, named only once seen, in the order they first came in (as it always had)."""
        for section in self.arrived:
            if section == "started":
                yield "tiers", list(self.tiers)
                yield "tokens", self.tokens
            elif section == "ended":
                yield "committed_tokens", self.committed_tokens
                yield "failure_kind", self.failure_kind.value if self.failure_kind is not None else None
            elif section == "marker" and self.marker is not None:
                yield "marker", {"excluded_tiers": list(self.marker.excluded_tiers), "reason": self.marker.reason}
            elif section == "quarantined":
                yield "quarantined", [dataclasses.asdict(q) for q in self.quarantined]


class Subject(StrEnum):
    """What an explanation is about: a prompt on an engine, a prompt in a Mooncake store, or a request."""

    ENGINE = "engine"
    STORE = "store"
    REQUEST = "request"


@dataclass(frozen=True)
class Explanation:
    """`bsr explain`'s answer: the verdict (the first finding), every finding, where each tier's prefix ends per
    rank, and the last restore of the prompt (or the request's own restore)."""

    subject: Subject
    prompt: str
    verdict: FindingKind
    reusable: bool
    summary: str
    findings: tuple[Finding, ...]
    next: str
    tokens: int = 0
    chunks: int = 0
    source: str | None = None  # the engine's name, or the store's address
    probe_error: str | None = None
    request: str = ""
    tiers: tuple[TierPrefix, ...] = ()
    last_restore: FoldedRestore | None = None
    url: str | None = None  # the engine asked, when the command asked one
    # The id of the force-local marker that stands for the prompt (the request's), as `bsr markers list` shows it:
    # the prompt's own hash, or a vLLM worker's for a prefix of it.
    marker: str | None = None

    def to_wire(self) -> wire.JsonObject:
        return (
            {"kind": "bsr.explain"}
            | dict(self._subject_facts())
            | {
                "verdict": self.verdict.value,
                "reusable": self.reusable,
                "summary": self.summary,
                "findings": [f.to_wire() for f in self.findings],
                "tiers": [dataclasses.asdict(t) for t in self.tiers],
                "last_restore": self.last_restore.to_wire() if self.last_restore is not None else None,
                "next": self.next,
            }
            | ({"marker": self.marker} if self.marker is not None else {})
            | ({"url": self.url} if self.url is not None else {})
        )

    def _subject_facts(self) -> Iterator[tuple[str, wire.JsonValue]]:
        """What the wire says of the subject: a request and its prompt, or a prompt with the engine or store."""
        if self.subject is Subject.REQUEST:
            yield from (("request", self.request), ("prompt", self.prompt))
            return
        yield from (("prompt", self.prompt), ("tokens", self.tokens), ("chunks", self.chunks))
        yield self.subject.value, self.source
        if self.probe_error:
            yield "probe_error", self.probe_error


def tier_prefixes(bitmap: HitBitmap) -> list[TierPrefix]:
    """Per tier and rank: how many leading chunks that tier alone holds for every group of the rank, and how many
    chunks it holds at all."""
    out = []
    for i, tier in enumerate(bitmap.tiers):
        for r in range(bitmap.ranks):
            prefix = 0
            while prefix < bitmap.chunks and all(bitmap.mask(r, g, prefix) >> i & 1 for g in bitmap.groups):
                prefix += 1
            held = sum(1 for c in range(bitmap.chunks) if all(bitmap.mask(r, g, c) >> i & 1 for g in bitmap.groups))
            out.append(TierPrefix(tier, r, prefix, held))
    return out


def _content(bitmap: HitBitmap, exclude: Sequence[str], prompt_flags: str) -> list[Finding]:
    """What the bitmap alone says: never stored, skew, eviction, partial, or restorable."""
    n = bitmap.chunks
    k = bitmap.prefix_chunks(exclude)
    any_held = any(bitmap.mask(r, g, c) for r in range(bitmap.ranks) for g in bitmap.groups for c in range(n))
    if not any_held:
        return [
            _observation(
                FindingKind.NEVER_STORED,
                "no tier holds any chunk of this prompt",
                "it was never stored (or everything was evicted)",
                [f"probe: 0 of {n} chunks held on any rank, group or tier ({', '.join(bitmap.tiers)})"],
                "admit it once so it is computed and stored",
                f"bsr submit {prompt_flags}",
            )
        ]
    if k >= n:
        return [
            _finding(
                FindingKind.RESTORABLE,
                f"every rank and group holds all {n} chunks: the prompt will be restored ({bitmap.tokens:,} tokens)",
                [f"probe: committable prefix {k}/{n} chunks"],
                "nothing to fix",
                f"bsr restore {prompt_flags}",
            )
        ]
    brk = bitmap.first_break(exclude)
    assert brk is not None
    holders = [
        (r, g)
        for r in range(bitmap.ranks)
        for g in bitmap.groups
        if bitmap.mask(r, g, k) & sum(1 << i for i, t in enumerate(bitmap.tiers) if t not in exclude)
    ]
    missing = [(r, g) for r in range(bitmap.ranks) for g in bitmap.groups if (r, g) not in holders]
    later = [
        c for c in range(k + 1, n) if any(bitmap.mask(r, g, c) for r in range(bitmap.ranks) for g in bitmap.groups)
    ]
    where = ", ".join(f"rank {r} group {g}" for r, g in missing)
    ev = [f"probe: committable prefix {k}/{n} chunks ({min(k * bitmap.chunk_size, bitmap.tokens):,} tokens)"]
    ev.append(f"first break: chunk {k}, missing on {where}" + (f" ({brk.reason})" if brk.reason else ""))
    if holders:
        ev.append("held at chunk {} by {}".format(k, ", ".join(f"rank {r} group {g}" for r, g in holders)))
        return [
            _observation(
                FindingKind.RANK_SKEW,
                f"the prefix breaks at chunk {k} on {where} only",
                "the other ranks/groups hold it (TP-rank skew: that rank's store failed or its copy was evicted)",
                ev,
                "re-store the prompt (every rank writes its own keys), and check that rank's store errors",
                f"bsr events --request REQ   # then: bsr submit {prompt_flags}",
            )
        ]
    if later:
        ev.append(f"held after the break: chunks {_ranges(later)}")
        return [
            _observation(
                FindingKind.EVICTED,
                f"chunk {k} is missing in every tier while {len(later)} later chunk(s) are held",
                "it was evicted from the store (a middle chunk cannot be skipped, so the prefix ends there)",
                ev,
                "give the tier more room (Mooncake segment size, eviction watermark) or pin hot prompts; re-store it",
                f"bsr submit {prompt_flags}",
            )
        ]
    return [
        _observation(
            FindingKind.PARTIAL,
            f"the tiers hold chunks 0..{k - 1} and nothing after",
            "the rest was never stored or was evicted",
            ev,
            "re-store the prompt; if this repeats, the store is evicting tails (raise its capacity)",
            f"bsr submit {prompt_flags}",
        )
    ]


def _ranges(xs: Sequence[int]) -> str:
    out: list[str] = []
    start = prev = xs[0]
    for x in xs[1:]:
        if x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = x
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(out[:6]) + (" ..." if len(out) > 6 else "")


def explain_engine(
    *,
    prompt: str,
    prompt_flags: str,
    registration: Registration,
    bitmap: HitBitmap | None,
    probe_error: str | None = None,
    n_tokens: int,
    info: EngineInfo,
    health: Health,
    markers: Sequence[MarkerView],
    faults: Sequence[FaultSpec],
    w: int | None,
    last_restore: FoldedRestore | None,
    covering: Collection[str] = (),
) -> Explanation:
    """The verdict for a prompt on a live engine, from the admin API's typed answers: the probe's bitmap (None when
    the probe could not run: ``probe_error`` says why), info, health, the markers (the prompt's own: keyed by its
    hash, or by one of ``covering``, the ids of markers that stand for a prefix of it) and the armed faults, and
    the prompt's last restore. A marker is named by its own id, as `bsr markers list` shows it."""
    mine = [m for m in markers if m.prompt == prompt or m.prompt in covering]
    findings = _unhealthy_ranks(health)
    findings += _window_fit(registration, info, w, bitmap, n_tokens, prompt_flags)
    findings += _markers(prompt, mine, bitmap)
    findings += _armed_faults(faults)
    findings += _lost_segments(health, bitmap, prompt_flags)
    if bitmap is not None:
        content = _content(bitmap, (), prompt_flags)
        if bitmap.tokens < n_tokens:  # the engine probes (and stores) full chunks only
            tail = (
                f"the last {n_tokens - bitmap.tokens:,} token(s) do not fill a chunk: they are never stored "
                "(only full chunks are) and are always computed"
            )
            content = [dataclasses.replace(f, evidence=(*f.evidence, tail)) for f in content]
        findings.extend(content)
    elif not findings:
        raise ServerError(
            f"the engine's probe failed and nothing else explains it: {probe_error}",
            hint="`bsr status` shows the engine's ranks and tiers; retry the explain when they answer",
        )
    findings.extend(_quarantined(bitmap, last_restore, prompt_flags))
    findings.extend(_unhealthy_tiers(health, bitmap, last_restore))
    if info.host_fields.get("serves_restores") is False:
        findings = [_on_worker(f, prompt_flags) for f in findings]
    result = _result(
        prompt,
        bitmap,
        findings,
        last_restore,
        subject=Subject.ENGINE,
        source=info.engine,
        probe_error=probe_error,
        n_tokens=n_tokens,
        chunk_size=registration.chunk_size,
    )
    return dataclasses.replace(result, marker=mine[0].prompt) if mine else result


def _unhealthy_ranks(health: Health) -> list[Finding]:
    """A rank down, stopped or stuck: every restore fails closed until it is back."""
    findings: list[Finding] = []
    bad_ranks = [r for r in health.ranks if not r.healthy]
    if bad_ranks:
        findings.append(
            _finding(
                FindingKind.RANK_UNHEALTHY,
                "; ".join(f"rank {r.rank} {r.reason or 'unhealthy'}" for r in bad_ranks)
                + ": every restore fails closed until it is back (the prefix is held, but no rank can install "
                "without all of them)",
                [
                    f"health: rank {r.rank} alive={r.alive} healthy=False"
                    + (f", heartbeat {r.heartbeat_age_s} s ago" if r.heartbeat_age_s is not None else "")
                    for r in bad_ranks
                ],
                "resume the stopped rank process (SIGCONT), or restart the engine",
                "bsr status",
            )
        )
    return findings


def _window_fit(
    reg: Registration,
    info: EngineInfo,
    w: int | None,
    bitmap: HitBitmap | None,
    n_tokens: int,
    prompt_flags: str,
) -> list[Finding]:
    """A window (W=0: the whole plan) that the budget B (the pool) can never admit."""
    findings: list[Finding] = []
    window = info.w if w is None else w
    budget = info.budget_bytes
    pool = info.pool_bytes
    slot = reg.bytes_per_chunk
    if window > 0:
        need = accounting.rws_bytes(reg, window)
        if budget and need > budget:
            fit = max(1, budget // slot) if slot else 1
            findings.append(
                _finding(
                    FindingKind.WINDOW_OVER_BUDGET,
                    f"W={window} needs RWS(W) = {need:,} bytes per rank but the budget B is {budget:,}: no window "
                    "could be admitted (a capacity refusal, no tier is at fault)",
                    [f"RWS(W={window}) = {window} × {slot:,} B/chunk = {need:,} B > B = {budget:,} B"],
                    f"use --W {fit} or lower, or raise B to at least {need:,} (at most the pool, {pool:,})",
                    f"bsr settings set --budget {need}" if need <= pool else f"bsr restore {prompt_flags} --W {fit}",
                )
            )
    else:
        k_all = bitmap.prefix_chunks() if bitmap is not None else accounting.chunks_for_tokens(n_tokens, reg.chunk_size)
        whole = accounting.whole_plan_bytes(reg, k_all)
        if pool and whole > pool:
            findings.append(
                _finding(
                    FindingKind.WINDOW_OVER_BUDGET,
                    f"W=0 stages the whole prefix at once ({whole:,} bytes per rank) and the pool holds {pool:,}",
                    [f"whole plan {k_all} chunks × {slot:,} B = {whole:,} B > pool {pool:,} B"],
                    "use a bounded window (--W)",
                    f"bsr restore {prompt_flags} --W {max(1, budget // slot) if slot else 1}",
                )
            )
    return findings


def _markers(prompt: str, mine: Sequence[MarkerView], bitmap: HitBitmap | None) -> list[Finding]:
    """This prompt's force-local marker (``mine``: those that stand for it): what the next admission does because
    of it. Named by its own id: a marker that stands for a prefix of the prompt says how long that prefix is."""
    findings: list[Finding] = []
    exclude: list[str] = []
    for m in mine:
        exclude = sorted(set(exclude) | set(m.excluded_tiers))
    if mine:
        m = mine[0]
        reason = m.reason or "no reason recorded"
        request = m.request
        when = f"set when restore {request} failed" if request else "set by a failed restore"
        n = m.host_fields.get("prefix_tokens")
        stands = f" (it stands for this prompt's first {n:,} tokens)" if m.prompt != prompt and n else ""
        if not exclude:
            # A marker that excludes no tier: a rank failed (install, synchronize), no tier is to blame, and the
            # next admission recomputes the prompt locally. The remedy is the rank's, then this prompt's marker.
            findings.append(
                _finding(
                    FindingKind.FORCE_LOCAL_MARKER,
                    f"a force-local marker makes the next admission recompute this prompt locally ({when}: "
                    f"{reason}); no tier is blamed",
                    [f"marker: prompt {m.prompt} excludes no tier (recompute locally){stands}"]
                    + ([f"request: {request}"] if request else []),
                    "check the rank (`bsr status` shows its last fault); a rank that keeps failing to install needs "
                    "its process or host looked at. Then clear this prompt's marker, or let a committed admission "
                    "clear it",
                    f"bsr markers clear --prompt {m.prompt}",
                )
            )
        else:
            rest = [t for t in (bitmap.tiers if bitmap is not None else ()) if t not in exclude]
            k_rest = bitmap.prefix_chunks(exclude) if bitmap is not None else 0
            if bitmap is None:
                then = "the next admission cannot be judged without a probe"
            elif k_rest:
                then = f"the next admission serves it from {', '.join(rest)} ({k_rest}/{bitmap.chunks} chunks there)"
            else:
                then = "the next admission recomputes it (no other tier holds its prefix)"
            findings.append(
                _finding(
                    FindingKind.FORCE_LOCAL_MARKER,
                    f"a force-local marker excludes {', '.join(exclude)} for this prompt, {when} ({reason}): {then}",
                    [f"marker: prompt {m.prompt} excludes {', '.join(exclude)}{stands}"]
                    + ([f"request: {request}"] if request else []),
                    f"fix tier {', '.join(exclude)} (`bsr status`); a committed admission clears the marker, or clear "
                    "this prompt's marker by hand",
                    f"bsr markers clear --prompt {m.prompt}",
                )
            )
    return findings


def _armed_faults(faults: Sequence[FaultSpec]) -> list[Finding]:
    findings: list[Finding] = []
    armed = [f for f in faults if not f.exhausted()]
    if armed:
        findings.append(
            _finding(
                FindingKind.FAULT_ARMED,
                f"{len(armed)} injected fault(s) armed: the next restore fails on purpose",
                [
                    f"fault #{f.id} {f.kind} on " + (f"rank {f.rank}" if f.rank is not None else "every rank")
                    for f in armed
                ],
                "clear the faults when the drill is over",
                "bsr faults clear",
            )
        )
    return findings


def _lost_segments(health: Health, bitmap: HitBitmap | None, prompt_flags: str) -> list[Finding]:
    """A segment the engine's store lost, when it explains this prompt: the tier no longer holds the whole prompt
    (or lists chunks whose holder is gone) and no healthy tier holds it all."""
    whole = [t for t in bitmap.tiers if bitmap.tier_prefix_chunks(t) >= bitmap.chunks] if bitmap is not None else []
    if any(t not in health.tiers or health.tiers[t].ok for t in whole):
        return []  # a tier no loss touches holds it all: the prompt is restored from there
    findings: list[Finding] = []
    for tier, h in health.tiers.items():
        losses = [x for x in h.lost_segments if tier not in whole or _listed_but_gone(x)]
        if not losses:
            continue
        held = f" (it holds {bitmap.tier_prefix_chunks(tier)}/{bitmap.chunks} of its chunks now)" if bitmap else ""
        findings.append(
            _finding(
                FindingKind.SEGMENT_LOST,
                f"{losses[-1].line()}: this prompt's chunks on tier {tier} went with it{held}",
                [f"tier {tier}: {x.line()}" for x in losses],
                "keep the segment holder from stalling past the master's client TTL (`bsr engine up "
                "--store-client-ttl`; see what starved or stopped it), or restart a holder that died; the next "
                "submit stores the prompt again",
                f"bsr submit {prompt_flags}",
            )
        )
    return findings


def _listed_but_gone(loss: SegmentLoss) -> bool:
    """The master still lists the segment's objects (probes call them held), but its holder is gone."""
    return loss.cause is SegmentLossCause.HOLDER_GONE and loss.remounted_at is None


def _unhealthy_tiers(health: Health, bitmap: HitBitmap | None, last: FoldedRestore | None) -> list[Finding]:
    """Unhealthy tiers: the verdict (``blocks``) when every tier holding the whole prompt is one of them. A tier
    unhealthy only because a restore from it failed before this prompt's last restore is dated; when that restore
    read from it without a failure of the tier, the newer evidence stands and the older is dropped."""
    findings: list[Finding] = []
    degraded = {t: h for t, h in health.tiers.items() if not h.ok and not _served_since(t, h, last)}
    full = [t for t in bitmap.tiers if bitmap.tier_prefix_chunks(t) >= bitmap.chunks] if bitmap is not None else []
    for t, h in degraded.items():
        evidence = [f"tier {t}: {'; '.join(h.detail) or 'unhealthy'}"]
        if last is not None and _before(h.failed_at, last):
            evidence.append(f"that failure is older than this prompt's last restore ({last.request}, {_ended(last)})")
        finding = _finding(
            FindingKind.TIER_UNHEALTHY,
            f"tier {t} is unhealthy: a restore from it may fail closed and set a marker",
            evidence,
            "see `bsr status`; a lower tier or recompute serves meanwhile",
            "bsr status",
        )
        findings.append(dataclasses.replace(finding, blocks=t in full and set(full) <= set(degraded)))
    return findings


def _before(failed_at: float | None, last: FoldedRestore) -> bool:
    return failed_at is not None and last.started_at is not None and failed_at < last.started_at


def _served_since(tier: str, h: TierHealth, last: FoldedRestore | None) -> bool:
    """The tier is unhealthy only for a restore failure that this prompt's later restore contradicts: that restore
    read from the tier and no failure of it blamed the tier."""
    return (
        last is not None
        and set(h.conditions) == {TierCondition.RESTORE_FAILED}
        and _before(h.failed_at, last)
        and tier in last.tiers
        and not any(f.tier == tier for f in last.failures)
    )


def _ended(last: FoldedRestore) -> str:
    return last.outcome.value.replace("_", " ") if last.outcome is not None else "still running"


def _quarantined(bitmap: HitBitmap | None, last_restore: FoldedRestore | None, prompt_flags: str) -> list[Finding]:
    """The chunks the last restore found damaged on a tier and set apart: the cause of the gap they leave (until the
    next submit stores them again), or, once they are held again, the repair."""
    out: list[Finding] = []
    if last_restore is None:
        return out
    for q in last_restore.quarantined:
        where = f"chunk {q.chunk} group {q.group} on rank {q.rank} in tier {q.tier}"
        evidence = [
            f"quarantined: {where} (key {q.key}): {q.reason}",
            f"moved to {q.file}" if q.file else "removed from the tier",
        ]
        held = (
            bitmap is not None
            and q.tier in bitmap.tiers
            and q.group in bitmap.groups
            and 0 <= q.rank < bitmap.ranks
            and 0 <= q.chunk < bitmap.chunks
            and bool(bitmap.mask(q.rank, q.group, q.chunk) >> bitmap.tiers.index(q.tier) & 1)
        )
        if held:
            out.append(
                _finding(
                    FindingKind.REPAIRED,
                    f"{where} was damaged (quarantined by restore {last_restore.request}) and "
                    "has been stored again since",
                    evidence,
                    "nothing to fix; keep the quarantined file for the incident (`bsr bundle` lists it)",
                    "bsr status",
                )
            )
        else:
            out.append(
                _finding(
                    FindingKind.QUARANTINED,
                    f"{where} was damaged on the tier (its checksum failed) and is quarantined: the tier no longer "
                    "holds it, so restores stop before it until it is stored again",
                    evidence,
                    "submit the prompt: the chunk is computed (or restored from another tier) and rewritten; check "
                    "the tier's disk if it happens again",
                    f"bsr submit {prompt_flags}",
                )
            )
    return out


# On an engine that serves no restores (a vLLM worker: KV moves only through vLLM's scheduler and the BSR connector,
# configured by vLLM's kv_connector_extra_config, and its markers live in the scheduler), the fix and the next
# command of each finding, in what that engine serves.
_WORKER_REMEDY: dict[FindingKind, tuple[str, str]] = {
    FindingKind.NEVER_STORED: (
        "send the prompt through vLLM once: it is computed and LMCache stores its full chunks",
        "probe",
    ),
    FindingKind.PARTIAL: (
        "send the prompt through vLLM: the chunks LMCache lacks are computed and stored again",
        "probe",
    ),
    FindingKind.EVICTED: (
        "give LMCache's tier more room (max_local_disk_size, Mooncake's segment size); sending the prompt through "
        "vLLM stores the evicted chunk again. Right after a restart against a running master, `bsr probe --store` "
        "(the line `bsr engine endpoints` prints) shows whether a gone holder's segment took the put instead",
        "probe",
    ),
    FindingKind.RANK_SKEW: (
        "check that TP rank's LMCache store errors in the vLLM log (a put on a gone holder's segment: `bsr probe "
        "--store`); sending the prompt through vLLM stores it again",
        "probe",
    ),
    FindingKind.RESTORABLE: (
        "nothing to fix: vLLM's next admission of it loads the prefix through the BSR connector",
        "status",
    ),
    FindingKind.FORCE_LOCAL_MARKER: (
        "nothing to clear by hand: vLLM's scheduler holds the marker and the next admission of a prompt starting "
        "with this prefix computes it locally and clears it",
        "markers list",
    ),
    FindingKind.WINDOW_OVER_BUDGET: ("lower the connector's bsr_window_chunks (kv_connector_extra_config)", "status"),
}


def _on_worker(f: Finding, prompt_flags: str) -> Finding:
    remedy = _WORKER_REMEDY.get(f.kind)
    if remedy is None:  # rank/tier health and armed faults: `bsr status` / `bsr faults clear` are served there
        return f
    fix, cmd = remedy
    return dataclasses.replace(f, fix=fix, next=f"bsr probe {prompt_flags}" if cmd == "probe" else f"bsr {cmd}")


def explain_store(
    *,
    prompt: str,
    prompt_flags: str,
    store: StoreProbe,
    command: Callable[[str, Mapping[str, KeyFormatValue]], str],
) -> Explanation:
    """The verdict for a prompt from a Mooncake store LMCache wrote (no engine): `bsr probe --store`'s result.

    `prompt_flags` name the prompt alone (for `bsr submit`/`restore`, which know no --store flags); `command(verb,
    changes)` gives a whole `bsr probe|explain --store ...` line with the store's flags as the user gave them and
    the key-format fields in `changes` replaced (the caller parses options; this module stays pure). The store's
    top-level bitmap counts live holders only; chunks listed on gone or unknown holders are findings here."""

    def store_cmd(verb: str, changes: Mapping[str, KeyFormatValue] | None = None) -> str:
        return command(verb, dict(changes or {}))

    full = store.bitmap
    # LMCache stores a partial last chunk only with save_unfull_chunk: without it, the tail is never a miss.
    storable = store.storable_chunks or full.chunks
    bitmap = full
    if storable < full.chunks:
        bitmap = HitBitmap(
            full.tiers,
            full.ranks,
            full.groups,
            storable * full.chunk_size,
            full.chunk_size,
            {where: cells[:storable] for where, cells in full.rows.items()},
            model=full.model,
        )
    findings: list[Finding] = []
    live = store.liveness
    k = store.committable_chunks
    listed_k = live.listed_committable_chunks or k
    stale, unknown = live.stale_chunks, live.unknown_chunks
    if stale or unknown:
        findings.append(_holder_gone(live, k, listed_k, store_cmd("probe")))
    diag = store.diagnosis if isinstance(store.diagnosis, Diagnosis) else None
    if listed_k == 0 and diag is not None:
        findings.extend(_key_format_mismatch(diag, store_cmd))
    content = _content(bitmap, (), prompt_flags)
    if any(f.kind is FindingKind.KEY_FORMAT_MISMATCH for f in findings):
        content = [f for f in content if f.kind is not FindingKind.NEVER_STORED]
    elif content and content[0].kind is FindingKind.NEVER_STORED and diag is not None and diag.causes:
        content[0] = dataclasses.replace(content[0], evidence=(*content[0].evidence, *diag.causes))
    if stale or unknown:  # listed, but not readable: holder-gone
        content = [f for f in content if f.kind is not FindingKind.NEVER_STORED]
    elif content and content[0].kind in _MISSING_CHUNKS and live.segments_gone:
        content[0] = _put_to_gone_holder(content[0], live, store_cmd("probe"))
    for i, f in enumerate(content):
        if f.kind is FindingKind.RESTORABLE:
            content[i] = dataclasses.replace(
                f,
                next=store_cmd("probe"),  # the store's bitmap; `bsr restore` asks a bsr engine, not this store
                summary=f.summary
                + (
                    f"; its partial last chunk ({full.tokens - bitmap.tokens:,} tokens) is not stored: LMCache "
                    "stores it only with save_unfull_chunk"
                    if bitmap.tokens < full.tokens
                    else ""
                ),
            )
    findings.extend(content)
    findings.extend(_unverified(store, store_cmd("probe")))
    return _result(
        prompt,
        full,
        findings,
        None,
        subject=Subject.STORE,
        source=store.store,
        n_tokens=full.tokens,
        chunk_size=0,
    )


# The content verdicts that say a chunk is not in the store (what a put lost on a gone holder also looks like).
_MISSING_CHUNKS = (FindingKind.EVICTED, FindingKind.PARTIAL, FindingKind.RANK_SKEW, FindingKind.NEVER_STORED)


def _put_to_gone_holder(missing: Finding, live: Liveness, next_cmd: str) -> Finding:
    """Chunks are missing while the master lists a segment whose holder is gone: the master keeps placing new objects
    there until its client TTL drops the segment, and a put placed there is lost (typically right after a vLLM
    instance restarted against a master that outlived it). That, not eviction or a store never made, is the lead."""
    gone = [s for s in live.segments if s.state is HolderState.GONE]
    return _observation(
        FindingKind.HOLDER_GONE,
        f"{missing.observed or 'chunks of this prompt are missing'}, while the master lists {len(gone)} segment(s) "
        "whose holder is gone",
        "it still places new objects there until its client TTL drops them, and a put placed there is lost",
        [*missing.evidence, *(f"segment {s.name} at {s.endpoint}: not answering, still listed" for s in gone)],
        "wait until the master drops the gone holder's segment (its client TTL; this probe then lists live "
        "holders only) or restart the master with the deployment, then send the prompt again to store it",
        next_cmd,
    )


def _holder_gone(live: Liveness, k: int, listed_k: int, next_cmd: str) -> Finding:
    """The master lists chunks whose holder is gone (or cannot be checked): only ``k`` chunks can be read."""
    stale, unknown = live.stale_chunks, live.unknown_chunks
    gone = [s for s in live.segments if s.state is HolderState.GONE]
    unsure = [s for s in live.segments if s.state is HolderState.UNKNOWN]
    unsure_text = f"{unknown} chunk(s) have no holder known to be alive (liveness unknown: not counted)"
    if stale:
        what = f"the master still lists {stale} chunk(s) of this prompt, but the process holding them is gone"
        what += f", and {unsure_text}" if unknown else ""
    else:
        what = f"the master lists this prompt's chunks, but {unsure_text}"
    return _finding(
        FindingKind.HOLDER_GONE,
        f"{what}: only {k} chunk(s) can really be read",
        [f"segment {s.name} at {s.endpoint}: not answering" for s in gone]
        + [f"segment {s.name}: could not be checked" for s in unsure]
        + [f"listed prefix {listed_k} chunks, live prefix {k}"],
        "restart the segment holder (its data is lost) and let the prompt be stored again",
        next_cmd,
    )


def _key_format_mismatch(
    diag: Diagnosis, store_cmd: Callable[[str, Mapping[str, KeyFormatValue] | None], str]
) -> list[Finding]:
    """The store holds this prompt under another key format (the closest one the diagnosis found)."""
    findings: list[Finding] = []
    g = diag.groups[diag.closest] if diag.closest is not None and diag.groups else None
    if g is not None and g.prompt_chunks_held and g.differs_in:
        fields = ", ".join({"world_size": "world size", "hash_start": "hash seed"}.get(f, f) for f in g.differs_in)
        findings.append(
            _finding(
                FindingKind.KEY_FORMAT_MISMATCH,
                f"the store holds {g.prompt_chunks_held} chunk(s) of this prompt under another key format "
                f"(differs in {fields}): LMCache computed different keys than asked for",
                list(diag.causes),
                f"ask with {' and '.join(g.flags)} (or align the deployment's {fields})",
                store_cmd("explain", g.changes),
            )
        )
    elif g is not None and g.unknown_start_chunks:
        other = [f for f in g.differs_in if f != "hash_start"]
        findings.append(
            _finding(
                FindingKind.KEY_FORMAT_MISMATCH,
                f"key-format mismatch (hash seed unknown): the store holds {g.unknown_start_chunks} chunk(s) "
                "of this prompt under a hash chain start none of the vLLM hash seeds tried gives: vLLM ran with "
                "another PYTHONHASHSEED",
                list(diag.causes),
                "ask with --vllm-hash-seed SEED (the PYTHONHASHSEED the vLLM that stored it ran with)"
                + (f" and {' and '.join(g.flags)}" if other else ""),
                store_cmd("explain", g.changes | {"vllm_hash_seed": "SEED"}),
            )
        )
    return findings


def _unverified(store: StoreProbe, next_cmd: str) -> list[Finding]:
    """Held chunks without a checksum bound to their chunk (stored by stock LMCache, or by an older bsr)."""
    integrity = store.integrity
    findings: list[Finding] = []
    if integrity.unverified_chunks:
        findings.append(
            _finding(
                FindingKind.UNVERIFIED,
                f"{integrity.unverified_chunks} held chunk(s) carry no checksum (stored by stock LMCache, or by an "
                "older bsr whose checksum covers the bytes alone): their bytes cannot be verified",
                [f"rank {u.rank} chunk {u.chunk}: no checksum" for u in integrity.unverified[:8]],
                "bsr's connector refuses them (recompute) unless bsr_load_unverified is set; an older bsr's are "
                "removed when refused and stored again with a checksum, stock LMCache's once they are evicted or "
                "removed (docs/mixed-deployments.md)",
                next_cmd,
            )
        )
    return findings


def _result(
    prompt: str,
    bitmap: HitBitmap | None,
    findings: list[Finding],
    last_restore: FoldedRestore | None,
    *,
    subject: Subject,
    source: str | None,
    probe_error: str | None = None,
    n_tokens: int,
    chunk_size: int,
) -> Explanation:
    findings.sort(key=lambda f: ORDER.index(FindingKind.PARTIAL) + 0.5 if f.blocks else ORDER.index(f.kind))
    verdict = findings[0]
    findings = [f if f is verdict else _not_the_verdict(f, verdict, bitmap) for f in findings]
    return Explanation(
        subject=subject,
        prompt=prompt,
        tokens=bitmap.tokens if bitmap is not None else n_tokens,
        chunks=bitmap.chunks if bitmap is not None else accounting.chunks_for_tokens(n_tokens, chunk_size),
        source=source,
        probe_error=probe_error,
        verdict=verdict.kind,
        reusable=verdict.kind is FindingKind.RESTORABLE,
        summary=verdict.summary,
        findings=tuple(findings),
        tiers=tuple(tier_prefixes(bitmap)) if bitmap is not None else (),
        last_restore=last_restore,
        next=verdict.next,
    )


def _not_the_verdict(f: Finding, verdict: Finding, bitmap: HitBitmap | None) -> Finding:
    """A finding listed under another verdict, worded so it does not contradict it: ``restorable`` says the prompt
    will be restored, which is for the verdict alone to say; below another verdict the prompt is only held."""
    if f.kind is not FindingKind.RESTORABLE or bitmap is None:
        return f
    return dataclasses.replace(
        f,
        kind=FindingKind.HELD,
        summary=f"every rank and group holds all {bitmap.chunks} chunks ({bitmap.tokens:,} tokens), but the next "
        f"admission does what the verdict ({verdict.kind.value}) says, not restore them as they stand",
        fix="see the verdict",
    )


def fold_restore(events: Sequence[ev.Event]) -> FoldedRestore | None:
    """One restore's events (one request) as per-rank, per-window facts: windows released, the failures with their
    rank, window, stage and kind, and the outcome."""
    mine = [e for e in events if ev.request_of(e)]
    if not mine:
        return None
    out = FoldedRestore(request=str(ev.request_of(mine[0])))
    ranks: dict[int, RankWindows] = {}
    arrived: list[str] = []
    quarantined: list[QuarantinedChunk] = []

    def seen(section: str) -> None:
        if section not in arrived:
            arrived.append(section)

    for e in mine:
        if isinstance(e, ev.RestoreStarted):
            out = dataclasses.replace(
                out, windows=e.windows, W=e.W, tiers=tuple(e.tiers), tokens=e.tokens, started_at=e.time or None
            )
            seen("started")
        elif isinstance(e, ev.WindowReleased):
            r = ranks.get(e.rank) or RankWindows(e.rank)
            ranks[e.rank] = dataclasses.replace(r, windows_released=r.windows_released + 1, bytes=r.bytes + e.bytes)
        elif isinstance(e, ev.RestoreEnded):
            # A restore that could not start (a silent rank) logs no failure_kind: its failures carry it.
            kind = e.failure_kind or (e.failures[0].kind if e.failures else None)
            out = dataclasses.replace(
                out,
                outcome=e.outcome,
                committed_tokens=e.committed_tokens,
                failures=tuple(e.failures),
                failure_kind=kind if e.outcome is not Outcome.COMMITTED else None,
            )
            seen("ended")
        elif isinstance(e, ev.MarkerSet):
            out = dataclasses.replace(out, marker=RestoreMarker(tuple(e.excluded_tiers), e.reason))
            seen("marker")
        elif isinstance(e, ev.ObjectQuarantined) and e.chunk is not None and e.group is not None:
            quarantined.append(QuarantinedChunk(e.rank, e.tier, e.chunk, e.group, e.file, e.reason, e.key))
            seen("quarantined")
    return dataclasses.replace(
        out, quarantined=tuple(quarantined), ranks=tuple(ranks[r] for r in sorted(ranks)), arrived=tuple(arrived)
    )


def _failure_line(f: ev.Failure) -> str:
    """One failure as evidence, naming only what is known (never a None)."""
    where = f"rank {f.rank}" if f.rank is not None else "before any rank answered"
    if f.window is not None:
        where += f" window G{f.window + 1}"
    if f.chunks is not None:
        where += f" (chunks {f.chunks[0]}-{f.chunks[1] - 1})"
    blame = [f"kind {f.kind.value}"]
    if f.stage:
        blame.append(f"stage {f.stage.value}")
    if f.tier:
        blame.append(f"tier {f.tier}")
    line = f"failed: {where}: {f.reason or 'no reason given'}" + (f" ({', '.join(blame)})" if blame else "")
    return line + (f"; figures: {f.load.describe()}" if f.load is not None and f.load.describe() not in line else "")


def explain_request(events: Sequence[ev.Event], *, health: Health, markers: Sequence[MarkerView]) -> Explanation:
    """How one request ended and why: its restore per rank and window, the failure's kind (the failure taxonomy:
    tier, rank, capacity, aborted), the marker it left, and what to do. ``health`` and ``markers`` are the admin
    API's answers (wire form)."""
    req = next((r for r in map(ev.request_of, events) if r), "")
    restore = fold_restore([e for e in events if not isinstance(e, ev.RequestAdmitted)])
    finished = next((e for e in events if isinstance(e, ev.RequestFinished)), None)
    prompt = next((str(p) for e in events if (p := getattr(e, "prompt", None))), "")
    evidence: list[str] = []
    if restore is not None and restore.windows is not None:
        source = ", ".join(restore.tiers) or "no tier"
        evidence.append(f"restore: {restore.windows} window(s) of W={restore.W} from {source}")
        for r in restore.ranks:
            evidence.append(f"rank {r.rank}: {r.windows_released} window(s) released, {r.bytes:,} bytes")
    outcome = restore.outcome if restore is not None else None
    fails = restore.failures if restore is not None else ()
    kind = restore.failure_kind if restore is not None else None
    if kind is None and outcome is Outcome.FAILED_CLOSED:
        kind = FailureKind.TIER
    evidence.extend(_failure_line(f) for f in fails)
    # The marker the request left: the one set for it (by request id), else the one standing for its prompt.
    marker = next((m for m in markers if m.request == req), None) or next(
        (m for m in markers if prompt and m.prompt == prompt), None
    )
    if marker is not None:
        evidence.append(f"marker: prompt {marker.prompt} {_marker_scope(marker.excluded_tiers)}")
    verdict, summary, fix, nxt = _request_verdict(req, restore, kind, fails, marker, finished, health)
    return Explanation(
        subject=Subject.REQUEST,
        request=req,
        prompt=prompt,
        verdict=verdict,
        reusable=verdict in (FindingKind.RESTORE_COMMITTED, FindingKind.ADMITTED),
        summary=summary,
        findings=(_finding(verdict, summary, evidence, fix, nxt),),
        last_restore=restore,
        next=nxt,
        marker=marker.prompt if marker is not None else None,
    )


def _host_verdict(fails: Sequence[ev.Failure]) -> tuple[FindingKind, str, str, str]:
    """A restore the host made miss its deadline: nobody in bsr is blamed; the figures name the pressure."""
    f = next(f for f in fails if f.kind is FailureKind.HOST_OVERLOADED)
    figures = f.load.describe() if f.load is not None else "no figures recorded"
    summary = (
        "failed closed because the host was overloaded: a deadline ran out while "
        + (f"rank {f.rank}" if f.rank is not None else "the engine")
        + f" waited to run ({figures}); no rank or tier is blamed, no marker was set"
    )
    fix = "retry once the load drops; give the engine CPU, or raise `bsr engine up --overload-ceiling`"
    return FindingKind.RESTORE_FAILED_HOST, summary, fix, "bsr status"


def _marker_scope(excluded_tiers: Sequence[str]) -> str:
    return f"excludes {', '.join(excluded_tiers)}" if excluded_tiers else "excludes no tier (recompute locally)"


def _request_verdict(
    req: str,
    restore: FoldedRestore | None,
    kind: FailureKind | None,
    fails: Sequence[ev.Failure],
    marker: MarkerView | None,
    finished: ev.RequestFinished | None,
    health: Health,
) -> tuple[FindingKind, str, str, str]:
    """How the request ended, as (verdict, summary, fix, next command): the failure taxonomy's kind decides whom
    it blames."""
    outcome = restore.outcome if restore is not None else None
    staged_rank_failure = next((f for f in fails if f.kind is FailureKind.RANK and f.stage), None)
    if restore is not None and outcome is Outcome.COMMITTED:
        verdict, summary, fix, nxt = (
            FindingKind.RESTORE_COMMITTED,
            f"the restore committed {restore.committed_tokens or 0:,} tokens on every rank",
            "nothing to fix",
            f"bsr describe {req}",
        )
    elif outcome is Outcome.ABORTED or kind is FailureKind.ABORTED:
        verdict, summary = (
            FindingKind.RESTORE_ABORTED,
            "an operator aborted it; it failed closed, nothing was committed",
        )
        fix, nxt = "nothing to fix", f"bsr describe {req}"
    elif outcome is Outcome.REFUSED or kind is FailureKind.CAPACITY:
        verdict = FindingKind.RESTORE_FAILED_CAPACITY
        summary = "refused for capacity: the window did not fit the budget B or the pool (no tier is blamed)"
        fix, nxt = "lower W or raise B (see the reason)", "bsr settings show"
    elif outcome is Outcome.FAILED_CLOSED and kind is FailureKind.HOST_OVERLOADED:
        verdict, summary, fix, nxt = _host_verdict(fails)
    elif outcome is Outcome.FAILED_CLOSED and kind is FailureKind.RANK and staged_rank_failure is not None:
        # The rank failed at its own stage (install, synchronize): the rank's fault, never a tier's.
        f = staged_rank_failure
        win = f" window G{f.window + 1}" if f.window is not None else ""
        stage = f.stage.value if f.stage else ""
        verdict = FindingKind.RESTORE_FAILED_RANK
        summary = (
            f"failed closed because rank {f.rank} failed at {stage}{win}: {f.reason} (no tier is "
            "blamed; the prompt's marker makes its next admission recompute it locally)"
        )
        fix = f"check rank {f.rank} (`bsr status` shows its last fault); restart it if it keeps failing"
        nxt = "bsr status"
    elif outcome is Outcome.FAILED_CLOSED and kind is FailureKind.RANK:
        ranks = sorted({f.rank for f in fails if f.kind is FailureKind.RANK and f.rank is not None})
        bad = [r for r in health.ranks if not r.healthy]
        who = f"rank {', '.join(map(str, ranks))}" if ranks else "a rank"
        verdict = FindingKind.RESTORE_FAILED_RANK
        summary = f"failed closed because {who} stopped making progress (no tier is blamed, no marker)" + (
            f"; still unhealthy: {bad[0].reason}" if bad and bad[0].reason else ""
        )
        fix, nxt = "resume or restart the rank; then retry", "bsr status"
    elif outcome is Outcome.FAILED_CLOSED:
        tiers = sorted({f.tier for f in fails if f.tier})
        verdict = FindingKind.RESTORE_FAILED_TIER
        which = f"tier {', '.join(tiers)}" if tiers else "a tier"
        summary = f"failed closed because {which} failed: nothing was committed" + (
            f"; a force-local marker now excludes {', '.join(marker.excluded_tiers)} for this prompt" if marker else ""
        )
        lost = [x for t in tiers for x in (health.tiers[t].lost_segments if t in health.tiers else ())]
        if lost:
            summary += f"; {lost[-1].line()}"
        fix = "fix the tier (`bsr status`); the next admission of the prompt uses a lower tier or recomputes"
        nxt = "bsr markers list" if marker else "bsr status"
    elif finished is not None:
        verdict = FindingKind.ADMITTED
        summary = (
            f"admitted: {finished.external_tokens:,} tokens from {finished.source or 'no tier'}, "
            f"{finished.computed_tokens:,} computed"
        )
        fix, nxt = "nothing to fix", f"bsr describe {req}"
    else:
        verdict, summary = FindingKind.RUNNING, "the request has not finished"
        fix, nxt = "wait", f"bsr events -f --request {req}"
    return verdict, summary, fix, nxt
