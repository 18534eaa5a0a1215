"""What the coordinator's parts share: the settings, the context every part reads, and the limits they apply.

The coordinator (``bsr_cli.runtime.coordinator.Coordinator``, the facade the admin API and the plugins call) composes
one part per concern, each owning its state under its own lock and constructed over a ``CoordinatorContext``:

- ``rank_calls``: every rank asked at once with liveness (heartbeats, deadlines), rank health, rank settings;
- ``observation``: tier health, pool/stats aggregation, the live view, each restore's report, snapshots;
- ``allocation``: destination blocks and the quarantine of blocks a stuck rank call may still write;
- ``admission``: discovery (probe-only lookup), the force-local markers, the external prefix's per-rank jobs;
- ``orchestration``: a request's life (admission with fallback, the windowed restore across ranks, the commit rule);
- ``armed_faults``: the operator's injected faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from bsr_cli.api.ranks import RankClient
from bsr_cli.core.overload import HostLoad
from bsr_cli.core.registration import Registration
from bsr_cli.errors import HostOverloaded, InvalidInput, ServerError
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.failures import OVERLOADED_HINT
from bsr_cli.runtime.judge import DEFAULT_OVERLOAD_CEILING_S
from bsr_cli.runtime.metrics import RuntimeCounters

MAX_PASSES = 3  # remote → lower tier → recompute
HEALTH_WAIT_S = 0.5  # how long /health waits for the ranks' view of their tiers (older answers fill in)
POLL_S = 0.1  # how often a wait on ranks checks their heartbeats and progress
TIER_FAILURE_TTL_S = 300.0  # a tier's real failure keeps it unhealthy this long unless a success clears it first


class RankUnresponsive(ServerError):
    """A rank stopped answering: no heartbeat, or no progress on a call within its deadline (the admin API answers
    503 ``rank-unresponsive``: the engine cannot serve the request now, and nothing says when it will)."""

    kind = "rank-unresponsive"

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(
            f"rank {rank} is not responding: {reason}",
            hint="`bsr status` shows the rank's health; a stopped or hung rank process must be resumed or restarted",
        )
        self.rank = rank
        self.reason = reason


class HostStarved(HostOverloaded):
    """A call's deadline ran out, stretched up to the overload ceiling, while the host starved a rank (or the
    coordinator itself): neither the rank nor a tier is at fault. ``load`` holds the figures."""

    def __init__(self, rank: int, reason: str, load: HostLoad | None) -> None:
        super().__init__(f"the host is overloaded: rank {rank} {reason}", hint=OVERLOADED_HINT)
        self.rank = rank
        self.reason = reason
        self.load = load


class RankRestarts(Protocol):
    """A host that starts a dead rank's process again (the embedded engine's ``lifecycle.RankRestarter``): a call
    that meets the dead rank is then refused with when to retry (``RankRestarting``) instead of failing."""

    def restart_in(self, rank: int) -> float:
        """Seconds until the host next tries to start ``rank`` again (0: it is starting it now, or will at once)."""
        ...


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
    # The longest a rank's deadline (heartbeat, window progress, a call) is stretched while the host starves it
    # (runtime/judge.py); past it the host is named, never the rank.
    overload_ceiling_s: float = DEFAULT_OVERLOAD_CEILING_S
    faults_enabled: bool = False
    fs_concurrency: int = 1
    name: str = "embedded"
    tokenizer: str = "bytes"  # how the host turns text into token ids (reported so clients can match it)
    # After a tier failed a restore at fetch or verify, each rank scrubs the rest of the prompt's objects on that
    # tier in the background (bsr_cli/runtime/scrub.py); off, only the failed window's objects are re-read.
    scrub_after_failure: bool = True


@dataclass(frozen=True)
class CoordinatorContext:
    """What every part of the coordinator reads and none of them owns: the registration, the ranks, the settings,
    the event log and the counters. Each part keeps its own mutable state under its own lock."""

    reg: Registration
    # One list shared by every part: a restarted rank replaces its entry in place (``Coordinator.replace_rank``).
    ranks: list[RankClient]
    settings: EngineSettings
    events: EventLog
    # Counted where each thing happens, from now on (the engine's /metrics serves them).
    counters: RuntimeCounters

    @classmethod
    def build(
        cls, reg: Registration, ranks: Sequence[RankClient], settings: EngineSettings, events: EventLog
    ) -> CoordinatorContext:
        if len(ranks) != reg.tp_size:
            raise InvalidInput(
                f"registration has tp_size {reg.tp_size} but {len(ranks)} ranks were given",
                hint="start one rank per TP rank of the registration (--world-size)",
            )
        return cls(reg, list(ranks), settings, events, RuntimeCounters([r.rank for r in ranks], settings.tiers))


__all__ = [
    "HEALTH_WAIT_S",
    "MAX_PASSES",
    "POLL_S",
    "TIER_FAILURE_TTL_S",
    "CoordinatorContext",
    "EngineSettings",
    "HostStarved",
    "RankRestarts",
    "RankUnresponsive",
]
