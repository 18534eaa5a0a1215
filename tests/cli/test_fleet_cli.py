"""The fleet's command line without engines: discovery from a file and from DNS, the one exit rule, what the fleet
remembers of an engine that went away; and `bsr drill`'s confirmation, `bsr top --json`, and TAB after `--engine`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bsr_cli import fleet
from bsr_cli.core.status import Snapshot
from bsr_cli.errors import EngineTimeout, EngineUnreachable, Unauthorized

pytestmark = pytest.mark.timeout(60)
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens there


def test_engines_from_a_file_of_urls_and_profiles(bsr: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[profiles.one]\nurl = "http://127.0.0.1:11"\n')
    listing = tmp_path / "engines.txt"
    listing.write_text("# the lab's engines\nhttp://127.0.0.1:9\n\none   # a profile\nhttp://127.0.0.1:10/\n")
    r = bsr("status", "--config", str(cfg), "--engines-from", str(listing), "--json", "--timeout", "2")
    assert r.code == 3, r.err
    assert [e["engine"] for e in r.report()["engines"]] == ["http://127.0.0.1:9", "one", "http://127.0.0.1:10/"]
    assert [e["url"] for e in r.report()["engines"]][2] == "http://127.0.0.1:10"
    listing.write_text("http://127.0.0.1:9\nnot-a-profile\n")
    bad = bsr("status", "--config", str(cfg), "--engines-from", f"file:{listing}")
    assert bad.code == 2 and f"{listing}:2: --engine 'not-a-profile' is neither a URL nor a profile" in bad.err
    listing.write_text("# nothing yet\n")
    empty = bsr("status", "--engines-from", str(listing), "--json")
    assert empty.code == 2 and empty.json()["error"] == "invalid-input" and "no engine found" in empty.json()["message"]


def test_an_engines_file_names_each_engines_token_file(bsr: Any, tmp_path: Path) -> None:
    """`URL token_file=PATH` (relative to the file) is that engine's token, read at each poll; --token is only for
    an engine with none of its own; a token file that cannot be read is that engine's row, exit 2."""
    from bsr_cli.settings import SettingFlags, load_settings

    (tmp_path / "a.token").write_text("token-of-a\n")
    listing = tmp_path / "engines.txt"
    listing.write_text(f"{NOWHERE} token_file=a.token   # engine a\nhttp://127.0.0.1:10\n")
    found = fleet.discover(str(listing), settings=load_settings(SettingFlags(token="one-for-all")))
    assert [(t.url, t.token_file, t.fallback) for t in found] == [
        (NOWHERE, tmp_path / "a.token", "one-for-all"),
        ("http://127.0.0.1:10", None, "one-for-all"),
    ]
    assert [fleet.credential(t).token for t in found] == ["token-of-a", "one-for-all"]
    for line, says in (
        (f"{NOWHERE} token=abc", "'token=abc' after http://127.0.0.1:9: not an option"),
        (f"{NOWHERE} token_file=", "token_file= after http://127.0.0.1:9 names no file"),
    ):
        listing.write_text(f"# engines\n{line}\n")
        r = bsr("status", "--engines-from", str(listing))
        assert r.code == 2 and f"{listing}:2: {says}" in r.err and "bsr: hint:" in r.err, r.err
    listing.write_text(f"{NOWHERE} token_file=missing.token\n")
    r = bsr("status", "--engines-from", str(listing), "--json")
    (row,) = r.report()["engines"]  # the fleet's result, carried by the one error object
    assert r.code == 2 and row["error"] == "invalid-input" and "missing.token" in row["problems"][0], r.out
    assert r.json()["exit_code"] == 2 and r.json()["hint"]


