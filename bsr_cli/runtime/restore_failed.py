"""How a window of one rank's restore fails: ``RestoreFailed`` names the stage, the failure kind and (for a fetch
or verify failure) the tier; the window loop (``runtime.restore``) classifies it on the rank's outcome. Apart from
the loop so the parts it runs (tiers, stages and the fault-injection wrappers around them) can raise it."""

from __future__ import annotations

from collections.abc import Sequence

from bsr_cli.core.evidence import FailureKind, Stage
from bsr_cli.core.overload import HostLoad


class RestoreFailed(Exception):
    """One rank's retrieve failed at ``stage``: a fetch or verify failure is the tier's (``tier`` names it), an
    install or synchronize failure the rank's own, an abort the operator's; a fetch deadline that ran out while the
    rank waited to run is the host's (``load`` holds the figures). ``unanswered``: the tier answered none of the
    window's objects that failed (each timed out, or found the tier unavailable), so no bytes came back to check."""

    def __init__(
        self,
        reason: str,
        window: int | None,
        groups: Sequence[str] | None = None,
        *,
        kind: FailureKind,
        stage: Stage | None,
        tier: str | None = None,
        load: HostLoad | None = None,
        unanswered: bool = False,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.window = window
        self.groups = groups  # None: every group of this rank
        self.kind = kind
        self.stage = stage
        self.tier = tier
        self.load = load
        self.unanswered = unanswered


def aborted(window: int | None, stage: Stage | None = None) -> RestoreFailed:
    return RestoreFailed("aborted by the operator", window, kind=FailureKind.ABORTED, stage=stage)


__all__ = ["RestoreFailed", "aborted"]
