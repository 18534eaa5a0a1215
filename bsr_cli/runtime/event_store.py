"""The engine's durable event store: every event the engine records, in SQLite (standard library, WAL mode) in
its state directory, kept by age and by size, indexed by request, prompt, kind and time.

Why SQLite: the evidence of a restore (a W=1 restore of 131,072 tokens writes ~3,000 events) must outlive a small
in-memory ring and an engine restart, and be found again by request or by time without reading everything.

Writing never slows the caller down: ``put`` hands the event to a writer thread, which commits in batches (every
``BATCH_S`` or ``BATCH_EVENTS``, whichever comes first) and applies retention after each commit. ``flush`` waits
for everything put so far to be committed (a reader calls it first, so it sees its own writes); ``close`` flushes,
records a clean stop and closes. Events still queued when the process is killed (at most one batch) are lost, and
the next start says so (``previous_stop: crash``).

``seq`` continues across restarts (the last one ever written is kept in the ``meta`` table, even once retention
removed that event), so a client's cursor stays valid.

Retention: events older than ``max_age_s`` are deleted, then the oldest events until the store's used pages fit
``max_bytes`` (pruned down to ``PRUNE_TO`` of it, so a full store does not prune on every commit). Freed pages are
given back to the file system (``auto_vacuum = INCREMENTAL``).
"""

from __future__ import annotations

import contextlib
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr_cli.core.events import Event, parse_event
from bsr_cli.core.evidence import EventKind

DEFAULT_MAX_AGE_S = 7 * 86400.0
DEFAULT_MAX_BYTES = 512 << 20
BATCH_S = 0.05
BATCH_EVENTS = 2000
PRUNE_TO = 0.9
FILE_NAME = "events.sqlite"

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS events (
        seq INTEGER PRIMARY KEY,
        time REAL NOT NULL,
        type TEXT NOT NULL,
        request TEXT,
        prompt TEXT,
        rank INTEGER,
        body TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS events_by_time ON events (time)",
    "CREATE INDEX IF NOT EXISTS events_by_request ON events (request, seq) WHERE request IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS events_by_prompt ON events (prompt, seq) WHERE prompt IS NOT NULL",
    "CREATE INDEX IF NOT EXISTS events_by_type ON events (type, seq)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
)


class _Barrier:
    """Put in the writer's queue behind the events: set once everything before it is committed (and, when asked,
    retention applied on the writer's own connection)."""

    def __init__(self, prune: bool = False) -> None:
        self.prune = prune
        self.deleted = 0
        self.done = threading.Event()


class EventStoreError(Exception):
    """The store cannot be opened or written (a full disk, a corrupt file)."""


@dataclass(frozen=True)
class PreviousRun:
    """What the store knew when it was opened: whether an earlier engine wrote here, and how it stopped."""

    existed: bool
    clean: bool  # the previous engine closed the store (False after a crash or a kill)
    last_seq: int


@dataclass(frozen=True)
class Query:
    """Which events a reader wants. Every filter combines (AND); ``kinds`` is any of."""

    after_seq: int = 0
    before_seq: int | None = None  # only events before this sequence number (paging back from the newest)
    since_time: float | None = None
    until_time: float | None = None
    request: str | None = None
    prompt: str | None = None
    kinds: tuple[EventKind, ...] = ()
    limit: int = 500
    newest: bool = False  # the last ``limit`` matches (still returned oldest first) instead of the first

    def matches(self, ev: Event) -> bool:
        """The same filter in memory (the event log's tail, a host without a store)."""
        if not (
            ev.seq > self.after_seq
            and (self.before_seq is None or ev.seq < self.before_seq)
            and (self.since_time is None or ev.time >= self.since_time)
            and (self.until_time is None or ev.time <= self.until_time)
            and (not self.kinds or ev.kind in self.kinds)
        ):
            return False
        if self.request is None and self.prompt is None:
            return True
        keys = _Keys.of(ev)
        return (self.request is None or keys.request == self.request) and (
            self.prompt is None or keys.prompt == self.prompt
        )


