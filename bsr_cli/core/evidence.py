"""The closed sets of bsr's evidence, spelled once: what happened (event kinds), how a restore ended (outcomes),
why it failed (failure kinds, with their exit code), where it failed (stages) and who is blamed (components).

Every module that writes or reads an event, an outcome or a failure uses these enums, never the bare strings.
They are ``StrEnum``s so the wire form (JSON, Prometheus labels, the SQLite event store) is the plain value and a
value read back from the wire converts with ``Kind(value)``, which refuses anything outside the set. Two sets a
monitor only shows, never acts on, keep a value a newer engine adds instead (``Stage``, ``TierCondition``: see
``_kept_as_sent``): one new reason must not make `bsr status` or `bsr top` unable to read the engine at all.

Blame follows the stage (the rule a restore debugger must not break):

    stage                         blamed component      force-local marker
    probe, fetch, verify          the tier              excludes that tier
    install, synchronize, stall   the rank              none against a tier (the prompt recomputes locally)
    a deadline while starved      the host              none (no rank, no tier: the host was overloaded)
    admission (W > B, no blocks)  capacity              none
    an operator abort             the operator          none

Pure: no I/O.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from bsr_cli.errors import ExitCode

_S = TypeVar("_S", bound=StrEnum)


def _kept_as_sent(cls: type[_S], value: object) -> _S | None:
    """A value of ``cls`` that a newer engine sends and this bsr does not know, kept as sent: it reads (the answer
    around it still reads), it is shown and written back under its own name, and it equals no member, so nothing
    takes it for a known one (an unknown condition is not ``ok``; an unknown stage blames no tier). Anything but a
    non-empty string is still refused."""
    if not isinstance(value, str) or not value:
        return None
    member = str.__new__(cls, value)
    member._name_ = value
    member._value_ = value
    return member


def window_label(index: int) -> str:
    """How a person reads window ``index`` (0-based, as JSON and events carry it): ``G1`` is the first, as plans,
    the CLI, the TUI, logs' text and error lines all show it."""
    return f"G{index + 1}"


class EventKind(StrEnum):
    """Every event the engine (or a plugin host) records."""

    ENGINE_STARTED = "engine_started"
    ENGINE_STOPPED = "engine_stopped"
    SETTINGS_CHANGED = "settings_changed"
    REQUEST_ADMITTED = "request_admitted"
    REQUEST_FINISHED = "request_finished"
    RESTORE_STARTED = "restore_started"
    WINDOW_WAITING = "window_waiting"
    WINDOW_FETCHED = "window_fetched"
    WINDOW_INSTALLED = "window_installed"
    WINDOW_RELEASED = "window_released"
    RESTORE_FAILED = "restore_failed"  # one rank's part failed (the request's outcome follows)
    RESTORE_COMMITTED = "restore_committed"
    RESTORE_FAILED_CLOSED = "restore_failed_closed"  # a fault: nothing committed, blocks scrubbed
    RESTORE_REFUSED = "restore_refused"  # capacity or settings refused it before any byte moved
    RESTORE_ABORTED = "restore_aborted"  # the operator (or a departed client) aborted it
    STORE_FAILED = "store_failed"
    OUTPUT_MISMATCH = "output_mismatch"  # a request's KV hashed differently from the canonical: invalidated
    OBJECT_QUARANTINED = "object_quarantined"  # a stored object failed its checksum and was moved aside
    SCRUB_STARTED = "scrub_started"  # a rank began reading a tier's objects back to check them
    SCRUB_FINISHED = "scrub_finished"  # ... and ended: what it checked and set aside, and how it ended
    SEGMENT_LOST = "segment_lost"  # the store dropped a holder's segment: every object on it is gone
    MARKER_SET = "marker_set"
    MARKER_CLEARED = "marker_cleared"
    FAULT_INJECTED = "fault_injected"
    FAULT_FIRED = "fault_fired"
    FAULTS_CLEARED = "faults_cleared"
    ABORT_REQUESTED = "abort_requested"
    RANK_UNRESPONSIVE = "rank_unresponsive"
    RANK_STARVED = "rank_starved"  # a rank's deadline was stretched: the host starved it (or the coordinator)
    RANK_RESTARTED = "rank_restarted"


