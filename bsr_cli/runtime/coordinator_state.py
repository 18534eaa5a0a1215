"""The coordinator's shared state: the settings, the ranks, and what the coordinator remembers between requests.

The coordinator is one object (``bsr_cli.runtime.coordinator.Coordinator``, the facade the admin API and the
plugins call) assembled from one module per concern, each a layer over this state:

- ``observation``: rank calls with liveness (heartbeats, deadlines), health, pool/stats aggregation, snapshots;
- ``allocation``: destination blocks and the quarantine of blocks a stuck rank call may still write;
- ``admission``: discovery (probe-only lookup), the force-local markers, the external prefix's per-rank jobs;
- ``orchestration``: a request's life (admission with fallback, the windowed restore across ranks, the commit rule).

Every mutable field below is read and written under ``_lock``; the events log has its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bsr_cli.api.ranks import RankClient
from bsr_cli.core.events import PROGRESS
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.markers import Marker
from bsr_cli.core.registration import Registration
from bsr_cli.errors import InvalidInput, ServerError
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.metrics import RuntimeCounters

MAX_PASSES = 3  # remote → lower tier → recompute
HEALTH_WAIT_S = 0.5  # how long /health waits for the ranks' view of their tiers (older answers fill in)
POLL_S = 0.1  # how often a wait on ranks checks their heartbeats and progress
TIER_FAILURE_TTL_S = 300.0  # a tier's real failure keeps it unhealthy this long unless a success clears it first
# Rank events that count as progress of a restore on that rank (window_waiting: blocked on admission).
PROGRESS_EVENTS = PROGRESS


class RankUnresponsive(ServerError):
    """A rank stopped answering: no heartbeat, or no progress on a call within its deadline."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(
            f"rank {rank} is not responding: {reason}",
            hint="`bsr status` shows the rank's health; a stopped or hung rank process must be resumed or restarted",
        )
        self.rank = rank
        self.reason = reason


@dataclass
class EngineSettings:
    w: int = 32
    tiers: tuple[str, ...] = ("mooncake", "fs")
    max_tokens: int = 131_072
    kv_tokens: int = 262_144
    pool_bytes: int = 0
    budget_bytes: int = 0
    fetch_timeout_s: float = 10.0
    admit_timeout_s: float = 60.0
    call_timeout_s: float = 120.0
    # How long a request waits for destination KV blocks held by running requests before it is refused (0: refuse
    # at once, as before). A serving scheduler keeps such a request waiting; a minute covers a long restore.
    kv_wait_s: float = 60.0
    faults_enabled: bool = False
    fs_concurrency: int = 1
    name: str = "embedded"
    tokenizer: str = "bytes"  # how the host turns text into token ids (reported so clients can match it)


class CoordinatorState:
    def __init__(
        self, reg: Registration, ranks: Sequence[RankClient], settings: EngineSettings, events: EventLog
    ) -> None:
        if len(ranks) != reg.tp_size:
            raise InvalidInput(f"registration has tp_size {reg.tp_size} but {len(ranks)} ranks were given")
        self.reg = reg
        self.ranks = list(ranks)
        self.settings = settings
        self.events = events
        # Counted where each thing happens, from now on (the engine's /metrics serves them).
        self.counters = RuntimeCounters([r.rank for r in self.ranks], settings.tiers)
        self.started_at = time.time()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.markers: dict[str, Marker] = {}
        self.faults: list[FaultSpec] = []
        self.active: dict[str, dict[str, Any]] = {}
        self._open_requests: set[str] = set()  # accepted and not yet finished (abortable)
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)
        self._rate: dict[int, deque[tuple[float, int]]] = {r.rank: deque(maxlen=4096) for r in ranks}
        # Liveness: per (request, rank) the time and kind of the last progress event of a running restore; the
        # last fault seen on each rank; per request the rank calls still running after it was failed (its blocks
        # stay allocated until they return, so a late install can never land in another request's blocks).
        self._progress: dict[tuple[str, int], tuple[float, str]] = {}
        self.rank_faults: dict[int, dict[str, Any]] = {}
        self._stuck: dict[int, set[str]] = {}
        self._outstanding: dict[str, list[Future[Any]]] = {}
        # Tier health from real restores: the last failure per tier, cleared by a later committed restore from it.
        self.tier_failures: dict[str, dict[str, Any]] = {}
        # Each rank's last answer about its tiers (for a quick /health), and the ranks asked and not answered yet.
        self._tier_views: dict[int, tuple[float, dict[str, Any]]] = {}
        self._tier_asks: set[int] = set()

    def continue_request_ids(self, after: int) -> None:
        """Number new requests after ``after``: an engine restarted over its own event store must never reuse a
        request id its kept evidence already names."""
        self._ids = itertools.count(max(0, after) + 1)


__all__ = [
    "HEALTH_WAIT_S",
    "MAX_PASSES",
    "POLL_S",
    "PROGRESS_EVENTS",
    "TIER_FAILURE_TTL_S",
    "CoordinatorState",
    "EngineSettings",
    "RankUnresponsive",
]
