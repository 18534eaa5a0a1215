"""The scheduler side of the BSR runtime: discovery, admission, the commit rule, force-local markers, faults.

Engine-agnostic: it drives TP ranks through the typed rank-ops contract (bsr_cli.api.ranks: a ``RankClient`` per
rank whose ``submit(request)`` returns a future of that request's result; the embedded engine's ranks are processes
behind pipes, a plugin's ranks can be in-process objects) and never touches tensors itself.

``Coordinator`` is the facade the admin API, the plugins and the tests call. It is assembled from one module per
concern, each a layer over the shared state (``coordinator_state``):

- ``observation``: calls to every rank with liveness, rank/tier health, pool/stats aggregation, snapshots;
- ``allocation``: destination blocks, and their quarantine while a stuck rank call may still write them;
- ``admission``: discovery (the probe-only lookup), force-local markers, the external prefix's per-rank jobs;
- ``orchestration``: a request's life (``submit`` with its fallback passes, the manual ``restore``, ``abort``).

This module adds the operator's faults (inject, list, clear).
"""

from __future__ import annotations

from typing import Any

from bsr_cli.api.ranks import RankClient
from bsr_cli.core.events import FaultInjected, FaultsCleared
from bsr_cli.core.faults import FaultSpec
from bsr_cli.errors import FaultsDisabled
from bsr_cli.runtime.allocation import BlockAllocator
from bsr_cli.runtime.coordinator_state import (
    HEALTH_WAIT_S,
    MAX_PASSES,
    POLL_S,
    PROGRESS_EVENTS,
    TIER_FAILURE_TTL_S,
    EngineSettings,
    RankUnresponsive,
)
from bsr_cli.runtime.orchestration import Orchestration


class Coordinator(Orchestration):
    # -- faults ------------------------------------------------------------------------------------------------
    def inject(self, spec: dict[str, Any]) -> FaultSpec:
        if not self.settings.faults_enabled:
            raise FaultsDisabled(
                "this engine does not allow fault injection",
                hint="start it with faults enabled (bsr engine up --enable-faults)",
            )
        # The longest prompt at W=1 has one window per chunk: a window past its last can never fire.
        max_window = max(1, -(-self.settings.max_tokens // self.reg.chunk_size)) - 1
        f = FaultSpec.parse(spec, ranks=len(self.ranks), groups=self.reg.group_names, max_window=max_window)
        with self._lock:
            self.faults.append(f)
        self.events.append(
            FaultInjected(
                fault_id=f.id, fault=f.kind, rank=f.rank, window=f.window, group=f.group, count=f.count, fired=f.fired
            )
        )
        return f

    def list_faults(self) -> list[dict[str, Any]]:
        with self._lock:
            self.faults = [f for f in self.faults if not f.exhausted()]  # expired ones are gone, as fired-out ones
            return [f.to_dict() for f in self.faults]

    def clear_faults(self) -> int:
        with self._lock:
            n = len(self.faults)
            self.faults = []
            # A tier that failed only because of an injected fault is not remembered as failing once faults are
            # cleared; a real failure stays until its TTL or the tier's next committed restore.
            self.tier_failures = {t: v for t, v in self.tier_failures.items() if not v.get("injected")}
        self.events.append(FaultsCleared(count=n))
        return n


__all__ = [
    "HEALTH_WAIT_S",
    "MAX_PASSES",
    "POLL_S",
    "PROGRESS_EVENTS",
    "TIER_FAILURE_TTL_S",
    "BlockAllocator",
    "Coordinator",
    "EngineSettings",
    "RankClient",
    "RankUnresponsive",
]
