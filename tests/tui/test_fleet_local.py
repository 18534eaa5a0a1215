"""Two real embedded engines, each with its own admin token, seen as a fleet without a config profile: listed in a
file of URLs (`bsr status --engines-from FILE` and `bsr top`'s fleet view through its pilot), and found through a
real Prometheus server that scrapes both, each with its own token.

bsr reads each engine with its own token: the one its state directory holds (an engine on this machine), the file
an engines file's line names (`URL token_file=PATH`), or the file a Prometheus target's `bsr_token_file` label names.
The negative controls take each away in turn (the local lookup, the file, the label): both engines are then refused
(`unauthorized`, exit 5), as they were when one token went to every engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import prometheus_server
import pytest
from prometheus_server import needs_prometheus

from bsr_cli import fleet
from bsr_cli.client import local_engine
from bsr_cli.settings import SettingFlags, load_settings
from bsr_cli.tui.fleet_app import FleetApp

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def two(live_engine: Any, stalling_engine: Any) -> list[Any]:
    """The session's two embedded engines: each its own state directory, port and token."""
    assert live_engine.token != stalling_engine.token
    return [live_engine, stalling_engine]


def _no_local_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine where these engines do not run: bsr finds no engine of its own serving their URLs."""
    monkeypatch.setattr(local_engine, "serving", lambda url: None)


def _status(bsr: Any, source: str) -> tuple[int, dict[str, dict[str, Any]]]:
    r = bsr("status", "--engines-from", source, "--json")
    return r.code, {e["url"]: e for e in r.report()["engines"]}  # an unhealthy fleet: in the error object


def _both_up(rows: dict[str, dict[str, Any]], two: list[Any]) -> None:
    assert set(rows) == {e.url for e in two}
    for e in two:
        row = rows[e.url]
        assert row["state"] != "down" and row["ranks_up"] == 2 and len(row["ranks"]) == 2, row
        assert row["W"] == 4 and row["budget_bytes"] > 0 and row["engine_name"], row


def _both_refused(code: int, rows: dict[str, dict[str, Any]], token_sent: str) -> None:
    assert code == 5, "unauthorized: 5, as `bsr status` on either alone"
    for row in rows.values():
        assert row["state"] == "down" and row["error"] == "unauthorized", row
        assert f"(token sent: {token_sent}" in row["problems"][0], row["problems"]
        assert "departure" not in row, "an engine that refuses a token has not gone anywhere"


def _both_rows_up(shown: str) -> bool:
    return shown.count(" 2/2 ") == 2


def _both_rows_refused(shown: str) -> bool:
    return shown.count("unauthorized") == 2


async def _top_shows(
    targets: list[fleet.Target], drawn: Callable[[str], bool], wait_until: Any, screen: Callable[[Any], str]
) -> str:
    """`bsr top`'s fleet view over ``targets`` (its pilot) once the first round is ``drawn``: the screen."""
    app = FleetApp(targets, interval=0.3, timeout_s=5)
    async with app.run_test(size=(160, 30)) as pilot:
        await wait_until(pilot, lambda: app.result is not None and app.rounds >= 1, "the first round", timeout=60)
        await wait_until(pilot, lambda: drawn(screen(app)), "the first round drawn")
        return screen(app)


