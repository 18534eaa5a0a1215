"""Plots of evidence bundles: PNG files (matplotlib, the optional ``bench`` extra) and compact terminal charts.

PNG: peak pool per rank against prefix length (BSR W=32 against the whole-plan need and the ladder's measured
rungs), restore time against prefix length, measured RWS against W, store bandwidth, fs load concurrency, bsr
inside LMCache against stock LMCache.
matplotlib is imported only when a PNG is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bsr_cli.bench import bundle as bundles
from bsr_cli.bench.evidence import Bundle, RestoreEvidence, Row, completed, record_of, record_wire, rows_of
from bsr_cli.bench.fs_concurrency import FsParams, FsRestoreRow
from bsr_cli.bench.ladder import LadderRow
from bsr_cli.bench.sweep import SweepParams, SweepRow, SweepSummary
from bsr_cli.bench.wlaw import WLawParams, WLawRow
from bsr_cli.core.units import MiB, format_bytes

BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(value: float, top: float, width: int = 24) -> str:
    """A horizontal bar of ``value`` on a scale ending at ``top`` (eighth-cell resolution)."""
    if top <= 0 or value <= 0:
        return ""
    cells = max(0.0, min(1.0, value / top)) * width
    full = int(cells)
    frac = int((cells - full) * 8)
    return "█" * full + (BLOCKS[frac] if frac and full < width else "")


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("PNG plots need matplotlib: pip install 'bsr[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, *, dpi: int = 110, rect: tuple[float, float, float, float] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)
    return path


def _thousands(axis: Any) -> None:
    """Tick labels with thousands separators (131,072 rather than 131072 or 1.3e5)."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:,.0f}" if x >= 1 or x == 0 else f"{x:g}"))


def _subtitle(b: Bundle) -> str:
    reg, m = b.registration, b.machine
    return (
        f"{b.run_id}  ·  {reg.model} {format_bytes(reg.bytes_per_chunk, compact=True)}/chunk/rank, "
        f"TP {reg.tp_size}  ·  {m.cpu_count} CPUs, {format_bytes(m.memory_bytes, compact=True)}"
    )


def _restored(rows: list[Row]) -> list[tuple[int, RestoreEvidence]]:
    """The sweep's completed rows: each prefix length and its restore's evidence."""
    done = completed(rows_of(SweepRow, rows))
    return [(r.tokens, r.restore) for r in done if r.restore]


def peak_vs_prefix(sweep: Bundle | None, ladder: Bundle | None, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    if ladder:
        rows = [r for r in rows_of(LadderRow, ladder.rows) if r.whole_plan_bytes]
        xs = [r.tokens for r in rows]
        ax.plot(xs, [r.whole_plan_bytes / MiB for r in rows], "k--", label="whole-plan need (core: N·Σc_i + aux)")
        passed = [(r.tokens, r.first_passing_rung, r.passing) for r in completed(rows) if r.first_passing_rung]
        # Markers only: the ladder measures a rung at each prefix, nothing in between.
        ax.plot(
            [n for n, _, _ in passed],
            [rung / MiB for _, rung, _ in passed],
            "s",
            color="tab:red",
            markerfacecolor="none",
            markersize=10,
            label="W=0: first passing rung (measured)",
        )
        peaks = [(n, ev.peak_pool_bytes) for n, _, ev in passed if ev and ev.peak_pool_bytes]
        ax.plot(
            [n for n, _ in peaks],
            [peak / MiB for _, peak in peaks],
            "x",
            color="tab:red",
            markersize=9,
            label="W=0: measured peak pool",
        )
    if sweep:
        done = _restored(sweep.rows)
        if not ladder:
            ax.plot(
                [n for n, _ in done],
                [ev.whole_plan_bytes / MiB for _, ev in done],
                "k--",
                label="whole-plan need (core: N·Σc_i + aux)",
            )
        w = record_of(SweepParams, sweep.params).W
        ax.plot(
            [n for n, _ in done],
            [ev.peak_pool_bytes / MiB for _, ev in done],
            "o-",
            color="tab:blue",
            label=f"BSR W={w}: measured peak pool per rank",
        )
        rws = record_of(SweepSummary, sweep.summary).rws_bytes
        if rws:
            label = f"RWS({w}) = {format_bytes(rws, compact=True)}"
            ax.axhline(rws / MiB, color="tab:blue", linestyle=":", label=label)
        for n, ev in _restored(sweep.repeat.rows if sweep.repeat else []):
            ax.plot([n], [ev.peak_pool_bytes / MiB], "D", color="tab:green", label="fresh-salt repeat")
    ax.set_xlabel("prefix length (tokens)")
    # Log scale: the whole plan grows to GiB while BSR stays at RWS(W); on a linear axis the BSR line sits on zero.
    ax.set_yscale("log")
    ax.set_ylabel("restore pool per rank (MiB, log scale)")
    ax.set_title("Peak restore pool against prefix length", fontsize=11)
    _thousands(ax.xaxis)
    _thousands(ax.yaxis)
    source = sweep or ladder
    if source:
        also = f"  ·  ladder {ladder.run_id}" if sweep and ladder else ""
        fig.suptitle(_subtitle(source) + also, fontsize=7, y=0.01, va="bottom")
    ax.grid(alpha=0.3, which="both")
    # Beside the axes, so no curve is covered.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.set_size_inches(10.5, 4.8)
    return _save(fig, path)


def time_vs_prefix(sweep: Bundle, path: Path) -> Path:
    plt = _plt()
    done = _restored(sweep.rows)
    xs = [n for n, _ in done]

    def mean(values: list[float]) -> float:
        return sum(values) / max(len(values), 1)

    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.plot(xs, [ev.seconds for _, ev in done], "o-", label="restore (request)")
    ax.plot(xs, [mean([x.fetch_seconds for x in ev.ranks]) for _, ev in done], "s--", label="fetch (mean of ranks)")
    ax.plot(xs, [mean([x.install_seconds for x in ev.ranks]) for _, ev in done], "^--", label="install (mean of ranks)")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"Restore time against prefix length (W={record_of(SweepParams, sweep.params).W}, B = RWS)", fontsize=11
    )
    _thousands(ax.xaxis)
    ax2 = ax.twinx()
    ax2.plot(xs, [ev.gbps for _, ev in done], ":", color="grey", label="GB/s (all ranks)")
    ax2.set_ylabel("GB/s", color="grey")
    ax2.set_ylim(bottom=0)
    fig.suptitle(_subtitle(sweep), fontsize=7, y=0.01, va="bottom")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    return _save(fig, path)


