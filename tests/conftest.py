"""Shared test isolation: no user config, no colour, a fixed width, a private state directory."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bsr_cli.cli.main import run
from bsr_cli.client import local_engine

# The fixtures that start the real stack (Mooncake services, rank processes, an embedded engine). A test that uses
# one is an engine test, whatever its module says; a test that starts a stack in its own body carries
# @pytest.mark.engine itself.
ENGINE_FIXTURES = frozenset(
    {"live_engine", "engine", "mooncake_stack", "private_stack", "store", "hard", "own_engine", "own", "three"}
)
# What the engine extra installs: without it an engine test is skipped, not errored.
_ENGINE_EXTRA = ("torch", "mooncake")


def _missing_engine_extra() -> list[str]:
    return [m for m in _ENGINE_EXTRA if importlib.util.find_spec(m) is None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_engine_extra()
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.engine)
        if missing and item.get_closest_marker("engine") is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"needs the engine extra ({', '.join(missing)} not installed: ./scripts/setup)")
            )


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".state"))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    for var in (
        "BSR_ENGINE",
        "BSR_TOKEN",
        "BSR_STATE_DIR",
        "BSR_CONFIG",
        "BSR_JSON",
        "BSR_TRACEBACK",
        "BSR_DEBUG",
        "BSR_STORE_CLIENT_TTL",
    ):
        monkeypatch.delenv(var, raising=False)


# -- the real embedded engine, shared by the tests that need one ----------------------------------------------------

from pathlib import Path  # noqa: E402


@dataclass
class LiveEngine:
    url: str
    token: str
    state_dir: Path

    def client(self, **kw):
        from bsr_cli.client import AdminClient

        return AdminClient(self.url, self.token, **kw)

    def env(self) -> dict[str, str]:
        return {"BSR_ENGINE": self.url, "BSR_TOKEN": self.token, "BSR_STATE_DIR": str(self.state_dir)}


ENGINE_TEST_SETTINGS = dict(w=4, max_tokens=32_768, faults_enabled=True, fetch_timeout_s=2.0, segment_bytes=3 << 30)


def _engine(tmp_path_factory: pytest.TempPathFactory, name: str, **settings: Any) -> Iterator[LiveEngine]:
    from bsr_cli.engine import supervisor
    from bsr_cli.loaders import builtin_registration

    state = tmp_path_factory.mktemp(name)
    opts = supervisor.EngineOptions(builtin_registration("demo"), **settings)
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        yield LiveEngine(conn[0], conn[1], state)
    finally:
        supervisor.down(state)


@pytest.fixture(scope="session")
def live_engine(tmp_path_factory: pytest.TempPathFactory):
    """One real embedded engine (mooncake_master, segment holder, 2 rank processes, admin API) for the session:
    the demo registration (4 KiB/token/rank), W=4, faults enabled, a 2 s fetch deadline. Always torn down."""
    yield from _engine(tmp_path_factory, "engine", **ENGINE_TEST_SETTINGS)


# A fetch deadline far above any step of a test: an injected stall ("timeout" fault) then holds a restore in flight
# until the test aborts it (an abort ends a stall at once), so a busy machine can never let the window's own deadline
# end the restore before the operator acts.
STALL_HOLDS_S = 150.0


@pytest.fixture(scope="session")
def stalling_engine(tmp_path_factory: pytest.TempPathFactory):
    """A second real engine like ``live_engine`` whose injected stalls last until aborted (started on first use)."""
    settings = {**ENGINE_TEST_SETTINGS, "fetch_timeout_s": STALL_HOLDS_S, "segment_bytes": 1 << 30}
    yield from _engine(tmp_path_factory, "stalling-engine", **settings)


@pytest.fixture
def engine_that_stalls(stalling_engine: LiveEngine) -> Iterator[LiveEngine]:
    """The stalling engine with no faults or markers left over."""
    with stalling_engine.client() as c:
        c.clear_faults()
        c.clear_markers()
    yield stalling_engine
    with stalling_engine.client() as c:
        c.clear_faults()
        c.clear_markers()


@pytest.fixture
def engine(live_engine: LiveEngine, monkeypatch: pytest.MonkeyPatch):
    """The shared engine, with no faults or markers left over, and BSR_* pointing at it."""
    with live_engine.client() as c:
        c.clear_faults()
        c.clear_markers()
    for k, v in live_engine.env().items():
        monkeypatch.setenv(k, v)
    yield live_engine
    with live_engine.client() as c:
        c.clear_faults()
        c.clear_markers()


# -- the CLI, run in-process through its real entry point -------------------------------------------------------------


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)

    def report(self):
        """The command's result as JSON: the document itself, or, when an error came with a result (a restore that
        failed closed, an unhealthy status), the result the one error object carries under ``report``."""
        doc = self.json()
        return doc["report"] if isinstance(doc, dict) and "error" in doc and "report" in doc else doc


@pytest.fixture
def bsr(capsys: pytest.CaptureFixture[str]):
    """Run the real CLI entry point in-process (same error boundary, same output layer)."""

    def call(*args: str) -> Result:
        code = run(list(args))
        cap = capsys.readouterr()
        return Result(code, cap.out, cap.err)

    return call
