"""What an on-call engineer reaches for beside probe and restore, without raw HTTP: runtime settings, aborting a
request, the event log (tail and follow), and one request's per-rank, per-window timeline (live or recorded)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.cli.output import Output
from bsr_cli.core import events as ev
from bsr_cli.core import wire
from bsr_cli.core.evidence import EventKind, WindowStep
from bsr_cli.core.timeline import Timeline, timeline
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient
    from bsr_cli.core.status import EngineInfo, MarkerView

DEFAULT_LIMIT = 50  # events `bsr events` shows without -n or --since
MAX_LIMIT = 10_000  # the most one /events answer holds

settings_app = typer.Typer(help="The engine's runtime settings: W, budget B, fs concurrency.", no_args_is_help=True)

# What `settings show` lists, in the order an operator checks them.
SETTING_KEYS = (
    "W",
    "rws_bytes",
    "budget_bytes",
    "pool_bytes",
    "fs_concurrency",
    "fetch_timeout_s",
    "overload_ceiling_s",
    "tiers",
    "max_tokens",
    "kv_tokens",
    "faults_enabled",
)


def _client(st: AppState) -> Any:
    from bsr_cli.client import AdminClient

    return AdminClient.from_settings(st.settings)


@dataclass(frozen=True)
class SettingsView:
    """`bsr settings show|set`: the engine's settings as they stand (those it reports, in SETTING_KEYS' order), and
    which ones `set` changed."""

    url: str
    changed: tuple[str, ...] | None = wire.field(omit_none=True, default=None)  # `set` only
    settings: dict[str, int | float | str | bool | list[str] | None] = field(default_factory=dict)

    to_wire = wire.writer()


def _settings_view(url: str, info: EngineInfo, changed: tuple[str, ...] | None = None) -> SettingsView:
    """The settings of the engine's info answer, under their keys in it."""
    sent = info.to_wire()
    return SettingsView(url, changed, {k: sent.get(k) for k in SETTING_KEYS if k in sent})


def _render_settings(console: Any, d: SettingsView) -> None:
    from rich.table import Table

    from bsr_cli.core.units import format_bytes

    t = Table()
    t.add_column("setting")
    t.add_column("value")
    for k, v in d.settings.items():
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
    st.out.result(_settings_view(client.url, info), _render_settings)


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
    changes: dict[str, int] = {}
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
    st.out.result(_settings_view(client.url, info, tuple(sorted(changes))), _render_settings)


def abort(
    ctx: typer.Context,
    request: Annotated[str, typer.Argument(help="Request id (from `bsr restore`, `bsr events`, `bsr top`).")],
    json_flag: JsonFlag = False,
) -> None:
    """Abort a running restore: it fails closed (nothing committed). Exit 2 when the engine knows no such request,
    18 when the abort came too late.

    Too late: the restore already committed (its KV stays) or the request already ended; the error says which."""
    st = state(ctx, json_flag)
    with _client(st) as client:
        result = client.abort(request)
    if not result.aborting:
        raise InvalidInput(
            f"no request {request!r} is running on this engine, and it has no record of one",
            hint="`bsr events --kind restore_started` lists recent requests",
        )
    st.out.result(result, lambda c, d: c.print(f"abort requested for {d.request}: it will fail closed"))


KindOpt = Annotated[
    list[EventKind] | None,
    typer.Option("--kind", "-k", help="Only events of this kind (repeatable: any of them).", case_sensitive=False),
]


