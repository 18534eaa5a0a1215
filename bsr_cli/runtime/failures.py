"""Why a restore failed, in one place: the kinds, how a restore's per-rank outcomes are classified, who is blamed.

A restore debugger must not misdiagnose: only a *tier* fault may set a force-local marker against a tier (the next
admission then skips that tier); a capacity/configuration problem, a stalled rank or an operator abort blames no
tier. Every failed restore still ends fail-closed (nothing committed, every destination block invalid) whatever
its kind.

    kind       cause                                                  marker           CLI exit
    capacity   W does not fit the budget B or the pool; admission    none             12 (the hint names
               waited past its deadline; no free destination blocks                   the setting to change)
    tier       an object missing, short, late, corrupt or failing    on the failing   10
               to transfer; an injected restore fault                 tier(s)
    rank       a rank stopped answering (no heartbeat, no progress   none; the rank   10 (restore)
               within its window deadline) or died                    is reported      9 (other calls)
                                                                      unhealthy
    aborted    the operator aborted the request                       none             130

Pure: no I/O, so the CLI can use the same rules to pick its exit code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CAPACITY = "capacity"
TIER = "tier"
RANK = "rank"
ABORTED = "aborted"
KINDS = (CAPACITY, TIER, RANK, ABORTED)
# When ranks fail for different reasons the most specific diagnosis wins: a stalled rank explains the others'
# aborts; an operator abort explains follow-on failures; a real tier failure outranks a capacity refusal.
_PRECEDENCE = (RANK, ABORTED, TIER, CAPACITY)


def classify(failures: Iterable[Mapping[str, Any]]) -> str | None:
    """The restore's failure kind from its per-rank failures (each with a ``kind``); None when nothing failed."""
    kinds = {str(f.get("kind") or TIER) for f in failures}
    if not kinds:
        return None
    for k in _PRECEDENCE:
        if k in kinds:
            return k
    return TIER


def blamed_tiers(kind: str | None, failures: Iterable[Mapping[str, Any]], tiers_used: Sequence[str]) -> set[str]:
    """The tiers a force-local marker should exclude: only for a tier fault, the tiers that failed (all the tiers
    the restore used when a failure does not say which)."""
    if kind != TIER:
        return set()
    named = {str(f["tier"]) for f in failures if f.get("kind", TIER) == TIER and f.get("tier")}
    return named or set(tiers_used)


def capacity_hint(reason: str, *, w: int, slot_bytes: int, budget_bytes: int, pool_bytes: int) -> str:
    """What to change when a restore was refused for capacity: name the setting and the value that would fit."""
    fit_budget = budget_bytes // slot_bytes if slot_bytes else 0
    fit_pool = pool_bytes // slot_bytes if slot_bytes else 0
    if "destination" in reason or "KV group" in reason:
        return "wait for running requests to finish, or start the engine with more --kv-tokens"
    if "timed out" in reason:
        return (
            "other restores held the budget for the whole admission deadline: retry, or raise the budget "
            "(POST /settings budget_bytes, `bsr engine up --budget`)"
        )
    if w == 0 and not fit_pool:
        return "the whole-plan path (W=0) stages the whole prefix at once: use a bounded window (--W)"
    if w == 0:
        return (
            f"the whole-plan path (W=0) stages the whole prefix at once and the pool holds {fit_pool} chunk(s) "
            "per rank: use a bounded window (--W), or start the engine with a larger --pool"
        )
    if not fit_budget:  # a host that does not report its budget in bytes (the rank's message says it)
        return "lower W, or raise the budget (POST /settings budget_bytes, at most the pool)"
    return (
        f"W={w} needs {w} chunk slots per rank but the budget B admits {fit_budget}: use --W {fit_budget} "
        "or lower, or raise the budget (POST /settings budget_bytes, `bsr engine up --budget`, at most the pool)"
    )


def summary(result: Mapping[str, Any]) -> str:
    """One line naming the cause of a failed restore result (its ``failure_kind`` and first failure)."""
    kind = result.get("failure_kind") or TIER
    fails = result.get("failures") or []
    first = fails[0] if fails else {}
    reason = str(first.get("reason") or "invalid group")
    if kind == RANK:
        ranks = sorted({int(f["rank"]) for f in fails if f.get("kind") == RANK})
        who = ", ".join(f"rank {r}" for r in ranks) or "a rank"
        reason = next((str(f["reason"]) for f in fails if f.get("kind") == RANK), reason)
        return f"{who} stopped responding: {reason}"
    if kind == TIER and first.get("tier"):
        return f"tier {first['tier']} failed on rank {first.get('rank')}: {reason}"
    return reason


__all__ = ["ABORTED", "CAPACITY", "KINDS", "RANK", "TIER", "blamed_tiers", "capacity_hint", "classify", "summary"]
