"""Where `bsr top` gets its snapshots: a live engine, or a recording of one.

    LiveSource    one blocking `poll()` per call through the one AdminClient; the caller (the app's worker) never
                  starts the next poll before the previous has answered, so a slow engine never stacks requests
                  (a one-shot poll, re-armed when it finishes). A failed poll drops the client, so the next
                  one reconnects and re-resolves the engine (a restarted embedded engine may listen on a new port).
    Recorder      appends every poll (snapshot or failure) to a gzip JSON-lines file, flushed each time so a crash
                  keeps what was seen; events a previous line already holds are not written again.
    ReplaySource  reads such a file and serves it back deterministically, with pause and seek.

No textual here: the worker threads and messages live in the app; this module is plain blocking code.
"""

from __future__ import annotations

import gzip
import io
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bsr_cli.client.admin import AdminClient, resolve_engine
from bsr_cli.core import events as ev
from bsr_cli.core import wire
from bsr_cli.core.evidence import EventKind
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.core.results import AbortAnswer
from bsr_cli.core.status import event_seq
from bsr_cli.errors import AlreadyEnded, BsrError, EngineError, InvalidInput
from bsr_cli.incident_bundle import RECORDING, RecordingHeader, read_member
from bsr_cli.incident_bundle import RECORDING_FORMAT as FORMAT
from bsr_cli.incident_bundle import RECORDING_FORMAT_VERSION as FORMAT_VERSION
from bsr_cli.settings import Settings
from bsr_cli.tui.model import (
    ENDING_KINDS,
    FAILURE_KINDS,
    Event,
    Frame,
    LogPage,
    View,
    event_of,
    fold,
    parse_wire,
    restart_event,
)

CHECKPOINT_EVERY = 32  # replay keeps every 32nd view so a seek folds at most 31 frames
LOG_PAGE = 500  # events per page of the full event log (GET /events answers up to 10,000)
NO_PAGING = "this engine cannot page back (it predates GET /events?before=): upgrade it to read older events"


@dataclass(frozen=True)
class PollFailure:
    """A poll that got no snapshot: what the banner says, and what a recording keeps of the outage."""

    at: float = field(metadata=wire.meta(name="t"))
    latency_s: float = field(metadata=wire.meta(name="lat", absent=0.0))
    kind: str = field(metadata=wire.meta(name="error"))  # the BsrError kind: unreachable, timeout, unauthorized, ...
    message: str
    hint: str | None = None

    # A recording's line: {"t": ..., "lat": ..., "error": ..., "message": ..., "hint": ...}.
    to_wire = wire.writer()
    from_wire = wire.reader()

    @property
    def unreachable(self) -> bool:
        return self.kind in ("unreachable", "timeout")

    @classmethod
    def from_error(cls, e: BaseException, at: float, latency_s: float) -> PollFailure:
        if isinstance(e, BsrError):
            return cls(at, latency_s, e.kind, e.message, e.hint)
        return cls(at, latency_s, "internal", f"{type(e).__name__}: {e}", "rerun with BSR_DEBUG=1 and report it")


Item = Frame | PollFailure