def test_a_profile_names_its_token_file_relative_to_the_config_file(bsr: Any, tmp_path: Path) -> None:
    from bsr_cli.settings import SettingFlags, load_settings

    (tmp_path / "p.token").write_text("token-of-p\n")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'[profiles.p]\nurl = "{NOWHERE}"\ntoken_file = "p.token"\n[profiles.q]\nurl = "http://127.0.0.1:10"\n'
    )
    settings = load_settings(SettingFlags(config=cfg, engine="p,q", token="one-for-all"))
    found = fleet.targets(settings)
    assert found is not None and [fleet.credential(t).token for t in found] == ["token-of-p", "one-for-all"]
    cfg.write_text(f'[profiles.p]\nurl = "{NOWHERE}"\ntoken = "x"\ntoken_file = "p.token"\n')
    r = bsr("status", "--config", str(cfg), "--engine", "p")
    assert r.code == 2 and "token_file must be a path, and given instead of token" in r.err and "hint" in r.err


def test_one_engine_from_a_file_is_still_a_fleet(bsr: Any, tmp_path: Path) -> None:
    listing = tmp_path / "engines.txt"
    listing.write_text(f"{NOWHERE}\n")
    r = bsr("status", "--engines-from", str(listing), "--json", "--timeout", "2")
    assert r.code == 3 and r.report()["fleet"] is True and len(r.report()["engines"]) == 1


def test_engines_from_dns_gives_one_engine_per_address() -> None:
    """A name with several addresses (A and AAAA); the resolver is injected, as no DNS server runs here."""
    addrs = {"engines.lab": ["10.0.0.7", "10.0.0.8", "fd00::9"]}
    found = fleet.discover("dns://engines.lab:8470", resolver=lambda host, port: addrs[host])
    assert [t.url for t in found] == ["http://10.0.0.7:8470", "http://10.0.0.8:8470", "http://[fd00::9]:8470"]
    assert [t.name for t in found] == ["engines.lab/10.0.0.7", "engines.lab/10.0.0.8", "engines.lab/fd00::9"]


def test_engines_from_dns_resolves_a_real_name() -> None:
    found = fleet.discover("dns://localhost:8470")
    assert found and all(t.url.endswith(":8470") for t in found)
    assert "http://127.0.0.1:8470" in [t.url for t in found]


def test_engines_from_bad_sources(bsr: Any) -> None:
    r = bsr("status", "--engines-from", "dns://engines.invalid:8470")
    assert r.code == 3 and "cannot resolve engines.invalid" in r.err
    r = bsr("status", "--engines-from", "dns://engines.lab")
    assert r.code == 2 and "dns://NAME:PORT" in r.err
    r = bsr("status", "--engines-from", "prometheus://127.0.0.1:9?job=bsr", "--json", "--timeout", "2")
    assert r.code == 3 and r.json()["error"] == "unreachable" and "Prometheus" in r.json()["message"]


def _row(state: str, severity: fleet.Severity, error: BaseException | None = None) -> fleet.EngineRow:
    if error is not None:
        return fleet.summarize(fleet.Target("x", "http://x", None), None, error, 0.0, at=1.0)
    row = fleet.EngineRow(state, f"http://{state}", 1.0, 0.0, severity, ())
    assert row.state == state
    return row


@pytest.mark.parametrize(
    ("rows", "code"),
    [
        ([], 0),
        ([_row("ok", fleet.OK), _row("attention", fleet.ATTENTION)], 0),
        ([_row("degraded", fleet.DEGRADED)], 0),
        ([_row("unhealthy", fleet.UNHEALTHY), _row("ok", fleet.OK)], 9),
        ([_row("down", fleet.DOWN, EngineUnreachable("refused")), _row("unhealthy", fleet.UNHEALTHY)], 3),
        ([_row("down", fleet.DOWN, EngineTimeout("slow"))], 4),
        ([_row("down", fleet.DOWN, Unauthorized("token"))], 5),
    ],
)
def test_a_fleet_exits_as_its_worst_engine_would(rows: list[fleet.EngineRow], code: int) -> None:
    assert fleet.exit_code(fleet.order(rows)) == code


