"""Every alert has a runbook, and every bsr command a runbook tells an operator to run exists: its command path, and
each option it passes (a command's own, or a global one). Parsed against the real CLI tree, nothing is run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from bsr_cli.cli.commands.monitoring_cmd import DEFAULT_RUNBOOK_BASE
from bsr_cli.cli.global_options import GLOBAL_OPTIONS

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docs" / "monitoring" / "bsr-alerts.yml"
RUNBOOKS = REPO / "docs" / "runbooks"
# Options of `bsr markers clear` added by the scoped-clear change (`--prompt KEY | --tier T | --all`), developed on
# its own branch; the runbooks already name them. Drop this once that change is merged.
PENDING_OPTIONS = {("markers", "clear"): {"--prompt", "--tier", "--all", "--yes"}}


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _commands(page: Path) -> list[str]:
    """The bsr commands on a page: lines of its sh blocks and inline code spans that start with `bsr `."""
    text = page.read_text()
    found: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        found += [ln.split("  #", 1)[0].strip() for ln in block.splitlines() if ln.strip().startswith("bsr ")]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [m.strip() for m in re.findall(r"`(bsr [^`]+)`", prose)]
    return found


def test_every_alert_names_a_runbook_page_that_exists() -> None:
    alerts = _alerts()
    assert len(alerts) >= 8
    for rule in alerts:
        url = rule.get("annotations", {}).get("runbook_url")
        assert url, f"{rule['alert']} has no runbook_url"
        # An absolute link an alert can carry: the default base of `bsr monitoring rules`, then the page's name.
        base, _, name = url.rpartition("/")
        assert base == DEFAULT_RUNBOOK_BASE, f"{rule['alert']}: {url} is not under {DEFAULT_RUNBOOK_BASE}"
        page = RUNBOOKS / name
        assert page.is_file() and page.parent == RUNBOOKS, f"{rule['alert']}: {url} is not a page of docs/runbooks"
        assert rule["alert"] in page.read_text().splitlines()[0], f"{url} is not {rule['alert']}'s page"
        assert _commands(page), f"{url} walks no bsr command"


@pytest.mark.parametrize("page", sorted(RUNBOOKS.glob("*.md")), ids=lambda p: p.name)
def test_every_bsr_command_of_a_runbook_exists_with_its_options(page: Path) -> None:
    from bsr_cli.cli.app import build_command

    root = build_command()  # typer's own click: a group is what has `commands`
    for line in _commands(page):
        words = shlex.split(line, comments=True)[1:]
        cmd: Any = root
        path: list[str] = []
        while hasattr(cmd, "commands") and words and not words[0].startswith("-"):
            sub = cmd.commands.get(words[0])
            assert sub is not None, f"{page.name}: `{line}`: no command `bsr {' '.join([*path, words[0]])}`"
            cmd, path, words = sub, [*path, words.pop(0)], words
        runs = not hasattr(cmd, "commands") or getattr(cmd, "invoke_without_command", False)
        assert runs, f"{page.name}: `{line}` names a group that does nothing by itself"
        known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
        known |= set(GLOBAL_OPTIONS) | PENDING_OPTIONS.get((path[0], path[-1]) if path else ("", ""), set())
        for word in words:
            if word.startswith("-"):
                assert word.split("=", 1)[0] in known, f"{page.name}: `{line}`: `bsr {' '.join(path)}` has no {word}"