def rws_vs_w(wlaw: Bundle, path: Path) -> Path:
    plt = _plt()
    rows = [(r.W, r.restore) for r in completed(rows_of(WLawRow, wlaw.rows)) if r.restore]
    reg = wlaw.registration
    ws = [w for w, _ in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if ws:
        line = [0, max(ws) * 1.1]
        ax.plot(
            line,
            [(w * reg.bytes_per_chunk + reg.aux_bytes) / MiB for w in line],
            "k--",
            label="W·Σc_i + aux (core)",
        )
    ax.plot(ws, [ev.peak_pool_bytes / MiB for _, ev in rows], "o", markersize=8, label="measured peak pool per rank")
    ax.set_xlabel("W (chunks per window)")
    ax.set_ylabel("RWS per rank (MiB)")
    ax.set_title(f"Measured RWS against W at {record_of(WLawParams, wlaw.params).tokens:,} tokens", fontsize=11)
    _thousands(ax.yaxis)
    fig.suptitle(_subtitle(wlaw), fontsize=7, y=0.01, va="bottom")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def store_bandwidth(store: Bundle, path: Path) -> Path:
    plt = _plt()
    labels, values = store_bars(store)
    notes = store_ratios(store)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 1.5))
    colors = ["tab:green" if lab.startswith("restore") else "tab:blue" for lab in labels]
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    for i, (lab, v) in enumerate(zip(labels[::-1], values[::-1], strict=True)):
        ratio = notes.get(lab)
        ax.text(
            v,
            i,
            f" {v:.2f}" + (f"  = {ratio:.2f}× paired raw GET" if ratio is not None else ""),
            va="center",
            fontsize=8,
        )
    ax.set_xlim(right=max(values, default=1) * 1.35)
    ax.set_xlabel("GB/s per rank / client")
    ax.set_title(
        "Store bandwidth beside the memory-copy ceiling (restores: × the raw GET paired in the same run)", fontsize=9
    )
    fig.suptitle(_subtitle(store), fontsize=7, y=0.01, va="bottom")
    return _save(fig, path)


def store_bars(store: Bundle) -> tuple[list[str], list[float]]:
    s = record_wire(store.summary)  # as sent: older store bundles have other keys than StoreSummary
    labels: list[str] = []
    values: list[float] = []
    for threads, g in s.get("memcpy_gbps", {}).items():
        labels.append(f"memcpy {threads} thread(s)")
        values.append(float(g))
    if s.get("checksum_gbps"):
        labels.append("crc32c 1 thread")
        values.append(float(s["checksum_gbps"]))
    for name, g in s.get("mooncake_gbps_per_client", {}).items():
        if g is not None:
            labels.append(f"mooncake {name}")
            values.append(float(g))
    if s.get("link_ceiling_gbps"):
        labels.append("link ceiling (tc tbf)")
        values.append(float(s["link_ceiling_gbps"]))
    for name, r in s.get("restore", {}).items():
        if r.get("gbps_per_rank") is not None:
            labels.append(f"restore {name}")
            values.append(float(r["gbps_per_rank"]))
    return labels, values


def store_ratios(store: Bundle) -> dict[str, float]:
    """Per restore bar label, its throughput as a multiple of the raw concurrent GET paired with it."""
    out: dict[str, float] = {}
    for name, r in record_wire(store.summary).get("restore", {}).items():
        if r.get("vs_paired_raw") is not None:
            out[f"restore {name}"] = float(r["vs_paired_raw"])
    return out


