"""What an on-call engineer reaches for beside probe and restore, without raw HTTP: runtime settings, aborting a
request, the event log (tail and follow), and one request's per-rank, per-window timeline (live or recorded)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.cli.output import Output
from bsr_cli.core.commit import COMMITTED
from bsr_cli.errors import InvalidInput

settings_app = typer.Typer(help="The engine's runtime settings: W, budget B, fs concurrency.", no_args_is_help=True)

# What `settings show` lists, in the order an operator checks them.
SETTING_KEYS = (
    "W",
    "rws_bytes",
    "budget_bytes",
    "pool_bytes",
    "fs_concurrency",
    "fetch_timeout_s",
    "tiers",
    "max_tokens",
    "kv_tokens",
    "faults_enabled",
)


def _client(st: AppState) -> Any:
    from bsr_cli.client import AdminClient

    return AdminClient.from_settings(st.settings)


def _settings_of(info: dict[str, Any]) -> dict[str, Any]:
    return {k: info.get(k) for k in SETTING_KEYS if k in info}


def _render_settings(console: Any, d: dict[str, Any]) -> None:
    from rich.table import Table

    from bsr_cli.core.units import format_bytes

    t = Table()
    t.add_column("setting")
    t.add_column("value")
    for k, v in d["settings"].items():
        if k.endswith("_bytes") and isinstance(v, int):
            shown = f"{format_bytes(v)} ({v:,} B)"
        elif isinstance(v, list):
            shown = ", ".join(map(str, v)) or "—"
        elif isinstance(v, bool):
            shown = "yes" if v else "no"
        elif isinstance(v, int):
            shown = f"{v:,}"
        else:
            shown = "—" if v is None else str(v)
        t.add_row(k, shown)
    console.print(t)


@settings_app.command("show")
def settings_show(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """The engine's settings as it runs now."""
    st = state(ctx, json_flag)
    with _client(st) as client:
        info = client.info()
    st.out.result({"url": client.url, "settings": _settings_of(info)}, _render_settings)


