"""The Typer application: global options, and every command in one table (`COMMANDS`), in help order.

Command modules define plain functions (and their own sub-groups) and import only typer, the core and
`bsr_cli.cli.context` at start-up; they never import this module. The root imports a command's module only when
that command runs or its help is asked (bsr_cli/cli/lazy.py): `bsr --help` lists the commands from the table's
summaries, and `bsr probe --help` loads the probe's module alone. Anything heavy (rich renderers, the HTTP client,
torch, textual) is imported inside the command function that needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from bsr_cli import __version__
from bsr_cli.cli.context import AppState
from bsr_cli.cli.global_options import GLOBAL_HELP, GLOBAL_OPTIONS, hidden_aliases, hoist_global_options
from bsr_cli.cli.lazy import CommandEntry, LazyCommands, LazyGroup
from bsr_cli.cli.output import Output
from bsr_cli.settings import SettingFlags, load_settings

__all__ = ["COMMANDS", "GLOBAL_OPTIONS", "app", "build_command", "hoist_global_options"]

app = typer.Typer(
    name="bsr",
    cls=LazyGroup,
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
    """The root command: the global options, and every command of `COMMANDS`, each built on first use."""
    import typer.main

    root = typer.main.get_command(app)
    assert isinstance(root, LazyGroup)
    _add_help_epilogs(root, path="")
    root.commands = LazyCommands(COMMANDS, _build_entry)
    return root


def _build_entry(entry: CommandEntry):  # -> click.Command
    """One command or group as the parser sees it, built the way a Typer app builds its commands, with its help's
    epilog (examples, global options) and its options' completions."""
    import typer.main

    host = typer.Typer(
        rich_markup_mode=app.rich_markup_mode,
        pretty_exceptions_short=app.pretty_exceptions_short,
        suggest_commands=app.suggest_commands,
    )
    if entry.group:
        host.add_typer(entry.target(), name=entry.name)
    else:
        host.command(entry.name)(entry.target())
    cmd = typer.main.get_group(host).commands[entry.name]
    _add_help_epilogs(cmd, path=entry.name)
    return cmd


def _add_help_epilogs(cmd, *, path: str) -> None:
    """Each command's help ends with its examples (bsr_cli/cli/examples.py) and the global options."""
    from bsr_cli.cli.completion import completer_for
    from bsr_cli.cli.examples import examples_block

    _convert_plain_values(cmd)
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


def _convert_plain_values(cmd) -> None:
    """A command's options, its help option included (the parser makes that one on first use), convert plain
    values without importing pydantic (bsr_cli/cli/coercion.py)."""
    from bsr_cli.cli.coercion import install_plain_values

    for param in getattr(cmd, "params", []):
        install_plain_values(param)
    make_help_option = cmd.get_help_option

    def get_help_option(ctx):
        option = make_help_option(ctx)
        if option is not None:
            install_plain_values(option)
        return option

    cmd.get_help_option = get_help_option


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


