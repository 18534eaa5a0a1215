"""A slow link with two windows in flight: the multi-host engine (`--hosts netns`) with every link capped by `tc tbf`
at 50 Mbit/s, where one 4 MiB window crosses a rank's link in ~0.7 s, under a fetch deadline of 1.5 s.

With B = 2·RWS two windows' fetches run at once and share the link, so each takes about twice as long on the clock
as it would alone. A window's deadline is its time with the transport to itself (runtime/restore.py, _FetchQueue):
the restore commits as one window at a time does, where deadlines counted on the clock failed it closed at its first
windows. The negative control: windows that need more than the deadline of the link each (12 MiB, ~2.1 s) fail
closed at the fetch, with no rank blamed.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bsr_cli.client import AdminClient, local_engine
from bsr_cli.core.evidence import Outcome, Stage
from bsr_cli.core.prompt import Prompt
from bsr_cli.engine import netns, supervisor
from bsr_cli.loaders import builtin_registration

WHY_NOT = netns.unavailable()
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}"),
]

LINK_RATE_BPS = 50_000_000
FETCH_TIMEOUT_S = 1.5
MIB = 1 << 20
WINDOW_BYTES = 4 * MIB  # W=4 chunks of 256 tokens at the demo registration's 4 KiB per token and rank
TOKENS = 8 * 4 * 256  # 8 windows of W=4
PROMPT = Prompt.synthetic_of(TOKENS, 2417)


@pytest.fixture(scope="module")
def slow_link(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    state: Path = tmp_path_factory.mktemp("slow-link")
    opts = supervisor.EngineOptions(
        builtin_registration("demo"),
        w=4,
        max_tokens=16_384,
        fetch_timeout_s=FETCH_TIMEOUT_S,
        segment_bytes=512 << 20,
        pool_bytes=24 * MIB,  # room for the negative control's two 12 MiB windows
        hosts=netns.MODE,
        link_rate_bps=LINK_RATE_BPS,
    )
    prefix = netns.prefix_for(state)
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        with AdminClient(*conn) as c:
            assert c.submit(PROMPT).hash_ok is True
        yield conn
    finally:
        supervisor.down(state)
        assert netns.leftovers(prefix) == []


def test_two_windows_sharing_a_slow_link_commit_as_one_at_a_time_does(slow_link: tuple[str, str]) -> None:
    with AdminClient(*slow_link) as c:
        for budget, live in ((WINDOW_BYTES, 1), (2 * WINDOW_BYTES, 2)):
            c.update_settings(W=4, budget_bytes=budget)
            res = c.restore(PROMPT, exclude_tiers=["fs"])
            report = res.report
            assert report is not None
            assert res.outcome is Outcome.COMMITTED and res.committed_tokens == TOKENS, report.failures
            assert report.tiers == ("mooncake",) and report.windows == 8
            # What was live says how many windows were in flight at once: one, then two sharing the link.
            assert [r.peak_live_bytes for r in report.ranks] == [live * WINDOW_BYTES] * 2, report.ranks
            assert res.hashes is not None and res.hashes.hash_ok is True


def test_control_windows_slower_than_the_deadline_fail_closed_at_the_fetch(slow_link: tuple[str, str]) -> None:
    with AdminClient(*slow_link) as c:
        c.clear_markers()
        try:
            # Two 12 MiB windows at once: each needs ~2.1 s of the link to itself, over the 1.5 s deadline.
            c.update_settings(W=12, budget_bytes=24 * MIB)
            res = c.restore(PROMPT, exclude_tiers=["fs"])
        finally:
            c.update_settings(W=4, budget_bytes=WINDOW_BYTES)
            c.clear_markers()
    report = res.report
    assert report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    assert report.failure_stage is Stage.FETCH and report.blamed_ranks == (), report.failures
    assert all("timeout" in f.reason or "waited to run" in f.reason for f in report.failures), report.failures
