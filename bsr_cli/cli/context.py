"""What every command shares: the resolved settings and output of this invocation, and the --json flag.

Command modules import this, never `bsr_cli.cli.app`: the app imports the command modules and registers their
functions (explicitly, in app.py), so nothing imports the app back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from bsr_cli.cli.output import Output
from bsr_cli.settings import SettingFlags, Settings, load_settings

__all__ = ["AppState", "JsonFlag", "state"]


@dataclass
class AppState:
    settings: Settings
    out: Output


JsonFlag = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]


def state(ctx: typer.Context, json_flag: bool = False) -> AppState:
    """The resolved settings and output for a command; a command-level --json overrides the global one."""
    root = ctx.find_root()
    st: AppState | None = root.obj if isinstance(root.obj, AppState) else None
    if st is None:  # invoked without the global callback (tests calling a command directly)
        st = AppState(load_settings(SettingFlags()), Output(json_mode=False))
        root.obj = st
    if json_flag and not st.out.json_mode:
        st.settings.json = True
        st.out = Output(json_mode=True)
    return st