async def test_a_file_of_local_engines_urls_shows_both_up_in_status_and_top(
    two: list[Any], bsr: Any, tmp_path: Path, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    urls = tmp_path / "engines.txt"
    urls.write_text("".join(f"{e.url}\n" for e in two))
    code, rows = _status(bsr, str(urls))
    assert code == 0
    _both_up(rows, two)
    assert [rows[e.url]["state_dir"] for e in two] == [str(e.state_dir) for e in two], "found on this machine"
    text = bsr("status", "--engines-from", str(urls))
    assert text.code == 0 and "fleet: 2 engines" in text.out and "unauthorized" not in text.out + text.err
    shown = await _top_shows(
        fleet.discover(str(urls), settings=load_settings(SettingFlags())), _both_rows_up, wait_until, screen
    )
    assert shown.count(" 2/2 ") == 2 and "unauthorized" not in shown, shown


async def test_an_engines_file_gives_each_engine_its_token_file(
    two: list[Any],
    bsr: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    wait_until: Any,
    screen: Callable[[Any], str],
) -> None:
    _no_local_lookup(monkeypatch)
    urls = tmp_path / "engines.txt"
    urls.write_text("".join(f"{e.url}\n" for e in two))
    # Negative control: no token of their own, as before: both refused, in status and in top.
    _both_refused(*_status(bsr, str(urls)), token_sent="none")
    shown = await _top_shows(
        fleet.discover(str(urls), settings=load_settings(SettingFlags())), _both_rows_refused, wait_until, screen
    )
    assert shown.count("unauthorized") == 2, shown

    for i, e in enumerate(two):
        (tmp_path / f"e{i}.token").write_text(e.token + "\n")
    urls.write_text("".join(f"{e.url} token_file=e{i}.token\n" for i, e in enumerate(two)))
    code, rows = _status(bsr, str(urls))
    assert code == 0
    _both_up(rows, two)
    shown = await _top_shows(
        fleet.discover(str(urls), settings=load_settings(SettingFlags())), _both_rows_up, wait_until, screen
    )
    assert shown.count(" 2/2 ") == 2 and "unauthorized" not in shown, shown

    # Each engine's own file, not one for all: swapped, both are refused, and the row names the file it sent.
    urls.write_text("".join(f"{e.url} token_file=e{1 - i}.token\n" for i, e in enumerate(two)))
    _both_refused(*_status(bsr, str(urls)), token_sent="token file")
    # The one token of --token does not stand in for engines that have their own.
    monkeypatch.setenv("BSR_TOKEN", two[0].token)
    code, rows = _status(bsr, str(urls))
    assert code == 5 and all(r["error"] == "unauthorized" for r in rows.values())


@pytest.fixture
def prometheus_of_two(two: list[Any], tmp_path: Path) -> Iterator[str]:
    """A real Prometheus scraping both engines, each with its own token file (one scrape job each, both labelled
    job="bsr"), each target naming its token file in a `bsr_token_file` label."""
    jobs = []
    for i, e in enumerate(two):
        token = tmp_path / f"e{i}.token"
        token.write_text(e.token)
        target = e.url.removeprefix("http://")
        jobs.append(
            f"  - job_name: bsr-{i}\n"
            f"    authorization: {{credentials_file: '{token}'}}\n"
            "    relabel_configs: [{target_label: job, replacement: bsr}]\n"
            f"    static_configs: [{{targets: ['{target}'], labels: {{bsr_token_file: '{token}'}}}}]\n"
        )
    config = "global: {scrape_interval: 1s}\nscrape_configs:\n" + "".join(jobs)
    with prometheus_server.running(config, tmp_path) as base:
        deadline = time.monotonic() + 60
        while True:  # both scraped: Prometheus read each engine's /metrics with its own token
            with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
                got = httpx.get(f"{base}/api/v1/targets", params={"state": "active"}, timeout=5).json()
                if [t["health"] for t in got["data"]["activeTargets"]] == ["up", "up"]:
                    break
            assert time.monotonic() < deadline, "prometheus did not scrape both engines within 60 s"
            time.sleep(0.2)
        yield f"{base.replace('http://', 'prometheus://')}?job=bsr"


@needs_prometheus
async def test_two_engines_found_through_prometheus_are_read_each_with_its_own_token(
    two: list[Any],
    prometheus_of_two: str,
    bsr: Any,
    monkeypatch: pytest.MonkeyPatch,
    wait_until: Any,
    screen: Callable[[Any], str],
) -> None:
    code, rows = _status(bsr, prometheus_of_two)  # an engine on this machine: its own token from its state dir
    assert code == 0
    _both_up(rows, two)
    _no_local_lookup(monkeypatch)
    code, rows = _status(bsr, prometheus_of_two)  # elsewhere: the token file its target's label names
    assert code == 0
    _both_up(rows, two)
    shown = await _top_shows(fleet.discover(prometheus_of_two), _both_rows_up, wait_until, screen)
    assert shown.count(" 2/2 ") == 2 and "unauthorized" not in shown, shown
    # Negative control: the label not read (nor the local lookup): both refused.
    monkeypatch.setattr(fleet, "TOKEN_FILE_LABEL", "bsr_no_such_label")
    _both_refused(*_status(bsr, prometheus_of_two), token_sent="none")
