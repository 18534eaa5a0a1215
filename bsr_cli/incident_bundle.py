"""`bsr bundle`: one archive an on-call engineer attaches to a ticket.

A gzip tar holding, from one engine: ``manifest.json`` (what is inside, what was redacted or cut, versions),
``status.json`` (snapshot with rank and tier health), ``health.json``, ``info.json`` (identity and settings),
``registration.json``, ``markers.json``, ``faults.json``, ``quarantine.json`` (per tier, the damaged objects it
set apart: key, file, reason, time, size, the newest few per rank and the total; never their bytes),
``events.jsonl`` (the engine's events of the last hour, or of ``--since``, from its durable event store, one JSON
object per line), ``pool-history.json`` (per rank, the pool
occupancy every window event reported), ``segments.json`` (the Mooncake master's mounted segments, when its admin
address is known), ``versions.json``, ``logs/*.log`` (the last lines of each engine log, the structured failure logs
of the engine and each rank included, for an embedded engine whose state directory is here), ``explain/*.json``
(`bsr explain` of the prompts given), and ``top-recording.jsonl.gz``, a `bsr top --record` file rebuilt from the
events (the incident frame by frame, pools, restores in flight, markers and faults as they were, then the snapshot),
so ``bsr top --replay BUNDLE`` replays the incident without `--record` having run, and
``bsr describe REQ --record BUNDLE`` reads the bundle directly.

Redaction: token ids are never written (every ``tokens`` list becomes ``{"redacted": N}``), and the admin token,
bearer headers and anything that looks like a secret are replaced by ``***`` in every file, logs included. Size:
the archive is kept under ``max_bytes`` by cutting log tails first, then the oldest events; the manifest says what
was cut.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import platform
import re
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bsr_cli import __version__
from bsr_cli.core import wire
from bsr_cli.core.evidence import FaultAct
from bsr_cli.core.status import Health, QuarantinedFile

if TYPE_CHECKING:
    from bsr_cli.core.events import Event, FaultEvent, RestoreEnded

FORMAT = "bsr.incident-bundle"
FORMAT_VERSION = 1
RECORDING = "top-recording.jsonl.gz"
# The `bsr top --record` file format: a bundle writes one, and `bsr top` records and replays them
# (bsr_cli.tui.source imports these; they live here, in the lower layer, so this module never imports the TUI).
RECORDING_FORMAT = "bsr.top-recording"
RECORDING_FORMAT_VERSION = 1


@dataclass(frozen=True)
class RecordingHeader:
    """The first line of a `bsr top --record` file: its format and version, when it started, what it recorded."""

    format: str = RECORDING_FORMAT
    version: int = RECORDING_FORMAT_VERSION
    started: float = 0.0
    source: str = ""

    to_wire = wire.writer()
    from_wire = wire.reader()


LOG_LINES = 400
_SECRET = re.compile(
    r"(?i)(authorization:\s*bearer\s+|\"?(?:token|password|secret|api[_-]?key)\"?\s*[:=]\s*\"?)([^\s\",}]+)"
)
PACKAGES = ("torch", "mooncake-transfer-engine", "lmcache", "vllm", "httpx", "textual", "typer")


def redact_tokens(obj: Any) -> Any:
    """Every `tokens` list of ints becomes {"redacted": length}; everything else is kept."""
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            if k == "tokens" and isinstance(v, list):
                out[k] = {"redacted": len(v)}
            else:
                out[k] = redact_tokens(v)
        return out
    if isinstance(obj, list):
        return [redact_tokens(v) for v in obj]
    return obj


def redact_text(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s and len(s) >= 8:
            text = text.replace(s, "***")
    return _SECRET.sub(lambda m: m.group(1) + "***", text)


@dataclass(frozen=True)
class Versions:
    """``versions.json``: bsr's, Python's and the platform's versions, and those of the packages bsr works with
    (None: not installed). Its fields are the file's keys (the engine's own are added beside them)."""

    bsr: str
    python: str
    platform: str
    packages: dict[str, str | None]


def versions() -> Versions:
    from importlib import metadata

    pkgs: dict[str, str | None] = {}
    for p in PACKAGES:
        try:
            pkgs[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pkgs[p] = None
    return Versions(__version__, platform.python_version(), platform.platform(), pkgs)


@dataclass(frozen=True)
class PoolSample:
    """A rank's pool as one window event reported it."""

    time: float
    event: str  # the event's kind
    request: str
    live_bytes: int | None
    peak_bytes: int | None


