"""`bsr bundle`: one archive an on-call engineer attaches to a ticket.

A gzip tar holding, from one engine: ``manifest.json`` (what is inside, what was redacted or cut, versions),
``status.json`` (snapshot with rank and tier health), ``health.json``, ``info.json`` (identity and settings),
``registration.json``, ``markers.json``, ``faults.json``, ``events.jsonl`` (the event log the engine still holds),
``pool-history.json`` (per rank, the pool occupancy every window event reported), ``segments.json`` (the Mooncake
master's mounted segments, when its admin address is known), ``versions.json``, ``logs/*.log`` (the last lines of
each engine log, for an embedded engine whose state directory is here), ``explain/*.json`` (`bsr explain` of the
prompts given), and ``top-recording.jsonl.gz``, a `bsr top --record` file of the snapshot, so
``bsr top --replay BUNDLE`` and ``bsr describe REQ --record BUNDLE`` read the bundle directly.

Redaction: token ids are never written (every ``tokens`` list becomes ``{"redacted": N}``), and the admin token,
bearer headers and anything that looks like a secret are replaced by ``***`` in every file, logs included. Size:
the archive is kept under ``max_bytes`` by cutting log tails first, then the oldest events; the manifest says what
was cut.
"""

from __future__ import annotations

import gzip
import io
import json
import platform
import re
import tarfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bsr_cli import __version__

FORMAT = "bsr.incident-bundle"
FORMAT_VERSION = 1
RECORDING = "top-recording.jsonl.gz"
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


def versions() -> dict[str, Any]:
    from importlib import metadata

    pkgs: dict[str, str | None] = {}
    for p in PACKAGES:
        try:
            pkgs[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pkgs[p] = None
    return {"bsr": __version__, "python": platform.python_version(), "platform": platform.platform(), "packages": pkgs}


def pool_history(events: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per rank, the pool occupancy each window event reported (time, event, live and peak bytes)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        p = e.get("pool")
        if isinstance(p, Mapping) and e.get("rank") is not None:
            out.setdefault(str(e["rank"]), []).append(
                {
                    "time": e.get("time"),
                    "event": e.get("type"),
                    "request": e.get("request"),
                    "live_bytes": p.get("live_bytes"),
                    "peak_bytes": p.get("peak_bytes"),
                }
            )
    return out


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
        text = json.dumps(redact_tokens(obj), indent=2, default=str, sort_keys=False)
        self.files[name] = redact_text(text, self.secrets).encode() + b"\n"

    def text(self, name: str, text: str) -> None:
        self.files[name] = redact_text(text, self.secrets).encode()

    def events(self, name: str, events: list[dict[str, Any]]) -> None:
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
            parsed = [json.loads(line) for line in lines]

            def keep_newest(k: int) -> None:
                # The pool history is derived from the events: it keeps to the same ones.
                self.files["events.jsonl"] = b"".join(lines[len(lines) - k :])
                if "pool-history.json" in self.files:
                    self.json("pool-history.json", pool_history(parsed[len(parsed) - k :]))

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

    def write(self, path: Path, manifest: dict[str, Any]) -> int:
        manifest = manifest | {"files": {n: len(d) for n, d in sorted(self.files.items())}, "notes": self.notes}
        data = json.dumps(manifest, indent=2, default=str).encode() + b"\n"
        now = time.time()
        with tarfile.open(path, "w:gz") as tar:
            for name, blob in [("manifest.json", data), *sorted(self.files.items())]:
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                info.mtime = int(now)
                info.mode = 0o600
                tar.addfile(info, io.BytesIO(blob))
        return path.stat().st_size


def recording_bytes(snapshot: dict[str, Any], received_at: float, latency_s: float, source: str) -> bytes:
    """One-frame `bsr top --record` file of the snapshot (the same format `bsr top --replay` reads)."""
    from bsr_cli.tui.source import FORMAT as REC_FORMAT
    from bsr_cli.tui.source import FORMAT_VERSION as REC_VERSION

    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb") as fh:
        header = {"format": REC_FORMAT, "version": REC_VERSION, "started": received_at, "source": source}
        frame = {"t": received_at, "lat": round(latency_s, 6), "snap": snapshot}
        for obj in (header, frame):
            fh.write(json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n")
    return buf.getvalue()


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