class Outcome(StrEnum):
    """How one restore ended. Only ``FAILED_CLOSED`` is a fault worth paging on."""

    COMMITTED = "committed"  # every (rank, group) valid: the advertised prefix is committed
    FAILED_CLOSED = "failed_closed"  # a tier or rank fault: nothing committed, every destination block scrubbed
    REFUSED = "refused"  # capacity/settings refused it (W over B, no destination blocks): nothing moved
    ABORTED = "aborted"  # the operator aborted it: nothing committed, blocks scrubbed
    NOTHING_TO_RESTORE = "nothing_to_restore"  # the probe found no external prefix


class FailureKind(StrEnum):
    """Why a restore did not commit. The exit code the CLI ends with is attached to the kind."""

    CAPACITY = "capacity"
    TIER = "tier"
    RANK = "rank"
    ABORTED = "aborted"
    HOST_OVERLOADED = "host_overloaded"  # a deadline ran out while the host starved the engine: nobody blamed

    @property
    def exit_code(self) -> ExitCode:
        return _EXIT[self]

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME[self]


_EXIT = {
    FailureKind.CAPACITY: ExitCode.CAPACITY,
    FailureKind.TIER: ExitCode.FAILED_CLOSED,
    FailureKind.RANK: ExitCode.FAILED_CLOSED,
    FailureKind.ABORTED: ExitCode.INTERRUPTED,
    FailureKind.HOST_OVERLOADED: ExitCode.HOST_OVERLOADED,
}
_OUTCOME = {
    FailureKind.CAPACITY: Outcome.REFUSED,
    FailureKind.TIER: Outcome.FAILED_CLOSED,
    FailureKind.RANK: Outcome.FAILED_CLOSED,
    FailureKind.ABORTED: Outcome.ABORTED,
    FailureKind.HOST_OVERLOADED: Outcome.FAILED_CLOSED,
}


class Stage(StrEnum):
    """Where in a request's life a failure happened."""

    PROBE = "probe"
    ADMISSION = "admission"
    FETCH = "fetch"
    VERIFY = "verify"
    INSTALL = "install"
    SYNCHRONIZE = "synchronize"
    COMMIT = "commit"

    @classmethod
    def _missing_(cls, value: object) -> Stage | None:
        return _kept_as_sent(cls, value)  # a newer engine's stage (a last fault's), shown as sent

    @property
    def blames_tier(self) -> bool:
        """A failure at this stage is the tier's (the bytes did not arrive, or arrived wrong)."""
        return self in (Stage.PROBE, Stage.FETCH, Stage.VERIFY)


class TimedStage(StrEnum):
    """The stages of a rank's restore whose wall and CPU seconds are counted (``core.stage_costs``): the transfer
    calls, the checksum check, the install into the destination KV, and the window loop waiting on one of them."""

    FETCH = "fetch"
    VERIFY = "verify"
    INSTALL = "install"
    WAIT = "wait"


class FaultAct(StrEnum):
    """What befell a fault an operator armed: each is an event kind of its own (``fault_<act>``)."""

    INJECTED = "injected"  # armed (`bsr inject-fault`, a drill)
    FIRED = "fired"  # it acted on a restore


class WindowStep(StrEnum):
    """A step of one window on one rank in a restore: each is an event kind of its own (``window_<step>``), and a
    column of a request's timeline."""

    WAITING = "waiting"  # for room under the admission budget
    FETCHED = "fetched"
    INSTALLED = "installed"
    RELEASED = "released"


class CapacityCause(StrEnum):
    """Why capacity refused a restore: what the hint names to change (never read back from the human text)."""

    WINDOW_OVER_BUDGET = "window_over_budget"  # a window of W chunks does not fit the budget B
    WINDOW_OVER_POOL = "window_over_pool"  # the whole-plan path (W=0) does not fit the pool
    ADMISSION_TIMEOUT = "admission_timeout"  # other restores held the budget for the whole admission deadline
    NO_DESTINATION_BLOCKS = "no_destination_blocks"  # the engine's KV blocks are all in use


class Component(StrEnum):
    """Who a failure is blamed on."""

    TIER = "tier"
    RANK = "rank"
    OPERATOR = "operator"
    CAPACITY = "capacity"
    HOST = "host"  # the machine the engine runs on (overloaded), not any part of bsr