def pool_history(events: Iterable[Event]) -> dict[str, list[PoolSample]]:
    """``pool-history.json``: per rank (a string, the file's key), the pool occupancy each window event reported
    (time, event, live and peak bytes)."""
    from bsr_cli.core import events as ev

    out: dict[str, list[PoolSample]] = {}
    for e in events:
        if isinstance(e, ev.WindowFetched | ev.WindowReleased) and e.pool:
            sample = PoolSample(e.time, e.kind.value, e.request, e.pool.get("live_bytes"), e.pool.get("peak_bytes"))
            out.setdefault(str(e.rank), []).append(sample)
    return out


@dataclass(frozen=True)
class TierQuarantine:
    """One tier's quarantined objects: how many, and the newest as each rank reported them (the health answer's
    entries, kept as they are)."""

    total: int
    newest: tuple[QuarantinedFile, ...]


def quarantine_list(health: Health) -> dict[str, TierQuarantine]:
    """Per tier, the objects it quarantined (as each rank reported them, newest first) and how many there are: the
    list only, never the bytes (they stay in the tier's ``quarantine/`` directory for whoever looks into it).
    ``health`` is the engine's health answer; the result is ``quarantine.json``."""
    return {
        name: TierQuarantine(tier.quarantined_total, tier.quarantined)
        for name, tier in health.tiers.items()
        if tier.quarantined_total or tier.quarantined
    }


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """``manifest.json`` (its fields are the file's keys, in order): what the bundle is, where it came from, what
    was redacted, and what is missing (file -> why). Writing adds the files with their sizes and the notes of what
    was cut."""

    format: str = FORMAT
    version: int = FORMAT_VERSION
    created: float
    engine: str
    found_via: str
    redacted: list[str] = field(
        default_factory=lambda: [
            "token ids (every `tokens` list)",
            "the admin token",
            "bearer headers and secret-like values",
        ]
    )
    missing: dict[str, str] = field(default_factory=dict)


def _plain(obj: Any) -> Any:
    """JSON data for a file: a typed part as its fields (dataclasses.asdict, nested ones too), the rest as it is."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


def tail(path: Path, lines: int = LOG_LINES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 256 * lines))
            data = f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read {path.name}: {e.strerror})\n"
    return "\n".join(data.splitlines()[-lines:]) + "\n"


class Builder:
    """Files of the bundle in memory (JSON, text, bytes), redacted on the way in, then cut to size and written."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = [s for s in secrets if s]
        self.files: dict[str, bytes] = {}
        self.notes: list[str] = []

    def json(self, name: str, obj: Any) -> None:
        """``obj`` as JSON: plain data, or typed parts (their fields as they are; a result with ``to_wire()`` is
        handed in as its wire form)."""
        text = json.dumps(redact_tokens(_plain(obj)), indent=2, default=str, sort_keys=False)
        self.files[name] = redact_text(text, self.secrets).encode() + b"\n"

    def text(self, name: str, text: str) -> None:
        self.files[name] = redact_text(text, self.secrets).encode()

    def events(self, name: str, events: Sequence[Mapping[str, Any]]) -> None:
        """``events`` as JSON lines, each as the engine served it (a kind this bsr does not know included)."""
        lines = [redact_text(json.dumps(redact_tokens(e), default=str), self.secrets) for e in events]
        self.files[name] = ("\n".join(lines) + "\n").encode() if lines else b""

    def raw(self, name: str, data: bytes) -> None:
        self.files[name] = data

    def fit(self, max_bytes: int) -> None:
        """Cut log tails, then the oldest events, until the files (uncompressed) fit ``max_bytes``."""

        def total() -> int:
            return sum(len(v) for v in self.files.values())

        for name in sorted(n for n in self.files if n.startswith("logs/")):
            if total() <= max_bytes:
                return
            over = total() - max_bytes
            data = self.files[name]
            keep = max(0, len(data) - over)
            self.files[name] = data[len(data) - keep :]
            self.notes.append(f"{name}: cut to its last {keep:,} bytes to fit the size cap")
        if total() > max_bytes and "events.jsonl" in self.files:
            lines = self.files["events.jsonl"].splitlines(keepends=True)
            parsed = [_parse(json.loads(line)) for line in lines]

            def keep_newest(k: int) -> None:
                # The pool history is derived from the events: it keeps to the same ones.
                self.files["events.jsonl"] = b"".join(lines[len(lines) - k :])
                if "pool-history.json" in self.files:
                    self.json("pool-history.json", pool_history(e for e in parsed[len(parsed) - k :] if e is not None))

            lo, hi = 0, len(lines)  # the most events that fit, by bisection (sizes grow with k)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                keep_newest(mid)
                if total() <= max_bytes:
                    lo = mid
                else:
                    hi = mid - 1
            keep_newest(lo)
            self.notes.append(f"events.jsonl: the {len(lines) - lo:,} oldest events dropped to fit the size cap")

    def write(self, path: Path, manifest: Manifest) -> int:
        files = {n: len(d) for n, d in sorted(self.files.items())}
        text = json.dumps(asdict(manifest) | {"files": files, "notes": self.notes}, indent=2, default=str)
        data = text.encode() + b"\n"
        now = time.time()
        with tarfile.open(path, "w:gz") as tar:
            for name, blob in [("manifest.json", data), *sorted(self.files.items())]:
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                info.mtime = int(now)
                info.mode = 0o600
                tar.addfile(info, io.BytesIO(blob))
        return path.stat().st_size


