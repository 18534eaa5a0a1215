"""Finding the engine that `bsr engine up` started on this machine: its state directory records the admin URL
(``state.json``) and the token (``token``, mode 0600). The supervisor writes these files; the client only reads
them, so that talking to an engine never imports the code that launches one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None
    except (OSError, json.JSONDecodeError):
        return None


def read_state(state: Path) -> dict[str, Any] | None:
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