def test_fleet_status_with_no_engine_answering_exits_3(bsr: Any) -> None:
    r = bsr("status", "--engine", f"{NOWHERE},http://127.0.0.1:10", "--timeout", "2")
    assert r.code == 3 and "none of the 2 engines answered" in r.err, "as for one unreachable engine"


def _up(url: str, *, stopping: bool = False, started: float = 100.0) -> fleet.EngineRow:
    snap = {"time": 0.0, "info": {"started_at": started}, "ranks": [], "stopping": stopping}
    return fleet.summarize(
        fleet.Target(url, url, None), fleet.EngineAnswer.of(Snapshot.from_wire(snap)), None, 0.0, at=0.0
    )


def _down(url: str, error: BaseException) -> fleet.EngineRow:
    return fleet.summarize(fleet.Target(url, url, None), None, error, 0.0, at=0.0)


def test_memory_tells_a_clean_stop_from_a_crash_and_a_hang(tmp_path: Path) -> None:
    now = [1000.0]
    path = tmp_path / "fleet-seen.json"
    mem = fleet.Memory(path, clock=lambda: now[0])

    def at(rows: list[fleet.EngineRow]) -> list[fleet.EngineRow]:
        return mem.observe([dataclasses.replace(r, polled_at=now[0]) for r in rows])

    at([_up("a", stopping=True), _up("b"), _up("c")])
    mem.save()
    now[0] = 1010.0
    mem = fleet.Memory(path, clock=lambda: now[0])  # a later invocation remembers
    refused, slow = EngineUnreachable("refused"), EngineTimeout("slow")
    rows = at([_down("a", refused), _down("b", refused), _down("c", slow), _down("d", refused)])
    got = {r.url: (r.departure, r.clean_stop, r.last_seen, r.down_since) for r in rows}
    assert got == {
        "a": ("clean", True, 1000.0, 1010.0),
        "b": ("crash", False, 1000.0, 1010.0),
        "c": ("hung", False, 1000.0, 1010.0),
        "d": ("unknown", None, None, 1010.0),
    }
    assert (rows[0].down_text or "").startswith("stopped cleanly: down since ")
    now[0] = 1020.0
    again = at([_down("b", EngineUnreachable("refused"))])
    assert again[0].down_since == 1010.0, "down since the first poll it missed, not the latest"
    back = at([_up("b", started=200.0)])
    assert back[0].came_back == "crash" and back[0].restarts == 1
    # Back after a restart, the engine's own record of how its previous run ended is carried on its row.
    started = {"type": "engine_started", "previous_stop": "clean"}
    snap = {"info": {"started_at": 300.0}, "ranks": [], "events": [started]}
    row = fleet.summarize(
        fleet.Target("b", "b", None), fleet.EngineAnswer.of(Snapshot.from_wire(snap)), None, 0.0, at=0.0
    )
    assert row.previous_stop == "clean" and at([row])[0].restarts == 2


def _store(state: Path, *stops: str) -> None:
    """A real durable event store in ``state`` whose run started and then, for each of ``stops``, recorded it."""
    from bsr_cli.core.events import EngineStarted, EngineStopped
    from bsr_cli.runtime.event_store import FILE_NAME, EventStore
    from bsr_cli.runtime.events import EventLog

    log = EventLog(store=EventStore(state / FILE_NAME))
    log.append(EngineStarted(pid=1))
    for reason in stops:
        log.append(EngineStopped(reason=reason))
    log.close()


