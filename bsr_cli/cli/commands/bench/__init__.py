"""`bsr bench`: the paper's evaluation against an engine, one subcommand per experiment, and its bundles.

Each experiment prints a table (or the bundle with --json), writes its evidence bundle to --output (validated against
docs/bench-schema.json) and redraws the plots the bundles there allow. By default it measures the engine the
global options name (--engine, BSR_ENGINE, or the embedded engine of the state directory); --embedded starts a
dedicated embedded engine sized for the experiment in a temporary directory and stops it afterwards. The ladder
always restarts its own embedded engine, once per capacity rung.

Subcommands are registered here, explicitly, in help order: a new experiment adds its command function (next to
the others in ``experiments``, or in a module of its own), one line below, and its table in
``bsr_cli.cli.render.bench.TABLES``.
"""

from __future__ import annotations

import typer

from bsr_cli.cli.commands.bench import bundles, cpu_bound, experiments, trace

bench_app = typer.Typer(
    help="Reproduce the paper's evaluation: each experiment prints a table, writes a JSON evidence bundle and "
    "plots. Against the configured engine, or a dedicated one with --embedded.",
    no_args_is_help=True,
)

bench_app.command("sweep")(experiments.sweep)
bench_app.command("ladder")(experiments.ladder)
bench_app.command("wlaw")(experiments.wlaw)
bench_app.command("fs-concurrency")(experiments.fs_concurrency)
bench_app.command("store")(experiments.store)
bench_app.command("failures")(experiments.failures)
bench_app.command("peer")(experiments.peer)
bench_app.command("cpu-bound")(cpu_bound.cpu_bound)
bench_app.command("trace")(trace.trace)
bench_app.command("plot")(bundles.plot)
bench_app.command("validate")(bundles.validate)
bench_app.command("schema")(bundles.schema)
bench_app.command("show")(bundles.show)

__all__ = ["bench_app"]