def fs_concurrency(fs: Bundle, path: Path) -> Path:
    plt = _plt()
    s = record_wire(fs.summary)  # as sent: FsSummary does not read every committed bundle back as written
    by = s.get("by_config", {})
    labels = list(by)
    spread = fs_spread(fs)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.8))
    medians = [by[k]["gbps"] for k in labels]
    lo = [max(0.0, m - spread.get(k, (m, m))[0]) for k, m in zip(labels, medians, strict=True)]
    hi = [max(0.0, spread.get(k, (m, m))[1] - m) for k, m in zip(labels, medians, strict=True)]
    ax.barh(
        labels[::-1],
        medians[::-1],
        xerr=[lo[::-1], hi[::-1]],
        color="tab:orange",
        capsize=3,
        label="restore, median (bars: min–max of trials)",
    )
    disk = s.get("disk_gbps") or {}
    for i, (c, g) in enumerate(sorted(disk.items(), key=lambda kv: int(kv[0]))):
        ax.axvline(
            float(g),
            color="k",
            linestyle="--" if i else ":",
            linewidth=1,
            label=f"disk alone, {c} thread(s): {float(g):.2f} GB/s",
        )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.set_size_inches(10.5, 0.4 * len(labels) + 1.8)
    ax.set_xlabel("restore GB/s (all ranks, median)")
    ax.set_title(f"Filesystem tier: load concurrency at {record_of(FsParams, fs.params).tokens:,} tokens", fontsize=11)
    fig.suptitle(_subtitle(fs), fontsize=7, y=0.01, va="bottom")
    return _save(fig, path)


def fs_spread(fs: Bundle) -> dict[str, tuple[float, float]]:
    """(min, max) GB/s of each configuration's trials, from the bundle's rows."""
    out: dict[str, list[float]] = {}
    for r in completed(rows_of(FsRestoreRow, fs.rows)):
        if r.restore is not None:
            out.setdefault(f"{r.cache}/c={r.concurrency}", []).append(float(r.restore.gbps))
    return {k: (min(v), max(v)) for k, v in out.items()}


def render_all(out_dir: Path, to: Path | None = None, found: dict[str, Bundle] | None = None) -> list[Path]:
    """Draw every plot the latest bundles in ``out_dir`` (or those ``found`` there already) allow, into ``to``
    (default: ``out_dir``)."""
    found = bundles.latest(out_dir) if found is None else found
    dest = to or out_dir
    made: list[Path] = []
    sweep, ladder = found.get("sweep"), found.get("ladder")
    if sweep or ladder:
        made.append(peak_vs_prefix(sweep, ladder, dest / "peak-vs-prefix.png"))
    if sweep and completed(sweep.rows):
        made.append(time_vs_prefix(sweep, dest / "restore-time-vs-prefix.png"))
    if "wlaw" in found and completed(found["wlaw"].rows):
        made.append(rws_vs_w(found["wlaw"], dest / "rws-vs-w.png"))
    if "store" in found and store_bars(found["store"])[0]:
        made.append(store_bandwidth(found["store"], dest / "store-bandwidth.png"))
    if "fs-concurrency" in found and record_wire(found["fs-concurrency"].summary).get("by_config"):
        made.append(fs_concurrency(found["fs-concurrency"], dest / "fs-concurrency.png"))
    if "peer" in found and record_wire(found["peer"].summary).get("by_prefix"):
        made.append(peer_plot(found["peer"], dest / "peer-lmcache.png"))
    return made


def peer_plot(b: Bundle, path: Path) -> Path:
    """bsr inside LMCache against stock LMCache: GB/s per rank beside raw GET, and the measured L1 peaks."""
    plt = _plt()
    by = list(record_wire(b.summary)["by_prefix"].values())
    x = list(range(len(by)))
    labels = [f"{v['tokens'] // 1024}K" for v in by]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.27
    for i, (key, name) in enumerate(
        (("raw", "raw Mooncake GET"), ("stock", "stock LMCache"), ("bsr", "bsr in LMCache"))
    ):
        vals = [v[key]["gbps_per_rank"] or 0 for v in by]
        ax1.bar([p + (i - 1) * width for p in x], vals, width, label=name)
    ax1.set_xticks(x, labels)
    ax1.set_xlabel("prefix (tokens)")
    ax1.set_ylabel("GB/s per rank")
    ax1.set_title("restore throughput")
    ax1.legend(fontsize=8)
    for i, (key, name) in enumerate((("stock", "stock LMCache"), ("bsr", f"bsr W={record_wire(b.params)['W']}"))):
        vals = [(v[key]["l1_peak_bytes"] or 0) / MiB for v in by]
        ax2.bar([p + (i - 0.5) * width for p in x], vals, width, label=name)
    ax2.set_yscale("log")
    ax2.set_xticks(x, labels)
    ax2.set_xlabel("prefix (tokens)")
    ax2.set_ylabel("measured L1 peak, MiB per rank")
    ax2.set_title("staging memory")
    ax2.legend(fontsize=8)
    fig.suptitle(_subtitle(b), fontsize=8)
    return _save(fig, path)
