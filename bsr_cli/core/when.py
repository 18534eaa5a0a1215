"""Points in time and durations as an operator types them: ``30s``, ``15m``, ``2h``, ``1d`` (also ``1h30m``), or
an absolute ISO 8601 time (``2026-12-01T14:00``, ``2026-12-01 14:00:00Z``; without a zone it is local time).

Pure: the current time is an argument.
"""

from __future__ import annotations

import math
import re
from datetime import datetime

from bsr_cli.errors import InvalidInput

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhdw])+")
FORMS = "a duration (30s, 15m, 2h, 1d) or an ISO time (2026-12-01T14:00)"


def ago(seconds: float) -> str:
    """A span a person reads at a glance: 42s, 7m, 3.5h."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (30s, 15m, 2h, 1d, 1w, 1h30m). InvalidInput for anything else."""
    t = text.strip().lower()
    if not _DURATION.fullmatch(t):
        raise InvalidInput(f"{text!r} is not a duration", hint="write it as 30s, 15m, 2h, 1d or 1h30m")
    seconds = sum(float(n) * UNITS[u] for n, u in _PART.findall(t))
    if not math.isfinite(seconds):
        raise InvalidInput(f"{text!r} is not a finite duration", hint="write it as 30s, 15m, 2h, 1d or 1h30m")
    return seconds


def parse_since(text: str, now: float, *, what: str = "--since") -> float:
    """The Unix time ``text`` names: ``now`` minus a duration, or an absolute ISO time."""
    t = text.strip()
    if _DURATION.fullmatch(t.lower()):
        return now - parse_duration(t)
    try:
        at = datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    except ValueError:
        raise InvalidInput(f"{what} {text!r} is neither a duration nor an ISO time", hint=f"give {FORMS}") from None
    return at.timestamp()  # a naive time is local time, as an operator reads a clock


__all__ = ["FORMS", "parse_duration", "parse_since"]
