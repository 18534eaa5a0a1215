"""Plots of a trace plan (`bsr plan --trace --plot DIR`): L1 per rank over time, whole plan against each budget B,
and the restore-latency CDF per path. matplotlib (the optional ``bench`` extra) is imported only here, and this
module only when --plot is given."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

from bsr_cli.core.trace_sim import TracePlan
from bsr_cli.core.units import GiB, format_bytes
from bsr_cli.errors import InvalidInput

L1_PLOT = "trace-l1-over-time.png"
CDF_PLOT = "trace-latency-cdf.png"


def _plt():  # -> matplotlib.pyplot
    try:
        from bsr_cli.bench.plots import _plt as plt

        return plt()
    except ImportError:
        raise InvalidInput("--plot needs matplotlib", hint="pip install 'bsr[bench]'") from None


def _subtitle(plan: TracePlan) -> str:
    return (
        f"{Path(plan.source).name}: {plan.requests:,} requests, {plan.restores:,} restores  ·  {plan.model} "
        f"{format_bytes(plan.bytes_per_chunk, compact=True)}/chunk/rank, W={plan.w}  ·  "
        f"{plan.bandwidth / 1e9:.2f} GB/s per rank  ·  speed-up {plan.speedup:g}×"
    )


def _binned_max(series: Sequence[tuple[float, int]], edges: Sequence[float]) -> list[float]:
    """The most L1 held (GiB) within each bin [edges[i], edges[i+1]) of a step function: an hour of steps drawn
    as-is is a solid block of ink, its per-bin maximum still shows every peak."""
    out = [0.0] * (len(edges) - 1)
    j = 0
    level = 0
    for i in range(len(out)):
        top = level
        while j < len(series) and series[j][0] < edges[i + 1]:
            level = series[j][1]
            top = max(top, level)
            j += 1
        out[i] = top / GiB
    return out


def _window(series: Sequence[tuple[float, int]], t0: float, t1: float) -> tuple[list[float], list[float]]:
    """The step function on [t0, t1], starting from the level held at t0."""
    i = max(0, bisect.bisect_right([t for t, _ in series], t0) - 1)
    level = series[i][1] if series and series[i][0] <= t0 else 0
    xs, ys = [t0], [level / GiB]
    for t, v in series[i:]:
        if t0 < t <= t1:
            xs.append(t)
            ys.append(v / GiB)
    xs.append(t1)
    ys.append(ys[-1])
    return xs, ys


def l1_over_time(plan: TracePlan, path: Path, *, zoom_s: float = 60.0) -> Path:
    plt = _plt()
    fig, (whole_ax, zoom_ax) = plt.subplots(2, 1, figsize=(10.5, 7.2))
    runs = [plan.whole_plan, *reversed(plan.bsr)]  # the largest B first, so the smaller ones are drawn over it
    series = plan.whole_plan.l1_series
    end = max((s.l1_series[-1][0] for s in runs if s.l1_series), default=0.0) or 1.0
    bins = 400
    edges = [end * i / bins for i in range(bins + 1)]
    centres = [(edges[i] + edges[i + 1]) / 2 for i in range(bins)]
    for run in runs:
        style = {"color": "black", "linewidth": 0.8} if run.budget_rws is None else {"linewidth": 0.9}
        label = f"{run.label if run.budget_rws is None else 'BSR ' + run.label}: peak " + format_bytes(
            run.peak_bytes, compact=True
        )
        whole_ax.step(centres, _binned_max(run.l1_series, edges), where="mid", label=label, **style)
    whole_ax.set_title(f"Restore L1 per rank over the trace (the most held in each {end / bins:.1f} s)", fontsize=10)
    peak_at = max(series, key=lambda p: p[1])[0] if series else 0.0
    t0, t1 = max(0.0, peak_at - zoom_s / 2), peak_at + zoom_s / 2
    for run in runs:
        style = {"color": "black", "linewidth": 0.8} if run.budget_rws is None else {"linewidth": 1.0}
        xs, ys = _window(run.l1_series, t0, t1)
        zoom_ax.step(xs, ys, where="post", **style)
    zoom_ax.set_title(f"{zoom_s:g} s around the whole plan's peak, every step", fontsize=10)
    for ax in (whole_ax, zoom_ax):
        ax.set_xlabel("time (s, after the speed-up)")
        ax.set_ylabel("L1 held per rank (GiB)")
        ax.grid(alpha=0.3)
    whole_ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(_subtitle(plan), fontsize=7, y=0.005, va="bottom")
    return _save(fig, path)


def latency_cdf(plan: TracePlan, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10.5, 4.8))
    for run in (plan.whole_plan, *plan.bsr):
        n = len(run.latencies)
        if not n:
            continue
        # Latencies of zero cannot sit on a log axis; every restore moves at least one chunk, so none is zero.
        style = {"color": "black", "linestyle": "--"} if run.budget_rws is None else {}
        ax.step(run.latencies, [(i + 1) / n for i in range(n)], where="post", linewidth=1, label=run.label, **style)
    if plan.p99_target_s is not None:
        ax.axvline(plan.p99_target_s, color="tab:red", linestyle=":", label=f"p99 target {plan.p99_target_s:g} s")
    ax.axhline(0.99, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("restore latency: queue wait + transfer (s, log scale)")
    ax.set_ylabel("fraction of restores")
    ax.set_title("Restore latency CDF per budget B", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(_subtitle(plan), fontsize=7, y=0.01, va="bottom")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    from bsr_cli.bench.plots import _save as save  # imported by _plt

    return save(fig, path, dpi=90, rect=(0, 0.025, 1, 1))  # room for the subtitle under the axis label


def write_plots(plan: TracePlan, directory: Path) -> list[Path]:
    """Both plots into ``directory`` (created if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidInput(
            f"cannot write plots into {directory}: {e.strerror or e}", hint="give --plot a directory you can write"
        ) from None
    return [l1_over_time(plan, directory / L1_PLOT), latency_cdf(plan, directory / CDF_PLOT)]
