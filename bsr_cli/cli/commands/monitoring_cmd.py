"""`bsr monitoring rules`: the Prometheus alert rules for bsr engines, each alert's `runbook_url` an absolute link
built from the base URL where the runbooks (docs/runbooks/) are served.

The rules are packaged (bsr_cli/data/bsr-alerts.yaml, the base written as ``${RUNBOOK_BASE}``); the copy in
docs/monitoring/bsr-alerts.yml is this command's output with the default base (a test keeps the two equal).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

monitoring_app = typer.Typer(help="Prometheus alert rules for bsr engines.", no_args_is_help=True)

# An absolute URL that resolves nowhere (.invalid is reserved for that): a deployment says where its runbooks are.
DEFAULT_RUNBOOK_BASE = "https://bsr-runbooks.invalid/runbooks"
PLACEHOLDER = "${RUNBOOK_BASE}"


@dataclass(frozen=True)
class AlertRules:
    """`bsr monitoring rules`: the rules file, the base its runbook links start with, its alerts, where it went."""

    runbook_base: str
    alerts: tuple[str, ...]
    written: str | None  # the file written; None: printed
    rules: str

    to_wire = wire.writer()


def runbook_base(url: str) -> str:
    """``url`` as the base of every runbook link: an absolute http(s) URL with a host, no query or fragment, its
    trailing slash dropped."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise InvalidInput(
            f"--runbook-base {url!r} is not an absolute http(s) URL",
            hint="give where docs/runbooks/ is served, e.g. https://wiki.example.com/bsr/runbooks",
        )
    return url.strip().rstrip("/")


def alert_rules(base: str = DEFAULT_RUNBOOK_BASE) -> str:
    """The rules file with every runbook link under ``base`` (already checked by ``runbook_base``)."""
    template = resources.files("bsr_cli.data").joinpath("bsr-alerts.yaml").read_text()
    return template.replace(PLACEHOLDER, base)


@monitoring_app.command("rules")
def rules(
    ctx: typer.Context,
    base: Annotated[
        str,
        typer.Option(
            "--runbook-base",
            metavar="URL",
            help="Where the runbooks (docs/runbooks/) are served: each alert's runbook_url is URL/<page>.md.",
        ),
    ] = DEFAULT_RUNBOOK_BASE,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the rules to FILE instead of printing them.")
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """The Prometheus alert rules for bsr engines, with absolute runbook links (promtool check rules FILE)."""
    st = state(ctx, json_flag)
    url = runbook_base(base)
    text = alert_rules(url)
    if output is not None:
        _write(output, text)
    if url == DEFAULT_RUNBOOK_BASE:
        st.out.warn(f"runbook links point at the placeholder {url}; pass --runbook-base URL where yours are served")
    result = AlertRules(url, tuple(re.findall(r"^\s*- alert: (\S+)$", text, re.M)), _shown(output), text)

    def render(console: Any, r: AlertRules) -> None:
        if r.written is None:
            console.file.write(r.rules)
        else:
            console.print(f"wrote {len(r.alerts)} alert rules to {r.written} (runbooks under {r.runbook_base})")

    st.out.result(result, render)


def _shown(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a half-written rules file is never left where Prometheus reads it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InvalidInput(
            f"cannot write {path}: {e.strerror or e}",
            hint="give -o a path you can write (the directory Prometheus reads its rule files from), or omit -o",
        ) from None