def events(
    ctx: typer.Context,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")] = False,
    since: Annotated[
        str | None,
        typer.Option("--since", help="Only events since then: a duration back (30s, 15m, 2h, 1d) or an ISO time."),
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Only events up to then (a duration back or an ISO time).")
    ] = None,
    request: Annotated[str | None, typer.Option("--request", help="Only this request's events.")] = None,
    kind: KindOpt = None,
    after: Annotated[
        int, typer.Option("--after", help="Only events after this sequence number (a cursor).", min=0)
    ] = 0,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            "-n",
            help="Show the last N matching events [default: 50; every match with --since].",
            min=1,
            max=MAX_LIMIT,
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Write the engine's past requests (within --since/--until) to FILE as a Mooncake-format trace "
            "for `bsr plan --trace` ('-' for stdout).",
        ),
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """The engine's events: restores and their windows, failures, markers, faults, restarts. The embedded engine
    keeps them in a durable store (by default 7 days, at most 512 MiB), across restarts.

    `bsr events --trace FILE --since 1d` exports the requests the engine admitted as a trace (arrival, length,
    one id per 512-token block), so `bsr plan --trace FILE` plans from the engine's own traffic.

    Filters combine: `bsr events --since 2h --request R --kind restore_failed`. With --json, one JSON object per
    line (JSON lines, for log shippers): `bsr events --since 1d --json > events.jsonl` exports a day.
    """
    st = state(ctx, json_flag)
    t_from, t_to = _time_window(since, until)
    kinds = [k.value for k in kind or ()]
    if trace is not None:
        if follow:
            raise InvalidInput(
                "--trace writes the requests seen so far: it cannot --follow",
                hint="drop --follow, or follow the events (-f) without --trace",
            )
        with _client(st) as client:
            held, _ = client.held_events(
                after, after=t_from, until=t_to, request=request, kinds=[EventKind.REQUEST_ADMITTED.value]
            )
        _write_trace(st, trace, held)
        return
    with _client(st) as client:
        if limit is None and t_from is not None:
            # An export: every match, as the engine sent it (a newer engine's kinds included).
            evs, last_seq = client.held_wire(after, after=t_from, until=t_to, request=request, kinds=kinds)
        else:
            got = client.events(
                after,
                after=t_from,
                until=t_to,
                request=request,
                kinds=kinds,
                limit=limit or DEFAULT_LIMIT,
                newest=True,
            )
            evs, last_seq = got.events, got.last_seq
        _print_events(st, evs)
        if not follow:
            return
        seq = max([last_seq, *(int(e.get("seq", 0)) for e in evs)])
        _follow(st, client, seq, _Filter(request, frozenset(kind or ()), t_to))


def _time_window(since: str | None, until: str | None) -> tuple[float | None, float | None]:
    """--since and --until as Unix times (None: open); InvalidInput when either does not parse or they cross."""
    from bsr_cli.core.when import parse_since

    now = time.time()
    try:
        t_from = parse_since(since, now) if since is not None else None
        t_to = parse_since(until, now, what="--until") if until is not None else None
    except InvalidInput as e:
        if since is not None and since.strip().isdigit():
            raise InvalidInput(e.message, hint="--after SEQ takes a sequence number; " + (e.hint or "")) from None
        raise
    if t_from is not None and t_to is not None and t_to < t_from:
        raise InvalidInput(
            "--until is before --since", hint="--since is the earlier point: e.g. --since 2h --until 30m"
        )
    return t_from, t_to


def _follow(st: AppState, client: AdminClient, seq: int, wanted: _Filter) -> None:
    """Print the events after ``seq`` that ``wanted`` matches as they come, until Ctrl-C (exit 130 through the error
    boundary)."""
    from bsr_cli.core.status import event_seq
    from bsr_cli.tui.model import parse_wire  # only when following: the live stream is filtered here

    while True:
        got = client.events(since=seq, wait_s=10.0)
        new = got.events
        if new:
            seq = event_seq(new[-1], seq)
        elif got.last_seq < seq:  # an engine without a store restarted: seq starts again
            seq = 0
            _say_restart(st)
            continue
        _print_events(st, [e for e in new if wanted.matches(parse_wire(e))])


def _write_trace(st: AppState, path: Path, held: list[ev.Event]) -> None:
    """The admitted requests as trace lines; those from an engine too old to record block ids are counted, not
    written (their prefixes are unknown)."""
    import json
    import sys

    from bsr_cli.core.trace import seen_requests, trace_records

    seen, skipped = seen_requests(held)
    lines = "".join(json.dumps(r.to_wire(), separators=(",", ":")) + "\n" for r in trace_records(seen))
    if str(path) == "-":
        sys.stdout.write(lines)
        sys.stdout.flush()
        Output.result_written = True
        return
    try:
        path.write_text(lines)
    except OSError as e:
        raise InvalidInput(
            f"cannot write {path}: {e.strerror or e}",
            hint="give --trace a path in a directory you can write ('-' for stdout)",
        ) from None
    st.out.result(
        TraceWritten(str(path), len(seen), skipped),
        lambda c, d: c.print(
            f"wrote {d.requests} request(s) to {d.trace}"
            + (f"; {d.skipped} without block ids (recorded by an older engine) left out" if d.skipped else "")
        ),
    )


@dataclass(frozen=True)
class TraceWritten:
    """`bsr events --trace FILE`: the file, the requests written to it, and those left out (no block ids)."""

    trace: str
    requests: int
    skipped: int

    def to_wire(self) -> dict[str, int | str]:
        return {"trace": self.trace, "requests": self.requests, "skipped": self.skipped}