# -- live ---------------------------------------------------------------------------------------------------------
class LiveSource:
    """Polls one engine. Not for concurrent polls: the app arms the next poll only once this one returned."""

    kind = "live"

    def __init__(
        self,
        connect: Callable[[], AdminClient],
        *,
        timeout_s: float = 5.0,
        label: str = "engine",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._connect = connect
        self._client: AdminClient | None = None
        self._last_seq: int | None = None  # last event seen on this connection
        self.timeout_s = timeout_s
        self.label = label
        self._clock = clock

    @classmethod
    def from_settings(cls, settings: Settings, *, timeout_s: float | None = None) -> LiveSource:
        try:
            label = resolve_engine(settings)[0]
        except BsrError:
            label = "engine (not found yet)"  # the app shows why in its banner and keeps retrying
        return cls(
            lambda: AdminClient.from_settings(settings),
            timeout_s=min(settings.timeout_s, 10.0) if timeout_s is None else timeout_s,
            label=label,
        )

    @classmethod
    def for_url(cls, url: str, token: str | None = None, *, timeout_s: float = 5.0) -> LiveSource:
        return cls(lambda: AdminClient(url, token, timeout_s=timeout_s), timeout_s=timeout_s, label=url)

    def poll(self) -> Frame:
        """One snapshot, or the EngineError that says why not."""
        try:
            if self._client is None:
                self._last_seq = None
                self._client = self._connect()
                self.label = self._client.url
            t0 = time.monotonic()
            # Ask for every event since the last one seen on this connection, so a burst between polls arrives
            # whole (a fresh connection may be a restarted engine, whose sequence numbers start again).
            snap = self._client.snapshot(timeout=self.timeout_s, events_since=self._last_seq)
            self._last_seq = snap.seq
            return Frame(snap, self._clock(), time.monotonic() - t0)
        except EngineError:
            self._drop()
            raise

    def events(self, *, kinds: Sequence[str], limit: int) -> list[wire.JsonObject]:
        """The newest ``limit`` events of ``kinds`` the engine holds (its durable history where it keeps one), oldest
        first, as it sent them."""
        with self._connect() as c:  # its own connection, as an operator's action: a poll never queues behind it
            return c.events(kinds=kinds, limit=limit, newest=True).events

    def inject_fault(self, fault: FaultRequest) -> FaultSpec:
        with self._connect() as c:  # its own connection: an operator's action never queues behind a poll
            return c.inject_fault(fault)

    def clear_faults(self) -> int:
        with self._connect() as c:
            return c.clear_faults()

    def abort(self, request: str) -> AbortAnswer:
        """Ask the engine to abort a restore (it fails closed); ``aborting`` is False when it is no longer running
        (the abort came too late: it committed or ended first)."""
        with self._connect() as c:
            try:
                return c.abort(request)
            except AlreadyEnded:
                return AbortAnswer(request=request, aborting=False)

    def log_page(self, before: int | None, kinds: Sequence[EventKind] = (), limit: int = LOG_PAGE) -> LogPage:
        """One page of the engine's event log, newest first: the last ``limit`` events (of ``kinds``) before the
        cursor ``before`` (None: the newest), read from its durable store through GET /events."""
        with self._connect() as c:  # its own connection: paging never queues behind a poll
            got = c.events(newest=True, limit=limit, before=before, kinds=list(kinds) or None)
        raw = [e for e in got.events if e]
        if before is not None and any(_seq(e) >= before for e in raw):
            # An engine that predates ?before= answers its newest page again: stop rather than loop over it.
            return LogPage((), None, got.held, got.oldest_seq, got.last_seq, note=NO_PAGING)
        events = tuple(event_of(e) for e in raw)
        oldest = events[0].seq if events else None
        more = len(raw) >= limit and oldest is not None and oldest > (got.oldest_seq or 0)
        return LogPage(events, oldest if more else None, got.held, got.oldest_seq, got.last_seq)

    def ending(self, request: str) -> ev.RestoreEnded | None:
        """How ``request`` ended, as its end event says (every failure: rank, window, kind, stage, tier, reason);
        None when the engine no longer holds it."""
        with self._connect() as c:
            got = c.events(request=request, kinds=list(ENDING_KINDS), newest=True, limit=1)
        return _ending(got.events, request)

    def _drop(self) -> None:
        self._last_seq = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def close(self) -> None:
        self._drop()


# -- recording ----------------------------------------------------------------------------------------------------
class Recorder:
    """Writes every poll to ``path`` as gzip JSON lines: a header, then one line per snapshot or failure. The app
    writes from its poll thread and closes on quit from its own: one lock keeps a close from landing inside a write
    (gzip's trailer would then not match the data, and the whole recording would read as corrupt)."""

    def __init__(self, fh: gzip.GzipFile, path: Path) -> None:
        self._fh = fh
        self._lock = threading.Lock()
        self.path = path
        self.lines = 0
        self._seen: tuple[float, int] = (0.0, -1)  # (engine started_at, last event seq written)

    @classmethod
    def open(cls, path: Path, source: str = "") -> Recorder:
        try:
            fh = gzip.GzipFile(path, "wb")  # the recorder owns it until close()
        except OSError as e:
            raise InvalidInput(
                f"cannot record to {path}: {e.strerror or e}", hint="give --record a path in a directory you can write"
            ) from None
        rec = cls(fh, path)
        rec._line(RecordingHeader(started=time.time(), source=source))
        return rec

    def write(self, item: Item) -> None:
        # A recording keeps each poll's latency to the microsecond.
        if isinstance(item, PollFailure):
            self._line(replace(item, latency_s=round(item.latency_s, 6)))
            return
        snap = item.snapshot
        started, seq = snap.info.started_at, snap.seq
        last_started, last_seq = self._seen
        if started == last_started and seq >= last_seq:
            # fold() uses only events newer than the previous snapshot, so the ones already on file are dropped.
            snap = replace(snap, events=[e for e in snap.events if event_seq(e) > last_seq])
        self._seen = (started, seq)
        self._line(Frame(snap, item.received_at, round(item.latency_s, 6)))

    def _line(self, line: RecordingHeader | Frame | PollFailure) -> None:
        data = json.dumps(line.to_wire(), separators=(",", ":"), default=str).encode() + b"\n"
        with self._lock:
            if self._fh.closed:
                raise ValueError(f"the recording {self.path} is closed")
            self._fh.write(data)
            self._fh.flush()  # a sync flush per line: what was recorded survives a killed terminal
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_recording(path: Path) -> tuple[RecordingHeader, list[Item]]:
    """(header, items) of a recording; InvalidInput when it is not one. A truncated tail (the recorder was killed
    mid-write) is tolerated: everything before it is kept."""
    member = read_member(path, RECORDING) if path.is_file() else None  # an incident bundle holds a recording
    try:
        with gzip.GzipFile(path, "rb") if member is None else gzip.GzipFile(fileobj=io.BytesIO(member)) as fh:
            lines = list(_complete_lines(fh))
    except FileNotFoundError:
        raise InvalidInput(
            f"no recording at {path}",
            hint="record one with `bsr top --record FILE`; `bsr bundle` archives carry one too",
        ) from None
    except gzip.BadGzipFile:
        raise InvalidInput(
            f"{path} is not a bsr top recording (not gzip)", hint="record one with `bsr top --record FILE`"
        ) from None
    except OSError as e:
        raise InvalidInput(f"cannot read {path}: {e.strerror or e}", hint="check its permissions") from None
    if not lines:
        raise InvalidInput(f"{path} is empty", hint="record one with `bsr top --record FILE`")
    try:
        header = json.loads(lines[0])
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise InvalidInput(f"{path} is not a bsr top recording", hint="record one with `bsr top --record FILE`")
    if header.get("version") != FORMAT_VERSION:
        raise InvalidInput(
            f"{path} is recording format {header.get('version')}, this bsr reads {FORMAT_VERSION}",
            hint="replay it with the bsr version that recorded it",
        )
    items: list[Item] = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            items.append(_recorded_item(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            raise InvalidInput(
                f"{path} line {n} is not a recorded snapshot",
                hint="the file is damaged; record again with `bsr top --record FILE`",
            ) from None
    if not items:
        raise InvalidInput(
            f"{path} holds no snapshots", hint="record one with `bsr top --record FILE` while an engine serves"
        )
    if member is not None:
        items = _with_bundle_events(path, items)
    return RecordingHeader.from_wire(header), items


def _recorded_item(d: object) -> Item:
    """One recorded line: a failed poll (it names its error) or a frame; KeyError or TypeError when it is neither."""
    if not isinstance(d, dict) or "t" not in d:
        raise KeyError("t")
    if "error" in d:
        return PollFailure.from_wire(d)
    if not isinstance(d.get("snap"), dict):
        raise TypeError("a recorded snapshot is a JSON object")
    return Frame.from_wire(d)


def _with_bundle_events(path: Path, items: list[Item]) -> list[Item]:
    """An incident bundle keeps its events in events.jsonl, not in the recorded frames: give each frame the events
    up to its sequence number (after the previous frame's), so a replay shows them as they happened and
    `bsr describe --record` sees them all."""
    raw = read_member(path, "events.jsonl") or b""
    events = []
    for line in raw.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    if not events:
        return items
    events.sort(key=lambda e: int(e.get("seq", 0)))
    out: list[Item] = []
    taken = 0
    last = (
        max(i for i, item in enumerate(items) if isinstance(item, Frame))
        if any(isinstance(i, Frame) for i in items)
        else -1
    )
    for n, item in enumerate(items):
        if isinstance(item, Frame) and not item.snapshot.events:
            # The last frame takes the rest: events recorded after its snapshot was taken still belong in a replay.
            upto = item.snapshot.seq if n != last else int(events[-1].get("seq", 0))
            mine = []
            while taken < len(events) and int(events[taken].get("seq", 0)) <= upto:
                mine.append(events[taken])
                taken += 1
            item = Frame(replace(item.snapshot, events=mine), item.received_at, item.latency_s)
        out.append(item)
    return out


def _complete_lines(fh: Iterable[bytes]) -> Iterator[bytes]:
    try:
        for line in fh:
            if line.endswith(b"\n"):
                yield line
    except (EOFError, zlib.error):
        return  # a recorder killed mid-line: keep the complete lines before it


# -- replay -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayFrame:
    """What the replay shows at one position: the view as of then, and the failure if that poll failed."""

    index: int
    total: int
    view: View | None
    failure: PollFailure | None
    at: float  # when it was recorded


class ReplaySource:
    """A recording served back frame by frame. Views are folded in order from the start (history depends on every
    earlier frame), with checkpoints, so any position always shows the same view however it was reached."""

    kind = "replay"

    def __init__(self, items: Sequence[Item], label: str = "recording") -> None:
        if not items:
            raise InvalidInput(
                "a replay needs at least one recorded snapshot", hint="record one with `bsr top --record FILE`"
            )
        self.items = tuple(items)
        self.label = label
        self.position = 0
        self.paused = False
        self._checkpoints: dict[int, View | None] = {}

    @classmethod
    def load(cls, path: Path) -> ReplaySource:
        _, items = read_recording(path)
        return cls(items, label=path.name)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def at_end(self) -> bool:
        return self.position >= len(self.items) - 1

    def frame(self, index: int | None = None) -> ReplayFrame:
        i = self.position if index is None else max(0, min(index, len(self.items) - 1))
        item = self.items[i]
        return ReplayFrame(
            index=i,
            total=len(self.items),
            view=self._view_at(i),
            failure=item if isinstance(item, PollFailure) else None,
            at=item.at if isinstance(item, PollFailure) else item.received_at,
        )

    def _view_at(self, i: int) -> View | None:
        """The view after folding every snapshot up to and including position ``i``."""
        start = max((k for k in self._checkpoints if k <= i), default=-1)
        view = self._checkpoints[start] if start >= 0 else None
        for k in range(start + 1, i + 1):
            item = self.items[k]
            if isinstance(item, Frame):
                view = fold(view, item)
            if k % CHECKPOINT_EVERY == 0:
                self._checkpoints[k] = view
        return view

    def seek(self, delta: int) -> ReplayFrame:
        self.position = max(0, min(self.position + delta, len(self.items) - 1))
        return self.frame()

    def advance(self) -> ReplayFrame | None:
        """The next frame, or None at the end (the replay stops there; seeking back still works)."""
        if self.at_end:
            return None
        self.position += 1
        return self.frame()

    def next_failure(self) -> int | None:
        """The first frame after the current one where something failed: a restore failed closed (a new such event
        in the view) or the poll itself failed. None when nothing fails later in the recording."""
        seen = _failures(self._view_at(self.position))
        for i in range(self.position + 1, len(self.items)):
            if isinstance(self.items[i], PollFailure):
                return i
            now = _failures(self._view_at(i))
            if now - seen:
                return i
            seen = now
        return None

    def delay_after(self, index: int, speed: float = 1.0) -> float:
        """The recorded gap to the next frame, kept within reason so a long outage does not stall the replay."""
        if index + 1 >= len(self.items):
            return 1.0
        gap = _at(self.items[index + 1]) - _at(self.items[index])
        return min(max(gap, 0.05), 5.0) / max(speed, 0.01)

    def toggle_pause(self) -> bool:
        self.paused = not self.paused
        return self.paused

    def recorded_events(self) -> list[Mapping[str, Any] | Event]:
        """Every event the recording holds up to the frame shown, oldest first, as recorded (a restarted engine's
        events start after a separator line, as in the view)."""
        out: list[Mapping[str, Any] | Event] = []
        seen: tuple[float, int] | None = None  # (engine started_at, seq) of the previous frame
        for item in self.items[: self.position + 1]:
            if not isinstance(item, Frame):
                continue
            snap = item.snapshot
            same = seen is not None and seen[0] == snap.info.started_at and snap.seq >= seen[1]
            if seen is not None and not same:
                out.append(restart_event(snap.info.started_at, item.received_at))
            after = seen[1] if same and seen is not None else 0
            out.extend(e for e in snap.events if _seq(e) > after)
            seen = (snap.info.started_at, snap.seq)
        return out

    def log_page(self, before: int | None, kinds: Sequence[EventKind] = (), limit: int = LOG_PAGE) -> LogPage:
        """One page of what the recording holds, newest first: the last ``limit`` events (of ``kinds``) before
        the cursor ``before``, an index into them (None: the newest)."""
        held = self.recorded_events()
        wanted = {k.value for k in kinds}
        matching = [e for e in held if not wanted or _type(e) in wanted]
        end = len(matching) if before is None else max(0, min(before, len(matching)))
        start = max(0, end - limit)
        page = tuple(e if isinstance(e, Event) else event_of(e) for e in matching[start:end])
        recorded = [_seq(e) for e in held if not isinstance(e, Event)]  # the separator lines are not events
        return LogPage(page, start or None, len(recorded), recorded[0] if recorded else None, max(recorded, default=0))

    def ending(self, request: str) -> ev.RestoreEnded | None:
        """How ``request`` ended, as the recording's end event says; None when the recording does not hold it."""
        ends = {k.value for k in ENDING_KINDS}
        raw = [e for e in self.recorded_events() if not isinstance(e, Event) and _type(e) in ends]
        return _ending(raw, request)

    def close(self) -> None:
        """Nothing to release: the recording was read whole."""


def _seq(raw: Mapping[str, Any] | Event) -> int:
    if isinstance(raw, Event):
        return raw.seq
    try:
        return int(raw.get("seq", 0))
    except (TypeError, ValueError):
        return 0


def _type(raw: Mapping[str, Any] | Event) -> str:
    return raw.type if isinstance(raw, Event) else str(raw.get("type", ""))


def _ending(raw: Sequence[Mapping[str, Any]], request: str) -> ev.RestoreEnded | None:
    """The newest end event of ``request`` among ``raw`` (wire forms), typed."""
    for e in reversed(raw):
        typed = parse_wire(e)
        if isinstance(typed, ev.RestoreEnded) and typed.request == request:
            return typed
    return None


def _failures(view: View | None) -> set[tuple[float, int]]:
    if view is None:
        return set()
    return {(e.time, e.seq) for e in view.events if e.type in FAILURE_KINDS}


def _at(item: Item) -> float:
    return item.at if isinstance(item, PollFailure) else item.received_at
