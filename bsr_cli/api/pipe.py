"""The envelopes on the embedded engine's pipe between the coordinator and a rank process (pickled as they are):
``Call`` carries a typed request, ``Reply`` its typed result or an error, ``Abort`` and ``Shutdown`` are signals.
Progress events and heartbeats travel as plain dicts next to them. The envelopes carry the rank-ops types
(``bsr_cli.api.ranks``), which know nothing of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bsr_cli.api.ranks import RankRequest, UnsupportedOp


@dataclass(frozen=True)
class Call:
    id: int
    request: RankRequest[Any]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Reply:
    """A rank's answer to ``Call`` ``id``: the result object, or an error line (``refused`` when the host does not
    serve the op, so the caller can raise the same ``UnsupportedOp``)."""

    id: int
    result: Any = None
    error: str | None = None
    trace: str = ""
    refused: UnsupportedOp | None = None


__all__ = ["Abort", "Call", "Reply", "Shutdown"]
