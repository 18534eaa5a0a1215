"""The evidence that a host was overloaded, as a failure, an event and `bsr explain` carry it: how long each rank
waited to run, the kernel's pressure stall figures (PSI) and how late the coordinator itself ran.

Each figure is None where it could not be read (no ``/proc/pressure`` on this kernel, a rank without a process of
its own): unknown, never shown as 0 or "fine".

Pure: no I/O (``runtime/liveness.py`` reads the kernel, ``runtime/judge.py`` judges).
"""

from __future__ import annotations

from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.core.evidence import RankState


@dataclass(frozen=True)
class Psi:
    """One resource's pressure stall information (``/proc/pressure/<resource>``): the share of the last 10 s, in
    percent, in which at least one task (some) or every task at once (full) waited for it."""

    some_avg10: float
    full_avg10: float | None = None  # None: the kernel reports no "full" line for this resource

    to_wire = wire.writer()
    from_wire = wire.reader()

    def describe(self) -> str:
        full = f", full {self.full_avg10:g}%" if self.full_avg10 is not None else ""
        return f"some {self.some_avg10:g}%{full}"


@dataclass(frozen=True)
class RankDelay:
    """One rank as the judge saw it: how long its threads waited in the run queue over the span, and how long they
    ran, each summed over its threads (None: unknown, a rank without a process of its own, or no schedstat)."""

    rank: int
    state: RankState
    run_delay_s: float | None = None
    ran_s: float | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()

    def describe(self, span_s: float) -> str:
        if self.run_delay_s is None:
            return f"rank {self.rank} run delay unknown"
        ran = f" and ran {self.ran_s:.1f} s" if self.ran_s is not None else ""
        return f"rank {self.rank}'s threads waited {self.run_delay_s:.1f} s to run{ran} in {span_s:.1f} s"


@dataclass(frozen=True)
class HostLoad:
    """What the kernel and the coordinator's own clock said when a deadline was judged: over ``span_s`` seconds,
    each rank's run-queue delay, the coordinator's own lag, and the host's pressure (avg10, percent)."""

    span_s: float
    # How long the coordinator's own loop did not run on time within the span (None: not measured, a rank's own
    # verdict on its fetch deadline).
    coordinator_lag_s: float | None = None
    ranks: tuple[RankDelay, ...] = ()
    cpu: Psi | None = None  # None: unknown (no /proc/pressure/cpu here)
    memory: Psi | None = None
    io: Psi | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()

    def describe(self) -> str:
        """One line of figures, e.g. ``rank 0's threads waited 7.9 s to run and ran 0.1 s in 5.0 s; cpu pressure some
        92%, full 31% (avg10); memory pressure unknown; io pressure some 0%, full 0% (avg10); the coordinator ran 0.4
        s late``."""
        parts = [r.describe(self.span_s) for r in self.ranks]
        for name, psi in (("cpu", self.cpu), ("memory", self.memory), ("io", self.io)):
            parts.append(f"{name} pressure {psi.describe()} (avg10)" if psi is not None else f"{name} pressure unknown")
        if self.coordinator_lag_s is not None:
            parts.append(f"the coordinator ran {self.coordinator_lag_s:.1f} s late")
        return "; ".join(parts)


__all__ = ["HostLoad", "Psi", "RankDelay"]
