"""Why a restore failed, in one place: how a restore's per-rank outcomes are classified, who is blamed, what the
operator is told and which exit code the CLI ends with, and what a liveness verdict (``runtime/judge.py``) makes of
a rank that went quiet.

A restore debugger must not misdiagnose. Blame follows the *stage* a failure happened at (``core.evidence``):
only a fetch or verify failure (the bytes did not arrive, or arrived wrong) is the tier's and may set a
force-local marker against that tier; an install or synchronize failure, a stalled or dead rank is the rank's
(no tier is marked unhealthy or excluded; the prompt is recomputed locally); a deadline that ran out while the host
starved the engine (a rank waited to run, the host was under pressure, the coordinator itself ran late) is the
host's: no rank and no tier is blamed, no marker is set; a capacity refusal and an operator abort blame nobody.
Every failed restore still ends fail-closed (nothing committed, every destination block invalid) whatever its kind.

    kind      stage                cause                                         marker            outcome        exit
    capacity  admission            W does not fit B or the pool; admission       none              refused        12
                                   waited past its deadline; no destination
                                   blocks
    tier      fetch, verify        an object missing, short, late, corrupt or    excludes the      failed_closed  10
                                   failing to transfer                           failing tier(s)
    rank      install,             the rank could not install or synchronize     recompute the     failed_closed  10
              synchronize (none:   a window (an injected restore-fault too);     prompt locally
              a stall)             a rank stopped answering or died              (no tier excluded)
    aborted   the stage it was in  the operator aborted the request              none              aborted        130
    host_     fetch (a rank's own  a deadline ran out while the host starved     none              failed_closed  17
    overloaded  deadline), none    the engine: run-queue delay, PSI, the
              (the coordinator's)  coordinator's own lag (the figures ride
                                   on the failure)

Pure: no I/O, so the CLI uses the same rules (``FailureKind.exit_code``) to pick its exit code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bsr_cli.api.jobs import RestoreResult
from bsr_cli.core.events import Failure
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome, RankState, Stage, window_label
from bsr_cli.core.overload import HostLoad
from bsr_cli.core.results import ManualRestoreResult, OutputHashes, RestoreReport
from bsr_cli.errors import (
    BsrError,
    CapacityError,
    ExitCode,
    HostOverloaded,
    OutputHashMismatch,
    RestoreAborted,
    RestoreFailedClosed,
)

CAPACITY = FailureKind.CAPACITY
TIER = FailureKind.TIER
RANK = FailureKind.RANK
ABORTED = FailureKind.ABORTED
HOST = FailureKind.HOST_OVERLOADED
# When ranks fail for different reasons the most specific diagnosis wins: a rank's own failure explains the others'
# aborts; an overloaded host explains the aborts and timeouts around it (no tier is excluded for a deadline the
# host made it miss); an operator abort explains follow-on failures; a real tier failure outranks a capacity refusal.
_PRECEDENCE = (RANK, HOST, ABORTED, TIER, CAPACITY)


class WindowRefused(CapacityError):
    """Capacity refused a window before any byte moved; ``cause`` says what did not fit (the hint is built from it,
    never from the message)."""

    def __init__(self, message: str, *, cause: CapacityCause, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.cause = cause


def failure_of(result: RestoreResult) -> Failure:
    """The typed failure of one rank's failed restore result. A result without a kind is a host bug, never
    guessed to be a tier's (that would steer traffic away from a healthy tier)."""
    if not result.kind:
        raise ValueError(f"rank {result.rank}'s failed restore result names no failure kind: {result.reason!r}")
    return Failure(
        rank=result.rank,
        reason=result.reason,
        kind=FailureKind(result.kind),
        stage=Stage(result.stage) if result.stage else None,
        window=result.failed_window,
        tier=result.tier or None,
        cause=CapacityCause(result.cause) if result.cause else None,
        chunks=result.failed_chunks,
        load=result.load,
    )


def quiet_rank_kind(state: RankState) -> FailureKind:
    """The failure kind of a rank judged past its deadline (``runtime/judge.py``): dead, stopped or hung is the
    rank's; starved is the host's (the rank waited to run)."""
    return RANK if state.rank_at_fault else HOST