@dataclass(frozen=True)
class StoreStats:
    path: str
    events: int
    used_bytes: int
    file_bytes: int
    oldest_time: float | None
    max_age_s: float
    max_bytes: int
    write_errors: int


class EventStore:
    def __init__(
        self,
        path: Path,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.time,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_age_s = float(max_age_s)
        self.max_bytes = int(max_bytes)
        self._clock = clock
        self._on_error = on_error
        self.write_errors = 0
        try:
            self._db = self._connect()
            with self._db:
                for stmt in _SCHEMA:
                    self._db.execute(stmt)
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            self._previous_meta: dict[str, str] = dict(meta)
            self._pending_meta: dict[str, str] = {}
            (max_seq, held) = self._db.execute("SELECT COALESCE(MAX(seq), 0), COUNT(*) FROM events").fetchone()
            last = max(int(meta.get("last_seq", 0)), int(max_seq))
            self.previous = PreviousRun(existed="opened_at" in meta, clean=meta.get("running") == "0", last_seq=last)
            with self._db:
                self._meta(running="1", opened_at=repr(self._clock()), last_seq=str(last))
        except sqlite3.Error as e:
            raise EventStoreError(f"cannot open the event store {self.path}: {e}") from None
        self._last_seq = last
        # How many events the store holds: counted once here, then kept by the writer thread (each commit adds its
        # rows, retention takes away what it deleted), so a reader never pays a COUNT over a large store.
        self._held = int(held)
        self._reader = self._connect()
        self._read_lock = threading.Lock()
        self._queue: queue.SimpleQueue[Event | _Barrier | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="bsr-event-store", daemon=True)
        self._closed = False
        self._writer.start()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # DEFERRED: a DML statement opens a transaction that `with db:` commits (PRAGMAs run outside one).
        db = sqlite3.connect(self.path, timeout=30.0, check_same_thread=False, isolation_level="DEFERRED")
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # only takes effect on a new file, which is when it matters
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")  # WAL: a commit is durable against a process crash, not power loss
        return db

    def _meta(self, **values: str) -> None:
        self._db.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            list(values.items()),
        )

    def previous_meta(self, key: str) -> str | None:
        """A value the previous run left with ``set_meta`` (read when the store was opened)."""
        return self._previous_meta.get(key)

    def set_meta(self, **values: str) -> None:
        """Small facts about this run kept beside the events, written when the store closes cleanly."""
        self._pending_meta.update(values)

    # -- writing -----------------------------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """The last sequence number ever written here (the event log continues from it)."""
        return self._last_seq

    def put(self, event: Event) -> None:
        """Queue one stamped event for the writer thread (in the order the event log numbered them); the writer
        turns it into its row."""
        if not self._closed:
            self._queue.put(event)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything put before this call is committed (False if the writer did not get there)."""
        if self._closed:
            return True
        barrier = _Barrier()
        self._queue.put(barrier)
        return barrier.done.wait(timeout_s)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch: list[Event] = []
            waiters: list[_Barrier] = []
            stop = False
            deadline = time.monotonic() + BATCH_S
            while True:
                if item is None:
                    stop = True
                elif isinstance(item, _Barrier):
                    waiters.append(item)
                else:
                    batch.append(item)
                if stop or waiters or len(batch) >= BATCH_EVENTS:
                    break  # a reader or the closer waits: commit now
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
            if batch:
                try:
                    self._commit(batch)
                except Exception as e:  # noqa: BLE001 - the writer must outlive any one batch, or readers wait
                    self._error(f"{len(batch)} event(s) not written: {type(e).__name__}: {e}")
            for w in waiters:
                if w.prune:
                    w.deleted = self._prune_safely()
                w.done.set()
            if stop:
                return

    def _commit(self, batch: Sequence[Event]) -> None:
        rows = []
        for ev in batch:
            try:
                rows.append(_row(ev))
            except (TypeError, ValueError):  # a value JSON cannot hold (a writer's bug)
                self._error(f"a malformed event was not written: {str(ev)[:200]}")
        if not rows:
            return
        last = max(self._last_seq, max(r[0] for r in rows))
        try:
            with self._db:
                cur = self._db.executemany(
                    "INSERT OR REPLACE INTO events (seq, time, type, request, prompt, rank, body) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self._meta(last_seq=str(last))
            self._last_seq = last
            self._held += max(cur.rowcount, 0)
        except sqlite3.Error as e:
            self._error(f"{len(batch)} event(s) not written: {e}")
            return
        self._prune_safely()

    def _error(self, what: str) -> None:
        self.write_errors += 1
        if self._on_error is not None:
            self._on_error(f"event store {self.path}: {what}")

    def _prune_safely(self) -> int:
        try:
            return self._prune()
        except sqlite3.Error as e:
            self._error(f"retention not applied: {e}")
            return 0

    # -- retention ---------------------------------------------------------------------------------------------
    def prune(self, timeout_s: float = 30.0) -> int:
        """Apply retention now, on the writer thread (it does after every commit); the number of events deleted."""
        if self._closed:
            return 0
        barrier = _Barrier(prune=True)
        self._queue.put(barrier)
        barrier.done.wait(timeout_s)
        return barrier.deleted

    def _prune(self) -> int:
        deleted = 0
        with self._db:
            cur = self._db.execute("DELETE FROM events WHERE time < ?", (self._clock() - self.max_age_s,))
        deleted += self._deleted(cur)  # once committed
        used = self._used_bytes(self._db)
        if used > self.max_bytes:
            target = int(self.max_bytes * PRUNE_TO)
            while used > target:
                (count,) = self._db.execute("SELECT COUNT(*) FROM events").fetchone()
                if count == 0:
                    break
                # Delete the oldest events in proportion to what is over, at least one; repeat until under.
                n = max(1, min(count, -(-count * (used - target) // used)))
                with self._db:
                    cur = self._db.execute(
                        "DELETE FROM events WHERE seq IN (SELECT seq FROM events ORDER BY seq LIMIT ?)", (n,)
                    )
                deleted += self._deleted(cur)
                used = self._used_bytes(self._db)
        if deleted:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("PRAGMA incremental_vacuum")
        return deleted

    def _deleted(self, cur: sqlite3.Cursor) -> int:
        """The rows a DELETE took away, counted off what the store holds."""
        n = max(cur.rowcount, 0)
        self._held = max(0, self._held - n)
        return n

    @staticmethod
    def _used_bytes(db: sqlite3.Connection) -> int:
        (pages,) = db.execute("PRAGMA page_count").fetchone()
        (free,) = db.execute("PRAGMA freelist_count").fetchone()
        (size,) = db.execute("PRAGMA page_size").fetchone()
        return (int(pages) - int(free)) * int(size)

    # -- reading -----------------------------------------------------------------------------------------------
    def query(self, q: Query) -> list[Event]:
        """The events matching ``q``, oldest first (with ``newest``, the last ``limit`` of them). A row this bsr
        cannot read back (a kind a newer engine wrote into the same state directory) is left out."""
        self.flush()
        bounds = (
            ("seq > ?", q.after_seq),
            ("seq < ?", q.before_seq),
            ("time >= ?", q.since_time),
            ("time <= ?", q.until_time),
            ("request = ?", q.request),
            ("prompt = ?", q.prompt),
        )
        where = [clause for clause, value in bounds if value is not None]
        args: list[Any] = [value for _, value in bounds if value is not None]
        if q.kinds:
            where.append(f"type IN ({', '.join('?' * len(q.kinds))})")
            args.extend(q.kinds)
        order = "DESC" if q.newest else "ASC"
        sql = f"SELECT body FROM events WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?"
        with self._read_lock:
            rows = self._reader.execute(sql, [*args, max(0, q.limit)]).fetchall()
        out = [ev for (body,) in rows if (ev := _event(body)) is not None]
        return out[::-1] if q.newest else out

    def extent(self) -> tuple[int, int]:
        """(how many events the store holds, the sequence number of the oldest; 0 when it holds none)."""
        self.flush()
        with self._read_lock:
            (oldest,) = self._reader.execute("SELECT COALESCE(MIN(seq), 0) FROM events").fetchone()
        return self._held, int(oldest)

    def newest_request(self, prefix: str) -> str | None:
        """The request id (starting with ``prefix``) of the newest event that names one, if any is kept."""
        self.flush()
        with self._read_lock:
            row = self._reader.execute(
                "SELECT request FROM events WHERE request LIKE ? ORDER BY seq DESC LIMIT 1", (prefix + "%",)
            ).fetchone()
        return str(row[0]) if row else None

    def stats(self) -> StoreStats:
        self.flush()
        with self._read_lock:
            (count, oldest) = self._reader.execute("SELECT COUNT(*), MIN(time) FROM events").fetchone()
            used = self._used_bytes(self._reader)
        size = sum(p.stat().st_size for p in self._files() if p.exists())
        return StoreStats(
            str(self.path), int(count), used, size, oldest, self.max_age_s, self.max_bytes, self.write_errors
        )

    def _files(self) -> Iterable[Path]:
        return (self.path, self.path.with_name(self.path.name + "-wal"), self.path.with_name(self.path.name + "-shm"))

    # -- closing -----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit everything queued, record a clean stop, close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        try:
            with self._db:
                self._meta(
                    **self._pending_meta, running="0", closed_at=repr(self._clock()), last_seq=str(self._last_seq)
                )
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            self._error(f"clean stop not recorded: {e}")
        finally:
            self._reader.close()
            self._db.close()


@dataclass(frozen=True)
class _Keys:
    """What the store indexes an event by besides its seq, time and kind: the request, the prompt and the rank it
    names (read from its wire form, where every event class spells them the same)."""

    request: str | None
    prompt: str | None
    rank: int | None

    @classmethod
    def of(cls, ev: Event, wire: Mapping[str, Any] | None = None) -> _Keys:
        w = ev.to_wire() if wire is None else wire
        request, prompt, rank = w.get("request"), w.get("prompt"), w.get("rank")
        return cls(
            request if isinstance(request, str) and request else None,
            prompt if isinstance(prompt, str) and prompt else None,
            rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        )


def _row(ev: Event) -> tuple[int, float, str, str | None, str | None, int | None, str]:
    wire = ev.to_wire()
    keys = _Keys.of(ev, wire)
    return (
        ev.seq,
        float(ev.time),
        ev.kind.value,
        keys.request,
        keys.prompt,
        keys.rank,
        json.dumps(wire, separators=(",", ":"), default=str),
    )


def _event(body: str) -> Event | None:
    try:
        return parse_event(json.loads(body))
    except ValueError:
        return None


def stopped_cleanly(state_dir: Path) -> bool | None:
    """Whether the engine whose store lies in ``state_dir`` recorded its stop: True when its newest lifecycle event
    is ``engine_stopped`` (a requested shutdown says so before its admin API goes), False when it is
    ``engine_started`` (still running, or gone without a word: killed, crashed), None when there is no store to
    read. Read-only, for a monitor that saw an engine on this machine go away."""
    path = Path(state_dir) / FILE_NAME
    if not path.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=2.0)) as db:
            row = db.execute(
                "SELECT type FROM events WHERE type IN (?, ?) ORDER BY seq DESC LIMIT 1",
                (EventKind.ENGINE_STARTED.value, EventKind.ENGINE_STOPPED.value),
            ).fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else row[0] == EventKind.ENGINE_STOPPED.value


__all__ = [
    "DEFAULT_MAX_AGE_S",
    "DEFAULT_MAX_BYTES",
    "FILE_NAME",
    "EventStore",
    "EventStoreError",
    "PreviousRun",
    "Query",
    "StoreStats",
    "stopped_cleanly",
]
