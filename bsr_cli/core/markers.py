"""The force-local marker: after a restore of a prompt failed by a tier fault, the next admission of that prompt
skips the failed tiers (a lower tier that holds the prefix, else local recompute); a successful admission clears
it. Keyed by the prompt, not the request, so it outlives the failed request. One class for every host (the
embedded engine's coordinator, the vLLM connector's scheduler side). Pure: no I/O."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from bsr_cli.core import wire


@dataclass
class Marker:
    prompt: str  # the key the marker stands under (a prompt hash)
    # the tiers the next admission skips (empty: compute locally); written sorted
    excluded: set[str] = field(metadata=wire.meta(name="excluded_tiers"))
    reason: str
    request: str  # the request whose restore failed
    set_at: float = wire.field(default_factory=time.time, absent=0.0)  # a marker read without it: set at 0

    # Its wire form, which a submit's answer carries; the older names stay for hosts that use them.
    to_wire = wire.writer()
    from_wire = wire.reader()
    to_dict = to_wire
    from_dict = from_wire


class ScopeKind(StrEnum):
    """What an operator's `bsr markers clear` removes."""

    PROMPT = "prompt"  # the one marker of a prompt (its key as `bsr markers list` shows it)
    TIER = "tier"  # one tier from every marker's exclusions; a marker left excluding nothing is removed
    ALL = "all"  # every marker


@dataclass(frozen=True)
class ClearScope:
    kind: ScopeKind
    value: str | None = None  # the prompt key or the tier name; None for ALL

    @classmethod
    def all(cls) -> ClearScope:
        return cls(ScopeKind.ALL)

    @classmethod
    def prompt(cls, key: str) -> ClearScope:
        return cls(ScopeKind.PROMPT, key)

    @classmethod
    def tier(cls, name: str) -> ClearScope:
        return cls(ScopeKind.TIER, name)

    def describe(self) -> str:
        return "every marker" if self.kind is ScopeKind.ALL else f"{self.kind.value} {self.value}"


@dataclass(frozen=True)
class Cleared:
    """One marker an operator's clear touched: removed (``remaining`` empty and ``removed``), or left excluding
    ``remaining`` after a tier was taken out of it."""

    prompt: str
    removed: bool
    remaining: frozenset[str]


def clear(markers: dict[str, Marker], scope: ClearScope) -> list[Cleared]:
    """Apply ``scope`` to ``markers`` in place; what it touched, in the markers' order."""
    out: list[Cleared] = []
    if scope.kind is ScopeKind.PROMPT:
        if scope.value in markers:
            del markers[scope.value]
            out.append(Cleared(str(scope.value), True, frozenset()))
        return out
    for key in list(markers):
        m = markers[key]
        if scope.kind is ScopeKind.ALL:
            del markers[key]
            out.append(Cleared(key, True, frozenset()))
        elif scope.value in m.excluded:
            m.excluded.discard(str(scope.value))
            if not m.excluded:
                del markers[key]
            out.append(Cleared(key, not m.excluded, frozenset(m.excluded)))
    return out


__all__ = ["ClearScope", "Cleared", "Marker", "ScopeKind", "clear"]
