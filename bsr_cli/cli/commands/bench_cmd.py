"""`bsr bench ladder|sweep|wlaw|fs-concurrency|store|failures|peer`: the paper's evaluation against an engine.

Each experiment prints a table (or the bundle with --json), writes its evidence bundle to --out (validated against
docs/bench-schema.json) and redraws the plots the bundles there allow. By default it measures the engine the
global options name (--engine, BSR_ENGINE, or the embedded engine of the state directory); --embedded starts a
dedicated embedded engine sized for the experiment in a temporary directory and stops it afterwards. The ladder
always restarts its own embedded engine, once per capacity rung.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.app import AppState, JsonFlag, app, state
from bsr_cli.core.units import MiB, format_bytes, parse_bytes
from bsr_cli.errors import DrillViolation, InvalidInput, ServerError

if TYPE_CHECKING:
    from rich.console import Console

    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions

bench_app = typer.Typer(
    help="Reproduce the paper's evaluation: each experiment prints a table, writes a JSON evidence bundle and "
    "plots. Against the configured engine, or a dedicated one with --embedded.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Directory for bundles and plots.")]
EmbeddedOpt = Annotated[
    bool,
    typer.Option("--embedded", help="Start a dedicated embedded engine sized for this experiment, stop it after."),
]
RegOpt = Annotated[
    str | None, typer.Option("--registration", "-r", help="With --embedded: registration [default: demo].")
]
TierOpt = Annotated[str | None, typer.Option("--tier", help="Tier to restore from [default: the engine's first].")]
SaltOpt = Annotated[int | None, typer.Option("--salt", help="Seed of the synthetic prompts [default: random].")]
NoPlotsOpt = Annotated[bool, typer.Option("--no-plots", help="Write the bundle only, no PNG plots.")]
WOpt = Annotated[int, typer.Option("--W", "-W", "--window-size", help="Window size in chunks.", min=1)]
DEFAULT_OUT = Path("bench-out")

Experiment = Callable[["AdminClient", dict[str, Any], Path | None], dict[str, Any]]


# -- shared plumbing ---------------------------------------------------------------------------------------------


def _ints(text: str, what: str, *, sizes: bool = False) -> list[int]:
    try:
        values = [parse_bytes(x) if sizes else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(f"{what} takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise InvalidInput(f"{what} must be positive")
    return values


def _row_note(st: AppState, experiment: str) -> Callable[[dict[str, Any]], None]:
    def note(r: dict[str, Any]) -> None:
        status = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]"}.get(r["status"], "[yellow]interrupted[/]")
        what = ", ".join(
            f"{k}={r[k]:,}" if isinstance(r[k], int) else f"{k}={r[k]}"
            for k in ("kind", "scenario", "tokens", "W", "concurrency", "cache", "trial")
            if r.get(k) is not None
        )
        extra = f"  {r['seconds']:.2f} s" if isinstance(r.get("seconds"), float) else ""
        if r.get("peak_pool_bytes"):
            extra += f"  peak {format_bytes(r['peak_pool_bytes'])}/rank"
        if r.get("l1_bytes") is not None and r.get("loaded_tokens") is not None:
            extra += (
                f"  L1 {format_bytes(r['l1_bytes'])}: {r['loaded_tokens']:,} tokens, {r['gbps_per_rank']} GB/s/rank,"
                f" L1 peak {format_bytes(r.get('l1_peak_bytes') or 0)}" + (" (timed out)" if r.get("timed_out") else "")
            )
        if r.get("reason"):
            extra += f"  ({r['reason']})"
        st.out.note(f"{experiment} {what}: {status}{extra}")

    return note


def _engine_client(st: AppState) -> AdminClient:
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import resolve_engine

    url, token, _ = resolve_engine(st.settings)
    # Restores of large prefixes stream for minutes; only plain calls use this deadline.
    return AdminClient(url, token, timeout_s=max(st.settings.timeout_s, 60.0))


def _execute(
    st: AppState,
    experiment: str,
    out: Path,
    embedded: bool,
    registration: str | None,
    no_plots: bool,
    run: Experiment,
    options: Callable[[Any], EngineOptions],
    render: Callable[[Console, dict[str, Any]], None],
) -> None:
    """Run an experiment against the configured engine or a dedicated embedded one, then write, plot, print."""
    from bsr_cli.bench import experiments as ex

    if embedded:
        import tempfile

        from bsr_cli import loaders

        reg = loaders.load_registration(registration or "demo")
        opts = options(reg)
        pool = format_bytes(opts.resolved()["pool_bytes"])
        st.out.note(f"starting a dedicated embedded engine for {experiment} (pool {pool}/rank)…")
        with tempfile.TemporaryDirectory(prefix="bsr-bench-") as tmp:
            t0 = time.monotonic()
            with ex.embedded_engine(Path(tmp), opts) as client:
                meta = {"embedded": True, "startup_s": round(time.monotonic() - t0, 3)}
                st.out.note(f"engine up in {meta['startup_s']:.1f} s at {client.url}")
                result = run(client, meta, Path(tmp))
    else:
        with _engine_client(st) as client:
            result = run(client, {"embedded": False, "startup_s": None}, Path(st.settings.state_dir))
    _publish(st, result, out, no_plots, render)


def _publish(
    st: AppState, result: dict[str, Any], out: Path, no_plots: bool, render: Callable[[Console, dict[str, Any]], None]
) -> None:
    from bsr_cli.bench import bundle as bundles

    path = bundles.write(result, out)
    plots: list[str] = []
    if not no_plots:
        try:
            from bsr_cli.bench import plots as plotting

            plots = [str(p) for p in plotting.render_all(out)]
        except ImportError as e:
            st.out.note(f"[yellow]no PNG plots:[/] {e}")
    st.out.result(result | {"files": {"bundle": str(path), "plots": plots}}, render)
    _exit_for(result, path)


def _exit_for(result: dict[str, Any], path: Path) -> None:
    rows = list(result["rows"]) + list(result.get("repeat", {}).get("rows", []))
    if result.get("interrupted_by") == "operator":
        raise KeyboardInterrupt
    if result.get("interrupted"):
        reason = next((r.get("reason") for r in rows if r["status"] == "interrupted"), "unknown")
        raise ServerError(f"the experiment stopped early: {reason}", hint=f"the partial bundle is {path}")
    failed = [r for r in rows if r["status"] == "fail"]
    if failed:
        what = sorted({k for r in failed for k, ok in r.get("checks", {}).items() if not ok})
        raise DrillViolation(
            f"{len(failed)} row(s) failed their acceptance checks ({', '.join(what)})", hint=f"evidence: {path}"
        )


# -- renderers ---------------------------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    if n is None:
        return "—"
    return f"{n // MiB:,}" if n % MiB == 0 else f"{n / MiB:,.2f}"


def _short(n: int) -> str:
    """64M, 1G: a rung in few characters."""
    return f"{n // 2**30}G" if n % 2**30 == 0 else (f"{n // MiB}M" if n % MiB == 0 else format_bytes(n))


def _status(s: str) -> str:
    return {"pass": "[green]PASS[/]", "fail": "[red]FAIL[/]"}.get(s, "[yellow]interrupted[/]")


def _yes(v: Any) -> str:
    return "[green]yes[/]" if v is True else ("—" if v is None else "[red]no[/]")


def _mean(r: dict[str, Any], key: str) -> float:
    ranks = r.get("ranks") or []
    return sum(x[key] for x in ranks) / max(len(ranks), 1)


def _table(*columns: str, title: str | None = None) -> Any:
    """A compact table: the sweep's thirteen columns fit 120 characters."""
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title=title, title_justify="left")
    for col in columns:
        t.add_column(
            col,
            justify="left" if col in ("", "hash", "healthy", "status", "config", "scenario", "attempts") else "right",
        )
    return t


