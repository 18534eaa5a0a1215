"""`bsr status` and `bsr top` over a fleet of three real embedded engines (each its own mooncake_master, segment
holder, two rank processes and admin API): per-engine and per-rank rows, worst first; an engine stopped mid-test
becomes one `down` row while the others keep their ranks and the TUI keeps rendering."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.client import (
    AdminClient,
    local_engine,
)
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.engine import supervisor
from bsr_cli.fleet import Target
from bsr_cli.loaders import builtin_registration
from bsr_cli.tui.fleet_app import FleetApp

# Small on purpose: three engines share the machine with everything else.
SMALL = dict(w=4, max_tokens=4096, faults_enabled=True, fetch_timeout_s=2.0, segment_bytes=64 << 20)
PROMPT = Prompt.synthetic_of(3000, 5)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[str, str, Path]]]:
    states = [tmp_path_factory.mktemp(f"fleet{i}") for i in range(3)]
    try:
        out = []
        for s in states:
            supervisor.up(s, supervisor.EngineOptions(builtin_registration("demo"), **SMALL))  # type: ignore[arg-type]
            conn = local_engine.connection(s)
            assert conn is not None
            out.append((conn[0], conn[1], s))
        yield out
    finally:
        for s in states:
            supervisor.down(s)


@pytest.mark.timeout(280)
async def test_fleet_status_and_top_survive_a_stopped_engine(
    three: list[tuple[str, str, Path]],
    bsr: Any,
    wait_until: Any,
    screen: Callable[[Any], str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (url_a, tok_a, _), (url_b, tok_b, _), (url_c, tok_c, state_c) = three
    # Every read needs its engine's token: one profile per engine carries it (`--engine a,b,c` names them).
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        "".join(
            f'[profiles.{n}]\nurl = "{u}"\ntoken = "{t}"\n'
            for n, u, t in zip("abc", (url_a, url_b, url_c), (tok_a, tok_b, tok_c), strict=True)
        )
    )
    monkeypatch.setenv("BSR_CONFIG", str(cfg))
    # Engine B: a restore fails closed under an injected fault and leaves a force-local marker.
    with AdminClient(url_b, tok_b) as c:
        c.submit(PROMPT)
        c.inject_fault(FaultRequest("remote-unavailable", rank=1, count=1))  # Mooncake's fetch fails: a tier fault
        assert c.restore(PROMPT, w=4).outcome is Outcome.FAILED_CLOSED

    r = bsr("status", "--engine", "a", "--engine", "b,c", "--json")
    assert r.code == 0, r.err
    d = r.report()
    assert [e["url"] for e in d["engines"]] == [url_b, url_a, url_c], "worst first, then in the order named"
    b, a, cc = d["engines"]
    # The failed tier is shown unhealthy for a while after the failure, and says an injected fault did it (a drill):
    # attention, not degraded, above the engines that are fine.
    assert b["state"] == "attention" and b["markers"] == 1 and b["failed_recent"] == 1
    assert any(p.startswith("tier mooncake unhealthy after an injected fault") for p in b["problems"]), b["problems"]
    assert any("failed closed" in p for p in b["problems"])
    assert a["state"] == cc["state"] == "ok"
    assert all([r["rank"] for r in e["ranks"]] == [0, 1] for e in d["engines"])

    text = bsr("status", "--engine", "a,b,c")
    assert text.code == 0
    assert "fleet: 3 engines" in text.out and "r0" in text.out and "r1" in text.out

    # A frozen rank on engine A: A is unhealthy, above B's drill, and its rank 1 leads its rank rows.
    state_a = three[0][2]
    pid = int(next(r["pid"] for r in json.loads((state_a / "state.json").read_text())["ranks"] if r["rank"] == 1))
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while True:
            r = bsr("status", "--engine", "a,b,c", "--json")
            if r.report()["engines"][0]["url"] == url_a or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.code == 9, "an unhealthy engine: the fleet is unhealthy"
    d = r.report()
    assert [(e["url"], e["state"]) for e in d["engines"]] == [(url_a, "unhealthy"), (url_b, "attention"), (url_c, "ok")]
    assert [x["rank"] for x in d["engines"][0]["ranks"]] == [1, 0] and d["engines"][0]["ranks"][0][
        "state"
    ] == "unhealthy"
    with AdminClient(url_a, tok_a) as c:
        deadline = time.monotonic() + 60
        while not c.health().ok:
            assert time.monotonic() < deadline, "rank 1 of engine A did not come back"
            time.sleep(0.2)

    app = FleetApp(
        [Target("a", url_a, tok_a), Target("b", url_b, tok_b), Target("c", url_c, tok_c)], interval=0.2, timeout_s=3
    )
    async with app.run_test(size=(160, 30)) as pilot:
        await wait_until(pilot, lambda: app.result is not None, "the first round")
        assert app.result is not None
        assert [e.state for e in app.result.engines] == ["attention", "ok", "ok"]
        supervisor.down(state_c)  # engine C goes away mid-session

        def c_down() -> bool:
            res = app.result
            return res is not None and any(e.url == url_c and e.down for e in res.engines)

        await wait_until(pilot, c_down, "engine c shown down", timeout=60)
        rounds = app.rounds
        await wait_until(pilot, lambda: app.rounds >= rounds + 2, "two more rounds after the stop")
        res = app.result
        assert res is not None
        assert [e.engine for e in res.engines] == ["c", "b", "a"], "the down engine first"
        assert all(len(e.ranks) == 2 for e in res.engines if e.engine != "c")
        shown = screen(app)
        assert "down" in shown and "unreachable" in shown
        assert shown.count(" 2/2 ") == 2, "the live engines keep their rows (both ranks up; Enter shows them)"
        assert "down since" in shown and "last seen" in shown, "it was seen up in this session"
        assert "worst: down" in shown

    r = bsr("status", "--engine", "a,b,c", "--json")
    assert r.code == 3, "an engine down: 3, as `bsr status` on that engine alone (docs/fleet.md)"
    d = r.report()
    assert d["engines"][0]["url"] == url_c and d["engines"][0]["state"] == "down"
    assert [e["url"] for e in d["engines"][1:]] == [url_b, url_a]
    assert "fleet unhealthy: c down (unreachable" in r.err


def test_single_engine_commands_refuse_a_fleet(bsr: Any) -> None:
    r = bsr("probe", "--synthetic", "10", "--engine", "http://127.0.0.1:1,http://127.0.0.1:2")
    assert r.code == 2
    assert "only `bsr status` and `bsr top` take a fleet" in r.err


def test_fleet_profile_lists_engines(bsr: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[profiles.tp2]\nurls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]\n'
        '[profiles.one]\nurl = "http://127.0.0.1:11"\n'
    )
    r = bsr("status", "--config", str(cfg), "--engine", "tp2,one", "--json", "--timeout", "2")
    assert r.code == 3, r.err  # nothing listens there: every row down, and says why
    d = r.report()
    assert [e["engine"] for e in d["engines"]] == ["tp2[0]", "tp2[1]", "one"]
    assert all(e["state"] == "down" and e["error"] == "unreachable" for e in d["engines"])
    assert "none of the 3 engines answered" in r.err
    r = bsr("probe", "--config", str(cfg), "--engine", "tp2", "--synthetic", "10")
    assert r.code == 2 and "profile 'tp2' names several engines" in r.err


def test_summarize_pool_at_budget_and_waiters() -> None:
    """Pure: a rank whose pool is at B is degraded; one with restores waiting for room needs attention."""
    from bsr_cli.core.status import Snapshot
    from bsr_cli.fleet import EngineAnswer, summarize

    snap = {
        "time": 1000.0,
        "info": {"budget_bytes": 100, "W": 4, "registration": {"model": "m"}},
        "ranks": [
            {"rank": 0, "alive": True, "healthy": True, "pool": {"live_bytes": 100, "waiters": 2}},
            {"rank": 1, "alive": True, "healthy": True, "pool": {"live_bytes": 50, "waiters": 1}},
        ],
        "tiers": {"mooncake": {"ok": True}},
        "recent": [{"outcome": "failed_closed", "finished": 500.0, "reason": "old"}],  # too old to count
    }
    row = summarize(Target("e", "http://e", None), EngineAnswer.of(Snapshot.from_wire(snap)), None, 0.01, at=1000.0)
    assert row.state == "degraded" and row.problems == ("rank 0: pool at budget B",)
    assert [(r.rank, r.state) for r in row.ranks] == [(0, "degraded"), (1, "attention")]
    assert row.failed_recent == 0


def test_summarize_a_starved_rank_needs_attention_and_is_not_unhealthy() -> None:
    """Pure: a rank the host keeps from running is the host's doing: attention, never unhealthy; the control, a rank
    the engine reports unhealthy (stopped), makes the engine unhealthy."""
    from bsr_cli.core.status import Snapshot
    from bsr_cli.fleet import EngineAnswer, summarize

    def row(rank: dict[str, Any]) -> Any:
        snap = {"time": 1000.0, "info": {"budget_bytes": 100}, "ranks": [rank], "tiers": {}, "recent": []}
        answer = EngineAnswer.of(Snapshot.from_wire(snap))
        return summarize(Target("e", "http://e", None), answer, None, 0.01, at=1000.0)

    starved = row({"rank": 0, "alive": True, "healthy": True, "state": "starved", "reason": "waited 9 s to run"})
    assert starved.state == "attention" and starved.ranks[0].state == "attention"
    assert starved.ranks[0].reason == "starved (the host, not the rank): waited 9 s to run"
    stopped = row({"rank": 0, "alive": True, "healthy": False, "state": "stopped", "reason": "its process is stopped"})
    assert stopped.state == "unhealthy" and stopped.ranks[0].state == "unhealthy"
