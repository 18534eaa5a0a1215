"""The architecture, enforced: the core is pure, the CLI starts without heavy imports, no two modules import each
other, and no function is longer than a screen."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import bsr_cli.core

FORBIDDEN_IN_CORE = {
    "torch",
    "textual",
    "rich",
    "typer",
    "httpx",
    "yaml",
    "socket",
    "subprocess",
    "mooncake",
    "lmcache",
}
FORBIDDEN_AT_STARTUP = {"torch", "textual", "httpx", "mooncake", "lmcache", "pydantic"}


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return {m.split(".")[0] for m in json.loads(out.stdout.strip().splitlines()[-1])}


def test_core_imports_no_io_or_ui_library() -> None:
    names = [f"bsr_cli.core.{m.name}" for m in pkgutil.iter_modules(bsr_cli.core.__path__)]
    assert len(names) >= 7
    loaded = _modules_after("\n".join(f"import {n}" for n in names))
    assert not (loaded & FORBIDDEN_IN_CORE), loaded & FORBIDDEN_IN_CORE


def test_help_and_planning_import_nothing_heavy() -> None:
    code = (
        "import io, contextlib\n"
        "from bsr_cli.cli.main import run\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    assert run(['--help']) == 0\n"
        "    assert run(['plan', '--W', '32', '--tokens', '524032', '-r', 'paper-mtp-on', '--json']) == 0\n"
        "    assert run(['rws', '-r', 'paper-mtp-on']) == 0\n"
    )
    loaded = _modules_after(code)
    assert not (loaded & FORBIDDEN_AT_STARTUP), loaded & FORBIDDEN_AT_STARTUP


# What no command's help needs: typer (and the click it bundles) is all `bsr X --help` should import beside bsr's
# own modules. pydantic is here too: typer converts option values through it, bsr_cli/cli/coercion.py converts
# plain ones without it, and a help page converts nothing but the global options.
FORBIDDEN_FOR_HELP = {
    "pydantic",
    "httpx",
    "yaml",
    "numpy",
    "rich",
    "torch",
    "textual",
    "mooncake",
    "lmcache",
    "fastapi",
    "uvicorn",
}


def _after_run(*argvs: list[str]) -> set[str]:
    """The modules loaded after running each command line in one process, through the real entry point."""
    runs = "".join(f"    assert run({argv!r}) == 0, {argv!r}\n" for argv in argvs)
    code = "import io, contextlib\nfrom bsr_cli.cli.main import run\nwith contextlib.redirect_stdout(io.StringIO()):\n"
    return _full_modules_after(code + runs)


def _heavy(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules} & FORBIDDEN_FOR_HELP


def _command_modules(modules: set[str]) -> set[str]:
    return {m for m in modules if m.startswith("bsr_cli.cli.commands.")}


def test_bsr_help_loads_no_command() -> None:
    """`bsr --help` lists the commands from the app's table: no command module, nothing heavy."""
    loaded = _after_run(["--help"])
    assert "bsr_cli.cli.app" in loaded
    assert not _command_modules(loaded), _command_modules(loaded)
    assert not _heavy(loaded), _heavy(loaded)


def test_a_command_help_loads_that_command_alone() -> None:
    """`bsr probe --help` loads the probe's module (and what it imports at the top), no other command's, no result
    types of the engine's answers, and nothing heavy."""
    loaded = _after_run(["probe", "--help"])
    assert _command_modules(loaded) == {"bsr_cli.cli.commands.operate"}
    assert not {"bsr_cli.core.results", "bsr_cli.core.status", "bsr_cli.client"} & loaded
    assert not _heavy(loaded), _heavy(loaded)


@pytest.mark.timeout(120)
def test_no_command_help_imports_anything_heavy() -> None:
    """Every command's and group's `--help`, all in one process: still nothing heavy (pydantic included)."""
    from bsr_cli.cli.app import COMMANDS

    loaded = _after_run(
        *[[e.name, "--help"] for e in COMMANDS], ["engine", "up", "--help"], ["bench", "sweep", "--help"]
    )
    assert len(_command_modules(loaded)) >= 10
    assert not _heavy(loaded), _heavy(loaded)


RECORDING = Path(__file__).parent / "tui" / "data" / "incident.jsonl.gz"

