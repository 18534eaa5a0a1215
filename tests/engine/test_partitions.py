"""Partitions across real network interfaces: the multi-host engine (`--hosts netns`) puts the Mooncake master, the
segment holder and each rank in a network namespace of its own, joined by veth links capped with `tc tbf`. Each
test cuts one link (`ip link set DEV down`) in the middle of a restore, when the first window of the cut rank has
been released, and checks that the restore fails closed (0 tokens committed) within the fetch deadline (the
restore returns), that the failure blames the Mooncake tier at the fetch stage on that rank only and names the
link, that the rank reads nothing back across the cut link to look for damage (the tier sent nothing), and that a
restore commits again once the link is back.

Needs root and iproute2 (`ip netns`); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bsr_cli.core.events import Event, WindowReleased
from bsr_cli.core.evidence import EventKind, Outcome, Stage
from bsr_cli.core.prompt import Prompt
from bsr_cli.engine import netns, supervisor
from bsr_cli.loaders import builtin_registration

pytestmark = pytest.mark.engine

WHY_NOT = netns.unavailable()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"needs network namespaces: {WHY_NOT}")

# 50 Mbit/s per link: a 4 MiB window takes ~0.7 s, so a restore of 8 windows lasts seconds after its first window
# (time to cut a link in the middle) while a whole test stays short.
LINK_RATE_BPS = 50_000_000
TOKENS = 8 * 4 * 256  # 8 windows of W=4 chunks of 256 tokens
PROMPT = Prompt.synthetic_of(TOKENS, 2401)


class MultiHost:
    def __init__(self, state: Path) -> None:
        self.state = state
        st = json.loads((state / "state.json").read_text())
        self.topology = netns.Topology.from_wire(st["netns"])
        from bsr_cli.client import local_engine

        conn = local_engine.connection(state)
        assert conn is not None
        self.url, self.token = conn

    def client(self):
        from bsr_cli.client import AdminClient

        return AdminClient(self.url, self.token)


@pytest.fixture(scope="module")
def multihost(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    state = tmp_path_factory.mktemp("multihost")
    opts = supervisor.EngineOptions(
        builtin_registration("demo"),
        w=4,
        max_tokens=16_384,
        fetch_timeout_s=2.0,
        segment_bytes=512 << 20,
        hosts=netns.MODE,
        link_rate_bps=LINK_RATE_BPS,
    )
    prefix = netns.prefix_for(state)
    try:
        supervisor.up(state, opts)
        engine = MultiHost(state)
        with engine.client() as c:
            assert c.submit(PROMPT).hash_ok is True
        yield engine
    finally:
        supervisor.down(state)
        assert netns.leftovers(prefix) == [], "every namespace and veth of the engine is removed on down"


def _restore_cutting(engine: MultiHost, rank: int, peer: str) -> dict:
    """Restore PROMPT from Mooncake and cut rank↔peer once that rank has released its first window."""
    cut: list[str] = []

    def on_event(ev: Event) -> None:
        if not cut and isinstance(ev, WindowReleased) and ev.rank == rank:
            cut.append(netns.cut(engine.topology, netns.rank_node(rank), peer).name)

    with engine.client() as c:
        res = c.restore(PROMPT, exclude_tiers=["fs"], on_event=on_event)
    assert cut, "the link was cut during the restore"
    return res


def _until_no_call_in_flight(client, deadline_s: float = 120.0) -> None:
    """Poll the ranks' tier health until no Mooncake call abandoned at a deadline is still running."""
    end = time.monotonic() + deadline_s
    while True:
        details = [t.detail for r in client.pool(health=True) if (t := (r.tiers or {}).get("mooncake")) is not None]
        if not any("in flight" in d for d in details):
            return
        assert time.monotonic() < end, f"an abandoned Mooncake call is still running: {details}"
        time.sleep(0.2)  # the poll's interval (the health is cached for 1 s in the rank)