def _header(console: Console, d: dict[str, Any], title: str) -> None:
    reg, m = d["registration"], d["machine"]
    eng = d["engine"]
    where = "embedded (dedicated)" if eng.get("embedded") else eng["url"]
    console.print(f"[bold]{title}[/]  run {d['run_id']}" + (f"  salt {d['salt']}" if d.get("salt") is not None else ""))
    console.print(
        f"[dim]engine {where}  registration {reg['identity']} ({reg['model']}, {format_bytes(reg['bytes_per_chunk'])}"
        f"/chunk/rank, TP {reg['tp_size']})  machine {m['cpu_count']} CPUs {format_bytes(m['memory_bytes'])}"
        f"  torch {m.get('torch')}  {d['elapsed_s']:.1f} s[/]"
    )


def _plain(value: Any) -> str:
    """A measured value as a person reads it: `W=8: 1, W=16: 2`, not a Python repr."""
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        return ", ".join(_plain(v) for v in value) or "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _footer(console: Console, d: dict[str, Any]) -> None:
    for t in d["targets"]:
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: "[dim]n/a[/]"}[t["met"]]
        note = f"  [dim]({t['note']})[/]" if t.get("note") else ""
        console.print(f"target: {t['name']} {t['target']}: measured {_plain(t['measured'])} → {mark}{note}")
    files = d.get("files", {})
    console.print(
        f"[dim]bundle {files.get('bundle')}"
        + (f"; plots {', '.join(files['plots'])}" if files.get("plots") else "")
        + "[/]"
    )