def test_an_engine_on_this_machine_that_recorded_its_stop_went_cleanly(tmp_path: Path) -> None:
    """A fleet that polled too seldom to see the stop announced still tells a clean `bsr engine down` from a kill:
    an engine on this machine left its own record (its event store ends with engine_stopped). One that answers but
    refuses the token has not gone anywhere."""
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    _store(clean, "shutdown")
    _store(killed)  # started, never said it stopped
    mem = fleet.Memory()
    ups = [dataclasses.replace(_up(u), state_dir=str(d), polled_at=1.0) for u, d in (("c", clean), ("k", killed))]
    mem.observe(ups)
    refused = EngineUnreachable("refused")
    rows = mem.observe([dataclasses.replace(_down(u, refused), polled_at=2.0) for u in ("c", "k")])
    assert [(r.url, r.departure, r.clean_stop) for r in rows] == [("c", "clean", True), ("k", "crash", False)]
    assert [i.text for i in mem.incidents_of("c")] == ["stopped cleanly"]
    # An engine that answers 401 is there: no departure, nothing in the timeline.
    mem.observe([dataclasses.replace(_up("u"), polled_at=1.0)])
    (row,) = mem.observe([dataclasses.replace(_down("u", Unauthorized("HTTP 401")), polled_at=2.0)])
    assert row.down and row.departure is None and row.down_since is None and mem.incidents_of("u") == ()


def test_drill_refuses_without_confirmation_when_not_on_a_terminal(bsr: Any) -> None:
    r = bsr("drill", "--engine", NOWHERE)
    assert r.code == 2, "refused before it reaches the engine (which would be exit 3)"
    assert "injects faults into" in r.err and "--yes" in r.err
    r = bsr("drill", "--engine", NOWHERE, "--json")
    assert r.code == 2 and r.json()["error"] == "invalid-input"
    r = bsr("drill", "--engine", NOWHERE, "--yes", "--timeout", "2")
    assert r.code == 3, "with --yes it goes on (and finds no engine)"


def test_drill_asks_on_a_terminal() -> None:
    from bsr_cli.drill import confirm_drill
    from bsr_cli.errors import RestoreAborted

    asked: list[str] = []
    confirm_drill("http://e", assume_yes=False, ask=lambda q: asked.append(q) or "y\n")  # type: ignore[func-returns-value]
    assert "injects faults into http://e" in asked[0]
    with pytest.raises(RestoreAborted):
        confirm_drill("http://e", assume_yes=False, ask=lambda q: "\n")


def test_top_json_prints_one_snapshot_or_a_json_error(bsr: Any) -> None:
    r = bsr("top", "--json", "--engine", NOWHERE, "--timeout", "2")
    assert r.code == 3 and r.json()["error"] == "unreachable", "one engine: `bsr pool --json`'s answer"
    r = bsr("top", "--json", "--engine", f"{NOWHERE},http://127.0.0.1:10", "--timeout", "2")
    assert r.code == 3 and r.report()["fleet"] is True and len(r.report()["engines"]) == 2
    r = bsr("top", "--json", "--record", "x.gz")
    assert r.code == 2 and r.json()["error"] == "invalid-input"
    r = bsr("top", "--replay", "x.gz", "--engines-from", "engines.txt")
    assert r.code == 2 and "not both" in r.err


def _complete(words: str, cword: int, cache: Path, **env: str) -> list[str]:
    e = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _BSR_COMPLETE="complete_bash", **env)
    e["XDG_CACHE_HOME"] = str(cache)
    r = subprocess.run([sys.executable, "-m", "bsr_cli"], env=e, capture_output=True, text=True, timeout=60)
    return r.stdout.split()


def test_tab_after_engine_offers_profiles_wherever_it_stands(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[profiles.prod]\nurl = "http://10.0.0.7:8470"\n[profiles.lab]\nurl = "http://127.0.0.1:8470"\n')
    for words, cword in (("bsr top -e p", 3), ("bsr status --engine ", 3), ("bsr top --engine l", 3)):
        for _ in range(2):  # the first TAB (no index yet) and the next (from the index)
            got = _complete(words, cword, tmp_path / "cache", BSR_CONFIG=str(cfg))
            want = [p for p in ("prod", "lab") if p.startswith(words.split()[-1] if words[-1] != " " else "")]
            assert got == want, words
