"""A JSON-lines event file for what the plugins do inside a serving engine's processes.

vLLM runs the scheduler and every TP worker in separate processes, so what BSR's connector decided (the probe-only
count, the windows a load used, a failed window) is not visible to whoever drives vLLM. When ``$BSR_VLLM_EVENTS``
names a file, each process appends one JSON object per event to it (one ``write`` of one line, with ``O_APPEND``:
lines from several processes do not interleave). Unset: nothing is written. The tests of the real-vLLM stage read
it; an operator can too (``tail -f``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

ENV = "BSR_VLLM_EVENTS"


def emit(event: str, **fields: Any) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    rec = {"event": event, "pid": os.getpid(), "t": round(time.time(), 3), **fields}
    line = (json.dumps(rec, default=str) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass  # observability must never fail serving


__all__ = ["ENV", "emit"]