def render_sweep(console: Console, d: dict[str, Any]) -> None:

    from bsr_cli.bench.plots import bar

    _header(console, d, f"E1 sweep, W={d['params']['W']}, B = RWS(W), restored from {d['params']['tier']} only")
    rows = [("", r) for r in d["rows"]] + [("R ", r) for r in d.get("repeat", {}).get("rows", [])]
    top_t = max((r.get("seconds", 0.0) for _, r in rows), default=0.0)
    t = _table(
        "tokens",
        "K",
        "committed",
        "peak MiB",
        "whole MiB",
        "restore s",
        "fetch s",
        "inst s",
        "GB/s",
        "hash",
        "healthy",
        "",
        "status",
    )
    for tag, r in rows:
        if r["status"] == "interrupted":
            t.add_row(f"{tag}{r['tokens']:,}", *[""] * 10, r.get("reason", ""), _status(r["status"]))
            continue
        t.add_row(
            f"{tag}{r['tokens']:,}",
            f"{r['windows']:,}",
            f"{r['committed_tokens']:,}",
            _mib(r["peak_pool_bytes"]),
            _mib(r["whole_plan_bytes"]),
            f"{r['seconds']:.2f}",
            f"{_mean(r, 'fetch_seconds'):.2f}",
            f"{_mean(r, 'install_seconds'):.2f}",
            f"{r['gbps']:.2f}",
            _yes(r["hash_ok"]),
            _yes(r["healthy"]),
            bar(r["seconds"], top_t, 10),
            _status(r["status"]),
        )
    console.print(t)
    s = d["summary"]
    if d.get("repeat"):
        console.print(f"R = the repeat with a fresh salt ({d['repeat']['salt']}), run {d['repeat']['run_id']}")
    console.print("fetch s, inst s: mean over ranks.  peak pool per rank against the whole-plan need (MiB):")
    top = max([r.get("whole_plan_bytes", 0) for _, r in rows] + [1])
    for _, r in rows:
        if r["status"] != "interrupted":
            console.print(
                f"  {r['tokens']:>8,}  BSR   {bar(r['peak_pool_bytes'], top, 40)} {_mib(r['peak_pool_bytes'])}"
            )
            console.print(f"  {'':>8}  whole {bar(r['whole_plan_bytes'], top, 40)} {_mib(r['whole_plan_bytes'])}")
    peaks = ", ".join(_mib(p) for p in s["peak_pool_bytes_per_rank"])
    console.print(
        f"block {s['block_seconds']:.1f} s; distinct peaks per rank [{peaks}] MiB; RWS {_mib(s['rws_bytes'])} MiB"
    )
    _footer(console, d)


def render_ladder(console: Console, d: dict[str, Any]) -> None:

    from bsr_cli.bench.plots import bar

    _header(console, d, "Whole-plan ladder (W=0), one engine start per rung")
    t = _table(
        "tokens",
        "need MiB",
        "predicted",
        "first pass",
        "peak MiB",
        "attempts",
        "",
        "status",
    )
    top = max((r["whole_plan_bytes"] for r in d["rows"]), default=1)
    for r in d["rows"]:
        atts = " ".join(("✓" if a["passed"] else "✗") + _short(a["rung"]) for a in r.get("attempts", []))
        t.add_row(
            f"{r['tokens']:,}",
            _mib(r["whole_plan_bytes"]),
            _short(r["predicted_rung"]) if r["predicted_rung"] else "beyond ladder",
            _short(r["first_passing_rung"]) if r["first_passing_rung"] else "—",
            _mib(r.get("measured_peak_bytes")),
            atts,
            bar(r["whole_plan_bytes"], top, 12),
            _status(r["status"]) + (f" {r['reason']}" if r.get("reason") else ""),
        )
    console.print(t)
    _footer(console, d)


