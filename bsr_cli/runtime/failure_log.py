"""Structured failure logs: one JSON line per failure (time, level, request, rank, window, stage, reason), written by
the engine and by every rank process to rotated files in the state directory's ``logs/`` (``bsr-engine.log``,
``bsr-rank<N>.log``), so an incident's log says why, not only that, and `bsr bundle` carries it.

What is a failure: a rank's part of a restore failing (``restore_failed``), a restore ending without committing
(failed closed, refused, aborted), a request whose KV hashed differently from the canonical (``output_mismatch``),
a rank unresponsive, a store to a tier failing, and the event store itself failing to write.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from bsr_cli.core import wire
from bsr_cli.core.events import (
    Event,
    OutputMismatch,
    RankUnresponsive,
    RestoreEnded,
    RestoreFailed,
    SegmentLost,
    StoreFailed,
)
from bsr_cli.core.evidence import EventKind, FailureKind, Outcome, Stage

MAX_BYTES = 10 << 20  # per file before it rotates
BACKUPS = 3  # rotated files kept beside the current one


class JsonLineFormatter(logging.Formatter):
    """A record as one JSON object: time (UTC, ISO 8601), level, the logger, the message, and the failure's
    fields (request, rank, window, stage, reason, ...) when the record carries them."""

    def format(self, record: logging.LogRecord) -> str:
        at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        line: dict[str, object] = {"time": at, "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "bsr", None)
        if isinstance(fields, Mapping):
            line.update(fields)
        line["message"] = record.getMessage()
        if record.exc_info:
            line["trace"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def open_log(path: Path, name: str) -> logging.Logger:
    """A logger writing JSON lines to ``path``, rotated at MAX_BYTES with BACKUPS kept; not propagated (the
    engine's stdout log stays as it was)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"bsr.failures.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8")
    handler.setFormatter(JsonLineFormatter())
    logger.addHandler(handler)
    return logger


def close_log(logger: logging.Logger) -> None:
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()


@dataclass(frozen=True)
class RankFailedRecord:
    """A rank's part of a restore failed."""

    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    request: str | None = wire.field(omit_none=True, default=None)
    rank: int | None = wire.field(omit_none=True, default=None)
    window: int | None = wire.field(omit_none=True, default=None)
    stage: Stage | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)
    failure_kind: FailureKind | None = wire.field(omit_none=True, default=None)
    tier: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class RestoreEndedRecord:
    """A restore ended without committing: its outcome, and the first failure's where and why."""

    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    request: str | None = wire.field(omit_none=True, default=None)
    outcome: Outcome | None = wire.field(omit_none=True, default=None)
    rank: int | None = wire.field(omit_none=True, default=None)
    window: int | None = wire.field(omit_none=True, default=None)
    stage: Stage | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)
    failure_kind: FailureKind | None = wire.field(omit_none=True, default=None)
    failures: int | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class RankUnresponsiveRecord:
    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    request: str | None = wire.field(omit_none=True, default=None)
    rank: int | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class StoreFailedRecord:
    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    request: str | None = wire.field(omit_none=True, default=None)
    rank: int | None = wire.field(omit_none=True, default=None)
    tier: str | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class OutputMismatchRecord:
    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    request: str | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


@dataclass(frozen=True)
class SegmentLostRecord:
    event: EventKind
    seq: int | None = wire.field(omit_none=True, default=None)
    tier: str | None = wire.field(omit_none=True, default=None)
    segment: str | None = wire.field(omit_none=True, default=None)
    objects_lost: int | None = wire.field(omit_none=True, default=None)
    reason: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


# The fields of one failure's log line (the line adds its time, level, logger and message): the event's kind and
# sequence number, then what each kind of failure says, in that order. A field left None is left out.
FailureRecord: TypeAlias = (
    RankFailedRecord
    | RestoreEndedRecord
    | RankUnresponsiveRecord
    | StoreFailedRecord
    | OutputMismatchRecord
    | SegmentLostRecord
)


