"""`bsr bench cpu-bound`: the restore runtime made CPU-bound on purpose (bsr_cli/bench/cpu_bound.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.app import JsonFlag, state
from bsr_cli.cli.commands.bench_cmd import (
    DEFAULT_OUT,
    RENDERERS,
    NoPlotsOpt,
    OutOpt,
    RegOpt,
    SaltOpt,
    WOpt,
    _ints,
    _publish,
    _row_note,
    bench_app,
)

if TYPE_CHECKING:
    from rich.console import Console


def render_cpu_bound(console: Console, d: dict[str, Any]) -> None:
    from rich.table import Table

    s = d["summary"]
    console.print(
        f"baselines: memcpy {s['memcpy']['gbps']} GB/s ({s['memcpy']['cpu_s_per_gb']} CPU s/GB), "
        f"CRC32C {s['crc32c']['gbps']} GB/s ({s['crc32c']['cpu_s_per_gb']} CPU s/GB); {s['cores']:g} cores, "
        f"{s.get('free_cores', s['cores']):g} free at the start"
    )
    t = Table(
        title=f"{d['run_id']}: restore from a memory tier, {d['params']['tokens']:,} tokens, W={d['params']['W']}"
    )
    for col in ("B", "GB/s", "CPU s/GB", "fetch", "verify", "install", "other", "predicted GB/s", "measured/pred."):
        t.add_column(col, justify="right")
    for bw, b in s["by_budget_windows"].items():
        c = b["stage_cpu_s_per_gb"]
        t.add_row(
            f"{bw}·RWS",
            str(b["gbps"]),
            str(b["cpu_s_per_gb"]),
            *(str(c[k]) for k in ("fetch", "verify", "install", "other")),
            str(b["predicted_gbps"]),
            str(b["measured_over_predicted"]),
        )
    console.print(t)
    for bw, b in s["by_budget_windows"].items():
        model = ", ".join(
            f"{m['transport_gbps']:g} GB/s → {m['sustained_gbps']} GB/s ({m['cores_needed']} cores)"
            for m in b["rdma_model"]
        )
        console.print(f"{bw}·RWS, RDMA model per rank: {model}")


@bench_app.command("cpu-bound")
def cpu_bound(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prefix length.", min=1)] = 131072,
    w: WOpt = 32,
    budgets: Annotated[str, typer.Option("--budgets", help="Budgets B in windows, comma-separated.")] = "1,2",
    trials: Annotated[int, typer.Option("--trials", help="Interleaved repetitions.", min=1)] = 3,
    registration: RegOpt = None,
    out: OutOpt = DEFAULT_OUT,
    salt: SaltOpt = None,
    no_plots: NoPlotsOpt = False,
    json_flag: JsonFlag = False,
) -> None:
    """The restore runtime (pool, completeness check, CRC32C verify, install) from a tier that serves from memory,
    so the CPU is the limit: CPU seconds per GB per stage, and the model of what a rank sustains at RDMA speeds."""
    from bsr_cli.bench import cpu_bound as cb
    from bsr_cli.loaders import load_registration

    st = state(ctx, json_flag)
    reg = load_registration(registration or "demo")
    result = cb.run_cpu_bound(
        reg=reg,
        tokens=tokens,
        w=w,
        budget_windows=_ints(budgets, "--budgets"),
        trials=trials,
        salt=salt,
        on_row=_row_note(st, "cpu-bound"),
    )
    _publish(st, result, out, no_plots, render_cpu_bound)


RENDERERS["cpu-bound"] = render_cpu_bound
