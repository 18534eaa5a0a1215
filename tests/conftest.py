"""Shared test isolation: no user config, no colour, a fixed width, a private state directory."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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


def pytest_configure(config: pytest.Config) -> None:
    # Registered now, not as this conftest's own hook: an xdist worker names each test after its xdist group in its
    # collection hook, registered before this (pluggy calls the hooks registered last first), so the groups must be
    # set by a plugin registered later still; the conftests of tests/unit and below run before it all the same.
    config.pluginmanager.register(_Placement(), "bsr-test-placement")
    if out := os.environ.get("BSR_WRITE_LANE_SECONDS"):
        config.pluginmanager.register(_LaneSeconds(Path(out)), "bsr-lane-seconds")


class _Placement:
    """Marks, skips, xdist groups and order: what the suite's collection adds to the tests it found."""

    @staticmethod
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        _mark_and_place(config, items)


def _mark_and_place(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = _missing_engine_extra()
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("fast") is None:
            item.add_marker(pytest.mark.engine)
        if missing and item.get_closest_marker("engine") is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"needs the engine extra ({', '.join(missing)} not installed: ./scripts/setup)")
            )
    if config.pluginmanager.hasplugin("xdist"):
        _group_for_xdist(items, config.rootpath)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so their collections agree
        # The engine lanes first (stable: in their order otherwise): xdist hands out the tests in this order, so the
        # long lanes start at once and the many short tests fill the other workers meanwhile.
        items.sort(key=lambda item: not _starts_engine(item))


# -- parallel runs (pytest-xdist, `-n N --dist loadgroup`): which tests must share a worker ------------------------

# The tests that start the engine's real stack (a Mooncake master and holder, a process per TP rank, or a session
# engine over them) go to this many xdist groups, "engine lanes", a module at a time: at most this many workers run
# stacks at once, one test each, whatever -n says. A stack takes CPU to start and to restore, so many more lanes than
# the two cores a CI machine has would only make the ranks wait on each other, and a rank kept waiting long enough is
# rightly reported as the host's fault; three keep the cores busy while a lane waits on processes, sockets and
# deadlines (main suite on a quiet 2-core host: 13:04 on two lanes, 11:31 on three, 8:28 on three filled by
# measured time, LANE_SECONDS below). BSR_ENGINE_LANES sets another number. The session engines (~1.3 GB each)
# start once per lane that uses them.
ENGINE_LANES = int(os.environ.get("BSR_ENGINE_LANES", "3"))
SESSION_ENGINES = frozenset({"live_engine", "stalling_engine"})


def _group_for_xdist(items: list[pytest.Item], root: Path) -> None:
    """Mark the tests that must run on one worker with their xdist group; every other test goes to whichever worker
    is free. A test that starts an engine stack: its module's engine lane (a module's tests that share a fixture go
    with them, so the module's stack starts once). Any other test that uses a fixture shared by its module (a class,
    a package): that module's group. Lanes are filled a module at a time, the module with the most engine tests
    first, each to the lane with the fewest so far; every worker computes the same lanes from the same collection."""
    shared = {item: _shared_path(item, root) for item in items}
    unit = {item: shared[item] or item.path.relative_to(root).as_posix() for item in items}
    engine_modules = {item.path for item in items if _starts_engine(item)}
    in_lane = {item for item in items if _starts_engine(item) or (shared[item] and item.path in engine_modules)}
    per_unit = Counter(unit[item] for item in in_lane)
    weight = _lane_weights(per_unit)
    load, lane_of = [0.0] * ENGINE_LANES, {}
    for name in sorted(per_unit, key=lambda n: (-weight[n], n)):
        lane_of[name] = min(range(ENGINE_LANES), key=load.__getitem__)
        load[lane_of[name]] += weight[name]
    for item in items:
        if item in in_lane:
            _join_group(item, f"engine-lane-{lane_of[unit[item]]}")
        elif shared[item] is not None:
            _join_group(item, f"shared:{shared[item]}")


# Each engine module's measured test time (setup, call and teardown, seconds), so that the lanes end together: by
# test count alone the longest lane took 778 s and the shortest 276 s of one run. A module missing here counts as
# its number of tests times the measured modules' mean. Refresh after moving or adding slow engine tests:
# BSR_WRITE_LANE_SECONDS=tests/engine_lane_seconds.json ./scripts/test
LANE_SECONDS = Path(__file__).with_name("engine_lane_seconds.json")


def _lane_weights(per_unit: Counter[str]) -> dict[str, float]:
    """Each lane unit's expected seconds: its modules' measured time, else its test count at the measured mean."""
    measured: dict[str, float] = json.loads(LANE_SECONDS.read_text()) if LANE_SECONDS.is_file() else {}

    def known(name: str) -> float | None:
        hits = [t for m, t in measured.items() if m == name or m.startswith(name + "/")]
        return float(sum(hits)) if hits else None

    seen = {n: t for n in per_unit if (t := known(n)) is not None}
    mean = sum(seen.values()) / sum(per_unit[n] for n in seen) if seen else 1.0
    return {n: seen.get(n, per_unit[n] * mean) for n in per_unit}


class _LaneSeconds:
    """With BSR_WRITE_LANE_SECONDS=FILE: the engine lanes' test time per module, written to FILE at the end (in the
    process that sees every test's report: the xdist controller, or the only one)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "@engine-lane-" in report.nodeid:
            module = report.nodeid.split("::", 1)[0]
            self.seconds[module] = self.seconds.get(module, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput") and self.seconds:
            rounded = {m: round(t) for m, t in sorted(self.seconds.items())}
            self.path.write_text(json.dumps(rounded, indent=1, sort_keys=True) + "\n")


def _join_group(item: pytest.Item, group: str) -> None:
    """Put ``item`` in an xdist group. An xdist worker with ``--dist loadgroup`` tells the scheduler a test's group
    by appending ``@group`` to its node id; pytest-xdist 3.8 does it by setting ``Item._nodeid``, which pytest 9.2
    no longer reads (the id is ``Item._id`` there), so the groups would be dropped without a word. Here the id is
    set where this pytest keeps it; xdist's own renaming, after this, then has nothing left to do."""
    item.add_marker(pytest.mark.xdist_group(group))
    if getattr(item.config.option, "loadgroup", False) and not hasattr(item, "_nodeid"):  # pytest >= 9.2
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(f"{item.nodeid}@{group}")


def _starts_engine(item: pytest.Item) -> bool:
    uses = set(getattr(item, "fixturenames", ()))
    return item.get_closest_marker("engine") is not None or bool(SESSION_ENGINES & uses)


def _shared_path(item: pytest.Item, root: Path) -> str | None:
    """The module (or package) whose shared fixture ``item`` uses, if any."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    scopes = {defs[-1].scope for defs in info.name2fixturedefs.values() if defs}
    path = item.path if scopes & {"module", "class"} else item.path.parent if "package" in scopes else None
    return None if path is None else path.relative_to(root).as_posix()


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
