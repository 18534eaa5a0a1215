"""The commit rule (the paper's Eq. 6) and fail-closed composition.

The storage layer knows objects; the runtime knows whether they compose a valid request state. An advertised
external prefix is committed only when every TP rank and every KV group installed its part. Any invalid
(rank, group) collapses the *whole* external prefix to zero: per-group block indices are not comparable token
offsets, so no partial prefix is inferred from them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bsr_cli.core.evidence import Outcome

# The outcomes the commit rule decides between, under the names their readers import (spelled once, in Outcome).
COMMITTED = Outcome.COMMITTED  # every (rank, group) valid: the advertised prefix is committed
FAILED_CLOSED = Outcome.FAILED_CLOSED  # anything invalid: nothing committed, every destination block scrubbed
NOTHING_TO_RESTORE = Outcome.NOTHING_TO_RESTORE  # the probe found no external prefix
OUTCOMES = (COMMITTED, FAILED_CLOSED, NOTHING_TO_RESTORE)


@dataclass(frozen=True)
class CommitDecision:
    committed_tokens: int
    collapsed: bool
    invalid: tuple[tuple[int, str], ...]  # (rank, group) cells that were not valid


def commit_prefix(
    advertised_tokens: int,
    validity: Mapping[tuple[int, str], bool],
    ranks: Iterable[int],
    groups: Iterable[str],
) -> CommitDecision:
    """Commit ``advertised_tokens`` only if every (rank, group) is valid; a cell with no report is invalid."""
    group_list = list(groups)
    invalid = tuple((r, g) for r in ranks for g in group_list if not validity.get((r, g), False))
    if invalid or advertised_tokens <= 0:
        return CommitDecision(0, bool(invalid) and advertised_tokens > 0, invalid)
    return CommitDecision(advertised_tokens, False, ())
