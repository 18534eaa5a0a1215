"""The coordinator's armed faults: what the operator injected (``bsr inject-fault``), until each fires out, expires
or is cleared. Restores read the armed ones (each rank's job carries those aimed at it) and report which fired;
tier health reads them too (an armed fault that takes a tier down makes it unhealthy)."""

from __future__ import annotations

import threading
from collections.abc import Collection

from bsr_cli.core.events import FaultEvent
from bsr_cli.core.evidence import FaultAct
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.errors import FaultsDisabled
from bsr_cli.runtime.coordinator_state import CoordinatorContext


class ArmedFaults:
    def __init__(self, ctx: CoordinatorContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._faults: list[FaultSpec] = []

    def inject(self, request: FaultRequest) -> FaultSpec:
        """Arm the fault an operator asked for (checked against this engine's ranks, groups and windows)."""
        settings, reg = self._ctx.settings, self._ctx.reg
        if not settings.faults_enabled:
            raise FaultsDisabled(
                "this engine does not allow fault injection",
                hint="start it with faults enabled (bsr engine up --enable-faults)",
            )
        # The longest prompt at W=1 has one window per chunk: a window past its last can never fire.
        max_window = max(1, -(-settings.max_tokens // reg.chunk_size)) - 1
        f = FaultSpec.parse(
            request.to_wire(), ranks=len(self._ctx.ranks), groups=reg.group_names, max_window=max_window
        )
        self.arm(f)
        self._ctx.events.append(FaultEvent.of(FaultAct.INJECTED, f))
        return f

    def arm(self, fault: FaultSpec) -> None:
        with self._lock:
            self._faults.append(fault)

    def current(self) -> list[FaultSpec]:
        """Every fault held now, fired-out or expired ones included until the next ``listed``."""
        with self._lock:
            return list(self._faults)

    def armed(self) -> list[FaultSpec]:
        """The faults that can still fire."""
        with self._lock:
            return [f for f in self._faults if not f.exhausted()]

    def listed(self) -> list[FaultSpec]:
        """The armed faults; expired ones are dropped, as fired-out ones are."""
        with self._lock:
            self._faults = [f for f in self._faults if not f.exhausted()]
            return list(self._faults)

    def clear(self) -> int:
        """Disarm every fault; answers how many there were."""
        with self._lock:
            n = len(self._faults)
            self._faults = []
        return n

    def record_fired(self, fired: Collection[int], request: str) -> None:
        """The faults (by id) that acted on ``request``'s restore (a fault fires only where it acts: one that takes
        down a tier the restore did not read from stays armed): counted, dropped once their count is spent, and each
        recorded as a ``fault_fired`` event (what a drill caused is told apart by it)."""
        if not fired:
            return
        with self._lock:
            self._faults = [f.after_firing() if f.id in fired else f for f in self._faults]
            spent = [f for f in self._faults if f.id in fired]
            self._faults = [f for f in self._faults if not f.exhausted()]
        for f in spent:
            self._ctx.events.append(FaultEvent.of(FaultAct.FIRED, f, request))

    def fire(self, rank: int, window: int, first_window: int = 0) -> FaultSpec | None:
        """The first armed fault that hits ``window`` on ``rank`` (one armed for no window hits ``first_window``),
        counted as fired: a host that runs its own windows, as a vLLM worker does, asks this once per window. None
        when none hits."""
        with self._lock:
            for i, f in enumerate(self._faults):
                if f.applies_to_rank(rank) and f.hits(window, first_window):
                    fired = f.after_firing()
                    if fired.exhausted():
                        del self._faults[i]
                    else:
                        self._faults[i] = fired
                    return fired
        return None


__all__ = ["ArmedFaults"]