MAX_FRAMES = 240  # frames a bundle's recording rebuilds from the events (besides the snapshot itself)


# What a rebuilt frame holds besides the ranks, as `bsr top` reads a snapshot: each is written as it is (asdict).
@dataclass(frozen=True)
class _ActiveRestore:
    """A restore in flight: its windows released and bytes so far, per rank (as a string)."""

    request: str
    W: int
    windows: int
    tokens: int
    tiers: list[str]
    started: float
    done: dict[str, int]
    bytes: dict[str, int]


@dataclass(frozen=True)
class _RecentRestore:
    request: str
    outcome: str
    tokens: int
    W: int
    tiers: list[str]
    seconds: float
    finished: float
    reason: str


@dataclass(frozen=True)
class _StandingMarker:
    prompt: str
    excluded_tiers: list[str]
    reason: str
    request: str
    set_at: float


class _Standing:
    """What a rebuilt frame shows besides the ranks, as the events so far leave it: the restores in flight and the
    last ones ended, the markers standing and the faults armed."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self._ranks = ranks
        self.active: dict[str, _ActiveRestore] = {}
        self.markers: dict[str, _StandingMarker] = {}
        self.faults: dict[int, FaultEvent] = {}  # the armed faults, as their events recorded them
        self.recent: list[_RecentRestore] = []

    def apply(self, e: Event) -> bool:
        """Take one event in; True when it is a restore's end or a rank's failure (a frame is due)."""
        from bsr_cli.core import events as ev

        if isinstance(e, ev.RestoreStarted):
            self.active[e.request] = _ActiveRestore(
                request=e.request,
                W=e.W,
                windows=e.windows,
                tokens=e.tokens,
                tiers=list(e.tiers),
                started=e.time,
                done={str(r): 0 for r in self._ranks},
                bytes={str(r): 0 for r in self._ranks},
            )
        elif isinstance(e, ev.WindowReleased) and e.request in self.active:
            a = self.active[e.request]
            a.done[str(e.rank)] = a.done.get(str(e.rank), 0) + 1
            a.bytes[str(e.rank)] = a.bytes.get(str(e.rank), 0) + e.bytes
        elif isinstance(e, ev.RestoreFailed):
            return True
        elif isinstance(e, ev.RestoreEnded):
            self._ended(e)
            return True
        elif isinstance(e, ev.MarkerSet):
            self.markers[e.prompt] = _StandingMarker(
                e.prompt, list(e.excluded_tiers), e.reason, e.request or "", e.time
            )
        elif isinstance(e, ev.MarkerCleared):
            self.markers.pop(e.prompt, None)
        elif isinstance(e, ev.FaultEvent) and e.act is FaultAct.INJECTED:
            self.faults[e.fault_id] = e
        elif isinstance(e, ev.FaultsCleared):
            self.faults.clear()
        return False

    def _ended(self, e: RestoreEnded) -> None:
        started = self.active.pop(e.request, None)
        first = e.failures[0] if e.failures else None
        self.recent.append(
            _RecentRestore(
                request=e.request,
                outcome=e.outcome.value,
                tokens=e.committed_tokens or e.advertised_tokens,
                W=started.W if started is not None else 0,
                tiers=started.tiers if started is not None else [],
                seconds=e.seconds,
                finished=e.time,
                reason=first.reason if first else "",
            )
        )


def history_frames(snapshot: Mapping[str, wire.JsonValue], events: Sequence[Event]) -> list[wire.JsonObject]:
    """The incident frame by frame, rebuilt from the engine's events: one snapshot per step (at most MAX_FRAMES,
    and always one at each restore's end or failure), each as the engine would have answered then: every rank's
    pool as the last window event reported it, the restores in flight with their windows released, the markers
    and faults armed. The frames carry no events: a replay reads them from events.jsonl by sequence number, so
    the size cap, which cuts events.jsonl, bounds both. ``snapshot`` (the engine now) gives what events do not:
    the engine's identity and settings, its ranks, its tiers."""
    from bsr_cli.core import events as ev

    pooled = sum(1 for e in events if isinstance(e, ev.WindowFetched | ev.WindowReleased) and e.pool)
    every = max(1, -(-pooled // MAX_FRAMES))
    ranks = _rank_rows(snapshot.get("ranks"))
    standing = _Standing(list(ranks))
    frames: list[wire.JsonObject] = []
    since_frame = 0
    for e in events:
        if isinstance(e, ev.WindowFetched | ev.WindowReleased) and e.pool and e.rank in ranks:
            pool = ranks[e.rank].get("pool")
            ranks[e.rank] = {**ranks[e.rank], "pool": {**(pool if isinstance(pool, dict) else {}), **e.pool}}
            since_frame += 1
        boundary = standing.apply(e)
        if boundary or since_frame >= every:
            since_frame = 0
            frames.append(
                {
                    **{k: v for k, v in snapshot.items() if k not in ("events", "ranks", "active", "recent")},
                    "time": e.time,
                    "seq": e.seq,
                    "ranks": [ranks[r] for r in sorted(ranks)],
                    "active": [asdict(a) for a in standing.active.values()],  # a copy: the restore goes on
                    "recent": [asdict(r) for r in standing.recent[-50:]],
                    "markers": [asdict(m) for m in standing.markers.values()],
                    # Each as its event recorded it, less type, seq and time.
                    "faults": [
                        {k: v for k, v in f.to_wire().items() if k not in ("type", "seq", "time")}
                        for f in standing.faults.values()
                    ],
                    "events": [],
                }
            )
    return frames


def _rank_rows(rows: wire.JsonValue) -> dict[int, wire.JsonObject]:
    """A snapshot's rank rows by rank, as it sent them (a row that names no rank under -1)."""
    if not isinstance(rows, list):
        return {}
    return {_rank_of(row): dict(row) for row in rows if isinstance(row, dict)}


def _rank_of(row: wire.JsonObject) -> int:
    rank = row.get("rank", -1)
    return int(rank) if isinstance(rank, int | float | str) else -1


def _parse(wire: Any) -> Event | None:
    """An event read back from a line of events.jsonl, or None for one this bsr cannot read."""
    from bsr_cli.core.events import parse_event

    if not isinstance(wire, dict):
        return None

    try:
        return parse_event(wire)
    except ValueError:
        return None


def recording_bytes(
    snapshot: Mapping[str, wire.JsonValue],
    received_at: float,
    latency_s: float,
    source: str,
    history: Sequence[Mapping[str, wire.JsonValue]] = (),
) -> bytes:
    """A `bsr top --record` file (the format `bsr top --replay` reads): the ``history`` frames (see
    history_frames), each stamped with its engine time, then the snapshot itself."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as fh:
        first = _engine_time(history[0]) if history else received_at
        lines = [RecordingHeader(started=first, source=source).to_wire()]
        lines += [{"t": _engine_time(h), "lat": 0.0, "snap": h} for h in history]
        lines.append({"t": received_at, "lat": round(latency_s, 6), "snap": snapshot})
        for obj in lines:
            fh.write(json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n")
    return buf.getvalue()


def _engine_time(frame: Mapping[str, wire.JsonValue]) -> float:
    """When a history frame stood, in the engine's time."""
    at = frame["time"]
    return float(at) if isinstance(at, int | float | str) else 0.0


def read_member(path: Path, name: str) -> bytes | None:
    """One file of a bundle, or None when ``path`` is not a bundle (or lacks it)."""
    try:
        if not tarfile.is_tarfile(path):
            return None
        with tarfile.open(path, "r:gz") as tar:
            try:
                f = tar.extractfile(name)
            except KeyError:
                return None
            return f.read() if f is not None else None
    except (OSError, tarfile.TarError):
        return None
