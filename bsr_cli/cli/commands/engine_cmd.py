"""`bsr engine up | down | status`: run the embedded reference engine on this machine; `bsr engine endpoints`:
every endpoint bsr needs for an engine (a vLLM instance's ranks, Mooncake), endpoints_cmd.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.commands.endpoints_cmd import engine_endpoints
from bsr_cli.cli.commands.planning import RegOpt, WOpt
from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core.units import parse_bytes

if TYPE_CHECKING:
    from bsr_cli.engine.supervisor import EngineStatus, StoppedEngine

engine_app = typer.Typer(
    help="Run the embedded reference engine: real mooncake_master, a segment holder, one process per TP rank, "
    "and the admin API, all on loopback (or, with --hosts netns, the store and each rank on hosts of their own).",
    no_args_is_help=True,
)


def _size(text: str | None) -> int | None:
    return None if text is None else parse_bytes(text)


def _bit_rate(text: str) -> int:
    """``200mbit`` / ``1gbit`` / ``500kbit`` / a plain number of bits per second, as bits per second."""
    from bsr_cli.errors import InvalidInput

    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}
    low = text.strip().lower()
    suffix = next((u for u in units if low.endswith(u)), "bit")
    number, scale = low.removesuffix(suffix), units[suffix]
    try:
        value = float(number) * scale
    except ValueError:
        raise InvalidInput(f"--link-rate {text!r} is not a rate", hint="e.g. 200mbit, 1gbit, 500kbit") from None
    if value < 8_000:
        raise InvalidInput(f"--link-rate {text!r} is below 8kbit", hint="e.g. 200mbit")
    return int(value)


# The options of `bsr engine up`.
PoolOpt = Annotated[str | None, typer.Option("--pool", help="Restore-pool capacity per rank [default: 2·RWS(W)].")]
BudgetOpt = Annotated[
    str | None, typer.Option("--budget", help="Admission budget B per rank [default: RWS(W), the paper's lock].")
]
MaxTokensOpt = Annotated[int, typer.Option("--max-tokens", help="Longest prompt the engine accepts.", min=1)]
KvTokensOpt = Annotated[
    int | None, typer.Option("--kv-tokens", help="Destination KV capacity in tokens [default: 2·max-tokens].")
]
SegmentOpt = Annotated[str | None, typer.Option("--segment", help="Mooncake segment size (store capacity).")]
EnableFaultsOpt = Annotated[bool, typer.Option("--enable-faults", help="Allow fault injection (off by default).")]
FsConcurrencyOpt = Annotated[int, typer.Option("--fs-concurrency", help="Filesystem tier load concurrency.", min=1)]
FetchTimeoutOpt = Annotated[float, typer.Option("--fetch-timeout", help="Per-window fetch deadline (s).")]
KvWaitOpt = Annotated[
    float,
    typer.Option(
        "--kv-wait",
        help="How long a request waits for destination KV blocks held by running requests before it is "
        "refused for capacity (s; 0 refuses at once).",
    ),
]
OverloadCeilingOpt = Annotated[
    float,
    typer.Option(
        "--overload-ceiling",
        help="The longest a rank's deadline (heartbeat, window progress) is stretched while the host starves it; "
        "past it the restore fails naming the host, never the rank (s).",
    ),
]
HostOpt = Annotated[str, typer.Option("--host", help="Admin API bind address (loopback by default).")]
PortOpt = Annotated[int, typer.Option("--port", help="Admin API port (0 = a free one).", min=0)]
AllowHostOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-host",
        help="A host name the admin API answers to besides loopback names and its bind address (repeatable).",
    ),
]
OpenMetricsOpt = Annotated[
    bool, typer.Option("--open-metrics", help="Serve /metrics without the token (for a scraper without one).")
]
NoRemoteOpt = Annotated[bool, typer.Option("--no-remote", help="Run without the Mooncake tier.")]
RestartOpt = Annotated[
    bool, typer.Option("--restart", help="Restart a running engine whose options differ from these.")
]
EventRetentionOpt = Annotated[
    str | None,
    typer.Option("--event-retention", help="Keep events this long (e.g. 7d, 12h) [default: 7d or the config's]."),
]
EventStoreMaxOpt = Annotated[
    str | None,
    typer.Option("--event-store-max", help="Largest the event store may grow (oldest go first) [default: 512MiB]."),
]
HostsOpt = Annotated[
    str,
    typer.Option(
        "--hosts",
        help="local: every part on loopback; netns: the Mooncake master, the segment holder and each rank in a "
        "Linux network namespace of their own, joined by veth links (needs root and iproute2).",
    ),
]
StoreClientTtlOpt = Annotated[
    str | None,
    typer.Option(
        "--store-client-ttl",
        help="How long the Mooncake master keeps a silent segment holder before it drops its segment and every "
        "object on it (e.g. 120s, 2m) [default: 120s or the config's].",
    ),
]
LinkRateOpt = Annotated[
    str | None,
    typer.Option("--link-rate", help="With --hosts netns: cap every link at this rate (tc tbf), e.g. 200mbit."),
]


@engine_app.command("up")
def engine_up(
    ctx: typer.Context,
    registration: RegOpt = None,
    w: WOpt = 32,
    pool: PoolOpt = None,
    budget: BudgetOpt = None,
    max_tokens: MaxTokensOpt = 131_072,
    kv_tokens: KvTokensOpt = None,
    segment: SegmentOpt = None,
    enable_faults: EnableFaultsOpt = False,
    fs_concurrency: FsConcurrencyOpt = 1,
    fetch_timeout: FetchTimeoutOpt = 10.0,
    kv_wait: KvWaitOpt = 60.0,
    overload_ceiling: OverloadCeilingOpt = 60.0,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 0,
    allow_host: AllowHostOpt = None,
    open_metrics: OpenMetricsOpt = False,
    no_remote: NoRemoteOpt = False,
    restart: RestartOpt = False,
    event_retention: EventRetentionOpt = None,
    event_store_max: EventStoreMaxOpt = None,
    hosts: HostsOpt = "local",
    link_rate: LinkRateOpt = None,
    store_client_ttl: StoreClientTtlOpt = None,
    json_flag: JsonFlag = False,
) -> None:
    """Start the embedded engine (idempotent: a healthy engine with the same options is reported, not restarted;
    one with other options is refused unless --restart)."""
    from bsr_cli import loaders
    from bsr_cli.engine import supervisor
    from bsr_cli.settings import parse_event_retention, parse_event_store_bytes, resolve_store_client_ttl

    st = state(ctx, json_flag)
    reg = loaders.load_registration(registration or "demo")
    settings = st.settings
    retention = settings.event_retention_s if event_retention is None else parse_event_retention(event_retention)
    store_max = settings.event_store_bytes if event_store_max is None else parse_event_store_bytes(event_store_max)
    ttl = resolve_store_client_ttl(store_client_ttl, settings)
    opts = supervisor.EngineOptions(
        reg,
        w=w,
        pool_bytes=_size(pool),
        budget_bytes=_size(budget),
        max_tokens=max_tokens,
        kv_tokens=kv_tokens,
        segment_bytes=_size(segment),
        faults_enabled=enable_faults,
        fs_concurrency=fs_concurrency,
        fetch_timeout_s=fetch_timeout,
        kv_wait_s=kv_wait,
        overload_ceiling_s=overload_ceiling,
        host=host,
        port=port,
        remote=not no_remote,
        allowed_hosts=tuple(allow_host or ()),
        open_metrics=open_metrics,
        event_retention_s=retention,
        event_store_bytes=store_max,
        hosts=hosts,
        link_rate_bps=None if link_rate is None else _bit_rate(link_rate),
        store_client_ttl_s=ttl,
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        st.out.note(f"[yellow]warning:[/] the admin API will listen on {host}, beyond loopback")
    opts.resolved()  # refuse bad settings before saying anything is starting
    st.out.note("starting the embedded engine (mooncake_master, segment holder, rank processes)…")
    result = supervisor.up(Path(st.settings.state_dir), opts, restart=restart)
    st.out.result(result, _render_status)


@engine_app.command("down")
def engine_down(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Stop every process of the embedded engine."""
    from bsr_cli.engine import supervisor

    st = state(ctx, json_flag)
    result = supervisor.down(Path(st.settings.state_dir))

    def render(console: Any, d: StoppedEngine) -> None:
        if not d.was_running:
            console.print(f"no engine running in {d.state_dir}")
        else:
            console.print("stopped " + ", ".join(f"{name} ({pid})" for name, pid in d.stopped))

    st.out.result(result, render)