class _Filter:
    """What `bsr events -f` keeps of the live stream (the server filtered the backlog)."""

    def __init__(self, request: str | None, kinds: frozenset[EventKind], until: float | None) -> None:
        self.request, self.kinds, self.until = request, kinds, until

    def matches(self, e: ev.Event | None) -> bool:
        """Whether to show an event (None: one of a kind this bsr does not know)."""
        if e is None:
            return not self.kinds and self.request is None  # unknown to this bsr: shown only when unfiltered
        return (
            (self.request is None or ev.request_of(e) == self.request)
            and (not self.kinds or e.kind in self.kinds)
            and (self.until is None or e.time <= self.until)
        )


def _print_events(st: AppState, evs: Sequence[Mapping[str, wire.JsonValue]]) -> None:
    """JSON lines with --json (one event per line, as the engine recorded it), else one line a person reads."""
    import json
    import sys

    if st.out.json_mode:
        for e in evs:
            sys.stdout.write(json.dumps(e, separators=(",", ":")) + "\n")
        sys.stdout.flush()
        Output.result_written = True  # the error boundary adds no second document (e.g. on Ctrl-C)
        return
    from bsr_cli.cli.render.ops import event_line

    for e in evs:
        st.out.console.print(event_line(e), highlight=False, markup=False)


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
    """One request's timeline: per rank and window, when it was fetched, installed and released; the window that
    failed (its chunks, the tier and stage blamed, why), the marker it left, the scrubs it started; how it ended."""
    st = state(ctx, json_flag)
    markers: list[MarkerView] = []
    if record is not None:
        mine = [e for e in _recorded_events(record) if ev.request_of(e) == request]
        where = str(record)
    else:
        with _client(st) as client:
            mine, _ = client.held_events(0, request=request)
            markers = client.markers()
            where = client.url
    if not mine:
        raise InvalidInput(
            f"no events of request {request!r} in {where}",
            hint="`bsr events --since 1d --kind restore_started` lists recent requests; the engine keeps events "
            "for its retention (7 days / 512 MiB by default)",
        )
    st.out.result(timeline(request, mine, markers), _render_timeline)


def _recorded_events(path: Path) -> list[ev.Event]:
    """The events a recording holds, once each, oldest first (as types; a kind this bsr does not know is left out)."""
    from bsr_cli.tui.model import Frame, parse_wire
    from bsr_cli.tui.source import read_recording

    _, items = read_recording(path)
    seen: dict[tuple[float, int], ev.Event | None] = {}
    for item in items:
        if isinstance(item, Frame):
            snap = item.snapshot.to_wire()
            for e in snap.get("events") or ():
                # Frames overlap; an engine restart reuses sequence numbers, so key by (started_at, seq).
                seen[(float(item.snapshot.info.started_at), int(e.get("seq", 0)))] = parse_wire(e)
    return [e for k in sorted(seen) if (e := seen[k]) is not None]


def _render_timeline(console: Any, d: Timeline) -> None:
    from rich.markup import escape
    from rich.table import Table

    from bsr_cli.cli.render.ops import marker_scope
    from bsr_cli.core.units import format_bytes

    o = d.outcome
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.started_at))
    console.print(
        f"request {d.request}  started {when}  outcome: {o.state}"
        + (f" ({o.tokens:,} tokens)" if o.tokens is not None else "")
        + (f"  prompt {d.prompt}" if d.prompt else "")
    )
    for f in d.failures:
        who = f"rank {f.rank}" if f.rank is not None else "the restore"
        console.print(f"[red]{who} failed at {f.where()}[/] ({f.why()}, +{f.at:.3f} s): {escape(f.reason)}")
    if d.marker is not None:
        scope = marker_scope(d.marker.excluded_tiers)
        console.print(f"[magenta]force-local marker[/] prompt {d.marker.prompt} {scope}: {escape(d.marker.reason)}")
    for sc in d.scrubs:
        console.print(
            f"rank {sc.rank} scrubbed {'the prompt' if sc.prompt else 'the tier'} on tier {sc.tier} ({sc.scrub}): "
            f"{sc.state.value}, {sc.checked} checked, {sc.damaged} damaged, {sc.quarantined} set aside"
            + (f" ({escape(sc.reason)})" if sc.reason else "")
        )
    t = Table(title="windows (seconds from the first event)", title_justify="left")
    for col in ("rank", "window", "fetched", "installed", "released", "bytes", "tiers"):
        t.add_column(col, justify="left" if col == "tiers" else "right")

    def s(v: float | None) -> str:
        return f"{v:.3f}" if v is not None else "[red]—[/]"

    for r in d.windows:
        t.add_row(
            str(r.rank),
            str(r.window),
            s(r.steps.get(WindowStep.FETCHED)),
            s(r.steps.get(WindowStep.INSTALLED)),
            s(r.steps.get(WindowStep.RELEASED)),
            format_bytes(r.bytes) if r.bytes is not None else "",
            ",".join(r.tiers),
        )
    console.print(t)
