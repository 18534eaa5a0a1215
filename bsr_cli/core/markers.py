"""The force-local marker: after a restore of a prompt failed by a tier fault, the next admission of that prompt
skips the failed tiers (a lower tier that holds the prefix, else local recompute); a successful admission clears
it. Keyed by the prompt, not the request, so it outlives the failed request. One class for every host (the
embedded engine's coordinator, the vLLM connector's scheduler side). Pure: no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Marker:
    prompt: str  # the key the marker stands under (a prompt hash)
    excluded: set[str]  # the tiers the next admission skips (empty: compute locally)
    reason: str
    request: str  # the request whose restore failed
    set_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "excluded_tiers": sorted(self.excluded),
            "reason": self.reason,
            "request": self.request,
            "set_at": self.set_at,
        }


__all__ = ["Marker"]