# A real loopback HTTP server answering GET /snapshot with one recorded engine snapshot, so the real CLI polls it
# over the wire; then `bsr pool --json` and `bsr describe --record --json` run in the same process.
_SERVE_AND_RUN = """
import io, contextlib, json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
snapshot = open(sys.argv[1], "rb").read()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path.split("?")[0].endswith("/snapshot")
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(snapshot) if ok else 2))
        self.end_headers()
        self.wfile.write(snapshot if ok else b"{}")
    def log_message(self, *a):
        pass
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
from bsr_cli.cli.main import run
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = run(["--engine", f"http://127.0.0.1:{srv.server_port}", "--json", "pool"])
srv.shutdown()
assert code == 0, code
view = json.loads(out.getvalue())
assert view["gauges"] and "info" in view, sorted(view)
with contextlib.redirect_stdout(io.StringIO()) as out2:
    code = run(["describe", sys.argv[2], "--record", sys.argv[3], "--json"])
assert code == 0, code
assert json.loads(out2.getvalue())["request"] == sys.argv[2]
"""


def _rich(modules: set[str]) -> set[str]:
    return {m for m in modules if m == "rich" or m.startswith("rich.")}


@pytest.mark.timeout(120)
def test_json_views_import_no_renderer(tmp_path: Path) -> None:
    """`bsr pool --json` and `bsr describe --json` print the view model (bsr_cli.tui.model) and import no renderer:
    neither the TUI's panels, nor the CLI's render layer, nor any part of rich that bsr itself would pull in.

    httpx imports most of rich on its own whenever rich is installed (its command-line module, `httpx._main`, is
    imported by `import httpx`), so "no rich at all" cannot hold for a command that talks to an engine; what bsr
    must add to it is nothing, and that is what is checked."""
    from bsr_cli.tui.model import Frame
    from bsr_cli.tui.source import read_recording

    _, items = read_recording(RECORDING)
    frame = next(i for i in items if isinstance(i, Frame) and i.snapshot.events)
    events = [e for i in items if isinstance(i, Frame) for e in i.snapshot.events]
    request = next(e["request"] for e in events if e.get("request"))
    snap = tmp_path / "snapshot.json"
    snap.write_text(json.dumps(frame.snapshot.to_wire()))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _SERVE_AND_RUN + "\nprint(json.dumps(sorted(sys.modules)), file=sys.stderr)",
            str(snap),
            request,
            str(RECORDING),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modules = set(json.loads(out.stderr.strip().splitlines()[-1]))
    assert "bsr_cli.tui.model" in modules  # the view was built
    renderers = {m for m in modules if m == "bsr_cli.tui.panels" or m.startswith("bsr_cli.cli.render")}
    assert not renderers and "textual" not in modules, renderers
    httpx_alone = _rich(_full_modules_after("import httpx"))
    assert _rich(modules) <= httpx_alone, _rich(modules) - httpx_alone


def _full_modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# pydantic is not in the list: it is a base dependency (the bench bundles' models), and typer imports it to convert
# an option value that is not plain (bsr_cli/cli/coercion.py).
SERVER_STACK = {"fastapi", "starlette", "uvicorn", "prometheus_client", "bsr_cli.server"}


def test_the_cli_and_its_client_never_import_the_server_stack(tmp_path: Path) -> None:
    """The admin API's framework (bsr_cli/server) is the engine's: `bsr --help`, `bsr plan`, `bsr status --json`
    against no engine at all, and the client library load none of it."""
    code = (
        "import io, os, contextlib\n"
        f"os.environ['BSR_STATE_DIR'] = {str(tmp_path)!r}\n"
        "os.environ.pop('BSR_ENGINE', None)\n"
        "from bsr_cli.cli.main import run\n"
        "import bsr_cli.client\n"
        "from bsr_cli.client import AdminClient\n"
        "buf, err = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):\n"
        "    assert run(['--help']) == 0\n"
        "    assert run(['plan', '--W', '32', '--tokens', '524032', '-r', 'paper-mtp-on', '--json']) == 0\n"
        "    assert run(['status', '--json']) != 0\n"  # nothing runs there: a clean error, not a server import
    )
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "bsr_cli.client.admin" in loaded  # the probe ran
    hits = {m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER_STACK)}
    assert not hits, hits


def test_no_two_top_level_modules_import_each_other() -> None:
    """The static import graph (lazy imports included) has no cycle between two of bsr_cli's top-level modules:
    what two layers share lives in the lower one. import-linter's `layers` contract states the order; this names the
    cycle itself when one comes back."""
    grimp = pytest.importorskip("grimp")  # ships with import-linter (the dev extra)
    graph = grimp.build_graph("bsr_cli")
    tops = sorted({".".join(m.split(".")[:2]) for m in graph.modules if m != "bsr_cli"})
    assert {"bsr_cli.cli", "bsr_cli.tui", "bsr_cli.incident_bundle", "bsr_cli.core"} <= set(tops)
    cycles = []
    for n, a in enumerate(tops):
        for b in tops[n + 1 :]:
            there = graph.find_shortest_chains(importer=a, imported=b, as_packages=True)
            back = graph.find_shortest_chains(importer=b, imported=a, as_packages=True)
            if there and back:
                cycles.append((sorted(there)[0], sorted(back)[0]))
    assert not cycles, cycles