class RankState(StrEnum):
    """What the kernel says of a rank that has been silent (or made no progress) past its deadline, as the
    coordinator judges it (``runtime/judge.py``). Only dead, stopped and hung are the rank's fault; a starved rank
    waits to run (its run-queue delay grows, the host is under pressure, or the coordinator itself runs late),
    which is the host's; unknown: the kernel could not say which (starvation can neither be shown nor ruled out)."""

    LIVE = "live"  # it answers within its deadline
    STARVED = "starved"  # waiting to run: the host's doing, its deadline is stretched (up to a ceiling)
    STOPPED = "stopped"  # its process is stopped (SIGSTOP, a debugger): /proc/PID/stat state T or t
    HUNG = "hung"  # alive, able to run, the host has CPU, and still no progress
    DEAD = "dead"  # no process
    UNKNOWN = "unknown"  # past its deadline, and the kernel cannot tell starved from hung here

    @classmethod
    def _missing_(cls, value: object) -> RankState | None:
        return _kept_as_sent(cls, value)  # a newer engine's state, shown as sent

    @property
    def rank_at_fault(self) -> bool:
        """The rank itself is to blame (never for time it spent waiting to run)."""
        return self in (RankState.STOPPED, RankState.HUNG, RankState.DEAD)


class MarkerClearCause(StrEnum):
    """Why a force-local marker was cleared (a ``marker_cleared`` event's ``why``)."""

    ADMITTED = "admitted"  # a later admission of the prompt succeeded: the marker served its purpose
    OPERATOR = "operator"  # an operator cleared it (`bsr markers clear`)


class TierCondition(StrEnum):
    """Why a tier is (un)healthy, as a rank sees it: the reason /health, `bsr status` and the metrics name."""

    OK = "ok"
    UNAVAILABLE = "unavailable"  # it cannot serve at all (master down, unreachable)
    DIRECTORY_GONE = "directory_gone"  # the fs tier's directory does not exist
    READ_ONLY = "read_only"  # writes fail with EROFS (a read-only mount)
    FULL = "full"  # writes fail with ENOSPC or EDQUOT
    NOT_WRITABLE = "not_writable"  # writes fail otherwise (permissions, I/O errors)
    # An older engine's: an armed fault that takes the tier down (an armed fault is now shown, never a reason).
    FAULT_ARMED = "fault_armed"
    RESTORE_FAILED = "restore_failed"  # the coordinator's: a restore from it failed and none has committed since
    SEGMENT_LOST = "segment_lost"  # the engine's store watch: the store dropped a holder's segment and its objects

    @classmethod
    def _missing_(cls, value: object) -> TierCondition | None:
        return _kept_as_sent(cls, value)  # a newer engine's reason, shown as sent


class ScrubScope(StrEnum):
    """What a scrub reads back: one prompt's objects, or every object a tier holds."""

    PROMPT = "prompt"
    ALL = "all"


class ScrubState(StrEnum):
    """Where a scrub stands, or how it ended (`bsr scrub`'s exit code follows it)."""

    RUNNING = "running"
    COMPLETE = "complete"  # every object in its scope was read back and checked
    CUT = "cut"  # it stopped at its limit (objects or bytes) before the end of its scope
    FAILED = "failed"  # the tier could not be read (its directory gone, an I/O error on the walk)
    SKIPPED = "skipped"  # never ran: the rank already runs as many scrubs as it allows, or this one

    @property
    def finished(self) -> bool:
        return self is not ScrubState.RUNNING


class SegmentLossCause(StrEnum):
    """How a Mooncake segment (and every object on it) was lost, as the store's watch saw it."""

    # Its holder stopped accepting connections (the process died): its memory is gone, though the master keeps
    # listing the segment, and probing its objects as held, until the holder's client TTL runs out.
    HOLDER_GONE = "holder_gone"
    # The master no longer lists it: the holder missed its heartbeats for the client TTL (or it was unmounted).
    UNMOUNTED = "unmounted"
    # Between two looks the master dropped it and the holder mounted it again, empty.
    REMOUNTED_EMPTY = "remounted_empty"


class RestoreBound(StrEnum):
    """What bound a restore's latency the longest: the resource it waited for or was served by the slowest (the
    trace planner's model and `bsr bench trace`'s reading of a replay, bsr_cli/core/host_model.py)."""

    BANDWIDTH = "bandwidth"  # moving its bytes at its share of the bandwidth
    CPU = "cpu"  # its CPU work at its share of the cores available to bsr
    BUDGET = "budget"  # waiting for room under the admission budget B
    DESTINATION_KV = "destination_kv"  # its request waiting for destination KV blocks


__all__ = [
    "CapacityCause",
    "Component",
    "EventKind",
    "FailureKind",
    "FaultAct",
    "Outcome",
    "RankState",
    "RestoreBound",
    "ScrubScope",
    "ScrubState",
    "SegmentLossCause",
    "Stage",
    "TierCondition",
    "TimedStage",
    "WindowStep",
]
