"""Where the scheduler-side connector publishes what it holds, for the workers' admin API to serve.

vLLM runs its scheduler (with the scheduler-side BSR connector: the force-local markers, the admissions a marker
sent to local compute) in the EngineCore process, and the workers (with bsr's admin API) in that process (TP=1) or
in their own (TP>1). The scheduler writes its state whole to one JSON file on every change (written to a temp file
and renamed over, so a reader never sees half of it); each worker's admin API reads it when asked. The file sits
next to the connector's probe sockets (``$VLLM_RPC_BASE_PATH``, else the temp dir), named by the LMCache engine id
both sides share. Plain standard library: no vLLM, no LMCache.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bsr_cli.core.wire import JsonObject

SCHEMA = "bsr.vllm.scheduler/1"


def board_path(engine_id: str, rpc_port: int | str = 0) -> str:
    base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    return os.path.join(base, f"bsr-scheduler-{engine_id}-{rpc_port}.json")


def publish(path: str, state: Mapping[str, object]) -> None:
    """Replace the board with ``state`` (plus who wrote it, when). Never raises: serving must not depend on it."""
    doc = {"schema": SCHEMA, "pid": os.getpid(), "updated_at": time.time(), **state}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, default=str)
        os.replace(tmp, path)
    except OSError:
        pass


def read(path: str) -> JsonObject | None:
    """The scheduler's last published state; None when it never published (no BSR scheduler for this engine id)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None


__all__ = ["SCHEMA", "board_path", "publish", "read"]