# Every command and command group, in the order of `bsr --help` (commands, then groups): the module under
# bsr_cli/cli/commands/ that defines it, its attribute there, and the first paragraph of its help (what `bsr --help`
# lists without importing the module; tests/cli/test_lazy_commands.py checks it against the command's own help).
COMMANDS = (
    # Commands.
    CommandEntry("rws", "planning", "rws", "Restore working set RWS(W) = W·Σc_i + aux per rank, from a registration."),
    CommandEntry(
        "plan",
        "planning",
        "plan",
        "Dry-run window planning: schedule, committable prefix, first break, peak vs whole-plan; or, with --trace, "
        "L1 per rank and restore latency over a request trace, whole-plan against BSR budgets.",
    ),
    CommandEntry(
        "probe",
        "operate",
        "probe",
        "Probe-only lookup: which rank, group and tier holds each chunk of a prompt. Changes nothing.",
    ),
    CommandEntry(
        "submit",
        "operate",
        "submit",
        "Submit a prompt as the scheduler would admit it: external hit, restore or local prefill, fallback.",
    ),
    CommandEntry(
        "restore",
        "operate",
        "restore",
        "A manual windowed restore into the engine, with live progress.",
    ),
    CommandEntry(
        "inject-fault",
        "operate",
        "inject_fault",
        "Arm a fault for the next restores. Refused unless the engine was started with faults enabled.",
    ),
    CommandEntry(
        "status",
        "operate",
        "status",
        "Engine identity, ranks and their health, tiers, registration, pool and budget, markers, faults.",
    ),
    CommandEntry(
        "drill",
        "operate",
        "drill",
        "The paper's failure matrix against a live engine: injects faults into it (asks first, or --yes). Exit 11 "
        "on any violated invariant.",
    ),
    CommandEntry(
        "abort",
        "incident",
        "abort",
        "Abort a running restore: it fails closed (nothing committed). Exit 2 when the engine knows no such request, "
        "18 when the abort came too late.",
    ),
    CommandEntry(
        "events",
        "incident",
        "events",
        "The engine's events: restores and their windows, failures, markers, faults, restarts. The embedded engine "
        "keeps them in a durable store (by default 7 days, at most 512 MiB), across restarts.",
    ),
    CommandEntry(
        "describe",
        "incident",
        "describe",
        "One request's timeline: per rank and window, when it was fetched, installed and released; the window that "
        "failed (its chunks, the tier and stage blamed, why), the marker it left, the scrubs it started; how it ended.",
    ),
    CommandEntry(
        "explain",
        "explain_cmd",
        "explain",
        "Why a prompt was not reused (or will be): one verdict, the evidence, the fix and the next command.",
    ),
    CommandEntry(
        "scrub",
        "scrub_cmd",
        "scrub",
        "Read a tier's objects back whole and check them: one prompt's, or every object (--all). Damaged objects are "
        "moved aside and the next store rewrites them. Exit 0 clean, 20 damaged objects found, 21 not everything read.",
    ),
    CommandEntry(
        "bundle",
        "bundle_cmd",
        "bundle",
        "Write an incident archive: status, settings, registration, markers, faults, the events of the last hour "
        "(--since) from the engine's event store, pool history, master segments, versions, engine log tails (the "
        "engine's and each rank's failure log included) and `explain` of the prompts given; token ids and secrets "
        "redacted.",
    ),
    CommandEntry(
        "top",
        "top_cmd",
        "top",
        "Live restore-pool monitor: per-rank occupancy vs RWS(W), restores, outcomes, tiers, faults, events.",
    ),
    # Groups.
    CommandEntry(
        "config",
        "config_cmd",
        "config_app",
        "Show resolved settings (flag > BSR_* env > config file > default).",
        group=True,
    ),
    CommandEntry("registration", "planning", "registration_app", "Inspect and compare registrations.", group=True),
    CommandEntry(
        "engine",
        "engine_cmd",
        "engine_app",
        "Run the embedded reference engine: real mooncake_master, a segment holder, one process per TP rank, and "
        "the admin API, all on loopback (or, with --hosts netns, the store and each rank on hosts of their own).",
        group=True,
    ),
    CommandEntry("faults", "operate", "faults_app", "Inject, list or clear faults.", group=True),
    CommandEntry(
        "markers", "operate", "markers_app", "Force-local markers (set after a failed external restore).", group=True
    ),
    CommandEntry(
        "settings",
        "incident",
        "settings_app",
        "The engine's runtime settings: W, budget B, fs concurrency.",
        group=True,
    ),
    CommandEntry(
        "pool",
        "top_cmd",
        "pool_app",
        "Restore-pool occupancy per rank; `bsr pool reset-peak` restarts the peak.",
        group=True,
    ),
    CommandEntry(
        "monitoring", "monitoring_cmd", "monitoring_app", "Prometheus alert rules for bsr engines.", group=True
    ),
    CommandEntry(
        "bench",
        "bench",
        "bench_app",
        "Reproduce the paper's evaluation: each experiment prints a table, writes a JSON evidence bundle and plots. "
        "Against the configured engine, or a dedicated one with --embedded.",
        group=True,
    ),
)