def render_wlaw(console: Console, d: dict[str, Any]) -> None:

    from bsr_cli.bench.plots import bar

    _header(console, d, f"W law at {d['params']['tokens']:,} tokens (B = RWS(W) for each W)")
    t = _table("W", "W·Σc_i + aux MiB", "measured MiB/rank", "K", "restore s", "GB/s", "hash", "", "status")
    top = max((r.get("peak_pool_bytes", 0) for r in d["rows"]), default=1)
    for r in d["rows"]:
        if r["status"] == "interrupted":
            t.add_row(str(r["W"]), *[""] * 6, r.get("reason", ""), _status(r["status"]))
            continue
        t.add_row(
            str(r["W"]),
            _mib(r["law_bytes"]),
            _mib(r["peak_pool_bytes"]),
            f"{r['windows']:,}",
            f"{r['seconds']:.2f}",
            f"{r['gbps']:.2f}",
            _yes(r["hash_ok"]),
            bar(r["peak_pool_bytes"], top, 20),
            _status(r["status"]),
        )
    console.print(t)
    s = d["summary"]
    console.print(
        f"fit: {s['fit_slope_bytes_per_W']} bytes per W, intercept {s['fit_intercept_bytes']} "
        f"(core: {s['coefficient_bytes']:,}, aux {s['aux_bytes']:,})"
    )
    _footer(console, d)


def render_fs(console: Console, d: dict[str, Any]) -> None:

    from bsr_cli.bench.plots import bar

    p = d["params"]
    _header(
        console, d, f"Filesystem tier only, load concurrency {p['concurrencies']}, {p['tokens']:,} tokens, W={p['W']}"
    )
    s = d["summary"]
    t = _table("config", "runs", "GB/s (median)", "restore s", "fetch s/rank", "install s/rank", "")
    top = max((v["gbps"] for v in s["by_config"].values()), default=1.0)
    for name, v in s["by_config"].items():
        t.add_row(
            name,
            str(v["runs"]),
            f"{v['gbps']:.2f}",
            f"{v['seconds']:.2f}",
            f"{v['fetch_seconds']:.2f}",
            f"{v['install_seconds']:.2f}",
            bar(v["gbps"], top, 20),
        )
    console.print(t)
    peaks = ", ".join(_mib(x) for x in s["peak_pool_bytes_per_rank"])
    how = s["cold_method"] or "nothing (warm only)"
    console.print(f"speedup {s['speedup']}; distinct peaks per rank [{peaks}] MiB; pages evicted by {how}")
    if s.get("disk_gbps"):
        rates = ", ".join(f"c={c} {v} GB/s" for c, v in s["disk_gbps"].items())
        console.print(
            f"the disk alone (cold, same files and total threads): {rates}; its ceiling is {s['disk_headroom']}x the "
            f"serial restore, and concurrency {max(s['disk_gbps'], key=int)} used {s['restore_share_of_disk']} of it"
        )
    _footer(console, d)


