"""The requests a coordinator has accepted and not yet finished, and the one race an abort runs: against the commit.

A request is abortable from acceptance to its end. Its commit decision and an abort are taken under one lock, so
exactly one of them wins and the operator is told which:

* the abort came first: the restore ends aborted, even if every rank has already installed its windows (nothing is
  committed, so nothing half-restored is ever read);
* the commit came first: the abort is refused as too late (``AlreadyEnded``, exit 18), naming what was committed;
  the request may still be finishing (its output-hash check, a submit's local prefill), but its KV stays;
* the request is no longer open: the abort is refused as too late with how it ended, when the event log still
  holds its end, else the request is unknown.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from bsr_cli.core import events as ev
from bsr_cli.core.evidence import EventKind, Outcome
from bsr_cli.errors import AlreadyEnded
from bsr_cli.runtime.event_store import Query
from bsr_cli.runtime.events import EventLog

# The events that say a request's restore or the request itself ended, newest wins.
_ENDINGS = (
    EventKind.RESTORE_COMMITTED,
    EventKind.RESTORE_FAILED_CLOSED,
    EventKind.RESTORE_REFUSED,
    EventKind.RESTORE_ABORTED,
    EventKind.REQUEST_FINISHED,
)
_HINT = "nothing was aborted; `bsr describe {request}` shows what it did, `bsr explain {request}` how it ended"


@dataclass
class _Open:
    abort_asked: bool = False
    committed_tokens: int | None = None  # set once its restore committed


class OpenRequests:
    """Accepted, unfinished requests: whether an abort was asked for each, and whether it has committed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}

    def open(self, request: str) -> None:
        with self._lock:
            self._open.setdefault(request, _Open())

    def close(self, request: str) -> None:
        with self._lock:
            self._open.pop(request, None)

    def commit(self, request: str, tokens: int) -> bool:
        """The commit point of a restore that would commit ``tokens``: True when it commits, False when an abort
        came first (the restore must then end aborted)."""
        with self._lock:
            state = self._open.get(request)
            if state is not None and state.abort_asked:
                return False
            if state is not None:
                state.committed_tokens = tokens
            return True

    def abort(self, request: str, events: EventLog) -> bool:
        """Ask to abort ``request``: True when it is open and has not committed (it will end aborted); False when
        the engine never had it, or no longer knows it. Raises ``AlreadyEnded`` when the abort is too late."""
        with self._lock:
            state = self._open.get(request)
            if state is not None and state.committed_tokens is None:
                state.abort_asked = True
                return True
            committed = state.committed_tokens if state is not None else None
        if committed is not None:
            raise AlreadyEnded(
                f"restore {request} already committed {committed:,} tokens before the abort arrived; it is "
                "finishing (output-hash check) and its KV stays",
                hint=_HINT.format(request=request),
                outcome=Outcome.COMMITTED.value,
            )
        ended = events.query(Query(request=request, kinds=_ENDINGS, newest=True, limit=1))
        if ended:
            raise _too_late(request, ended[-1])
        return False


def _too_late(request: str, end: ev.Event) -> AlreadyEnded:
    """The refusal of an abort of a request that already ended, saying how it ended."""
    hint = _HINT.format(request=request)
    if isinstance(end, ev.RequestFinished):
        return AlreadyEnded(
            f"request {request} already finished: {end.external_tokens:,} tokens restored from "
            f"{end.source or 'no tier'}, {end.computed_tokens:,} computed",
            hint=hint,
            outcome=Outcome.COMMITTED.value if end.external_tokens else None,
        )
    assert isinstance(end, ev.RestoreEnded)
    if end.outcome is Outcome.COMMITTED:
        what = f"already committed {end.committed_tokens:,} tokens"
    else:
        what = f"already ended {end.outcome.value.replace('_', ' ')}, nothing committed"
    return AlreadyEnded(f"restore {request} {what} before the abort arrived", hint=hint, outcome=end.outcome.value)


__all__ = ["OpenRequests"]
