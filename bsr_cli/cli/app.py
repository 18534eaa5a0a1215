"""The Typer application, global options, and the shared per-command context.

Command modules import only typer, the core and this module at start-up; anything heavy (rich renderers, the
HTTP client, torch, textual) is imported inside the command function that needs it, so `bsr --help` and the
planning commands stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from bsr_cli import __version__
from bsr_cli.cli.global_options import GLOBAL_HELP, GLOBAL_OPTIONS, hoist_global_options
from bsr_cli.cli.output import Output
from bsr_cli.settings import Settings, load_settings

__all__ = ["GLOBAL_OPTIONS", "AppState", "JsonFlag", "app", "build_command", "hoist_global_options", "state"]

app = typer.Typer(
    name="bsr",
    help="Operations CLI and restore debugger for bounded-state restoration (BSR) of LLM KV state.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; generated copies live in completions/
    pretty_exceptions_enable=False,  # the error boundary in main.py reports errors, in one line
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)


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
        st = AppState(load_settings({}), Output(json_mode=False))
        root.obj = st
    if json_flag and not st.out.json_mode:
        st.settings.json = True
        st.out = Output(json_mode=True)
    return st


def _version(value: bool) -> None:
    if value:
        if Output.json_requested:  # --version is eager: it runs before --json is parsed
            import json

            typer.echo(json.dumps({"version": __version__}))
        else:
            typer.echo(f"bsr {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    json_flag: Annotated[bool, typer.Option("--json", help="Print results as JSON (env BSR_JSON).")] = False,
    traceback: Annotated[
        bool,
        typer.Option("--traceback", help="Show the stack trace on errors (env BSR_TRACEBACK, BSR_DEBUG)."),
    ] = False,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            "-e",
            help="Engine admin URL or profile name (env BSR_ENGINE); several, comma-separated or repeated, make "
            "`status` and `top` show a fleet.",
        ),
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="Admin token (env BSR_TOKEN).", show_default=False)
    ] = None,
    state_dir: Annotated[
        Path | None, typer.Option("--state-dir", help="Embedded engine state directory (env BSR_STATE_DIR).")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", help="Config file (env BSR_CONFIG).")] = None,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", help="Deadline in seconds for engine calls (env BSR_TIMEOUT)."),
    ] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    flags = {
        "json": json_flag or None,
        "traceback": traceback or None,
        "engine": engine,
        "token": token,
        "state_dir": state_dir,
        "config": config,
        "timeout_s": timeout,
    }
    # The error boundary needs --traceback even if settings fail to load.
    ctx.meta["bsr.traceback"] = traceback
    settings = load_settings(flags)
    ctx.obj = AppState(settings, Output(json_mode=settings.json))


def build_command():  # -> click.Command; typed loosely so this module does not import click at type-check time
    """The root command with every command group attached, and the global options named in each command's help."""
    import typer.main

    register_commands()
    root = typer.main.get_command(app)
    _add_help_epilogs(root, path="")
    return root


def _add_help_epilogs(cmd, *, path: str) -> None:
    """Each command's help ends with its examples (bsr_cli/cli/examples.py) and the global options."""
    from bsr_cli.cli.completion import completer_for
    from bsr_cli.cli.examples import examples_block

    for param in getattr(cmd, "params", []):
        complete = completer_for(list(param.opts))
        if complete is not None:
            param._custom_shell_complete = complete  # TAB offers the option's known values
    if path:
        parts = [p for p in (cmd.epilog, examples_block(path), GLOBAL_HELP) if p]
        cmd.epilog = "\n\n".join(parts)
    for param in getattr(cmd, "params", []):
        if param.param_type_name == "argument" and param.metavar:
            # A named argument reads `BUNDLE...`, not `BUNDLE... <list[Path]>` (the annotation's Python spelling).
            param.display_type_rich = lambda ctx: None
    for name, sub in getattr(cmd, "commands", {}).items():
        _add_help_epilogs(sub, path=f"{path} {name}".strip())


def register_commands() -> None:
    """Attach every command group (import order = help order)."""
    from bsr_cli.cli.commands import config_cmd, planning  # noqa: F401

    for optional in ("engine_cmd", "operate", "incident", "explain_cmd", "bundle_cmd", "top_cmd"):
        try:
            __import__(f"bsr_cli.cli.commands.{optional}")
        except ModuleNotFoundError as e:
            if e.name != f"bsr_cli.cli.commands.{optional}":
                raise
    from bsr_cli.cli.commands.bench import bench_app

    app.add_typer(bench_app, name="bench")