def failure_record(event: Event) -> FailureRecord | None:
    """The log line's fields for a failure event, or None when the event is not a failure."""
    seq = event.seq or None
    if isinstance(event, RestoreFailed):
        return RankFailedRecord(
            event=event.kind,
            seq=seq,
            request=event.request,
            rank=event.rank,
            window=event.window,
            stage=event.stage,
            reason=event.reason,
            failure_kind=event.failure_kind,
            tier=event.tier,
        )
    if isinstance(event, RestoreEnded):
        if event.outcome is Outcome.COMMITTED:
            return None
        first = event.failures[0] if event.failures else None
        return RestoreEndedRecord(
            event=event.kind,
            seq=seq,
            request=event.request,
            outcome=event.outcome,
            rank=first.rank if first else None,
            window=first.window if first else None,
            stage=first.stage if first else None,
            reason=first.reason if first else event.outcome.value.replace("_", " "),
            failure_kind=event.failure_kind,
            failures=len(event.failures),
        )
    if isinstance(event, RankUnresponsive):
        return RankUnresponsiveRecord(
            event=event.kind, seq=seq, request=event.request, rank=event.rank, reason=event.reason
        )
    if isinstance(event, StoreFailed):
        return StoreFailedRecord(
            event=event.kind, seq=seq, request=event.request, rank=event.rank, tier=event.tier, reason=event.error
        )
    if isinstance(event, OutputMismatch):
        why = (
            f"output hash {event.output_hash} != canonical {event.canonical_hash} "
            f"({event.external_tokens:,} of {event.tokens:,} tokens from {event.source}): invalidated"
        )
        return OutputMismatchRecord(event=event.kind, seq=seq, request=event.request, reason=why)
    if isinstance(event, SegmentLost):
        loss = event.loss
        return SegmentLostRecord(
            event=event.kind,
            seq=seq,
            tier=event.tier,
            segment=loss.segment,
            objects_lost=loss.objects_lost,
            reason=loss.line(),
        )
    return None


# The kinds that may be failures (a committed restore ends too, and is not): anything else is not even parsed, so
# the window events of a restore cost the log nothing.
FAILURE_KINDS = frozenset(
    {
        EventKind.RESTORE_FAILED,
        EventKind.RESTORE_FAILED_CLOSED,
        EventKind.RESTORE_REFUSED,
        EventKind.RESTORE_ABORTED,
        EventKind.RANK_UNRESPONSIVE,
        EventKind.STORE_FAILED,
        EventKind.OUTPUT_MISMATCH,
        EventKind.SEGMENT_LOST,
    }
)


def log_failure_event(logger: logging.Logger, event: Event) -> None:
    """Log an event when it is a failure; anything else is ignored."""
    if event.kind not in FAILURE_KINDS:
        return
    record = failure_record(event)
    if record is None:
        return
    quiet = isinstance(record, RestoreEndedRecord) and record.outcome in (Outcome.REFUSED, Outcome.ABORTED)
    fields = record.to_wire()  # the line's JSON
    level = logging.WARNING if quiet else logging.ERROR
    logger.log(level, f"{event.kind.value}: {fields.get('reason', '')}", extra={"bsr": fields})


def log_failure(logger: logging.Logger, reason: str, **fields: Any) -> None:
    """A failure that is not an event (the event store failing, a rank's call raising)."""
    logger.error(reason, extra={"bsr": {k: v for k, v in fields.items() if v is not None} | {"reason": reason}})


__all__ = [
    "FAILURE_KINDS",
    "FailureRecord",
    "JsonLineFormatter",
    "OutputMismatchRecord",
    "RankFailedRecord",
    "RankUnresponsiveRecord",
    "RestoreEndedRecord",
    "SegmentLostRecord",
    "StoreFailedRecord",
    "close_log",
    "failure_record",
    "log_failure",
    "log_failure_event",
    "open_log",
]
