"""Finding the engine that `bsr engine up` started on this machine: its state directory records the admin URL
(``state.json``) and the token (``token``, mode 0600). The supervisor writes these files; the client only reads
them, so that talking to an engine never imports the code that launches one.

An embedded engine is also found by the URL it serves (``serving``): its server process runs as
``python -m bsr_cli.engine.server STATE_DIR``, so this machine's process table names every running engine's state
directory, and the one whose ``state.json`` records the URL holds its token. Only the user who started an engine can
read its token file, so this finds the engines of the user running bsr and nobody else's."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

SERVER_MODULE = "bsr_cli.engine.server"  # how the embedded engine's server process is started (engine/supervisor.py)
_LOOPBACK = frozenset({"localhost", "::1"})
_SCAN_TTL_S = 2.0  # a fleet of many loopback URLs polled each second scans the process table once per round


def read_json(path: Path) -> wire.JsonObject | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, json.JSONDecodeError):
        return None


def read_state(state: Path) -> wire.JsonObject | None:
    """The engine's state record, or None when no engine was started in `state`."""
    return read_json(state / "state.json")


def connection(state: Path) -> tuple[str, str] | None:
    """(admin URL, token) of the engine in ``state``, or None when none is recorded."""
    st = read_state(state)
    if not st or not st.get("admin_url"):
        return None
    try:
        token = (state / "token").read_text().strip()
    except OSError:
        token = ""
    return str(st["admin_url"]), token


def read_token_file(path: Path) -> str:
    """The token in a token file (surrounding whitespace dropped); InvalidInput when it cannot be read or is empty."""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise InvalidInput(
            f"token file {path}: {e.strerror or e}", hint="name a file holding the engine's admin token"
        ) from None
    except UnicodeDecodeError:
        raise InvalidInput(
            f"token file {path}: not a text file", hint="name a file holding the engine's admin token"
        ) from None
    if not token:
        raise InvalidInput(f"token file {path} is empty", hint="it must hold the engine's admin token")
    return token


# -- an embedded engine by the URL it serves ---------------------------------------------------------------------
@dataclass(frozen=True)
class LocalEngine:
    """An embedded engine running on this machine: its state directory, the admin URL it records, its token."""

    state_dir: Path
    url: str
    token: str


def same_endpoint(a: str, b: str) -> bool:
    """Whether two admin URLs reach the same listener: the same scheme and port, and the same host or both a
    loopback name (127.0.0.1, localhost and ::1 are one machine's loopback)."""
    ua, ub = urlsplit(a), urlsplit(b)
    if ua.scheme != ub.scheme:
        return False
    try:
        pa, pb = ua.port, ub.port
    except ValueError:
        return False
    default = 443 if ua.scheme == "https" else 80
    if (pa or default) != (pb or default):
        return False
    ha, hb = (ua.hostname or "").lower(), (ub.hostname or "").lower()
    return ha == hb or (_loopback(ha) and _loopback(hb))


def _loopback(host: str) -> bool:
    return host in _LOOPBACK or host.startswith("127.")


def serving(url: str) -> LocalEngine | None:
    """The embedded engine on this machine that serves ``url`` and whose token this user can read, or None."""
    for state in _running_state_dirs():
        st = read_state(state)
        if not st or not st.get("admin_url") or not same_endpoint(str(st["admin_url"]), url):
            continue
        try:
            token = (state / "token").read_text().strip()
        except OSError:
            continue  # another user's engine: its token is not ours to read
        if token:
            return LocalEngine(state, str(st["admin_url"]), token)
    return None


_scan_lock = threading.Lock()
_scan: tuple[float, tuple[Path, ...]] = (float("-inf"), ())


def _running_state_dirs() -> tuple[Path, ...]:
    """The state directory of every embedded engine server running on this machine (none where there is no /proc),
    from a scan of the process table at most every _SCAN_TTL_S."""
    global _scan
    with _scan_lock:
        at, found = _scan
        if time.monotonic() - at < _SCAN_TTL_S:
            return found
        found = tuple(_scan_proc(Path("/proc")))
        _scan = (time.monotonic(), found)
        return found


def _scan_proc(proc: Path) -> list[Path]:
    out: list[Path] = []
    try:
        pids = [p for p in proc.iterdir() if p.name.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            argv = (pid / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        state = _state_arg(argv)
        if state is None:
            continue
        if not state.is_absolute():
            try:
                state = Path(os.readlink(pid / "cwd")) / state
            except OSError:
                continue
        out.append(state)
    return out


def _state_arg(argv: list[bytes]) -> Path | None:
    """STATE_DIR of ``... -m bsr_cli.engine.server STATE_DIR``, or None for any other command line."""
    for i, word in enumerate(argv[:-2]):
        if word == b"-m" and argv[i + 1] == SERVER_MODULE.encode() and argv[i + 2]:
            return Path(os.fsdecode(argv[i + 2]))
    return None