def quiet_rank_failure(rank: int, state: RankState, reason: str, load: HostLoad | None) -> Failure:
    """The failure of a rank that went quiet (no stage: it did not fail at one; it stopped answering or waited)."""
    return Failure(rank=rank, reason=reason, kind=quiet_rank_kind(state), load=load)


def classify(failures: Iterable[Failure]) -> FailureKind | None:
    """The restore's failure kind from its per-rank failures; None when nothing failed."""
    kinds = {f.kind for f in failures}
    for k in _PRECEDENCE:
        if k in kinds:
            return k
    return None


def outcome(kind: FailureKind | None) -> Outcome:
    """How a restore with that failure kind ended (None: it committed)."""
    return Outcome.COMMITTED if kind is None else kind.outcome


def blamed_tiers(kind: FailureKind | None, failures: Iterable[Failure], tiers_used: Sequence[str]) -> set[str]:
    """The tiers a force-local marker should exclude: only for a tier fault at a tier's stage (fetch, verify), the
    tiers that failed (all the tiers the restore used when a failure does not say which). Never for a rank's
    install or synchronize failure."""
    if kind is not TIER:
        return set()
    at_tier = [f for f in failures if f.kind is TIER and (f.stage is None or f.stage.blames_tier)]
    named = {f.tier for f in at_tier if f.tier}
    return named or (set(tiers_used) if at_tier else set())


def blamed_ranks(failures: Iterable[Failure]) -> list[int]:
    """The ranks a rank failure is blamed on, in order."""
    return sorted({f.rank for f in failures if f.kind is RANK and f.rank is not None})


def capacity_hint(cause: CapacityCause | None, *, w: int, slot_bytes: int, budget_bytes: int, pool_bytes: int) -> str:
    """What to change when a restore was refused for capacity: name the setting and the value that would fit."""
    fit_budget = budget_bytes // slot_bytes if slot_bytes else 0
    fit_pool = pool_bytes // slot_bytes if slot_bytes else 0
    if cause is CapacityCause.NO_DESTINATION_BLOCKS:
        return "wait for running requests to finish, or start the engine with more --kv-tokens"
    if cause is CapacityCause.ADMISSION_TIMEOUT:
        return (
            "other restores held the budget for the whole admission deadline: retry, or raise the budget "
            "(POST /settings budget_bytes, `bsr engine up --budget`)"
        )
    if w == 0 and not fit_pool:
        return "the whole-plan path (W=0) stages the whole prefix at once: use a bounded window (--W)"
    if w == 0:
        return (
            f"the whole-plan path (W=0) stages the whole prefix at once and the pool holds {fit_pool} chunk(s) "
            "per rank: use a bounded window (--W), or start the engine with a larger --pool"
        )
    if not fit_budget:  # a host that does not report its budget in bytes (the rank's message says it)
        return "lower W, or raise the budget (POST /settings budget_bytes, at most the pool)"
    return (
        f"W={w} needs {w} chunk slots per rank but the budget B admits {fit_budget}: use --W {fit_budget} "
        "or lower, or raise the budget (POST /settings budget_bytes, `bsr engine up --budget`, at most the pool)"
    )


def describe(f: Failure) -> str:
    """One line for one failure: who failed, at which stage and window, and why. Never prints an absent field."""
    where = f" at {f.stage.value}" if f.stage is not None else ""
    win = f" (window {window_label(f.window)})" if f.window is not None else ""
    if f.kind is TIER:
        tier = f"tier {f.tier}" if f.tier else "a tier"
        on = f" on rank {f.rank}" if f.rank is not None else ""
        return f"{tier} failed{where}{on}{win}: {f.reason}"
    if f.kind is RANK:
        who = f"rank {f.rank}" if f.rank is not None else "a rank"
        if f.stage is None:
            return f"{who} stopped responding: {f.reason}"
        return f"{who} failed{where}{win}: {f.reason}"
    if f.kind is HOST:
        on = f" on rank {f.rank}" if f.rank is not None else ""
        return f"the host was overloaded{where}{on}{win}: {f.reason}"
    return f.reason


def summary(report: RestoreReport) -> str:
    """One line naming the cause of a failed restore (its ``failure_kind`` and the failure that decided it)."""
    fails = list(report.failures)
    if not fails:
        return "invalid group"
    kind = report.failure_kind or classify(fails)
    first = next((f for f in fails if f.kind is kind), fails[0])
    return describe(first)


