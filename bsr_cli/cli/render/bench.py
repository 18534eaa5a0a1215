"""The tables `bsr bench` prints for each experiment's bundle (rich, imported only when a table is drawn)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from bsr_cli.core.units import format_bytes
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from rich.console import Console

    from bsr_cli.bench.evidence import Bundle, PublishedBundle
    from bsr_cli.bench.peer_results import PeerPrefix
    from bsr_cli.core.wire import JsonValue


def _mib(n: int | None) -> str:
    """A number for a column headed "MiB"."""
    return format_bytes(n, unit="MiB")


def _short(n: int) -> str:
    """A rung in few characters (64 MiB, 1.0 GiB)."""
    return format_bytes(n, compact=True)


def _status(s: str) -> str:
    from bsr_cli.bench.evidence import RowStatus

    if s == RowStatus.PASS:
        return "[green]PASS[/]"
    return "[red]FAIL[/]" if s == RowStatus.FAIL else "[yellow]interrupted[/]"


def _yes(v: Any) -> str:
    return "[green]yes[/]" if v is True else ("—" if v is None else "[red]no[/]")


def _mean(values: Sequence[float]) -> float:
    """The mean over ranks (0 for none)."""
    return sum(values) / max(len(values), 1)


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


R = TypeVar("R")


def _rows_table(columns: Sequence[tuple[str, Callable[[R], str]]], rows: Iterable[R], title: str | None = None) -> Any:
    """A `_table` with a column per (heading, the cell it shows of a row) and a line per row."""
    t = _table(*(heading for heading, _ in columns), title=title)
    for row in rows:
        t.add_row(*(cell(row) for _, cell in columns))
    return t


def _header(console: Console, d: Bundle, title: str) -> None:
    reg, m = d.registration, d.machine
    where = "embedded (dedicated)" if d.engine.get("embedded") else d.engine["url"]
    console.print(f"[bold]{title}[/]  run {d.run_id}" + (f"  salt {d.salt}" if d.salt is not None else ""))
    console.print(
        f"[dim]engine {where}  registration {reg.identity} ({reg.model}, {format_bytes(reg.bytes_per_chunk)}"
        f"/chunk/rank, TP {reg.tp_size})  machine {m.cpu_count} CPUs {format_bytes(m.memory_bytes)}"
        f"  torch {m.torch}  {d.elapsed_s:.1f} s[/]"
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


def _footer(console: Console, pub: PublishedBundle) -> None:
    for t in pub.bundle.targets:
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: "[dim]n/a[/]"}[t.met]
        note = f"  [dim]({t.note})[/]" if t.note else ""
        console.print(f"target: {t.name} {t.target}: measured {_plain(t.measured)} → {mark}{note}")
    files = pub.files
    console.print(f"[dim]bundle {files.bundle}" + (f"; plots {', '.join(files.plots)}" if files.plots else "") + "[/]")


def render_sweep(console: Console, pub: PublishedBundle) -> None:
    from bsr_cli.bench.evidence import RowStatus, record_of, rows_of
    from bsr_cli.bench.plots import bar
    from bsr_cli.bench.sweep import SweepParams, SweepRow, SweepSummary

    d = pub.bundle
    p = record_of(SweepParams, d.params)
    _header(console, d, f"E1 sweep, W={p.W}, B = RWS(W), restored from {p.tier} only")
    repeat = d.repeat.rows if d.repeat else []
    rows = [("", r) for r in rows_of(SweepRow, d.rows)] + [("R ", r) for r in rows_of(SweepRow, repeat)]
    top_t = max((r.restore.seconds if r.restore else 0.0 for _, r in rows), default=0.0)
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
        ev = r.restore
        if r.meta.status == RowStatus.INTERRUPTED or ev is None:
            t.add_row(f"{tag}{r.tokens:,}", *[""] * 10, r.meta.reason or "", _status(r.meta.status))
            continue
        t.add_row(
            f"{tag}{r.tokens:,}",
            f"{ev.windows:,}",
            f"{ev.committed_tokens:,}",
            _mib(ev.peak_pool_bytes),
            _mib(ev.whole_plan_bytes),
            f"{ev.seconds:.2f}",
            f"{_mean([x.fetch_seconds for x in ev.ranks]):.2f}",
            f"{_mean([x.install_seconds for x in ev.ranks]):.2f}",
            f"{ev.gbps:.2f}",
            _yes(ev.hash_ok),
            _yes(ev.healthy),
            bar(ev.seconds, top_t, 10),
            _status(r.meta.status),
        )
    console.print(t)
    s = record_of(SweepSummary, d.summary)
    if d.repeat:
        console.print(f"R = the repeat with a fresh salt ({d.repeat.salt}), run {d.repeat.run_id}")
    console.print("fetch s, inst s: mean over ranks.  peak pool per rank against the whole-plan need (MiB):")
    top = max([r.restore.whole_plan_bytes if r.restore else 0 for _, r in rows] + [1])
    for _, r in rows:
        if r.meta.status != RowStatus.INTERRUPTED and (ev := r.restore) is not None:
            console.print(f"  {r.tokens:>8,}  BSR   {bar(ev.peak_pool_bytes, top, 40)} {_mib(ev.peak_pool_bytes)}")
            console.print(f"  {'':>8}  whole {bar(ev.whole_plan_bytes, top, 40)} {_mib(ev.whole_plan_bytes)}")
    peaks = ", ".join(_mib(peak) for peak in s.peak_pool_bytes_per_rank)
    console.print(f"block {s.block_seconds:.1f} s; distinct peaks per rank [{peaks}] MiB; RWS {_mib(s.rws_bytes)} MiB")
    _footer(console, pub)


def render_ladder(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle

    from bsr_cli.bench.evidence import rows_of
    from bsr_cli.bench.ladder import LadderRow
    from bsr_cli.bench.plots import bar

    _header(console, d, "Whole-plan ladder (W=0), one engine start per rung")
    rows = rows_of(LadderRow, d.rows)
    top = max((r.whole_plan_bytes for r in rows), default=1)

    def attempts(r: LadderRow) -> str:
        return " ".join(("✓" if a.passed else "✗") + _short(a.rung) for a in r.attempts)

    t = _rows_table(
        [
            ("tokens", lambda r: f"{r.tokens:,}"),
            ("need MiB", lambda r: _mib(r.whole_plan_bytes)),
            ("predicted", lambda r: _short(r.predicted_rung) if r.predicted_rung else "beyond ladder"),
            ("first pass", lambda r: _short(r.first_passing_rung) if r.first_passing_rung else "—"),
            ("peak MiB", lambda r: _mib(r.passing.peak_pool_bytes if r.passing else None)),
            ("attempts", attempts),
            ("", lambda r: bar(r.whole_plan_bytes, top, 12)),
            ("status", lambda r: _status(r.meta.status) + (f" {r.meta.reason}" if r.meta.reason else "")),
        ],
        rows,
    )
    console.print(t)
    _footer(console, pub)


def render_wlaw(console: Console, pub: PublishedBundle) -> None:
    from bsr_cli.bench.evidence import RowStatus, record_of, rows_of
    from bsr_cli.bench.plots import bar
    from bsr_cli.bench.wlaw import WLawParams, WLawRow, WLawSummary

    d = pub.bundle
    _header(console, d, f"W law at {record_of(WLawParams, d.params).tokens:,} tokens (B = RWS(W) for each W)")
    t = _table("W", "W·Σc_i + aux MiB", "measured MiB/rank", "K", "restore s", "GB/s", "hash", "", "status")
    rows = rows_of(WLawRow, d.rows)
    top = max((r.restore.peak_pool_bytes if r.restore else 0 for r in rows), default=1)
    for r in rows:
        ev = r.restore
        if r.meta.status == RowStatus.INTERRUPTED or ev is None:
            t.add_row(str(r.W), *[""] * 6, r.meta.reason or "", _status(r.meta.status))
            continue
        t.add_row(
            str(r.W),
            _mib(r.law_bytes),
            _mib(ev.peak_pool_bytes),
            f"{ev.windows:,}",
            f"{ev.seconds:.2f}",
            f"{ev.gbps:.2f}",
            _yes(ev.hash_ok),
            bar(ev.peak_pool_bytes, top, 20),
            _status(r.meta.status),
        )
    console.print(t)
    s = record_of(WLawSummary, d.summary)
    console.print(
        f"fit: {s.fit_slope_bytes_per_W} bytes per W, intercept {s.fit_intercept_bytes} "
        f"(core: {s.coefficient_bytes:,}, aux {s.aux_bytes:,})"
    )
    _footer(console, pub)


def render_fs(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle

    from bsr_cli.bench.evidence import record_of, record_wire
    from bsr_cli.bench.fs_concurrency import FsParams
    from bsr_cli.bench.plots import bar

    p = record_of(FsParams, d.params)
    _header(console, d, f"Filesystem tier only, load concurrency {p.concurrencies}, {p.tokens:,} tokens, W={p.W}")
    s = record_wire(d.summary)  # as sent: FsSummary does not read every committed bundle back as written
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
    _footer(console, pub)


def render_store(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle

    from bsr_cli.bench.evidence import record_wire
    from bsr_cli.bench.plots import bar, store_bars

    p = record_wire(d.params)  # as sent (and the summary): older store bundles have other keys
    _header(console, d, f"Store bandwidth, restores of {p['tokens_restored']:,} tokens from Mooncake, W={p['W']}")
    labels, values = store_bars(d)
    top = max(values, default=1.0)
    t = _table("measurement", "GB/s per rank/client", "")
    for label, v in zip(labels, values, strict=True):
        t.add_row(label, f"{v:.3f}", bar(v, top, 30))
    console.print(t)
    s = record_wire(d.summary)
    if s.get("mooncake_aggregate_gbps"):
        console.print(
            "concurrent aggregate GB/s: " + ", ".join(f"{k} {v}" for k, v in s["mooncake_aggregate_gbps"].items())
        )
    r = _rows_table(
        [
            ("config", lambda v: v["config"]),
            ("restore s", lambda v: f"{v['seconds']:.2f}"),
            ("fetch s", lambda v: f"{v['fetch_seconds']:.2f}"),
            ("install s", lambda v: f"{v['install_seconds']:.2f}"),
            ("peak MiB/rank", lambda v: _mib(v["peak_pool_bytes"])),
            ("× raw GET", lambda v: "-" if (paired := v.get("vs_paired_raw")) is None else f"{paired:.2f}"),
        ],
        [{**v, "config": name} for name, v in s["restore"].items()],
        title="where the restore time goes (median per rank; × raw GET: against the one measured just before)",
    )
    console.print(r)
    _store_stage_cpu(console, s["restore"])
    console.print("ratios: " + ", ".join(f"{k} {v}" for k, v in s["ratios"].items() if v is not None))
    _footer(console, pub)


def _store_stage_cpu(console: Console, restores: Mapping[str, JsonValue]) -> None:
    """Each restore configuration's CPU per GB by stage (bundles before the stage costs have none: no table)."""
    from bsr_cli.core.evidence import TimedStage
    from bsr_cli.core.stage_costs import OTHER_CPU

    keys = [*(s.value for s in TimedStage), OTHER_CPU]
    rows = [(name, per_gb) for name, v in restores.items() if (per_gb := _stage_cpu(v))]
    if not rows:
        return
    t = _table(
        "config",
        *keys,
        title="CPU seconds per GB a rank restored, by stage (medians over ranks; other: the rest of the rank "
        "process, the transport's own threads)",
    )
    for name, per_gb in rows:
        t.add_row(name, *(_peer_num(per_gb.get(k), 3) for k in keys))
    console.print(t)