def render_store(console: Console, d: dict[str, Any]) -> None:

    from bsr_cli.bench.plots import bar, store_bars

    p = d["params"]
    _header(console, d, f"Store bandwidth, restores of {p['tokens_restored']:,} tokens from Mooncake, W={p['W']}")
    labels, values = store_bars(d)
    top = max(values, default=1.0)
    t = _table("measurement", "GB/s per rank/client", "")
    for label, v in zip(labels, values, strict=True):
        t.add_row(label, f"{v:.3f}", bar(v, top, 30))
    console.print(t)
    s = d["summary"]
    if s.get("mooncake_aggregate_gbps"):
        console.print(
            "concurrent aggregate GB/s: " + ", ".join(f"{k} {v}" for k, v in s["mooncake_aggregate_gbps"].items())
        )
    r = _table(
        "config",
        "restore s",
        "fetch s",
        "install s",
        "peak MiB/rank",
        "× raw GET",
        title="where the restore time goes (median per rank; × raw GET: against the one measured just before)",
    )
    for name, v in s["restore"].items():
        paired = v.get("vs_paired_raw")
        r.add_row(
            name,
            f"{v['seconds']:.2f}",
            f"{v['fetch_seconds']:.2f}",
            f"{v['install_seconds']:.2f}",
            _mib(v["peak_pool_bytes"]),
            "-" if paired is None else f"{paired:.2f}",
        )
    console.print(r)
    console.print("ratios: " + ", ".join(f"{k} {v}" for k, v in s["ratios"].items() if v is not None))
    _footer(console, d)


def render_peer(console: Console, d: dict[str, Any]) -> None:
    from bsr_cli.bench.plots import bar

    p = d["params"]
    _header(console, d, f"bsr inside LMCache against stock LMCache 0.5.6, from Mooncake, W={p['W']}, TP {p['tp']}")
    la = d["machine"].get("loadavg") or []
    if la:
        console.print(f"[dim]load average at the start: {', '.join(str(x) for x in la)}[/]")
    t = _table(
        "tokens",
        "stock L1 MiB",
        "stock GB/s",
        "bsr L1 MiB",
        "bsr GB/s",
        "raw GB/s",
        "bsr/stock",
        "bsr/raw",
        "stock/raw",
        "L1 bsr/stock",
        title="throughput per rank (median of trials) and measured L1 peaks per rank",
    )
    by = d["summary"].get("by_prefix") or {}
    top = max((v["bsr"]["gbps_per_rank"] or 0 for v in by.values()), default=1.0)

    def f(x: float | None, digits: int = 2) -> str:
        return "—" if x is None else f"{x:.{digits}f}"

    for v in by.values():
        t.add_row(
            f"{v['tokens']:,}",
            _mib(v["stock"]["l1_peak_bytes"]),
            f(v["stock"]["gbps_per_rank"], 3),
            _mib(v["bsr"]["l1_peak_bytes"]),
            f(v["bsr"]["gbps_per_rank"], 3),
            f(v["raw"]["gbps_per_rank"], 3),
            f(v["bsr_vs_stock_gbps"]),
            f(v["bsr_vs_raw_gbps"]),
            f(v["stock_vs_raw_gbps"]),
            f(v["bsr_vs_stock_staging"], 4),
        )
    console.print(t)
    c = _table(
        "tokens",
        "raw GET",
        "stock",
        "bsr",
        "bsr install",
        "bsr/raw",
        "stock/raw",
        "",
        title="CPU seconds per GB restored (case process + Mooncake master + segment holder, from /proc)",
    )
    for v in by.values():
        c.add_row(
            f"{v['tokens']:,}",
            f(v["raw"]["cpu_s_per_gb"], 3),
            f(v["stock"]["cpu_s_per_gb"], 3),
            f(v["bsr"]["cpu_s_per_gb"], 3),
            f(v["bsr"]["install_cpu_s_per_gb"], 3),
            f(v["bsr_vs_raw_cpu"]),
            f(v["stock_vs_raw_cpu"]),
            bar(v["bsr"]["gbps_per_rank"] or 0, top or 1.0, 16),
        )
    console.print(c)
    for v in by.values():
        for b in v["below_rung"]:
            what = f"{b['loaded_tokens']:,} tokens" + (", timed out" if b["timed_out"] else "")
            bsr = "bsr committed at this L1 or less" if b["bsr_committed_at_this_l1"] else "bsr did not commit"
            console.print(f"below the rung: {v['tokens']:,} tokens, stock L1 {_mib(b['l1_bytes'])} MiB: {what}; {bsr}")
    _footer(console, d)


