"""`bsr markers clear --prompt KEY | --tier T | --all`: scoped clears through the real CLI, the admin API and the
coordinator (fake ranks); --all is never done without a confirmation; each marker touched is an event naming its
scope."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.core.events import MarkerCleared
from bsr_cli.core.markers import ClearScope, Marker, clear
from bsr_cli.errors import ExitCode
from bsr_cli.server.admin import AdminServer
from unit.fixtures import FakeEngine, build_engine

TOKEN = "markers-token"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeEngine]:
    eng = build_engine()
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    monkeypatch.setenv("BSR_ENGINE", server.url)
    monkeypatch.setenv("BSR_TOKEN", TOKEN)
    c = eng.coordinator
    c.admission.set_marker("p-moon", {"mooncake"}, "checksum mismatch", "req-1")
    c.admission.set_marker("p-both", {"mooncake", "fs"}, "timeout", "req-2")
    c.admission.set_marker("p-fs", {"fs"}, "missing object", "req-3")
    try:
        yield eng
    finally:
        server.stop()
        for r in eng.ranks:
            r.close()


def _excluded(eng: FakeEngine) -> dict[str, list[str]]:
    return {m.prompt: list(m.excluded_tiers) for m in eng.coordinator.list_markers()}


def _cleared_events(eng: FakeEngine) -> list[MarkerCleared]:
    return [e for e in eng.events.since(0) if isinstance(e, MarkerCleared)]


def test_clear_one_prompt(served: FakeEngine, bsr) -> None:
    r = bsr("markers", "clear", "--prompt", "p-both", "--json")
    assert r.code == 0 and r.json() == {"cleared": 1, "scope": "prompt p-both"}
    assert _excluded(served) == {"p-moon": ["mooncake"], "p-fs": ["fs"]}
    assert [(e.prompt, e.scope, e.prompt) for e in _cleared_events(served)] == [("p-both", "prompt", "p-both")]
    assert bsr("markers", "clear", "--prompt", "p-none", "--json").json()["cleared"] == 0  # nothing of that prompt
    # Any key is a key (a newline or a non-ASCII character in the path is not "no route").
    assert bsr("markers", "clear", "--prompt", "p\nü", "--json").json()["cleared"] == 0


def test_clear_one_tier(served: FakeEngine, bsr) -> None:
    r = bsr("markers", "clear", "--tier", "mooncake")
    assert r.code == 0 and "cleared 2 marker(s) (tier mooncake)" in r.out
    # p-moon is gone; p-both still keeps fs off; p-fs is untouched.
    assert _excluded(served) == {"p-both": ["fs"], "p-fs": ["fs"]}
    events = {e.prompt: e for e in _cleared_events(served)}
    assert set(events) == {"p-moon", "p-both"}
    assert all(e.scope == "tier" and e.tier == "mooncake" for e in events.values())
    assert events["p-both"].excluded_tiers == ("fs",) and events["p-moon"].excluded_tiers is None


def test_clearing_every_marker_needs_a_confirmation(served: FakeEngine, bsr) -> None:
    r = bsr("markers", "clear", "--all")  # not at a terminal, no --yes
    assert r.code == ExitCode.INVALID_INPUT and "--yes" in r.err
    assert len(_excluded(served)) == 3 and _cleared_events(served) == []
    r = bsr("markers", "clear", "--all", "--yes", "--json")
    assert r.code == 0 and r.json()["cleared"] == 3 and _excluded(served) == {}
    assert sorted(e.scope for e in _cleared_events(served)) == ["all"] * 3


@pytest.mark.parametrize(
    "args", [(), ("--prompt", "p-moon", "--tier", "fs"), ("--all", "--yes", "--tier", "fs"), ("--tier", "ssd")]
)
def test_exactly_one_scope(served: FakeEngine, bsr, args: tuple[str, ...]) -> None:
    r = bsr("markers", "clear", *args)
    assert r.code in (ExitCode.INVALID_INPUT, ExitCode.BAD_REQUEST), (r.code, r.err)
    assert len(_excluded(served)) == 3  # nothing cleared


def test_clear_in_core_is_pure_and_scoped() -> None:
    markers = {
        "a": Marker("a", {"mooncake"}, "r", "q"),
        "b": Marker("b", {"mooncake", "fs"}, "r", "q"),
        "c": Marker("c", set(), "rank fault", "q"),
    }
    touched = clear(markers, ClearScope.tier("mooncake"))
    assert [(t.prompt, t.removed, sorted(t.remaining)) for t in touched] == [("a", True, []), ("b", False, ["fs"])]
    assert set(markers) == {"b", "c"}  # a marker that excluded no tier is no tier's to clear
    assert [t.prompt for t in clear(markers, ClearScope.prompt("c"))] == ["c"]
    assert [t.prompt for t in clear(markers, ClearScope.all())] == ["b"] and markers == {}