def _stage_cpu(restore: JsonValue) -> dict[str, float]:
    """A restore configuration's CPU seconds per GB by stage, as its bundle says them (none in an older bundle)."""
    per_gb = restore.get("stage_cpu_s_per_gb") if isinstance(restore, dict) else None
    if not isinstance(per_gb, dict):
        return {}
    return {k: v for k, v in per_gb.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _peer_num(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render_peer(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle
    from bsr_cli.bench.evidence import record_wire
    from bsr_cli.bench.peer_results import PeerSummary

    p = record_wire(d.params)  # as sent: peer bundles write PeerParams with its model on the ranks
    _header(console, d, f"bsr inside LMCache against stock LMCache 0.5.6, from Mooncake, W={p['W']}, TP {p['tp']}")
    la = d.machine.loadavg or []
    if la:
        console.print(f"[dim]load average at the start: {', '.join(str(x) for x in la)}[/]")
    prefixes = list(PeerSummary.from_wire(record_wire(d.summary)).by_prefix.values())
    _peer_throughput(console, prefixes)
    _peer_stock_stages(console, prefixes)
    _peer_cpu(console, prefixes)
    _peer_stage_costs(console, prefixes)
    for v in prefixes:
        for b in v.below_rung:
            what = f"{b.loaded_tokens:,} tokens" + (", timed out" if b.timed_out else "")
            bsr = "bsr committed at this L1 or less" if b.bsr_committed_at_this_l1 else "bsr did not commit"
            console.print(f"below the rung: {v.tokens:,} tokens, stock L1 {_mib(b.l1_bytes)} MiB: {what}; {bsr}")
    for r in (record_wire(x) for x in d.rows):
        if r.get("status") == "interrupted" and r.get("reason"):
            lost = "[red]store lost[/]" if r.get("store_lost") else "[yellow]interrupted[/]"
            console.print(f"{lost}: {r['kind']} at {r['tokens']:,} tokens: {r['reason']}")
    _footer(console, pub)


def _peer_throughput(console: Console, prefixes: Sequence[PeerPrefix]) -> None:
    t = _rows_table(
        [
            ("tokens", lambda v: f"{v.tokens:,}"),
            ("stock L1 MiB", lambda v: _mib(v.stock.l1_peak_bytes)),
            ("stock GB/s", lambda v: _peer_num(v.stock.gbps_per_rank, 3)),
            ("contig GB/s", lambda v: _peer_num(v.stock_contiguous.gbps_per_rank if v.stock_contiguous else None, 3)),
            ("bsr L1 MiB", lambda v: _mib(v.bsr.l1_peak_bytes)),
            ("bsr GB/s", lambda v: _peer_num(v.bsr.gbps_per_rank, 3)),
            ("raw GB/s", lambda v: _peer_num(v.raw.gbps_per_rank, 3)),
            ("bsr/stock", lambda v: _peer_num(v.bsr_vs_stock_gbps)),
            ("bsr/contig", lambda v: _peer_num(v.bsr_vs_stock_contiguous_gbps)),
            ("bsr/raw", lambda v: _peer_num(v.bsr_vs_raw_gbps)),
            ("stock/raw", lambda v: _peer_num(v.stock_vs_raw_gbps)),
            ("contig/raw", lambda v: _peer_num(v.stock_contiguous_vs_raw_gbps)),
            ("L1 bsr/stock", lambda v: _peer_num(v.bsr_vs_stock_staging, 4)),
        ],
        prefixes,
        title="throughput per rank (median of trials) and measured L1 peaks per rank; stock into the paged KV, "
        "and contig: stock after its lookup into a contiguous destination",
    )
    console.print(t)


def _peer_stock_stages(console: Console, prefixes: Sequence[PeerPrefix]) -> None:
    """Where stock's time goes: its retrieve by stage, for both installs, beside the raw GET of the same bytes."""
    rows = [
        (v.tokens, name, side, side.stage_seconds, v.raw.seconds)
        for v in prefixes
        for name, side in (("paged", v.stock), ("contiguous", v.stock_contiguous))
        if side is not None and side.stage_seconds
    ]
    if not rows:
        return
    t = _table(
        "tokens",
        "stock install",
        "call s",
        "lookup s",
        "fetch s",
        "install s",
        "other s",
        "raw GET s",
        title="stock LMCache's retrieve by stage (wall seconds, medians): lookup (which tier holds each chunk), "
        "fetch (L1 allocation + transfer), install (the connector's copies)",
    )
    for n, name, side, st, raw_s in rows:
        parts: list[float | None] = [(st or {}).get(k) for k in ("lookup", "fetch", "install")]
        known = [x for x in parts if x is not None]
        # What is left of the call: LMCache's key hashing and bookkeeping (TP 1: the stages add up per rank).
        other = side.seconds - sum(known) if side.seconds is not None and len(known) == len(parts) else None
        t.add_row(
            f"{n:,}",
            name,
            _peer_num(side.seconds, 3),
            *(_peer_num(x, 3) for x in parts),
            _peer_num(other, 3),
            _peer_num(raw_s, 3),
        )
    console.print(t)


def _peer_cpu(console: Console, prefixes: Sequence[PeerPrefix]) -> None:
    from bsr_cli.bench.plots import bar

    top = max((v.bsr.gbps_per_rank or 0 for v in prefixes), default=1.0)
    c = _rows_table(
        [
            ("tokens", lambda v: f"{v.tokens:,}"),
            ("raw GET", lambda v: _peer_num(v.raw.cpu_s_per_gb, 3)),
            ("stock", lambda v: _peer_num(v.stock.cpu_s_per_gb, 3)),
            ("contig", lambda v: _peer_num(v.stock_contiguous.cpu_s_per_gb if v.stock_contiguous else None, 3)),
            ("bsr", lambda v: _peer_num(v.bsr.cpu_s_per_gb, 3)),
            ("bsr install", lambda v: _peer_num(v.bsr.install_cpu_s_per_gb, 3)),
            ("bsr/raw", lambda v: _peer_num(v.bsr_vs_raw_cpu)),
            ("stock/raw", lambda v: _peer_num(v.stock_vs_raw_cpu)),
            ("", lambda v: bar(v.bsr.gbps_per_rank or 0, top or 1.0, 16)),
        ],
        prefixes,
        title="CPU seconds per GB restored (case process + Mooncake master + segment holder, from /proc)",
    )
    console.print(c)


def _peer_stage_costs(console: Console, prefixes: Sequence[PeerPrefix]) -> None:
    """Where each case's CPU goes, stage by stage: the next regression names its stage."""
    from bsr_cli.core.evidence import TimedStage
    from bsr_cli.core.stage_costs import OTHER_CPU

    sides = [
        (v.tokens, name, side.stage_costs)
        for v in prefixes
        for name, side in (("raw GET", v.raw), ("stock", v.stock), ("contig", v.stock_contiguous), ("bsr", v.bsr))
        if side is not None and side.stage_costs is not None
    ]
    if not sides:
        return
    stages = [s.value for s in TimedStage]
    t = _table(
        "tokens",
        "case",
        *(f"{s} CPU/GB" for s in stages),
        "other CPU/GB",
        *(f"{s} s" for s in stages),
        title="by stage (medians): CPU seconds per GB restored of the threads doing each stage, the rest of the "
        "case process (other: the transport's own threads, bookkeeping), and wall seconds (summed over windows; "
        "they overlap when fetches run ahead)",
    )
    for n, name, st in sides:
        assert st is not None
        t.add_row(
            f"{n:,}",
            name,
            *(_peer_num(st.cpu_s_per_gb.get(s), 3) for s in stages),
            _peer_num(st.cpu_s_per_gb.get(OTHER_CPU), 3),
            *(_peer_num(st.wall_s.get(s), 3) for s in stages),
        )
    console.print(t)


def render_failures(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle
    from bsr_cli.bench.evidence import RowStatus, record_of
    from bsr_cli.bench.failures import FailuresParams

    _header(console, d, f"Failure matrix ({record_of(FailuresParams, d.params).tokens:,} tokens)")
    t = _table("scenario", "first pass", "fallback", "hash = canonical", "ranks healthy", "status")
    # Read as sent: failure rows of older bundles lack keys `FailureRow` needs (a first pass's failure kind).
    for r in (row.to_wire() for row in d.rows):
        if r["status"] == RowStatus.INTERRUPTED:
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
    _footer(console, pub)


def render_cpu_bound(console: Console, pub: PublishedBundle) -> None:
    d = pub.bundle
    from rich.table import Table

    from bsr_cli.bench.evidence import record_wire

    s, p = record_wire(d.summary), record_wire(d.params)  # as sent: cpu-bound has no params or summary reader
    console.print(
        f"baselines: memcpy {s['memcpy']['gbps']} GB/s ({s['memcpy']['cpu_s_per_gb']} CPU s/GB), "
        f"CRC32C {s['crc32c']['gbps']} GB/s ({s['crc32c']['cpu_s_per_gb']} CPU s/GB); {s['cores']:g} cores, "
        f"{s.get('free_cores', s['cores']):g} free at the start"
    )
    t = Table(title=f"{d.run_id}: restore from a memory tier, {p['tokens']:,} tokens, W={p['W']}")
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


def render_trace(console: Console, pub: PublishedBundle) -> None:
    """`bsr bench trace`'s report again, as the replay printed it."""
    from bsr_cli.bench.trace_bundle import report_of
    from bsr_cli.cli.render.planning import trace_replay

    trace_replay(console, report_of(pub.bundle, pub.files.bundle))


TABLES: dict[str, Callable[[Console, PublishedBundle], None]] = {
    "sweep": render_sweep,
    "ladder": render_ladder,
    "wlaw": render_wlaw,
    "fs-concurrency": render_fs,
    "store": render_store,
    "failures": render_failures,
    "peer": render_peer,
    "cpu-bound": render_cpu_bound,
    "trace": render_trace,
}
"""Each experiment's table, by the bundle's ``experiment``: a new experiment adds its renderer here."""


def table_for(experiment: str) -> Callable[[Console, PublishedBundle], None]:
    try:
        return TABLES[experiment]
    except KeyError:
        raise InvalidInput(
            f"no table for experiment {experiment!r} (known: {', '.join(TABLES)})",
            hint="`bsr bench show` reads bundles of the experiments bsr ships",
        ) from None
