"""`bsr bench cpu-bound`: the restore runtime made CPU-bound on purpose (bsr_cli/bench/cpu_bound.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from bsr_cli.cli.commands.bench.common import (
    DEFAULT_OUT,
    NoPlotsOpt,
    OutOpt,
    RegOpt,
    SaltOpt,
    WOpt,
    ints,
    publish,
    row_note,
)
from bsr_cli.cli.context import JsonFlag, state


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
        budget_windows=ints(budgets, "--budgets"),
        trials=trials,
        salt=salt,
        on_row=row_note(st, "cpu-bound"),
    )
    publish(st, result, out, no_plots)
