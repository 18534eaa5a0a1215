"""A fleet of 21 engines discovered from a real Prometheus server's active targets, in `bsr status` and `bsr top`
(Textual pilot, with the drill-down into one engine), and what the fleet remembers of an engine that went away.

The fleet is one real embedded engine (the shared test engine) and 20 stand-ins. A stand-in is a real HTTP server
(http.server on loopback) that serves the admin API's read routes (/bsr/v1/snapshot, /health, /info) with a
snapshot taken from the real engine (renamed, its pool use varied) and /metrics for Prometheus to scrape: twenty
real engines would need twenty Mooncake stacks and forty rank processes, more than this machine holds beside its
other work. What the stand-ins answer is what the real engine answered, so the fleet code reads real shapes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import prometheus_server
import pytest
from answering_server import AnsweringServer, json_answer
from prometheus_server import needs_prometheus

from bsr_cli import fleet
from bsr_cli.tui.fleet_app import FLEET_HELP, EngineScreen, FleetApp
from bsr_cli.tui.screens import HelpScreen

STANDINS = 20


class StandIn:
    """One stand-in engine: a real HTTP server answering the admin API's read routes from ``snapshot``."""

    def __init__(self, name: str, snapshot: dict[str, Any]) -> None:
        self.snapshot = snapshot
        self.snapshot["info"]["engine"] = name
        self.stopping = False
        self.http = AnsweringServer(self._answer)
        self.url = self.http.url

    def _answer(self, path: str) -> tuple[bytes, str] | None:
        snap = dict(self.snapshot, stopping=self.stopping)
        if path == "/metrics":
            return b"# TYPE bsr_standin_up gauge\nbsr_standin_up 1\n", "text/plain; version=0.0.4"
        body = {
            "/bsr/v1/snapshot": snap,
            "/bsr/v1/info": snap["info"],
            "/bsr/v1/health": {"ok": True, "stopping": self.stopping, "ranks": snap["ranks"]},
        }.get(path)
        return json_answer(body)

    def stop(self) -> None:
        """The process is gone: the port refuses connections from now on."""
        self.http.stop()


@pytest.fixture
def standins(live_engine: Any) -> Iterator[list[StandIn]]:
    with live_engine.client() as c:
        real = c.snapshot(health=True).to_wire()
    out = []
    try:
        for i in range(STANDINS):
            snap = copy.deepcopy(real)
            for r in snap["ranks"]:
                r.setdefault("pool", {})["live_bytes"] = i * 4096  # each its own pool use, under the budget
            snap["markers"], snap["faults"], snap["recent"], snap["active"] = [], [], [], []
            out.append(StandIn(f"standin-{i:02d}", snap))
        yield out
    finally:
        for s in out:
            with contextlib.suppress(OSError):
                s.stop()


