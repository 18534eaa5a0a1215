"""The restore job a rank runs and the outcome it answers: wire types of ``RestoreRequest``/``RestoreResult``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bsr_cli.core import wire
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.overload import HostLoad
from bsr_cli.core.stage_costs import StageCosts
from bsr_cli.errors import BadRequest

# A malformed job is a coordinator bug or a version skew between the coordinator and a host.
_JOB_HINT = "run the same bsr version on the coordinator and every rank host; report it if they match"


@dataclass(frozen=True)
class ObjectRef:
    key: str
    tier: str
    size: int


@dataclass(frozen=True)
class WindowJob:
    index: int
    chunk_start: int
    chunk_end: int
    token_start: int
    token_end: int
    blocks: Mapping[str, tuple[int, int]]  # group -> [start, end) into the request's block table


@dataclass(frozen=True)
class RestoreJob:
    """One rank's share of a windowed restore: its objects, the windows, the blocks, the faults aimed at it."""

    request_id: str
    w: int
    windows: Sequence[WindowJob]
    # objects[group][chunk] for chunks [0, committable)
    objects: Mapping[str, Sequence[ObjectRef]]
    block_tables: Mapping[str, Sequence[int]]
    faults: Sequence[FaultSpec] = ()
    fetch_timeout_s: float = 10.0
    admit_timeout_s: float = 60.0
    # The prompt's hash and every chunk hash of it (not only the restored prefix's): what a rank scrubs when a tier
    # failed this restore, so that every damaged object of the prompt is found in one pass.
    prompt: str = ""
    chunk_hashes: Sequence[str] = ()

    def validate(self, groups: Sequence[str]) -> None:
        """Refuse a job that does not cover its own windows (``BadRequest``): every group must have an object for
        every planned chunk and a block range inside its block table, so a restore never starts half-described."""
        what = f"malformed restore job for {self.request_id}"
        if self.w < 0:
            raise BadRequest(f"{what}: W must be non-negative, got {self.w}", hint=_JOB_HINT)
        for g in groups:
            if g not in self.objects or g not in self.block_tables:
                raise BadRequest(f"{what}: KV group {g!r} has no objects or no block table", hint=_JOB_HINT)
        for win in self.windows:
            if not 0 <= win.chunk_start < win.chunk_end or win.token_start >= win.token_end:
                raise BadRequest(f"{what}: window {win.index} is empty or reversed", hint=_JOB_HINT)
            for g in groups:
                if win.chunk_end > len(self.objects[g]):
                    raise BadRequest(
                        f"{what}: window {win.index} needs chunks up to {win.chunk_end} of group {g!r}, "
                        f"the job lists {len(self.objects[g])}",
                        hint=_JOB_HINT,
                    )
                span = win.blocks.get(g)
                if span is None or not 0 <= span[0] <= span[1] <= len(self.block_tables[g]):
                    raise BadRequest(
                        f"{what}: window {win.index} has no valid block range for group {g!r}", hint=_JOB_HINT
                    )


@dataclass
class RestoreResult:
    """One rank's outcome of a restore job (the window loop fills it in as it goes)."""

    rank: int
    ok: bool
    valid: dict[str, bool]
    windows_done: int = 0
    bytes_restored: int = 0
    seconds: float = 0.0
    reason: str = ""
    failed_window: int | None = None
    failed_chunks: tuple[int, int] | None = None  # the failed window's chunks [start, end)
    fired_faults: list[int] = field(default_factory=list)
    fetch_seconds: float = 0.0
    install_seconds: float = 0.0
    peak_live_bytes: int = 0  # the pool's live bytes at their highest while this restore held slots
    kind: str = ""  # why it failed (bsr_cli.runtime.failures): capacity | tier | rank | aborted | host_overloaded
    tier: str | None = None  # the tier that failed, when a tier fault names one
    stage: str = ""  # where it failed (bsr_cli.core.evidence.Stage): fetch | verify | install | synchronize | ...
    cause: str = ""  # for a capacity refusal, what did not fit (bsr_cli.core.evidence.CapacityCause)
    load: HostLoad | None = None  # for a host_overloaded failure: the figures (run-queue delay, pressure)
    # A fetch failure where the tier answered none of the objects that failed (each timed out or found it down): no
    # bytes came back, so there is nothing of the tier's to re-read for damage (a re-read would wait on the fault).
    unanswered: bool = False
    # Wall and CPU seconds by stage (fetch, verify, install, wait) and the process's CPU over the restore.
    stages: StageCosts | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()


__all__ = ["ObjectRef", "RestoreJob", "RestoreResult", "WindowJob"]
