"""The Typer application: global options, and every command registered explicitly (`register_commands`).

Command modules define plain functions (and their own sub-groups) and import only typer, the core and
`bsr_cli.cli.context` at start-up; they never import this module, which imports them. Anything heavy (rich
renderers, the HTTP client, torch, textual) is imported inside the command function that needs it, so `bsr --help`
and the planning commands stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bsr_cli import __version__
from bsr_cli.cli.context import AppState
from bsr_cli.cli.global_options import GLOBAL_HELP, GLOBAL_OPTIONS, hidden_aliases, hoist_global_options
from bsr_cli.cli.output import Output
from bsr_cli.settings import SettingFlags, load_settings

__all__ = ["GLOBAL_OPTIONS", "app", "build_command", "hoist_global_options", "register_commands"]

app = typer.Typer(
    name="bsr",
    help="Operations CLI and restore debugger for bounded-state restoration (BSR) of LLM KV state.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; generated copies live in completions/
    pretty_exceptions_enable=False,  # the error boundary in main.py reports errors, in one line
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)


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
    flags = SettingFlags(
        json=json_flag or None,
        traceback=traceback or None,
        engine=engine,
        token=token,
        state_dir=state_dir,
        config=config,
        timeout_s=timeout,
    )
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
        aliases = hidden_aliases(list(param.opts))
        if aliases:
            _hide_aliases(param, aliases)
    if path:
        parts = [p for p in (cmd.epilog, examples_block(path), GLOBAL_HELP) if p]
        cmd.epilog = "\n\n".join(parts)
    for param in getattr(cmd, "params", []):
        if param.param_type_name == "argument" and param.metavar:
            # A named argument reads `BUNDLE...`, not `BUNDLE... <list[Path]>` (the annotation's Python spelling).
            param.display_type_rich = lambda ctx: None
    for name, sub in getattr(cmd, "commands", {}).items():
        _add_help_epilogs(sub, path=f"{path} {name}".strip())


def _hide_aliases(param, aliases: list[str]) -> None:
    """Keep accepting an option's old spellings while help, completion and error messages show only its canonical
    name: the parser is the one place that reads the full list (global_options.HIDDEN_ALIASES)."""
    param.opts = [o for o in param.opts if o not in aliases]
    add_visible = param.add_to_parser

    def add_to_parser(parser, ctx) -> None:
        visible = param.opts
        param.opts = [*visible, *aliases]
        try:
            add_visible(parser, ctx)
        finally:
            param.opts = visible

    param.add_to_parser = add_to_parser


_registered = False


def register_commands() -> None:
    """Attach every command and command group, once. The order here is the order of `bsr --help` (commands,
    then groups); a new command is one line in its place."""
    global _registered
    if _registered:
        return
    _registered = True
    from bsr_cli.cli.commands import (
        bundle_cmd,
        config_cmd,
        engine_cmd,
        explain_cmd,
        incident,
        monitoring_cmd,
        operate,
        planning,
        top_cmd,
    )
    from bsr_cli.cli.commands.bench import bench_app

    # Commands.
    app.command("rws")(planning.rws)
    app.command("plan")(planning.plan)
    app.command("probe")(operate.probe)
    app.command("submit")(operate.submit)
    app.command("restore")(operate.restore)
    app.command("inject-fault")(operate.inject_fault)
    app.command("status")(operate.status)
    app.command("drill")(operate.drill)
    app.command("abort")(incident.abort)
    app.command("events")(incident.events)
    app.command("describe")(incident.describe)
    app.command("explain")(explain_cmd.explain)
    app.command("bundle")(bundle_cmd.bundle)
    app.command("top")(top_cmd.top)
    # Groups.
    app.add_typer(config_cmd.config_app, name="config")
    app.add_typer(planning.registration_app, name="registration")
    app.add_typer(engine_cmd.engine_app, name="engine")
    app.add_typer(operate.faults_app, name="faults")
    app.add_typer(operate.markers_app, name="markers")
    app.add_typer(incident.settings_app, name="settings")
    app.add_typer(top_cmd.pool_app, name="pool")
    app.add_typer(monitoring_cmd.monitoring_app, name="monitoring")
    app.add_typer(bench_app, name="bench")