@needs_netns
@pytest.mark.parametrize(("rank", "peer"), [(0, netns.HOLDER), (0, netns.MASTER), (1, netns.HOLDER)])
def test_a_link_cut_mid_restore_fails_closed_names_the_link_and_recovers(
    multihost: MultiHost, bsr, monkeypatch: pytest.MonkeyPatch, rank: int, peer: str
) -> None:
    link = multihost.topology.link(netns.rank_node(rank), peer).name
    try:
        res = _restore_cutting(multihost, rank, peer)
        # `bsr engine status` shows the link down, at the end that was set down.
        monkeypatch.setenv("BSR_STATE_DIR", str(multihost.state))
        status = bsr("engine", "status", "--json").report()
        assert [lk for lk in status["hosts"]["links"] if lk["state"] != "up"] == [
            {"link": link, "state": "down", "down_at": [netns.rank_node(rank)]}
        ]
    finally:
        netns.heal(multihost.topology, netns.rank_node(rank), peer)
    assert all(lk.up for lk in supervisor.status(multihost.state).hosts.links)
    # Returned (the stall ended at the fetch deadline), failed closed, nothing committed.
    report = res.report
    assert report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    assert report.failure_stage is Stage.FETCH and report.blamed_tiers == ("mooncake",)
    assert [f.rank for f in report.failures] == [rank], "only the rank behind the cut link fails"
    failed = {r.rank: r for r in report.ranks}
    assert failed[rank].ok is False and failed[rank].tier == "mooncake"
    assert failed[rank].failed_window is not None and failed[rank].windows_done >= 1, "cut mid-restore"
    assert f"link {link} down" in failed[rank].reason
    assert failed[1 - rank].ok is True and "link" not in failed[1 - rank].reason
    # The tier did not answer the cut rank's fetch, so nothing came back to check for damage: the rank reads nothing
    # back across the cut link (no repair read of the window, no scrub of the prompt's other objects).
    with multihost.client() as c:
        assert c.events(request=res.request, kinds=[EventKind.SCRUB_STARTED]).events == []
    # `bsr explain` of the request says which link.
    monkeypatch.setenv("BSR_ENGINE", multihost.url)
    monkeypatch.setenv("BSR_TOKEN", multihost.token)
    explained = bsr("explain", res.request)
    assert explained.code == 0, explained.err
    assert f"link {link} down" in explained.out
    # The link is back. The fetch abandoned at the deadline still runs in the rank until its bytes arrive (the
    # tier says so in its health); once it has, the next restore from Mooncake commits the whole prompt.
    with multihost.client() as c:
        _until_no_call_in_flight(c)
        c.clear_markers()
        again = c.restore(PROMPT, exclude_tiers=["fs"])
    assert again.report is not None and again.hashes is not None
    assert again.outcome is Outcome.COMMITTED and again.committed_tokens == TOKENS, again.report.failures
    assert again.report.tiers == ("mooncake",) and again.hashes.hash_ok is True


@needs_netns
def test_down_removes_namespaces_left_by_a_crashed_run(tmp_path: Path) -> None:
    """A run that died without cleaning up leaves namespaces and veths: `down` (and the next `up`) remove them."""
    topo = netns.create(netns.Topology.plan(netns.prefix_for(tmp_path), ranks=1, rate_bps=LINK_RATE_BPS))
    try:
        assert sorted(netns.leftovers(topo.prefix)) == sorted(topo.netns(n) for n in topo.nodes)
        # A start over a crashed run's namespaces removes them first (the names would collide otherwise).
        netns.create(topo)
        assert sorted(netns.leftovers(topo.prefix)) == sorted(topo.netns(n) for n in topo.nodes)
        out = supervisor.down(tmp_path)  # no state.json: the crash happened before it was written
        assert sorted(out.removed_netns) == sorted(topo.netns(n) for n in topo.nodes)
        assert netns.leftovers(topo.prefix) == []
    finally:
        netns.destroy(topo.prefix)


@needs_netns
def test_bench_store_shows_the_link_cap_as_the_ceiling(
    multihost: MultiHost, bsr, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`bsr bench store` against the multi-host engine: the restores cross the capped links, and the cap is shown
    as their ceiling (a restore cannot pass it: tbf's burst is 32 KiB against MiBs per window)."""
    for key, value in (("BSR_ENGINE", multihost.url), ("BSR_TOKEN", multihost.token)):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("BSR_STATE_DIR", str(multihost.state))
    args = ["bench", "store", "--tokens", "2048", "--W", "4", "--trials", "1", "--copy-bytes", "8MiB"]
    res = bsr(*args, "--no-plots", "--out", str(tmp_path), "--json")
    assert res.code == 0, res.err
    summary = res.json()["summary"]
    assert summary["link_ceiling_gbps"] == LINK_RATE_BPS / 8 / 1e9
    below = summary["ratios"]["restore_W,B=RWS/link_ceiling"]
    assert below is not None and 0 < below <= 1.05
    text = bsr(*args, "--no-plots", "--out", str(tmp_path))
    assert text.code == 0, text.err
    assert "link ceiling (tc tbf)" in text.out and "restore_W,B=RWS/link_ceiling" in text.out


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--hosts", "lan"], 2, "unknown --hosts 'lan'"),
        (["--link-rate", "200mbit"], 2, "--link-rate caps the links between hosts: it needs --hosts netns"),
        (["--hosts", "netns", "--link-rate", "fast"], 2, "--link-rate 'fast' is not a rate"),
        (["--hosts", "netns", "--no-remote"], 2, "drop --no-remote"),
    ],
)
def test_engine_up_refuses_a_multi_host_request_it_cannot_build(
    bsr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, says: str
) -> None:
    """Refused in one line before anything starts (no state written, no namespace created)."""
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    res = bsr("engine", "up", "--max-tokens", "4096", *args)
    assert res.code == code and says in res.err, res.err
    assert "Traceback" not in res.err
    assert not (tmp_path / "state.json").exists()
    assert netns.leftovers(netns.prefix_for(tmp_path)) == []
