"""What every `bsr bench` experiment command shares: its options, the engine it runs against (the configured one
or a dedicated embedded one), and publishing the bundle (write, plot, print, exit code)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.context import AppState
from bsr_cli.core.units import format_bytes, parse_bytes
from bsr_cli.errors import DrillViolation, InvalidInput, ServerError

if TYPE_CHECKING:
    from bsr_cli.bench.evidence import Bundle, OnRow, Row
    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions

OutOpt = Annotated[Path, typer.Option("--output", "-o", "--out", help="Directory for bundles and plots.")]
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

# An experiment run against a client, given the engine's facts (embedded, startup_s) and its state directory.
Experiment = Callable[["AdminClient", dict[str, bool | float | None], Path | None], "Bundle"]


def ints(text: str, what: str, *, sizes: bool = False) -> list[int]:
    try:
        values = [parse_bytes(x) if sizes else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInput(
            f"{what} takes comma-separated integers, got {text!r}", hint=f"e.g. {what} 8,16,32"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise InvalidInput(f"{what} must be positive", hint=f"e.g. {what} 8,16,32")
    return values


def row_note(st: AppState, experiment: str) -> OnRow:
    from bsr_cli.bench.evidence import RowStatus

    def note(row: Row) -> None:
        # The row's labels and measurement by their JSON names: one line across every experiment's row types.
        r, meta = row.to_wire(), row.meta
        status = {RowStatus.PASS: "[green]pass[/]", RowStatus.FAIL: "[red]FAIL[/]"}.get(
            meta.status, "[yellow]interrupted[/]"
        )
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
        if meta.reason:
            extra += f"  ({meta.reason})"
        st.out.note(f"{experiment} {what}: {status}{extra}")

    return note


def engine_client(st: AppState) -> AdminClient:
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import resolve_engine

    url, token, _ = resolve_engine(st.settings)
    # Restores of large prefixes stream for minutes; only plain calls use this deadline.
    return AdminClient(url, token, timeout_s=max(st.settings.timeout_s, 60.0))


def execute(
    st: AppState,
    experiment: str,
    out: Path,
    embedded: bool,
    registration: str | None,
    no_plots: bool,
    run: Experiment,
    options: Callable[[Any], EngineOptions],
) -> None:
    """Run an experiment against the configured engine or a dedicated embedded one, then write, plot, print."""
    from bsr_cli.bench import experiments as ex

    if embedded:
        import tempfile

        from bsr_cli import loaders

        reg = loaders.load_registration(registration or "demo")
        opts = options(reg)
        pool = format_bytes(opts.resolved().pool_bytes)
        st.out.note(f"starting a dedicated embedded engine for {experiment} (pool {pool}/rank)…")
        with tempfile.TemporaryDirectory(prefix="bsr-bench-") as tmp:
            t0 = time.monotonic()
            with ex.embedded_engine(Path(tmp), opts) as client:
                startup_s = round(time.monotonic() - t0, 3)
                meta: dict[str, bool | float | None] = {"embedded": True, "startup_s": startup_s}
                st.out.note(f"engine up in {startup_s:.1f} s at {client.url}")
                result = run(client, meta, Path(tmp))
    else:
        with engine_client(st) as client:
            result = run(client, {"embedded": False, "startup_s": None}, Path(st.settings.state_dir))
    publish(st, result, out, no_plots)


def publish(st: AppState, bundle: Bundle, out: Path, no_plots: bool) -> None:
    """Write the bundle, redraw the plots, print the experiment's table (or the bundle with --json), exit by it."""
    from bsr_cli.bench import bundle as bundles
    from bsr_cli.bench.evidence import BundleFiles, PublishedBundle

    path = bundles.write(bundle, out)
    plots: list[str] = []
    if not no_plots:
        try:
            from bsr_cli.bench import plots as plotting

            plots = [str(p) for p in plotting.render_all(out)]
        except ImportError as e:
            st.out.note(f"[yellow]no PNG plots:[/] {e}")
    from bsr_cli.cli.render.bench import table_for  # rich, only when a person reads the table

    st.out.result(PublishedBundle(bundle=bundle, files=BundleFiles(str(path), plots)), table_for(bundle.experiment))
    exit_for(bundle, path)


def exit_for(bundle: Bundle, path: Path) -> None:
    from bsr_cli.bench.evidence import Interruption, RowStatus

    rows = [r.meta for r in bundle.every_row()]
    if bundle.interrupted_by == Interruption.OPERATOR:
        raise KeyboardInterrupt
    if bundle.interrupted:
        reason = next((r.reason for r in rows if r.status == RowStatus.INTERRUPTED), "unknown")
        raise ServerError(f"the experiment stopped early: {reason}", hint=f"the partial bundle is {path}")
    failed = [r for r in rows if r.status == RowStatus.FAIL]
    if failed:
        what = sorted({k for r in failed for k, ok in (r.checks or {}).items() if not ok})
        raise DrillViolation(
            f"{len(failed)} row(s) failed their acceptance checks ({', '.join(what)})", hint=f"evidence: {path}"
        )