@settings_app.command("set")
def settings_set(
    ctx: typer.Context,
    w: Annotated[
        int | None, typer.Option("--W", "-W", "--window-size", help="Window size in chunks (0 = whole plan).", min=0)
    ] = None,
    budget: Annotated[
        str | None, typer.Option("--budget", help="Admission budget B per rank, e.g. 64MiB or 67108864.")
    ] = None,
    fs_concurrency: Annotated[
        int | None, typer.Option("--fs-concurrency", help="Parallel reads from the fs tier.", min=1)
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Change runtime settings (needs the admin token); prints the settings as they now stand."""
    from bsr_cli.core.units import parse_bytes

    st = state(ctx, json_flag)
    changes: dict[str, Any] = {}
    if w is not None:
        changes["W"] = w
    if budget is not None:
        changes["budget_bytes"] = parse_bytes(budget)
    if fs_concurrency is not None:
        changes["fs_concurrency"] = fs_concurrency
    if not changes:
        raise InvalidInput("nothing to set", hint="give --W, --budget or --fs-concurrency")
    with _client(st) as client:
        info = client.update_settings(**changes)
    st.out.result({"url": client.url, "changed": sorted(changes), "settings": _settings_of(info)}, _render_settings)


def abort(
    ctx: typer.Context,
    request: Annotated[str, typer.Argument(help="Request id (from `bsr restore`, `bsr events`, `bsr top`).")],
    json_flag: JsonFlag = False,
) -> None:
    """Abort a running restore: it fails closed (nothing committed). Exit 2 when no such request is running."""
    st = state(ctx, json_flag)
    with _client(st) as client:
        result = client.abort(request)
    if not result.get("aborting"):
        raise InvalidInput(f"no running request {request!r} on this engine", hint="`bsr events` lists recent ones")
    st.out.result(result, lambda c, d: c.print(f"abort requested for {d['request']}: it will fail closed"))


def events(
    ctx: typer.Context,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")] = False,
    since: Annotated[int, typer.Option("--since", help="Only events after this sequence number.", min=0)] = 0,
    request: Annotated[str | None, typer.Option("--request", help="Only this request's events.")] = None,
    limit: Annotated[
        int, typer.Option("--limit", "-n", help="Show at most the last N events (without -f).", min=1)
    ] = 50,
    json_flag: JsonFlag = False,
) -> None:
    """The engine's event log: windows fetched/installed/released, failures, markers, faults.

    With --json: one document {events, last_seq}; with --json -f, one JSON line per event (NDJSON).
    """
    st = state(ctx, json_flag)
    with _client(st) as client:
        if not follow:
            every, last_seq = client.held_events(since)
            evs = [e for e in every if request is None or e.get("request") == request][-limit:]
            if st.out.json_mode:
                st.out.result({"events": evs, "last_seq": last_seq})
            else:
                _print_events(st, evs)
            return
        seq = since
        while True:  # Ctrl-C ends it (exit 130 through the error boundary)
            got = client.events(since=seq, wait_s=10.0)
            evs = got.get("events", [])
            if evs:
                seq = int(evs[-1].get("seq", seq))
            elif int(got.get("last_seq") or 0) < seq:  # the engine restarted: its sequence starts again
                seq = 0
                _say_restart(st)
                continue
            _print_events(st, [e for e in evs if request is None or e.get("request") == request])


def _print_events(st: AppState, evs: list[dict[str, Any]]) -> None:
    import json
    import sys

    if st.out.json_mode:
        for e in evs:
            sys.stdout.write(json.dumps(e) + "\n")
        sys.stdout.flush()
        Output.result_written = True  # the error boundary adds no second document (e.g. on Ctrl-C)
        return
    from bsr_cli.tui.model import describe_event

    for e in evs:
        stamp = time.strftime("%H:%M:%S", time.localtime(float(e.get("time", 0))))
        rank = f" r{e['rank']}" if isinstance(e.get("rank"), int) else ""
        st.out.console.print(f"{e.get('seq', ''):>6} {stamp}{rank} {describe_event(e)}", highlight=False, markup=False)


def _say_restart(st: AppState) -> None:
    if st.out.json_mode:
        return
    st.out.console.print("──── engine restarted: sequence numbers start again ────", markup=False)


def describe(
    ctx: typer.Context,
    request: Annotated[str, typer.Argument(help="Request id.")],
    record: Annotated[
        Path | None, typer.Option("--record", help="Read a `bsr top --record` file instead of the live engine.")
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """One request's timeline: per rank and window, when it was fetched, installed and released, and how it ended."""
    st = state(ctx, json_flag)
    if record is not None:
        evs = _recorded_events(record)
        where = str(record)
    else:
        with _client(st) as client:
            evs, _ = client.held_events(0)
            where = client.url
    mine = [e for e in evs if e.get("request") == request]
    if not mine:
        raise InvalidInput(
            f"no events of request {request!r} in {where}",
            hint="the engine keeps its last events only; `bsr events` lists what it has",
        )
    st.out.result(timeline(request, mine), _render_timeline)


def _recorded_events(path: Path) -> list[dict[str, Any]]:
    from bsr_cli.tui.model import Frame
    from bsr_cli.tui.source import read_recording

    _, items = read_recording(path)
    seen: dict[tuple[float, int], dict[str, Any]] = {}
    for item in items:
        if isinstance(item, Frame):
            for e in item.snapshot.get("events") or ():
                # Frames overlap; an engine restart reuses sequence numbers, so key by (started_at, seq).
                seen[(float(item.snapshot.get("started_at") or 0), int(e.get("seq", 0)))] = dict(e)
    return [seen[k] for k in sorted(seen)]


def timeline(request: str, evs: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold one request's events into per-(rank, window) rows and an outcome."""
    t0 = min(float(e.get("time", 0)) for e in evs)
    windows: dict[tuple[int, int], dict[str, Any]] = {}
    outcome: dict[str, Any] = {"state": "in progress"}
    failures: list[dict[str, Any]] = []
    for e in sorted(evs, key=lambda e: (float(e.get("time", 0)), int(e.get("seq", 0)))):
        kind, at = str(e.get("type")), round(float(e.get("time", 0)) - t0, 6)
        rank, win = e.get("rank"), e.get("window")
        if isinstance(rank, int) and isinstance(win, int) and kind.startswith("window_"):
            row = windows.setdefault((rank, win), {"rank": rank, "window": win + 1})
            row[kind.removeprefix("window_")] = at
            if kind == "window_fetched":
                row["bytes"] = e.get("bytes")
                row["tiers"] = e.get("tiers")
                row["fetch_s"] = e.get("seconds")
        elif kind == "restore_failed":
            failures.append(
                {
                    "rank": rank,
                    "window": (win + 1) if isinstance(win, int) else None,
                    "at": at,
                    "reason": e.get("reason"),
                }
            )
        elif kind == "restore_committed":
            outcome = {"state": COMMITTED, "tokens": e.get("committed_tokens"), "at": at}
        elif kind == "restore_failed_closed":
            outcome = {"state": "failed closed", "tokens": 0, "at": at}
        elif kind == "request_finished":
            outcome = {
                "state": "finished",
                "source": e.get("source"),
                "external_tokens": e.get("external_tokens"),
                "computed_tokens": e.get("computed_tokens"),
                "at": at,
            }
    rows = [windows[k] for k in sorted(windows)]
    return {"request": request, "started_at": t0, "outcome": outcome, "failures": failures, "windows": rows}


def _render_timeline(console: Any, d: dict[str, Any]) -> None:
    from rich.table import Table

    from bsr_cli.core.units import format_bytes

    o = d["outcome"]
    when = time.strftime("%H:%M:%S", time.localtime(d["started_at"]))
    console.print(
        f"request {d['request']}  started {when}  outcome: {o['state']}"
        + (f" ({o['tokens']:,} tokens)" if isinstance(o.get("tokens"), int) else "")
    )
    for f in d["failures"]:
        at = f"window {f['window']}" if f["window"] else "before any window"
        console.print(f"[red]rank {f['rank']} failed at {at}[/] (+{f['at']:.3f} s): {f['reason']}")
    t = Table(title="windows (seconds from the first event)", title_justify="left")
    for col in ("rank", "window", "fetched", "installed", "released", "bytes", "tiers"):
        t.add_column(col, justify="left" if col == "tiers" else "right")

    def s(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, int | float) else "[red]—[/]"

    for r in d["windows"]:
        b = r.get("bytes")
        t.add_row(
            str(r["rank"]),
            str(r["window"]),
            s(r.get("fetched")),
            s(r.get("installed")),
            s(r.get("released")),
            format_bytes(b) if isinstance(b, int) else "",
            ",".join(r.get("tiers") or ()),
        )
    console.print(t)
