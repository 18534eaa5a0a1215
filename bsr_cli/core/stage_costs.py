"""Where a rank's restore spent its time and its CPU, stage by stage: the wire type a rank reports beside its outcome
and every bench bundle keeps, so a regression names the stage that grew.

Per stage (``TimedStage``) the wall seconds and the CPU seconds of the threads doing its work, summed over the
restore's windows: ``fetch`` (the transfer calls; on Mooncake the thread that waits on a transfer polls for its
completion, and that poll is counted here), ``verify`` (the checksum of every object), ``install`` (the copy into the
destination KV and its synchronize), ``wait`` (the window loop blocked on a fetch or a check it needs: wall time,
and the little CPU of waking up). Stages overlap when fetches run ahead, so the walls add up to more than the
restore. ``process_cpu_s`` is the CPU of the rank's whole process over the restore: what the stages leave of it is
the transport's own threads (socket copies) and anything else the process ran meanwhile.

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.core.evidence import TimedStage

__all__ = ["OTHER_CPU", "StageCost", "StageCosts"]

# The key, beside the stages' own, of the process's CPU beyond them (the transport's own threads, bookkeeping).
OTHER_CPU = "other"


@dataclass(frozen=True)
class StageCost:
    """One stage's wall seconds and the CPU seconds of the threads doing it."""

    wall_s: float = 0.0
    cpu_s: float = 0.0

    to_wire = wire.writer()
    from_wire = wire.reader()

    def plus(self, wall_s: float, cpu_s: float) -> StageCost:
        return StageCost(self.wall_s + max(wall_s, 0.0), self.cpu_s + max(cpu_s, 0.0))

    def rounded(self, digits: int = 4) -> StageCost:
        return StageCost(round(self.wall_s, digits), round(self.cpu_s, digits))


@dataclass(frozen=True)
class StageCosts:
    """Every timed stage of one restore on one rank (see the module's docstring), and its process's CPU."""

    fetch: StageCost = dataclasses.field(default_factory=StageCost)
    verify: StageCost = dataclasses.field(default_factory=StageCost)
    install: StageCost = dataclasses.field(default_factory=StageCost)
    wait: StageCost = dataclasses.field(default_factory=StageCost)
    process_cpu_s: float = 0.0

    to_wire = wire.writer()
    from_wire = wire.reader()

    def of(self, stage: TimedStage) -> StageCost:
        cost: StageCost = getattr(self, stage.value)
        return cost

    @classmethod
    def _of(cls, parts: dict[TimedStage, StageCost], process_cpu_s: float) -> StageCosts:
        return cls(
            fetch=parts[TimedStage.FETCH],
            verify=parts[TimedStage.VERIFY],
            install=parts[TimedStage.INSTALL],
            wait=parts[TimedStage.WAIT],
            process_cpu_s=process_cpu_s,
        )

    def plus(self, stage: TimedStage, wall_s: float, cpu_s: float) -> StageCosts:
        parts = {s: self.of(s) for s in TimedStage}
        parts[stage] = parts[stage].plus(wall_s, cpu_s)
        return self._of(parts, self.process_cpu_s)

    def with_process_cpu(self, process_cpu_s: float) -> StageCosts:
        return self._of({s: self.of(s) for s in TimedStage}, process_cpu_s)

    @property
    def staged_cpu_s(self) -> float:
        """CPU seconds the stages account for (the rest of ``process_cpu_s`` is the transport's own threads)."""
        return sum(self.of(s).cpu_s for s in TimedStage)

    def rounded(self, digits: int = 4) -> StageCosts:
        return self._of({s: self.of(s).rounded(digits) for s in TimedStage}, round(self.process_cpu_s, digits))

    @classmethod
    def total(cls, parts: list[StageCosts]) -> StageCosts:
        """The sum of several restores' (or ranks') costs."""
        sums = {s: StageCost() for s in TimedStage}
        for p in parts:
            for s in TimedStage:
                sums[s] = sums[s].plus(p.of(s).wall_s, p.of(s).cpu_s)
        return cls._of(sums, sum(p.process_cpu_s for p in parts))