def output_mismatch_error(request: str, hashes: OutputHashes, external_tokens: int, source: str) -> BsrError:
    """The one-line error a request whose KV hashed differently from the canonical ends the CLI with (exit 19): the
    engine invalidated its blocks and stored nothing; a marker recomputes the prompt next time when part of it was
    restored."""
    then = (
        f"; the {external_tokens:,} tokens restored from {source} were invalidated and the next admission of the "
        "prompt recomputes it"
        if external_tokens
        else "; it was computed locally, so the engine's own compute is wrong"
    )
    return OutputHashMismatch(
        f"request {request} failed: its output hash {hashes.output_hash} differs from the canonical "
        f"{hashes.canonical_hash}{then}; nothing was stored",
        hint=(
            f"every restored object passed its checksum, so what {source} holds for this prompt was wrong when it "
            f"was written: `bsr explain {request}` names the request; remove the prompt's objects from {source}"
            if external_tokens
            else "report it with `bsr bundle`: the canonical and computed KV of an engine must agree"
        ),
    )


OVERLOADED_HINT = (
    "the host could not run the engine in time (the figures are above; `bsr explain REQ` repeats them): retry once "
    "the load drops, give the engine CPU, or raise its overload ceiling (`bsr engine up --overload-ceiling`)"
)

_ERROR_FOR_EXIT: dict[ExitCode, type[BsrError]] = {
    ExitCode.CAPACITY: CapacityError,
    ExitCode.FAILED_CLOSED: RestoreFailedClosed,
    ExitCode.INTERRUPTED: RestoreAborted,
    ExitCode.HOST_OVERLOADED: HostOverloaded,
}


def restore_error(result: ManualRestoreResult) -> BsrError:
    """The one-line error a failed restore result ends the CLI with; its exit code is the failure kind's
    (``FailureKind.exit_code``: refused 12, failed closed 10, host overloaded 17, aborted 130)."""
    report = result.report
    if report is None:
        raise ValueError("a restore that found nothing to restore did not fail")
    fails = list(report.failures)
    found = report.failure_kind or classify(fails)
    if found is None:
        raise ValueError("a failed restore result names no failure kind and lists no failure")
    kind = found
    why = summary(report)
    error = _ERROR_FOR_EXIT[kind.exit_code]
    if kind is CAPACITY:
        return error(
            f"restore refused for capacity, nothing moved, no tier blamed: {why}",
            hint=report.hint or "lower --W or raise the budget B (`bsr settings show` shows both)",
        )
    if kind is ABORTED:
        return error(
            f"restore aborted, nothing committed, no tier blamed: {why}",
            hint="nothing changed; restore again when ready (`bsr describe REQ` shows where it stopped)",
        )
    if kind is HOST:
        return error(
            f"restore failed closed: {why}; nothing was committed, no rank or tier blamed",
            hint=OVERLOADED_HINT,
        )
    if kind is RANK:
        ranks = blamed_ranks(fails)
        who = ", ".join(f"rank {r}" for r in ranks) or "the rank"
        then = "; the next admission recomputes the prompt locally" if result.marker is not None else ""
        return error(
            f"restore failed closed: {why}; nothing was committed, no tier blamed{then}",
            hint=f"`bsr status` shows {who}'s health and last fault; a stopped or hung rank must be resumed or "
            "restarted",
        )
    tiers = ", ".join(report.blamed_tiers or report.tiers)
    return error(
        f"restore failed closed: {why}; nothing was committed and a force-local marker excludes "
        f"{tiers or 'the failing tier'}",
        hint="`bsr status` shows the marker; the next admission of this prompt skips the failed tier",
    )


__all__ = [
    "ABORTED",
    "CAPACITY",
    "HOST",
    "OVERLOADED_HINT",
    "RANK",
    "TIER",
    "WindowRefused",
    "blamed_ranks",
    "blamed_tiers",
    "capacity_hint",
    "classify",
    "describe",
    "failure_of",
    "outcome",
    "output_mismatch_error",
    "quiet_rank_failure",
    "quiet_rank_kind",
    "restore_error",
    "summary",
]
