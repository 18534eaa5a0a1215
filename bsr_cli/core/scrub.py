"""A scrub: a tier's stored objects read back whole and checked (payload checksum, header, key, length), the damaged
ones set apart, so the next store rewrites them all at once instead of one failed restore per damaged window (as
HDFS's block scanner and ZFS's scrub find bad blocks before a reader does).

A rank scrubs its own objects: after a restore from a tier failed at fetch or verify, the rest of that prompt's
objects on the tier, in the background (the request's fail-closed answer does not wait); or on an operator's
`bsr scrub`, one prompt's objects or every object the tier holds. These are the types a scrub is reported in: one
rank's scrub as it runs and ends (``ScrubProgress``, what `bsr status` shows and the events count), and the
engine's answer to `bsr scrub` (``ScrubReport``), whose ``verdict`` picks the command's exit code.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TypeVar

from bsr_cli.core import wire
from bsr_cli.core.events import ScrubFinished, ScrubStarted
from bsr_cli.core.evidence import ScrubScope, ScrubState
from bsr_cli.errors import ExitCode

_E = TypeVar("_E", ScrubStarted, ScrubFinished)

# A scrub's bounds by default: a rank reads at most this many objects and bytes per scrub, and runs at most this
# many scrubs at once (each reads whole objects from the tier, beside the restores that read the same tier).
MAX_OBJECTS = 100_000
MAX_BYTES = 64 << 30
MAX_CONCURRENT = 2


@dataclass(frozen=True)
class QuarantinedFile:
    """A stored object a tier set apart after its bytes failed their checksum: moved aside and kept for the incident
    bundle (the fs tier), or removed (the Mooncake tier, which has nowhere to keep it)."""

    key: str
    file: str  # where it lies now, under the tier's quarantine directory; "" when the tier removed it
    reason: str
    at: float  # when it was moved aside (Unix time)
    bytes: int

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class ScrubLimits:
    """How much one scrub may read: it stops (``cut``) at whichever comes first."""

    max_objects: int = MAX_OBJECTS
    max_bytes: int = MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_objects < 1 or self.max_bytes < 1:
            raise ValueError(f"scrub limits must be positive, got {self.max_objects} objects, {self.max_bytes} bytes")


@dataclass(frozen=True)
class ScrubProgress:
    """One rank's scrub of one tier: what it is for, how far it got, what it found. ``objects`` is its scope's size
    when known up front (a prompt's objects; 0 for every object of a tier, counted as it goes)."""

    scrub: str  # its id: scrub-<rank>-<n> for one started after a failed restore, the operator's otherwise
    rank: int
    tier: str
    scope: ScrubScope
    state: ScrubState
    started_at: float  # Unix time
    prompt: str = ""  # the prompt hash (scope prompt)
    request: str | None = None  # the failed restore that started it (None: an operator's)
    objects: int = 0
    checked: int = 0  # objects read back whole (intact or damaged)
    bytes: int = 0  # bytes read back
    missing: int = 0  # objects in scope the tier does not hold
    damaged: int = 0  # objects whose stored bytes failed their check (each set apart, unless it could not be)
    quarantined: int = 0  # of those, moved aside
    seconds: float = 0.0
    reason: str = ""  # why it was cut, failed or skipped

    to_wire = wire.writer()
    from_wire = wire.reader()

    def ended(self, state: ScrubState, seconds: float, reason: str = "") -> ScrubProgress:
        return dataclasses.replace(self, state=state, seconds=round(seconds, 6), reason=reason)

    def started_event(self) -> ScrubStarted:
        return self._event(ScrubStarted)

    def finished_event(self) -> ScrubFinished:
        return self._event(ScrubFinished)

    def _event(self, cls: type[_E]) -> _E:
        """The event of this scrub: its fields are the progress's own (stamped by the event log)."""
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls) if f.name not in ("seq", "time")})

    def describe(self) -> str:
        """One line a person reads: ``scrub scrub-0-1 of prompt 1a2b… on rank 0 (after req-7 failed): 40/128 objects
        looked at, 2 damaged (2 set aside), 0 not held — running``."""
        what = f"prompt {self.prompt}" if self.scope is ScrubScope.PROMPT else f"every {self.tier} object"
        after = f" (after {self.request} failed)" if self.request else ""
        seen = self.checked + self.missing
        done = f"{seen}/{self.objects}" if self.objects else f"{seen}"
        found = f"{self.damaged} damaged ({self.quarantined} set aside), {self.missing} not held"
        state = self.state.value + (f": {self.reason}" if self.reason else "")
        return f"scrub {self.scrub} of {what} on rank {self.rank}{after}: {done} objects looked at, {found} — {state}"


@dataclass(frozen=True)
class ScrubReport:
    """What `POST /scrub` answers and `bsr scrub --json` prints: every rank's scrub of the tier and what it set
    apart. ``damaged``/``complete`` sum the ranks'; ``exit_code`` is the command's."""

    tier: str
    scope: ScrubScope
    ranks: tuple[ScrubProgress, ...]
    prompt: str = wire.field(default="", omit_empty=True)
    quarantined: tuple[QuarantinedFile, ...] = ()

    to_wire = wire.writer(computed=("checked", "damaged", "missing", "complete"))
    from_wire = wire.reader()

    @property
    def checked(self) -> int:
        return sum(r.checked for r in self.ranks)

    @property
    def damaged(self) -> int:
        return sum(r.damaged for r in self.ranks)

    @property
    def missing(self) -> int:
        return sum(r.missing for r in self.ranks)

    @property
    def complete(self) -> bool:
        """Every rank read its whole scope."""
        return bool(self.ranks) and all(r.state is ScrubState.COMPLETE for r in self.ranks)

    @property
    def exit_code(self) -> ExitCode:
        """20 when damaged objects were found (set aside where they could be); else 0 when every rank read its
        whole scope, 21 when one did not (a limit, a tier it could not read, a scrub it could not start)."""
        if self.damaged:
            return ExitCode.DAMAGED_OBJECTS
        return ExitCode.OK if self.complete else ExitCode.SCRUB_INCOMPLETE


__all__ = ["QuarantinedFile", "ScrubLimits", "ScrubProgress", "ScrubReport"]