# Circles of modules that still import each other, each named with why it is allowed for now. A circle found that is
# not here fails the test, and so does one listed here that is gone (then its line goes). None is allowed today.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def _module_names(packages: list[Path]) -> dict[str, Path]:
    """Every module of ``packages`` (each the folder of a top-level package) by its dotted name."""
    names = {}
    for package in packages:
        for path in package.rglob("*.py"):
            parts = (package.name, *path.relative_to(package).with_suffix("").parts)
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement in ``module`` imports: a module, or a name in one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's own package, one level up per dot past the first
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` an imported name is in: its longest prefix that is one (``pkg.mod.f``: pkg.mod);
    None for a name from outside them."""
    parts = name.split(".")
    return next((m for n in range(len(parts), 0, -1) if (m := ".".join(parts[:n])) in modules), None)


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports anywhere in its source: at the top, inside a function, or for type
    checking alone (each is an edge a layer order must respect)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        imports = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import | ast.ImportFrom)]
        names = {name for node in imports for name in _imported(node, module, is_package)}
        graph[module] = {m for name in names if (m := _module_of(name, modules)) is not None and m != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The import circles of ``graph``: each set of modules that reach one another through their imports."""
    reach = {}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            if (module := todo.pop()) not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        reach[start] = seen
    return {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph if m in reach[m]}


def test_no_module_imports_one_that_imports_it_back() -> None:
    """No import circle among bsr_cli's and the plugins' modules, lazy and type-checking imports included: of two
    modules, the lower never imports the higher, so either can be read, tested and changed without the other."""
    repo = Path(bsr_cli.__file__).resolve().parents[1]
    plugins = sorted(p.parent for p in (repo / "plugins").glob("*/__init__.py"))
    modules = _module_names([repo / "bsr_cli", *plugins])
    assert {"bsr_cli.bench.evidence", "bsr_cli.api.ranks", "lmcache_bsr.host", "vllm_bsr.connector"} <= set(modules)
    found = _circles(_import_graph(modules))
    assert not found - KNOWN_CIRCLES, "import circles: " + "; ".join(
        ", ".join(sorted(c)) for c in found - KNOWN_CIRCLES
    )
    assert not KNOWN_CIRCLES - found, f"gone, remove from KNOWN_CIRCLES: {[sorted(c) for c in KNOWN_CIRCLES - found]}"


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """The check can fail: in a small package, a module importing back (inside a function, or relatively) the one
    that imports it is found, with every module on the circle and none beside it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg.high import g\n",  # the lower module importing back, lazily
        "high.py": "from pkg.mid import h\n",
        "mid.py": "import pkg.low\n",
        "leaf.py": "from pkg import low\n",  # imports the circle, is not on it
        "sub/__init__.py": "from . import a\n",
        "sub/a.py": "from .. import leaf\nfrom . import b\n",
        "sub/b.py": "from pkg.sub.a import x\n",  # a and b: a circle through relative imports
    }
    for name, source in files.items():
        (pkg / name).write_text(source)
    graph = _import_graph(_module_names([pkg]))
    assert graph["pkg.low"] == {"pkg.high"} and graph["pkg.sub.a"] == {"pkg.leaf", "pkg.sub.b"}
    assert _circles(graph) == {frozenset({"pkg.low", "pkg.high", "pkg.mid"}), frozenset({"pkg.sub.a", "pkg.sub.b"})}
    (pkg / "low.py").write_text("def f():\n    pass\n")
    (pkg / "sub" / "b.py").write_text("X = 1\n")
    assert _circles(_import_graph(_module_names([pkg]))) == set()


MAX_FUNCTION_LINES = 80  # a function longer than a screen is split into named steps


def _longer_than(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``module:function (lines)`` for every function in ``source`` longer than ``limit`` lines, decorators aside."""
    return [
        f"{name}:{node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_longer_than_80_lines() -> None:
    repo = Path(bsr_cli.__file__).resolve().parents[1]
    files = sorted((repo / "bsr_cli").rglob("*.py")) + sorted((repo / "plugins").rglob("*.py"))
    assert len(files) > 50, "the walk found the project's modules"
    long = [hit for f in files for hit in _longer_than(f.read_text(), str(f.relative_to(repo)))]
    assert not long, f"split these into named steps: {long}"
    # The count can fail: a function one line over the limit is found.
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _longer_than(f"def f():\n{body}", "m") == [f"m:f ({MAX_FUNCTION_LINES + 1})"]
    assert _longer_than(f"def f():\n{body[: body.rindex('    x')]}", "m") == []
