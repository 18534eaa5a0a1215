"""The one exception tree of bsr, and the exit codes it maps to.

Every layer raises a subclass of `BsrError`; the CLI's single error boundary turns it into one line on stderr
and the exit code below. This module is pure (no I/O) so the core can raise these too.

    BsrError
    ├── InvalidInput            bad flags, files, registrations, plans           (2)
    ├── CapacityError           the plan does not fit the configured pool        (12)
    ├── EngineError             talking to an engine's admin API
    │   ├── EngineUnreachable   connection refused / DNS / reset                  (3)
    │   ├── EngineTimeout       no answer within the deadline                     (4)
    │   ├── Unauthorized        missing or wrong token (401/403)                  (5)
    │   ├── VersionMismatch     engine speaks another admin API version          (6)
    │   ├── BadRequest          the engine rejected the request (4xx)            (7)
    │   ├── FaultsDisabled      fault injection refused: engine started without it (8)
    │   ├── EngineBusy          every serving slot in use (503 busy), after retries (15)
    │   ├── RankRestarting      a rank process died and the engine is starting it again (503) (16)
    │   ├── HostOverloaded      a deadline ran out while the host starved the engine: no rank  (17)
    │   │                       or tier blamed (503)
    │   └── ServerError         the engine failed (5xx)                           (9)
    ├── RestoreFailedClosed     a restore ended fail-closed (nothing committed)  (10)
    ├── DrillViolation          a drill found a broken invariant                 (11)
    ├── ServiceError            starting/stopping local services failed          (13)
    ├── NothingToRestore        no tier holds the prompt's first chunk: no restore ran (14)
    ├── AlreadyEnded            an abort came too late: the restore committed or ended (18)
    ├── OutputHashMismatch      the request's KV hashed differently from the canonical KV: invalidated (19)
    ├── DamagedObjects          a scrub found damaged objects (and set them aside) (20)
    ├── ScrubIncomplete         a scrub stopped at its limit, failed or did not run (21)
    └── RestoreAborted          the operator aborted the restore (fail-closed)   (130)

Under ``--json`` an error is one JSON object on stdout (``to_dict``); a command that has a result to show beside the
error (a restore refused at capacity, a drill that found a violation) attaches it as ``report``.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    INVALID_INPUT = 2
    ENGINE_UNREACHABLE = 3
    ENGINE_TIMEOUT = 4
    UNAUTHORIZED = 5
    VERSION_MISMATCH = 6
    BAD_REQUEST = 7
    FAULTS_DISABLED = 8
    SERVER_ERROR = 9
    FAILED_CLOSED = 10
    DRILL_VIOLATION = 11
    CAPACITY = 12
    SERVICE = 13
    NOTHING_TO_RESTORE = 14
    ENGINE_BUSY = 15
    RANK_RESTARTING = 16
    HOST_OVERLOADED = 17
    ALREADY_ENDED = 18  # an abort that came after the restore committed or ended
    OUTPUT_MISMATCH = 19
    DAMAGED_OBJECTS = 20
    SCRUB_INCOMPLETE = 21
    INTERRUPTED = 130


class BsrError(Exception):
    """Base of every error bsr reports to a user. `hint` is an optional second sentence: what to do next."""

    exit_code: ExitCode = ExitCode.INTERNAL
    kind = "error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # The command's result that came with the error, as JSON (``Output.fail`` sets it): written with the error.
        self.report: object | None = None

    def to_dict(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "error": self.kind,
            "message": self.message,
            "hint": self.hint,
            "exit_code": int(self.exit_code),
        }
        if self.report is not None:
            doc["report"] = self.report
        return doc


class InvalidInput(BsrError):
    exit_code = ExitCode.INVALID_INPUT
    kind = "invalid-input"


class CapacityError(BsrError):
    """The request does not fit the engine's capacity. ``retry_after_s``: when the same request may fit later (it
    waited its whole deadline while running requests held what it needs), how long to wait before trying again."""

    exit_code = ExitCode.CAPACITY
    kind = "capacity"

    def __init__(self, message: str, *, hint: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        if self.retry_after_s is not None:
            out["retry_after_s"] = round(self.retry_after_s)
        return out


class EngineError(BsrError):
    exit_code = ExitCode.SERVER_ERROR
    kind = "engine"


class EngineUnreachable(EngineError):
    exit_code = ExitCode.ENGINE_UNREACHABLE
    kind = "unreachable"


class EngineTimeout(EngineError):
    exit_code = ExitCode.ENGINE_TIMEOUT
    kind = "timeout"


class Unauthorized(EngineError):
    exit_code = ExitCode.UNAUTHORIZED
    kind = "unauthorized"


class VersionMismatch(EngineError):
    exit_code = ExitCode.VERSION_MISMATCH
    kind = "version-mismatch"


class BadRequest(EngineError):
    exit_code = ExitCode.BAD_REQUEST
    kind = "bad-request"


class FaultsDisabled(EngineError):
    exit_code = ExitCode.FAULTS_DISABLED
    kind = "faults-disabled"


class EngineBusy(EngineError):
    """The engine answered 503 busy: every serving slot is in use (reads were retried with backoff first)."""

    exit_code = ExitCode.ENGINE_BUSY
    kind = "busy"


class RankRestarting(EngineError):
    """A request met a rank whose process is gone while the engine starts it again (503 ``rank-restarting``): it
    ended without changing anything; retry after ``retry_after_s`` (when the engine next tries to start the rank)."""

    exit_code = ExitCode.RANK_RESTARTING
    kind = "rank-restarting"

    def __init__(
        self, message: str, *, hint: str | None = None, rank: int | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message, hint=hint)
        self.rank = rank
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, object]:
        return super().to_dict() | {"rank": self.rank, "retry_after_s": self.retry_after_s}


class HostOverloaded(EngineError):
    """A deadline ran out while the host starved the engine (its ranks waited to run, the host was under CPU,
    memory or I/O pressure, or the coordinator itself did not run on time): not a rank's or a tier's fault, so
    neither is blamed; the request can be retried once the load drops."""

    exit_code = ExitCode.HOST_OVERLOADED
    kind = "host-overloaded"


class ServerError(EngineError):
    exit_code = ExitCode.SERVER_ERROR
    kind = "server-error"


class RankDied(ServerError):
    """A rank's pipe broke or closed under a call: its process is going or gone, whether or not the kernel has
    reported it yet. The runtime answers it as the rank being unavailable (503), never as a server error."""


class RestoreFailedClosed(BsrError):
    exit_code = ExitCode.FAILED_CLOSED
    kind = "failed-closed"


class DrillViolation(BsrError):
    exit_code = ExitCode.DRILL_VIOLATION
    kind = "drill-violation"


class ServiceError(BsrError):
    exit_code = ExitCode.SERVICE
    kind = "service"


class NothingToRestore(BsrError):
    """A manual restore found no external prefix: not a failure of any tier, but no restore happened either."""

    exit_code = ExitCode.NOTHING_TO_RESTORE
    kind = "nothing-to-restore"


class AlreadyEnded(BsrError):
    """An abort that lost the race: the restore had already committed (its KV stays), or the request had already
    ended; ``outcome`` says how (a value of ``core.evidence.Outcome``)."""

    exit_code = ExitCode.ALREADY_ENDED
    kind = "already-ended"

    def __init__(self, message: str, *, hint: str | None = None, outcome: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.outcome = outcome

    def to_dict(self) -> dict[str, object]:
        return super().to_dict() | {"outcome": self.outcome}


class OutputHashMismatch(BsrError):
    """A request's KV (restored, or restored and computed) hashed differently from the canonical KV of its prompt:
    the engine invalidated its blocks, stored nothing and set a force-local marker. Never exit 0."""

    exit_code = ExitCode.OUTPUT_MISMATCH
    kind = "output-mismatch"


class DamagedObjects(BsrError):
    """A scrub read a tier's objects back and found damaged ones (it set them aside: the next store rewrites them)."""

    exit_code = ExitCode.DAMAGED_OBJECTS
    kind = "damaged-objects"


class ScrubIncomplete(BsrError):
    """A scrub found nothing damaged but did not check its whole scope (a limit, a tier it could not read, or a
    rank already running as many scrubs as it allows): clean is not proven."""

    exit_code = ExitCode.SCRUB_INCOMPLETE
    kind = "scrub-incomplete"


class RestoreAborted(BsrError):
    exit_code = ExitCode.INTERRUPTED
    kind = "aborted"
