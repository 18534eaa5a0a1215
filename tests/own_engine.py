"""An embedded engine of a test's own, for tests that break one (kill a rank, rot its objects, stop and start it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Small: it runs beside the session's shared engines on a busy machine.
SMALL: dict[str, Any] = dict(w=4, max_tokens=4096, faults_enabled=True, fetch_timeout_s=2.0, segment_bytes=64 << 20)


@dataclass(frozen=True)
class OwnEngine:
    url: str
    token: str
    state_dir: Path
    options: Any  # supervisor.EngineOptions: what starts it again in the same state directory

    def env(self) -> dict[str, str]:
        return {"BSR_ENGINE": self.url, "BSR_TOKEN": self.token, "BSR_STATE_DIR": str(self.state_dir)}


@contextlib.contextmanager
def own_engine(state: Path, **settings: Any) -> Iterator[OwnEngine]:
    """The demo registration on two ranks with both tiers, ``settings`` over SMALL, in ``state``; always stopped."""
    pytest.importorskip("mooncake.store")
    from bsr_cli.client import local_engine
    from bsr_cli.engine import supervisor
    from bsr_cli.loaders import builtin_registration

    opts = supervisor.EngineOptions(builtin_registration("demo"), **(SMALL | settings))
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        yield OwnEngine(conn[0], conn[1], state, opts)
    finally:
        supervisor.down(state)