def render_failures(console: Console, d: dict[str, Any]) -> None:

    _header(console, d, f"Failure matrix ({d['params']['tokens']:,} tokens)")
    t = _table("scenario", "first pass", "fallback", "hash = canonical", "ranks healthy", "status")
    for r in d["rows"]:
        if r["status"] == "interrupted":
            t.add_row(r["scenario"], "", "", "", r.get("reason", ""), _status(r["status"]))
            continue
        fp, c = r["first_pass"], r["checks"]
        t.add_row(
            r["scenario"],
            f"collapsed {fp['advertised_tokens']:,}→{fp['committed_tokens']}"
            if c["prefix_collapsed"]
            else "[red]not collapsed[/]",
            r["fallback"] if c["fallback"] else f"[red]{r['fallback']} (want {r['expected_fallback']})[/]",
            _yes(c["hash_canonical"]),
            _yes(c["ranks_healthy"]),
            _status(r["status"]),
        )
    console.print(t)
    _footer(console, d)


# -- commands ----------------------------------------------------------------------------------------------------


@bench_app.command("sweep")
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
    prefixes = _ints(tokens, "--tokens")

    def run(client: AdminClient, meta: dict[str, Any], _state: Path | None) -> dict[str, Any]:
        return ex.run_sweep(
            client,
            prefixes=prefixes,
            w=w,
            repeat=not no_repeat,
            salt=salt,
            tier=tier,
            on_row=_row_note(st, "sweep"),
            engine_meta=meta,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("sweep", reg, w=w, prefixes=prefixes, repeat=not no_repeat)

    _execute(st, "sweep", out, embedded, registration, no_plots, run, options, render_sweep)


@bench_app.command("ladder")
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
    engine, restart it per rung yourself and use bsr_cli.bench.experiments.run_ladder)."""
    import tempfile

    from bsr_cli import loaders
    from bsr_cli.bench import experiments as ex

    st = state(ctx, json_flag)
    prefixes = _ints(tokens, "--tokens")
    steps = _ints(rungs, "--rungs", sizes=True)
    reg = loaders.load_registration(registration or "demo")
    with tempfile.TemporaryDirectory(prefix="bsr-bench-ladder-") as tmp:
        factory = ex.embedded_ladder_factory(Path(tmp), reg, max_tokens=max(prefixes))
        result = ex.run_ladder(
            factory,
            prefixes=prefixes,
            rungs=steps,
            warm_w=warm_w,
            salt=salt,
            on_row=_row_note(st, "ladder"),
            on_rung=lambda r: st.out.note(f"rung {format_bytes(r)}/rank: starting the embedded engine…"),
            on_attempt=lambda n, a: st.out.note(
                f"ladder {n:,} tokens at {format_bytes(a['rung'])}: {a['outcome']}"
                + (f" ({a['failure']})" if a.get("failure") else f", peak {format_bytes(a['peak_pool_bytes'])}/rank")
            ),
            engine_meta={"embedded": True},
        )
    _publish(st, result, out, no_plots, render_ladder)


@bench_app.command("wlaw")
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
    w_list = _ints(ws, "--Ws")

    def run(client: AdminClient, meta: dict[str, Any], _state: Path | None) -> dict[str, Any]:
        return ex.run_wlaw(
            client, tokens=tokens, ws=w_list, salt=salt, tier=tier, on_row=_row_note(st, "wlaw"), engine_meta=meta
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("wlaw", reg, ws=w_list, tokens=tokens)

    _execute(st, "wlaw", out, embedded, registration, no_plots, run, options, render_wlaw)


@bench_app.command("fs-concurrency")
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
    conc = _ints(concurrency, "--concurrency")

    def run(client: AdminClient, meta: dict[str, Any], state_dir: Path | None) -> dict[str, Any]:
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
            on_row=_row_note(st, "fs"),
            engine_meta=meta,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("fs-concurrency", reg, w=w, tokens=tokens)

    _execute(st, "fs-concurrency", out, embedded, registration, no_plots, run, options, render_fs)


@bench_app.command("store")
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
        raise InvalidInput("give --mooncake-master and --mooncake-metadata together")

    def run(client: AdminClient, meta: dict[str, Any], state_dir: Path | None) -> dict[str, Any]:
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
            on_row=_row_note(st, "store"),
            engine_meta=meta,
        )

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("store", reg, w=w, tokens=tokens, raw_bytes=raw)

    _execute(st, "store", out, embedded, registration, no_plots, run, options, render_store)


@bench_app.command("failures")
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

    def run(client: AdminClient, meta: dict[str, Any], _state: Path | None) -> dict[str, Any]:
        return ex.run_failures(client, tokens=tokens, w=w, on_row=_row_note(st, "failures"), engine_meta=meta)

    def options(reg: Any) -> EngineOptions:
        return ex.embedded_options("failures", reg, tokens=tokens, w=w)

    _execute(st, "failures", out, embedded, registration, no_plots, run, options, render_failures)


@bench_app.command("peer")
def peer(
    ctx: typer.Context,
    tokens: Annotated[
        str, typer.Option("--tokens", "-n", help="Comma-separated prefix lengths.")
    ] = "32768,65536,131072",
    w: WOpt = 32,
    tp: Annotated[int, typer.Option("--tp", help="TP ranks (one LMCache engine each).", min=1)] = 1,
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

    st = state(ctx, json_flag)
    prefixes = _ints(tokens, "--tokens")
    extra = _ints(below_rung, "--below-rung", sizes=True) if below_rung.strip() else []
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
            on_row=_row_note(st, "peer"),
        )
    _publish(st, result, out, no_plots, render_peer)


@bench_app.command("plot")
def plot(
    ctx: typer.Context,
    out: OutOpt = DEFAULT_OUT,
    to: Annotated[Path | None, typer.Option("--to", help="Directory for the PNGs [default: --out].")] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Redraw the plots from the latest bundle of each experiment in --out."""
    from bsr_cli.bench import bundle as bundles
    from bsr_cli.bench import plots as plotting

    st = state(ctx, json_flag)
    latest = bundles.latest(out)
    found = sorted(latest)
    if not found:
        raise InvalidInput(f"no bundles in {out}", hint="run an experiment first, e.g. `bsr bench sweep --embedded`")
    try:
        made = [str(p) for p in plotting.render_all(out, to, latest)]
    except ImportError as e:
        raise InvalidInput(str(e)) from None
    if not made:
        raise InvalidInput(
            f"nothing to plot in {out}: its bundles ({', '.join(found)}) have no plot",
            hint="plots come from sweep, ladder, wlaw, store and fs-concurrency bundles",
        )
    st.out.result({"plots": made, "bundles": found}, lambda c, d: c.print("\n".join(d["plots"])))