@engine_app.command("status")
def engine_status(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Processes of the embedded engine and whether its admin API answers. Exit 3 when it is not running."""
    from bsr_cli.engine import supervisor
    from bsr_cli.errors import EngineUnreachable

    st = state(ctx, json_flag)
    result = supervisor.status(Path(st.settings.state_dir))
    if not result.healthy:
        error = EngineUnreachable(
            f"the embedded engine in {result.state_dir} is " + ("unhealthy" if result.running else "not running"),
            hint="bsr engine up",
        )
        st.out.fail(result, _render_status, error)
    st.out.result(result, _render_status)


engine_app.command("endpoints")(engine_endpoints)


def _render_status(console: Any, d: EngineStatus) -> None:
    from rich.table import Table

    rec = d.record
    if not d.running or rec is None:
        return  # the error line (exit 3) says it once
    verdict = "[green]healthy[/]" if d.healthy else "[red]unhealthy[/]"
    again = " (already running)" if d.already_running else ""
    console.print(f"engine {verdict}{again} at [bold]{rec.admin_url}[/]  registration {rec.registration_identity}")
    t = Table()
    for col in ("process", "pid", "state"):
        t.add_column(col)
    for p in d.processes:
        state = "[green]running[/]" if p.alive else "[red]gone[/]"
        if p.restarts:
            state += f" (restarted {p.restarts}×)"
        t.add_row(p.name, str(p.pid), state)
    console.print(t)
    for line in d.restored or ():
        console.print(line)
    s = rec.settings
    if s is not None:
        console.print(
            f"W={s.w}  pool {s.pool_bytes:,} B/rank  budget {s.budget_bytes:,} B/rank  "
            f"max prompt {s.max_tokens:,} tokens  faults {'enabled' if s.faults_enabled else 'disabled'}"
            + (f"  store client TTL {s.store_client_ttl_s} s" if "mooncake_master" in rec.services else "")
        )
    topo = d.hosts.topology
    if topo is not None:
        rate = f", each capped at {topo.rate_bps / 1e6:g} Mbit/s" if topo.rate_bps else ""
        down = [lk.link for lk in d.hosts.links if not lk.up]
        console.print(
            f"hosts: {len(topo.nodes)} network namespaces, {len(d.hosts.links)} links{rate}; "
            + (f"[red]down:[/] {', '.join(down)}" if down else "every link up")
        )
    exposed = d.exposed
    if exposed:
        ports = ", ".join(f"{e.process} {e.address}:{e.port}" for e in exposed)
        console.print(f"[yellow]exposed beyond loopback:[/] {ports}")
    elif topo is not None:
        # Sockets inside the engine's namespaces are not this namespace's: they cannot be reached from outside.
        console.print("every listening port in this network namespace is on loopback (the others are in the engine's)")
    else:
        console.print("every listening port is on loopback")
    console.print(f"state: {d.state_dir}  logs: {rec.logs}")