@pytest.fixture
def prometheus(live_engine: Any, standins: list[StandIn], tmp_path: Path) -> Iterator[str]:
    """A real Prometheus on loopback whose job `bsr` scrapes the real engine and every stand-in; its own job
    `prometheus` is there to be filtered out."""
    port = prometheus_server.free_port()
    targets = [live_engine.url, *(s.url for s in standins)]
    listed = ", ".join(f"'{u.removeprefix('http://')}'" for u in targets)
    config = (
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        # /metrics needs the engine's token (the stand-ins take any): Prometheus sends it as the operator would.
        f"  - job_name: bsr\n    authorization: {{credentials: '{live_engine.token}'}}\n"
        f"    static_configs: [{{targets: [{listed}]}}]\n"
        f"  - job_name: prometheus\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    with prometheus_server.running(config, tmp_path, port=port) as base:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                got = httpx.get(f"{base}/api/v1/targets", params={"state": "active"}, timeout=5).json()
                if len(got["data"]["activeTargets"]) == len(targets) + 1:
                    break
            assert time.monotonic() < deadline, "prometheus did not list its targets within 60 s"
            time.sleep(0.2)
        yield f"prometheus://127.0.0.1:{port}?job=bsr"


@needs_prometheus
@pytest.mark.timeout(240)
async def test_fleet_from_prometheus_in_status_and_top(
    live_engine: Any,
    standins: list[StandIn],
    prometheus: str,
    bsr: Any,
    wait_until: Any,
    screen: Callable[[Any], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Discovered engines are read with the operator's token (BSR_TOKEN); the stand-ins take any.
    monkeypatch.setenv("BSR_TOKEN", live_engine.token)
    urls = {live_engine.url, *(s.url for s in standins)}
    found = fleet.discover(prometheus)
    assert {t.url for t in found} == urls, "every target of job bsr, and nothing of the prometheus job"

    r = bsr("status", "--engines-from", prometheus, "--json")
    assert r.code == 0, r.err
    d = r.report()
    assert len(d["engines"]) == 21 and {e["url"] for e in d["engines"]} == urls
    # The stand-ins are healthy; the shared real engine is as it is on its own (earlier tests' failed restores
    # may leave it needing attention, which is not this test's business).
    real = next(e for e in d["engines"] if e["url"] == live_engine.url)
    real_state = real["state"]
    assert real_state == "ok" or (real_state == "attention" and all("failed closed" in p for p in real["problems"])), (
        real["problems"]
    )
    expected = {e["url"]: ("ok" if e["url"] != live_engine.url else real_state) for e in d["engines"]}
    assert all(e["state"] == expected[e["url"]] and len(e["ranks"]) == 2 for e in d["engines"]), [
        (e["engine"], e["state"], e["problems"]) for e in d["engines"] if e["state"] != expected[e["url"]]
    ]
    assert {e["engine_name"] for e in d["engines"]} >= {f"standin-{i:02d}" for i in range(STANDINS)}
    text = bsr("status", "--engines-from", prometheus)
    ok = sum(1 for v in expected.values() if v == "ok")
    assert "fleet: 21 engines (" in text.out and f"{ok} ok)" in text.out

    # One stand-in announces a shutdown and goes; another vanishes without a word (a crash).
    clean, crash = standins[3], standins[7]
    clean.stopping = True
    assert bsr("status", "--engines-from", prometheus).code == 0, "still up while it stops"
    clean.stop()
    crash.stop()
    r = bsr("status", "--engines-from", prometheus, "--json")
    assert r.code == 3, "an engine unreachable: 3, as `bsr status` on it alone"
    rows = {e["url"]: e for e in r.report()["engines"]}
    assert rows[clean.url]["departure"] == "clean" and rows[clean.url]["clean_stop"] is True
    assert rows[crash.url]["departure"] == "crash" and rows[crash.url]["clean_stop"] is False
    assert rows[crash.url]["last_seen"] <= rows[crash.url]["down_since"]
    assert [e["state"] for e in r.report()["engines"][:2]] == ["down", "down"], "down engines first"
    text = bsr("status", "--engines-from", prometheus)
    assert text.code == 3
    assert "stopped cleanly" in text.out and "went away without a clean stop" in text.out

    # The TUI over the same discovered fleet, at both sizes: rows, drill-down into the real engine, help.
    for size in ((160, 45), (80, 24)):
        await _drill_down(
            # The operator's token travels with each discovered target (as BSR_TOKEN does for `bsr top`).
            FleetApp(
                [dataclasses.replace(t, token=live_engine.token) for t in fleet.discover(prometheus)],
                interval=0.3,
                timeout_s=3,
            ),
            size,
            found,
            live_engine.url,
            wait_until,
            screen,
        )


async def _drill_down(
    app: FleetApp, size: tuple[int, int], found: list[fleet.Target], real: str, wait_until: Any, screen: Any
) -> None:
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.result is not None, "the first round", timeout=60)
        assert app.result is not None
        assert len(app.result.engines) == 21
        # The round's result is drawn on the next refresh: what is on screen is read once it has been drawn.
        await wait_until(pilot, lambda: "21 engines" in screen(app), "the first round drawn")
        if size == (160, 45):
            await wait_until(pilot, lambda: all(t.name in screen(app) for t in found), "all 21 engines on one screen")
        shown = screen(app)
        assert "worst: down" in shown and "21 engines" in shown
        if size == (160, 45):
            assert "never seen up" in shown, shown
        # Move to the real engine's row and open it.
        order = [e.url for e in app.result.engines]
        for _ in range(order.index(real)):
            await pilot.press("j")
        await pilot.pause()
        assert app.selected_url() == real
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, EngineScreen), "the engine view")
        eng = app.screen
        assert isinstance(eng, EngineScreen)
        await wait_until(pilot, lambda: eng.view is not None, "the engine's first snapshot")
        await wait_until(pilot, lambda: "Restore pool per rank" in (s := screen(app)) and real in s, "its view drawn")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, EngineScreen), "back to the fleet")
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
        assert isinstance(app.screen, HelpScreen) and app.screen.text == FLEET_HELP
        await wait_until(pilot, lambda: "open the engine's own view" in screen(app), "the help drawn")
        await pilot.press("x")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), "help closed")
