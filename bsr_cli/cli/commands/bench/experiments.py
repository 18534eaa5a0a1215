"""`bsr bench sweep|ladder|wlaw|fs-concurrency|store|failures|peer`: one command per experiment (bsr_cli.bench)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.commands.bench.common import (
    DEFAULT_OUT,
    EmbeddedOpt,
    NoPlotsOpt,
    OutOpt,
    RegOpt,
    SaltOpt,
    TierOpt,
    WOpt,
    execute,
    ints,
    publish,
    row_note,
)
from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core.units import format_bytes, parse_bytes
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.bench.evidence import Bundle
    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions


def sweep(
    ctx: typer.Context,
    tokens: Annotated[
        str, typer.Option("--tokens", "-n", help="Prefix lengths, comma-separated.")
    ] = "32768,65536,131072,262144,393216,524032",
    w: WOpt = 32,
    no_repeat: Annotated[
        bool, typer.Option("--no-repeat", help="Skip the fresh-salt repeat of the largest row.")
    ] = False,
    tier: TierOpt = None,
    out: OutOpt = DEFAULT_OUT,
    embedded: EmbeddedOpt = False,
    registration: RegOpt = None,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """E1: one engine, no restart, W fixed with B = RWS(W); peak pool must stay flat as the prefix grows."""
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    prefixes = ints(tokens, "--tokens")

    def run(client: AdminClient, meta: dict[str, bool | float | None], _state: Path | None) -> Bundle:
        return ex.run_sweep(
            client,
            prefixes=prefixes,
            w=w,
            repeat=not no_repeat,
            salt=salt,
            tier=tier,
            on_row=row_note(st, "sweep"),
            engine_meta=meta,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("sweep", reg, w=w, prefixes=prefixes, repeat=not no_repeat)

    execute(st, "sweep", out, embedded, registration, no_plots, run, options)


def ladder(
    ctx: typer.Context,
    tokens: Annotated[
        str, typer.Option("--tokens", "-n", help="Prefix lengths, comma-separated.")
    ] = "32768,65536,131072,262144,524032",
    rungs: Annotated[
        str, typer.Option("--rungs", help="Pool capacity rungs per rank, comma-separated sizes.")
    ] = "64MiB,128MiB,256MiB,512MiB,1GiB,2GiB,4GiB",
    warm_w: Annotated[int, typer.Option("--warm-W", help="W used to warm prompts into the tiers.", min=1)] = 32,
    out: OutOpt = DEFAULT_OUT,
    registration: RegOpt = None,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Whole-plan path (W=0): raise the pool through rungs until full reuse succeeds; first passing rung and
    measured peak against the core's prediction. Restarts its own embedded engine per rung (against another
    engine, restart it per rung yourself and use bsr_cli.bench.ladder.run_ladder)."""
    import tempfile

    from bsr_cli import loaders
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    prefixes = ints(tokens, "--tokens")
    steps = ints(rungs, "--rungs", sizes=True)
    reg = loaders.load_registration(registration or "demo")
    with tempfile.TemporaryDirectory(prefix="bsr-bench-ladder-") as tmp:
        factory = ex.embedded_ladder_factory(Path(tmp), reg, max_tokens=max(prefixes))
        result = ex.run_ladder(
            factory,
            prefixes=prefixes,
            rungs=steps,
            warm_w=warm_w,
            salt=salt,
            on_row=row_note(st, "ladder"),
            on_rung=lambda r: st.out.note(f"rung {format_bytes(r)}/rank: starting the embedded engine…"),
            on_attempt=lambda n, a: st.out.note(
                f"ladder {n:,} tokens at {format_bytes(a.rung)}: {a.outcome}"
                + (f" ({a.failure})" if a.failure else f", peak {format_bytes(a.peak_pool_bytes)}/rank")
            ),
            engine_meta={"embedded": True},
        )
    publish(st, result, out, no_plots)