@bench_app.command("validate")
def validate(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Bundle files.", metavar="BUNDLE")],
    json_flag: JsonFlag = False,
) -> None:
    """Check evidence bundles against the schema (docs/bench-schema.json). Exit 2 when one does not match."""
    from bsr_cli.bench import bundle as bundles

    st = state(ctx, json_flag)
    report = {str(f): bundles.validation_errors(bundles.load(f)) for f in files}

    def render(console: Console, d: dict[str, Any]) -> None:
        for f, errs in d.items():
            console.print(f"{f}: " + ("[green]valid[/]" if not errs else "[red]invalid[/]\n  " + "\n  ".join(errs)))

    st.out.result(report, render)
    bad = [f for f, errs in report.items() if errs]
    if bad:
        raise InvalidInput(f"{len(bad)} bundle(s) do not match the schema: {', '.join(bad)}")


@bench_app.command("schema")
def schema(ctx: typer.Context) -> None:
    """Print the JSON Schema of evidence bundles."""
    from bsr_cli.bench import bundle as bundles

    typer.echo(bundles.schema_json(), nl=False)


RENDERERS: dict[str, Callable[[Console, dict[str, Any]], None]] = {
    "sweep": render_sweep,
    "ladder": render_ladder,
    "wlaw": render_wlaw,
    "fs-concurrency": render_fs,
    "store": render_store,
    "failures": render_failures,
    "peer": render_peer,
}


@bench_app.command("show")
def show(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A bundle file written by a bench experiment.", metavar="BUNDLE")],
    json_flag: JsonFlag = False,
) -> None:
    """Print a bundle's table again (validated against the schema first)."""
    from bsr_cli.bench import bundle as bundles

    st = state(ctx, json_flag)
    data = bundles.load(file)
    bundles.validate(data)
    st.out.result(data | {"files": {"bundle": str(file), "plots": []}}, RENDERERS[data["experiment"]])


# Experiments registered from their own modules (each adds its command and renderer).
from bsr_cli.cli.commands import bench_cpu_bound as _bench_cpu_bound  # noqa: E402,F401
