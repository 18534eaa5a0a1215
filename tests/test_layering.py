"""The architecture, enforced: the core is pure, and the CLI starts without heavy imports."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

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
FORBIDDEN_AT_STARTUP = {"torch", "textual", "httpx", "mooncake", "lmcache"}


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


# pydantic is not in the list: typer (0.2x) itself requires and imports it.
SERVER_STACK = {"fastapi", "starlette", "uvicorn", "prometheus_client", "bsr_cli.server"}


def test_the_cli_and_its_client_never_import_the_server_stack(tmp_path) -> None:
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
