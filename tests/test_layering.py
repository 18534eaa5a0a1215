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
