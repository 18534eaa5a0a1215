"""Pure: `bsr explain REQ` and `bsr describe REQ` fold a request's typed events (as read back from the event store)
into one verdict and one timeline, for every way a restore ends, naming only what is known (never None, `?` or a
Python list)."""

from __future__ import annotations

import json

import pytest

from bsr_cli.core import events as ev
from bsr_cli.core.evidence import FailureKind, Outcome, Stage, WindowStep
from bsr_cli.core.explain import FindingKind, explain_request, fold_restore
from bsr_cli.core.status import Health
from bsr_cli.core.timeline import TimelineFailure, timeline

REQ = "req-00007"


def _restore(*ended: ev.Event) -> list[ev.Event]:
    """A W=1 restore of 3 windows on 2 ranks: rank 0 releases all, rank 1 releases one, then it ends."""
    out: list[ev.Event] = [
        ev.RestoreStarted(request=REQ, prompt="abc", W=1, windows=3, tokens=768, tiers=("mooncake",))
    ]
    for w in range(3):
        out.append(ev.WindowFetched(request=REQ, rank=0, window=w, bytes=100, tiers=("mooncake",)))
        out.append(ev.WindowReleased(request=REQ, rank=0, window=w, windows=3, bytes=100))
    out.append(ev.WindowReleased(request=REQ, rank=1, window=0, windows=3, bytes=100))
    out.extend(ended)
    # Stamped as the log stamps them, and through the wire and back, as the store hands them out.
    return [ev.parse_event(ev.stamped(e, i + 1, 100.0 + i).to_wire()) for i, e in enumerate(out)]


def _fail(kind: FailureKind, stage: Stage | None, tier: str | None = None) -> ev.Failure:
    return ev.Failure(rank=1, reason="it broke", kind=kind, stage=stage, window=1, tier=tier)


CASES = [
    (
        ev.RestoreEnded(outcome=Outcome.COMMITTED, request=REQ, committed_tokens=768, advertised_tokens=768),
        "restore-committed",
        "committed",
    ),
    (
        ev.RestoreEnded(
            outcome=Outcome.FAILED_CLOSED,
            request=REQ,
            failures=(_fail(FailureKind.TIER, Stage.FETCH, "mooncake"),),
            failure_kind=FailureKind.TIER,
        ),
        "restore-failed-tier",
        "failed closed",
    ),
    (
        ev.RestoreEnded(
            outcome=Outcome.FAILED_CLOSED,
            request=REQ,
            failures=(_fail(FailureKind.RANK, Stage.INSTALL),),
            failure_kind=FailureKind.RANK,
        ),
        "restore-failed-rank",
        "failed closed",
    ),
    (
        ev.RestoreEnded(
            outcome=Outcome.REFUSED,
            request=REQ,
            failures=(_fail(FailureKind.CAPACITY, None),),
            failure_kind=FailureKind.CAPACITY,
        ),
        "restore-failed-capacity",
        "refused",
    ),
    (
        ev.RestoreEnded(
            outcome=Outcome.ABORTED,
            request=REQ,
            failures=(_fail(FailureKind.ABORTED, None),),
            failure_kind=FailureKind.ABORTED,
        ),
        "restore-aborted",
        "aborted",
    ),
]


@pytest.mark.parametrize(("ended", "verdict", "state"), CASES, ids=[c[1] + "-" + c[2] for c in CASES])
def test_every_ending_folds_into_its_verdict_and_timeline(ended: ev.Event, verdict: str, state: str) -> None:
    events = _restore(ended)
    d = explain_request(events, health=Health(ranks=(), tiers={}), markers=[])
    assert d.verdict is FindingKind(verdict) and d.request == REQ and d.prompt == "abc"
    last = fold_restore(events)
    assert last is not None and {r.rank: r.windows_released for r in last.ranks} == {0: 3, 1: 1}
    text = json.dumps(d.to_wire())
    for bad in ("None", "?", "['", "{'"):
        assert bad not in d.summary and all(bad not in e for e in d.findings[0].evidence), (bad, text)
    assert "from mooncake" in d.findings[0].evidence[0]
    t = timeline(REQ, events)
    assert t.outcome.state == state
    assert [(w.rank, w.window) for w in t.windows] == [(0, 1), (0, 2), (0, 3), (1, 1)]
    assert all(WindowStep.RELEASED in w.steps for w in t.windows) and t.windows[0].tiers == ("mooncake",)


def test_a_failure_names_its_stage_and_tier_and_a_ranks_part_shows_in_the_timeline() -> None:
    failed = ev.RestoreFailed(
        request=REQ, rank=1, reason="crc mismatch", failure_kind=FailureKind.TIER, stage=Stage.VERIFY, window=1
    )
    closed = ev.RestoreEnded(
        outcome=Outcome.FAILED_CLOSED,
        request=REQ,
        failures=(_fail(FailureKind.TIER, Stage.VERIFY, "mooncake"),),
        failure_kind=FailureKind.TIER,
    )
    events = _restore(failed, closed)
    d = explain_request(events, health=Health(ranks=(), tiers={}), markers=[])
    line = d.findings[0].evidence[-1]
    assert line == "failed: rank 1 window G2: it broke (kind tier, stage verify, tier mooncake)"
    assert "tier mooncake failed" in d.summary
    t = timeline(REQ, events)
    assert t.failures == (TimelineFailure(1, 2, 8.0, "crc mismatch", FailureKind.TIER, Stage.VERIFY, None),)
    assert t.to_wire()["failures"] == [
        {
            "rank": 1,
            "window": 2,
            "label": "G2",
            "chunks": None,
            "at": 8.0,
            "reason": "crc mismatch",
            "kind": "tier",
            "stage": "verify",
            "tier": None,
        }
    ]


def test_a_host_verdict_names_the_host_with_its_figures_and_no_rank_or_tier() -> None:
    from bsr_cli.core.evidence import RankState
    from bsr_cli.core.overload import HostLoad, Psi, RankDelay

    load = HostLoad(
        span_s=18.2, coordinator_lag_s=0.0, ranks=(RankDelay(1, RankState.STARVED, 51.5, 0.1),), cpu=Psi(99.0, 0.0)
    )
    host = ev.Failure(rank=1, reason="no restore progress for 20.3s", kind=FailureKind.HOST_OVERLOADED, load=load)
    closed = ev.RestoreEnded(
        outcome=Outcome.FAILED_CLOSED, request=REQ, failures=(host,), failure_kind=FailureKind.HOST_OVERLOADED
    )
    d = explain_request(_restore(closed), health=Health(ranks=(), tiers={}), markers=[])
    assert d.verdict is FindingKind.RESTORE_FAILED_HOST and not d.reusable
    assert "the host was overloaded" in d.summary and "no rank or tier is blamed" in d.summary
    assert "rank 1's threads waited 51.5 s to run and ran 0.1 s in 18.2 s" in d.summary
    assert "cpu pressure some 99%, full 0% (avg10)" in d.summary and "memory pressure unknown" in d.summary
    assert d.findings[0].evidence[-1].startswith("failed: rank 1: no restore progress for 20.3s (kind host_overloaded)")
    assert "--overload-ceiling" in d.findings[0].fix
