"""Watching the restore pool: `bsr top` (the live Textual monitor, record/replay) and `bsr pool` (one snapshot).

Both draw the same immutable view (bsr_cli.tui.model, drawn by bsr_cli.tui.panels): `top` panel by panel in a
terminal UI, `pool` once as text or JSON (which imports no renderer). textual is imported only inside `top`, so
every other command starts without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.errors import InvalidInput

IntervalOpt = Annotated[
    float,
    typer.Option("--interval", "-i", help="Seconds between polls (a poll never overlaps the previous).", min=0.05),
]


def top(
    ctx: typer.Context,
    interval: IntervalOpt = 1.0,
    record: Annotated[
        Path | None, typer.Option("--record", help="Also append every snapshot to FILE (gzip JSON lines).")
    ] = None,
    replay: Annotated[
        Path | None, typer.Option("--replay", help="Replay a recording instead of polling an engine.")
    ] = None,
    engines_from: Annotated[
        str | None,
        typer.Option(
            "--engines-from",
            metavar="SOURCE",
            help="Discover a fleet: prometheus://HOST:PORT?job=JOB, dns://NAME:PORT, or a file of engines.",
            show_default=False,
        ),
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Live restore-pool monitor: per-rank occupancy vs RWS(W), restores, outcomes, tiers, faults, events.

    Over a fleet (several --engine, or --engines-from): one row per engine, Enter opens one. With --json: one
    snapshot as JSON instead of the screen (the view `bsr pool --json` prints; over a fleet, `bsr status --json`'s).
    """
    st = state(ctx, json_flag)
    if record is not None and replay is not None:
        raise InvalidInput(
            "give --record or --replay, not both",
            hint="--record FILE records a live session; --replay FILE plays one back",
        )
    if replay is not None and engines_from is not None:
        raise InvalidInput("give --replay or --engines-from, not both", hint="a recording names its own engines")
    from bsr_cli import fleet

    many = fleet.targets(st.settings, engines_from) if replay is None else None
    if st.out.json_mode:
        _top_json(ctx, st, many, record=record, replay=replay)
        return
    if replay is not None:
        from bsr_cli.tui.fleet_app import is_fleet_recording

        if is_fleet_recording(replay):
            from bsr_cli.tui.fleet_app import FleetApp, read_fleet_recording

            rounds = read_fleet_recording(replay)
            _interactive_or_fail()
            FleetApp([], interval=interval, replay=rounds).run()
            return
    if many is not None:
        _interactive_or_fail()
        from bsr_cli.tui.fleet_app import FleetApp, FleetRecorder

        recorder = FleetRecorder(record, len(many)) if record is not None else None
        FleetApp(
            many,
            interval=interval,
            timeout_s=min(st.settings.timeout_s, 5.0),
            memory=fleet.Memory.for_settings(st.settings),
            recorder=recorder,
        ).run()
        if recorder is not None:
            st.out.note(f"recorded {recorder.lines - 1} rounds to {recorder.path} (replay: bsr top --replay {record})")
        return
    _run_tui(st, interval=interval, record=record, replay=replay)


def _top_json(ctx: typer.Context, st: AppState, many: Any, *, record: Path | None, replay: Path | None) -> None:
    """`bsr top --json`: a screen cannot be JSON, so it prints what the screen would show first, once: the view
    model of one engine (as `bsr pool --json`), or a fleet's rows (as `bsr status --json`), with their exit codes."""
    if record is not None or replay is not None:
        raise InvalidInput(
            "--json prints one snapshot; it does not record or replay",
            hint="bsr top --record FILE on a terminal; read a recording back with bsr top --replay FILE",
        )
    if many is not None:
        from bsr_cli.cli.commands.operate import fleet_status

        fleet_status(st, many)
        return
    pool(ctx, once=True, interval=1.0, json_flag=True)


pool_app = typer.Typer(help="Restore-pool occupancy per rank; `bsr pool reset-peak` restarts the peak.")


@pool_app.command("reset-peak")
def pool_reset_peak(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Restart every rank's peak-pool measurement from what is live now (needs the admin token)."""
    from bsr_cli.client import AdminClient

    st = state(ctx, json_flag)
    with AdminClient.from_settings(st.settings) as client:
        client.reset_peak()
        ranks = client.pool()
    data = {"ranks": [{"rank": r.rank, "peak_bytes": (r.pool or {}).get("peak_bytes")} for r in ranks]}
    st.out.result(data, lambda c, d: c.print(f"peak reset on {len(d['ranks'])} rank(s)"))


@pool_app.callback(invoke_without_command=True)
def pool(
    ctx: typer.Context,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit (the default when piped).")] = False,
    interval: IntervalOpt = 1.0,
    json_flag: JsonFlag = False,
) -> None:
    """Restore-pool occupancy per rank with restores, outcomes, tiers, markers and faults.

    Prints one snapshot with --once, --json, or when stdout is not a terminal; otherwise opens `bsr top`.
    """
    if ctx.invoked_subcommand is not None:
        return
    st = state(ctx, json_flag)
    if not (once or st.out.json_mode) and st.out.interactive:
        _run_tui(st, interval=interval, record=None, replay=None)
        return
    from bsr_cli.tui import model
    from bsr_cli.tui.source import LiveSource

    source = LiveSource.from_settings(st.settings, timeout_s=st.settings.timeout_s)
    try:
        frame = source.poll()
    finally:
        source.close()
    view = model.fold(None, frame)

    def render(console: Any, data: Any) -> None:
        # Panels fill the width they are given: piped, that is a fixed page width rather than the unbounded one
        # that keeps tables from wrapping.
        from bsr_cli.tui import panels  # rich, only when a person reads it: --json prints the view model alone

        console.print(panels.render_text(view), width=st.out.layout_width)

    st.out.result(view.to_dict(), render)


def _run_tui(st: AppState, *, interval: float, record: Path | None, replay: Path | None) -> None:
    from bsr_cli.tui.source import LiveSource, Recorder, ReplaySource

    # A bad recording is one clear error before any screen is drawn.
    source = ReplaySource.load(replay) if replay is not None else LiveSource.from_settings(st.settings)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        source.close()
    _interactive_or_fail()
    recorder = Recorder.open(record, source=source.label) if record is not None else None
    from bsr_cli.tui.app import TopApp  # textual is imported here and nowhere on the way to other commands

    TopApp(source, interval=interval, recorder=recorder).run()
    if recorder is not None:
        st.out.note(f"recorded {recorder.lines - 1} polls to {recorder.path} (replay: bsr top --replay {record})")


def _interactive_or_fail() -> None:
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise InvalidInput(
            "bsr top needs an interactive terminal",
            hint="for scripts and pipes use `bsr pool --once` (or `bsr pool --json`); for a fleet, `bsr status`",
        )
