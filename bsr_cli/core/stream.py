"""The lines of a streamed answer (``POST /requests`` and ``POST /restore``): NDJSON, one JSON object a line, each
tagged by its ``type``. The engine first says it accepted the request, then streams its progress events, and ends
with the request's result or an error; the client reads each line back into its type.

The ``event`` and ``result`` payloads stay JSON objects here: an event is kept as the engine sent it (a newer
engine's kind is passed over by the client, not refused), and a result is read by the caller into the type of the
route it called (``SubmitResult`` or ``ManualRestoreResult``).

Pure: no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.core.prompt import Prompt


@dataclass(frozen=True, kw_only=True)
class StreamedRequest:
    """The body of a streamed ``POST /requests`` or ``POST /restore``: the prompt's keys, whether to verify, that the
    answer is streamed, the window W when one is asked for, and (a restore's) the tiers to leave out."""

    prompt: Prompt = wire.field(flatten=True)
    verify: bool = True
    stream: bool = True
    w: int | None = wire.field(name="W", omit_none=True, default=None)
    exclude_tiers: tuple[str, ...] = wire.field(omit_empty=True, default=())

    to_wire = wire.writer()


class LineKind(enum.StrEnum):
    """What one line of a streamed answer carries."""

    ACCEPTED = "accepted"  # the engine took the request: its id
    EVENT = "event"  # one progress event
    RESULT = "result"  # the request's result (the last line)
    ERROR = "error"  # the request failed (the last line)


@dataclass(frozen=True, kw_only=True)
class AcceptedLine:
    type: LineKind = LineKind.ACCEPTED
    request: str = ""

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class EventLine:
    type: LineKind = LineKind.EVENT
    event: wire.JsonObject = wire.field(default_factory=dict)  # as the engine wrote it; read by known_event

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class ResultLine:
    type: LineKind = LineKind.RESULT
    result: wire.JsonObject = wire.field(default_factory=dict)  # the route's result type, in its wire form

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True, kw_only=True)
class ErrorLine:
    """A failed request: the error's kind, its message and hint, and the HTTP status it would have answered."""

    type: LineKind = LineKind.ERROR
    error: str = ""
    message: str = ""
    hint: str | None = None
    status: int = wire.field(default=500, absent=500)
    # A rank restarting or not responding: the rank; and, for a rank restarting or a refusal the same request may get
    # past later, when to try again (seconds, the Retry-After it would have answered).
    rank: int | None = wire.field(default=None, omit_none=True)
    retry_after_s: int | None = wire.field(default=None, omit_none=True)
    # A bsr error always says its hint (null when it has none); an unexpected failure of the engine has none to say,
    # and its line has never carried the key.
    says_hint: bool = wire.field(skip=True, default=True)

    def to_wire(self) -> wire.JsonObject:
        out: wire.JsonObject = wire.write(self)
        if not self.says_hint:
            del out["hint"]
        return out

    from_wire = wire.reader()


StreamLine = AcceptedLine | EventLine | ResultLine | ErrorLine

_LINE_TYPES: dict[LineKind, type[StreamLine]] = {
    LineKind.ACCEPTED: AcceptedLine,
    LineKind.EVENT: EventLine,
    LineKind.RESULT: ResultLine,
    LineKind.ERROR: ErrorLine,
}


def read_line(obj: object) -> StreamLine | None:
    """The typed line of one parsed JSON line, or None for a kind this bsr does not know (a newer engine's)."""
    if not isinstance(obj, dict):
        return None
    try:
        kind = LineKind(str(obj.get("type")))
    except ValueError:
        return None
    return _LINE_TYPES[kind].from_wire(obj)
