"""The colours bsr draws with, one table each, shared by the TUI's panels and the CLI's tables.

It lives here, in the lower of the two layers, so the CLI's render layer imports it and the TUI never imports the
CLI. Pure data (style names rich understands); importing it imports nothing else.
"""

from __future__ import annotations

from bsr_cli.core.evidence import Outcome

# The tier palette: the letter a tier is drawn with (probe strips, legends) and its colour.
TIER_STYLE: dict[str, tuple[str, str]] = {"mooncake": ("M", "green"), "fs": ("F", "cyan"), "l1": ("L", "magenta")}
BOTH_TIERS = ("B", "bold green")  # every chunk of a cell is held by more than one tier (e.g. Mooncake and fs)


def tier_look(tier: str) -> tuple[str, str]:
    """A tier's letter and colour; a tier the palette does not know reads as its initial, in white."""
    return TIER_STYLE.get(tier, (tier[:1].upper() or "?", "white"))


# A rank's pool against its bounds (TUI gauges), a restore's outcome, an event's category, an engine in a fleet.
STATE_STYLE = {
    "ok": "green",
    "above-rws": "yellow",
    "draining": "yellow",
    "over-budget": "bold red",
    "down": "bold red",
}
OUTCOME_STYLE: dict[str, str] = {  # keyed by Outcome (a StrEnum: its value reads it too)
    Outcome.COMMITTED: "green",
    Outcome.FAILED_CLOSED: "bold red",
    Outcome.REFUSED: "yellow",  # capacity refused it: no fault
    Outcome.ABORTED: "yellow",  # the operator aborted it: no fault
    Outcome.NOTHING_TO_RESTORE: "dim",
}
CATEGORY_STYLE = {"windows": "dim", "restores": "cyan", "markers": "magenta", "faults": "bold red", "other": ""}
FLEET_STYLE = {"down": "bold red", "unhealthy": "red", "degraded": "yellow", "attention": "magenta", "ok": "green"}