def wlaw(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prefix length.", min=1)] = 262_144,
    ws: Annotated[str, typer.Option("--Ws", help="Window sizes, comma-separated.")] = "8,16,32,64",
    tier: TierOpt = None,
    out: OutOpt = DEFAULT_OUT,
    embedded: EmbeddedOpt = False,
    registration: RegOpt = None,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Measured RWS against W·Σc_i + aux at one prefix, for each W."""
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    w_list = ints(ws, "--Ws")

    def run(client: AdminClient, meta: dict[str, bool | float | None], _state: Path | None) -> Bundle:
        return ex.run_wlaw(
            client, tokens=tokens, ws=w_list, salt=salt, tier=tier, on_row=row_note(st, "wlaw"), engine_meta=meta
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("wlaw", reg, ws=w_list, tokens=tokens)

    execute(st, "wlaw", out, embedded, registration, no_plots, run, options)


def fs_concurrency(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prefix length.", min=1)] = 524_032,
    w: WOpt = 32,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Load concurrencies, comma-separated.")] = "1,4",
    trials: Annotated[int, typer.Option("--trials", help="Restores per configuration.", min=1)] = 2,
    fs_dir: Annotated[
        Path | None, typer.Option("--fs-dir", help="The fs tier's directory, to evict its pages (cold runs).")
    ] = None,
    warm_only: Annotated[bool, typer.Option("--warm-only", help="Skip the cold-cache runs.")] = False,
    out: OutOpt = DEFAULT_OUT,
    embedded: EmbeddedOpt = False,
    registration: RegOpt = None,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Filesystem tier only: load concurrency 1 against 4 at the same W; throughput may change, RWS must not."""
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    conc = ints(concurrency, "--concurrency")

    def run(client: AdminClient, meta: dict[str, bool | float | None], state_dir: Path | None) -> Bundle:
        where = fs_dir or (ex.fs_dir_of(state_dir, client.url) if state_dir else None)
        return ex.run_fs_concurrency(
            client,
            tokens=tokens,
            w=w,
            concurrencies=conc,
            trials=trials,
            fs_dir=where,
            cold=not warm_only,
            salt=salt,
            on_row=row_note(st, "fs"),
            engine_meta=meta,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("fs-concurrency", reg, w=w, tokens=tokens)

    execute(st, "fs-concurrency", out, embedded, registration, no_plots, run, options)


def store(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prefix restored through the engine.", min=1)] = 131_072,
    w: WOpt = 32,
    trials: Annotated[int, typer.Option("--trials", help="Repetitions of each measurement.", min=1)] = 2,
    raw_bytes: Annotated[
        str, typer.Option("--raw-bytes", help="Bytes per client for the direct Mooncake measurements.")
    ] = "512MiB",
    copy_bytes: Annotated[str, typer.Option("--copy-bytes", help="Buffer size of the memory-copy ceiling.")] = "1GiB",
    master: Annotated[
        str | None,
        typer.Option("--mooncake-master", help="Mooncake master HOST:PORT [default: the embedded engine's]."),
    ] = None,
    metadata: Annotated[
        str | None, typer.Option("--mooncake-metadata", help="Mooncake metadata URL (with --mooncake-master).")
    ] = None,
    out: OutOpt = DEFAULT_OUT,
    embedded: EmbeddedOpt = False,
    registration: RegOpt = None,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Tier bandwidth (GET/PUT, tier class and raw store, isolated and concurrent) beside the memory-copy
    ceiling, and restores from Mooncake: W=0 against W with B = RWS and 2·RWS. Ratios, not only numbers."""
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    raw = parse_bytes(raw_bytes)
    copy = parse_bytes(copy_bytes)
    if (master is None) != (metadata is None):
        raise InvalidInput(
            "give --mooncake-master and --mooncake-metadata together",
            hint="--mooncake-master HOST:PORT and --mooncake-metadata URL name one Mooncake deployment",
        )

    def run(client: AdminClient, meta: dict[str, bool | float | None], state_dir: Path | None) -> Bundle:
        mc = {"master_address": master, "metadata_url": metadata} if master and metadata else None
        if mc is None and state_dir is not None:
            mc = ex.mooncake_of(state_dir, client.url)
        if mc is None:
            st.out.note(
                "[yellow]no Mooncake master known: skipping the direct GET/PUT measurements[/] (--mooncake-master)"
            )
        return ex.run_store(
            client,
            tokens=tokens,
            w=w,
            trials=trials,
            raw_bytes=raw,
            copy_bytes=copy,
            mooncake=mc,
            salt=salt,
            on_row=row_note(st, "store"),
            engine_meta=meta,
            link_bps=ex.link_ceiling_of(state_dir, client.url) if state_dir is not None else None,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("store", reg, w=w, tokens=tokens, raw_bytes=raw)

    execute(st, "store", out, embedded, registration, no_plots, run, options)


def failures(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prompt length per scenario.", min=1)] = 8192,
    w: Annotated[
        int | None, typer.Option("--W", "-W", "--window-size", help="Window size [default: the engine's].", min=1)
    ] = None,
    out: OutOpt = DEFAULT_OUT,
    embedded: EmbeddedOpt = False,
    registration: RegOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """The failure matrix (shared with `bsr drill`): remote unavailable, remote and SSD absent, one-rank fault."""
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)

    def run(client: AdminClient, meta: dict[str, bool | float | None], _state: Path | None) -> Bundle:
        return ex.run_failures(client, tokens=tokens, w=w, on_row=row_note(st, "failures"), engine_meta=meta)

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("failures", reg, tokens=tokens, w=w)

    execute(st, "failures", out, embedded, registration, no_plots, run, options)


def peer(
    ctx: typer.Context,
    tokens: Annotated[
        str, typer.Option("--tokens", "-n", help="Comma-separated prefix lengths.")
    ] = "32768,65536,131072",
    w: WOpt = 32,
    tp: Annotated[int, typer.Option("--world-size", "--tp", help="TP ranks (one LMCache engine each).", min=1)] = 1,
    below_rung: Annotated[
        str,
        typer.Option("--below-rung", help="Extra stock L1 sizes below its rung (bsr's own L1 is always tried)."),
    ] = "",
    trials: Annotated[int, typer.Option("--trials", help="Repetitions of raw, stock and bsr.", min=1)] = 1,
    deadline: Annotated[
        float, typer.Option("--deadline", help="LMCache's blocking timeout for a retrieve, seconds.", min=1)
    ] = 10.0,
    bsr_windows: Annotated[
        int,
        typer.Option("--bsr-windows", help="bsr's L1 in windows: 2 overlaps fetch and install, 1 serializes.", min=1),
    ] = 2,
    store_client_ttl: Annotated[
        str | None,
        typer.Option(
            "--store-client-ttl",
            help="How long the store's master keeps a silent segment holder before it drops its segment and the "
            "prompt's objects (e.g. 120s) [default: 120s or the config's].",
        ),
    ] = None,
    out: OutOpt = DEFAULT_OUT,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """Stock LMCache 0.5.6 against bsr's windowed retrieve inside LMCache, on the same objects in one Mooncake
    store: GB/s per rank, measured L1 peaks, CPU seconds per GB, and what stock does below its L1 rung. Runs the
    measurements in the LMCache venv (.venv-lmcache from scripts/test-plugins, or BSR_LMCACHE_PYTHON)."""
    import tempfile

    from bsr_cli.bench import peer as pe
    from bsr_cli.settings import resolve_store_client_ttl

    st = state(ctx, json_flag)
    ttl = resolve_store_client_ttl(store_client_ttl, st.settings)
    prefixes = ints(tokens, "--tokens")
    extra = ints(below_rung, "--below-rung", sizes=True) if below_rung.strip() else []
    pe.plugin_python()  # fail at once, with the setup command, when LMCache is not there
    with tempfile.TemporaryDirectory(prefix="bsr-bench-peer-") as tmp:
        result = pe.run_peer(
            tokens=prefixes,
            w=w,
            tp=tp,
            below_rung=extra,
            trials=trials,
            deadline_s=deadline,
            bsr_windows=bsr_windows,
            salt=salt,
            workdir=Path(tmp),
            on_row=row_note(st, "peer"),
            store_client_ttl_s=ttl,
        )
    publish(st, result.to_bundle(), out, no_plots)
