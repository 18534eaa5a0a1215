"""The planning commands' tables (rws, plan, registration), and the registration summaries they also print as data."""

from __future__ import annotations

import re
from collections import Counter
from functools import partial
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from bsr_cli.core.registration import Registration
from bsr_cli.core.units import format_bytes

# Exact bytes and the binary-unit reading, as operators quote them: 525,074,432 (500.75 MiB). The one formatter.
b = partial(format_bytes, exact=True)


def first_break_line(br: dict[str, Any] | None) -> str:
    """Where the committable prefix ends, in one line (probe and plan say it the same way)."""
    if not br:
        return "[green]no break[/]: every rank and group holds the whole prompt"
    held = f" (held only by excluded {', '.join(br['held_by'])})" if br["held_by"] else ""
    return f"[yellow]first break[/]: chunk {br['chunk']} rank {br['rank']} group {br['group']}: {br['reason']}{held}"


def registration_summary(reg: Registration) -> dict[str, Any]:
    return {
        "model": reg.model,
        "identity": reg.identity,
        "source": reg.source,
        "tp_size": reg.tp_size,
        "chunk_size": reg.chunk_size,
        "tensors_count": len(reg.tensors),
        "bytes_per_token": reg.bytes_per_token,
        "bytes_per_chunk": reg.bytes_per_chunk,
        "aux_bytes": reg.aux_bytes,
        "groups": [
            {
                "name": g.name,
                "block_size": g.block_size,
                "tensors": len(reg.tensors_of(g.name)),
                "bytes_per_chunk": reg.group_bytes_per_chunk(g.name),
            }
            for g in reg.groups
        ],
    }


def tensor_rows(reg: Registration, every: bool) -> list[dict[str, Any]]:
    """One row per tensor, or one row per (group, dtype, shape) with a count (167 rows help nobody)."""
    if every:
        return [
            {
                "count": 1,
                "name": t.name,
                "group": t.group,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "bytes_per_chunk": t.bytes_per_token * reg.chunk_size,
            }
            for t in reg.tensors
        ]
    counts = Counter((t.group, t.dtype, t.shape) for t in reg.tensors)
    first: dict[tuple[str, str, tuple[int, ...]], str] = {}
    for t in reg.tensors:
        key = (t.group, t.dtype, t.shape)
        # layers.0.attn / layers.1.attn / ... -> layers.*.attn
        first[key] = t.name if key not in first else _merge_names(first[key], t.name)
    return [
        {
            "count": n,
            "name": first[k],
            "group": k[0],
            "dtype": k[1],
            "shape": list(k[2]),
            "bytes_per_chunk": n * reg.chunk_size * _prod_bytes(reg, k[0], k[1], k[2]),
        }
        for k, n in counts.items()
    ]


def _merge_names(a: str, b: str) -> str:
    pa, pb = re.split(r"(\d+)", a), re.split(r"(\d+)", b)
    if len(pa) != len(pb):
        return a
    return "".join(x if x == y else "*" for x, y in zip(pa, pb, strict=True))


def _prod_bytes(reg: Registration, group: str, dtype: str, shape: tuple[int, ...]) -> int:
    for t in reg.tensors:
        if (t.group, t.dtype, t.shape) == (group, dtype, shape):
            return t.bytes_per_token
    return 0


def _registration_tables(console: Console, s: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    console.print(
        f"[bold]{s['model']}[/]  {s['identity']}  tp={s['tp_size']}  chunk={s['chunk_size']} tokens  "
        f"{s['tensors_count']} tensors" + (f"  [dim]{s['source']}[/]" if s.get("source") else "")
    )
    t = Table(title="tensors (per rank)", title_justify="left")
    for col in ("count", "tensor", "group", "dtype", "shape/token"):
        t.add_column(col)
    t.add_column("bytes/chunk", justify="right")
    for r in rows:
        name = r["name"]
        t.add_row(
            str(r["count"]),
            name,
            r["group"],
            r["dtype"],
            "×".join(map(str, r["shape"])),
            f"{r['bytes_per_chunk']:,}",
        )
    console.print(t)
    g = Table(title="KV groups", title_justify="left")
    for col in ("group", "block size", "tensors"):
        g.add_column(col)
    g.add_column("bytes/chunk", justify="right")
    for grp in s["groups"]:
        g.add_row(grp["name"], str(grp["block_size"]), str(grp["tensors"]), f"{grp['bytes_per_chunk']:,}")
    g.add_row("[bold]Σ c_i[/]", "", str(s["tensors_count"]), f"[bold]{b(s['bytes_per_chunk'])}[/]")
    console.print(g)


def registration(console: Console, d: dict[str, Any]) -> None:
    _registration_tables(console, d, d["tensor_rows"])


def rws(console: Console, d: dict[str, Any]) -> None:
    _registration_tables(console, d["registration"], d["tensors"])
    w = d["W"]
    if w:
        console.print(
            f"RWS(W={w}) = {w} · {d['bytes_per_chunk']:,} + {d['aux_bytes']:,} = [bold]{b(d['rws_bytes'])}[/] per rank"
        )
    else:
        console.print("W=0: the whole-plan path; its staging grows with the prompt (see below)")
    sw = Table(title="window sweep", title_justify="left")
    sw.add_column("W", justify="right")
    sw.add_column("RWS per rank", justify="right")
    if d["tokens"]:
        sw.add_column(f"windows for {d['tokens']:,} tokens", justify="right")
    for row in d["sweep"]:
        cells = [str(row["W"]), b(row["rws_bytes"])]
        if d["tokens"]:
            cells.append(str(row["windows"]))
        sw.add_row(*cells, style="bold" if row["W"] == w else None)
    console.print(sw)
    if d["tokens"]:
        rung = d["whole_plan_ladder_rung"]
        console.print(
            f"{d['tokens']:,} tokens = {d['chunks']:,} chunks → {d['windows']} window(s) at W={w}; "
            f"whole-plan (W=0) staging {b(d['whole_plan_bytes'])} per rank → "
            + (f"first ladder rung {format_bytes(rung)}" if rung else "[red]above the largest ladder rung[/]")
        )
    if d["l1_bytes"] is not None:
        fit = d["max_W_for_l1"]
        console.print(
            f"L1 {b(d['l1_bytes'])} per rank holds W ≤ [bold]{fit}[/]"
            + ("" if fit else " [red](not even one chunk fits)[/]")
        )


def plan(console: Console, d: dict[str, Any]) -> None:
    w = d["W"]
    console.print(
        f"[bold]{d['model']}[/] {d['registration']}  W={w}{' (whole-plan path)' if w == 0 else ''}  "
        f"prompt {d['prompt_tokens']:,} tokens = {d['prompt_chunks']:,} chunks"
    )
    committed = d["committable_tokens"]
    console.print(
        f"committable prefix: [bold]{committed:,} tokens[/] ({d['committable_chunks']:,} chunks) "
        f"in {d['windows_count']} window(s)"
        + (
            f"; objects by tier: {', '.join(f'{k} {v:,}' for k, v in d['objects_by_tier'].items())}"
            if d["objects_by_tier"]
            else ""
        )
    )
    console.print(first_break_line(d["first_break"]))
    windows = d["windows"]
    if windows:
        t = Table(title="window schedule", title_justify="left")
        for col in ("window", "chunks", "tokens"):
            t.add_column(col, justify="right")
        groups = list(windows[0]["blocks"])
        for g in groups:
            t.add_column(f"{g} blocks", justify="right")
        t.add_column("bytes/rank", justify="right")
        shown = windows if d.get("show_all_windows") or len(windows) <= 10 else [*windows[:6], None, *windows[-2:]]
        for win in shown:
            if win is None:
                t.add_row("…", f"{len(windows) - 8} more", *([""] * (len(groups) + 2)))
                continue
            c0, c1 = win["chunks"]
            t0, t1 = win["tokens"]
            t.add_row(
                f"G{win['index'] + 1}",
                f"{c0}–{c1}",
                f"{t0:,}–{t1:,}",
                *(f"{win['blocks'][g][0]}–{win['blocks'][g][1]}" for g in groups),
                f"{win['bytes_per_rank']:,}",
            )
        console.print(t)
    cmp = Table(title="restore staging per rank", title_justify="left")
    cmp.add_column("path")
    cmp.add_column("peak live bytes", justify="right")
    cmp.add_column("ladder rung", justify="right")
    rung = d["whole_plan_rung"]
    if w:
        cmp.add_row(f"BSR, W={w}", b(d["peak_bytes_per_rank"]), "")
    cmp.add_row(
        "whole plan (W=0)",
        b(d["whole_plan_bytes"]),
        format_bytes(rung) if rung else ("—" if not d["committable_chunks"] else "beyond ladder"),
    )
    console.print(cmp)
    if w and d["whole_plan_bytes"] and d["peak_bytes_per_rank"]:
        ratio = d["whole_plan_bytes"] / d["peak_bytes_per_rank"]
        console.print(f"BSR stages {ratio:,.1f}× less than the whole-plan path for this prompt.")
    fit = d.get("capacity")
    if fit:  # a dry run against a live engine: can its budget B (W=0: its pool) admit these windows?
        if fit["fits"]:
            console.print(
                f"[green]fits[/] this engine: a window stages {b(fit['window_bytes'])} per rank; budget B "
                f"{b(fit['budget_bytes'])}, pool {b(fit['pool_bytes'])}"
            )
        else:
            console.print(f"[red]does not fit[/] this engine: {fit['message']}")


def registration_diff(console: Console, d: dict[str, Any]) -> None:
    a, bb = d["a"], d["b"]
    console.print(f"A: {a['source']} ({a['tensors']} tensors, {a['identity']})")
    console.print(f"B: {bb['source']} ({bb['tensors']} tensors, {bb['identity']})")
    if d["identical"]:
        console.print("[green]identical[/]")
        return
    t = Table()
    for col in ("change", "tensor", "group", "dtype", "shape/token"):
        t.add_column(col)
    for x in d["added"]:
        t.add_row(Text("+ added", style="green"), x["name"], x["group"], x["dtype"], "×".join(map(str, x["shape"])))
    for x in d["removed"]:
        t.add_row(Text("- removed", style="red"), x["name"], x["group"], x["dtype"], "×".join(map(str, x["shape"])))
    for ch in d["changed"]:
        x, y = ch["a"], ch["b"]
        t.add_row(
            Text("~ changed", style="yellow"),
            x["name"],
            f"{x['group']}→{y['group']}",
            f"{x['dtype']}→{y['dtype']}",
            f"{'×'.join(map(str, x['shape']))}→{'×'.join(map(str, y['shape']))}",
        )
    if t.row_count:
        console.print(t)
    for s in d["settings"]:
        console.print(f"{s['field']}: {s['a']} → {s['b']}")
    bpc = d["bytes_per_chunk"]
    console.print(f"Σ c_i: {bpc['a']:,} → {bpc['b']:,} bytes per chunk ({bpc['delta']:+,})")
    if d.get("rws_bytes"):
        r = d["rws_bytes"]
        console.print(f"RWS(W={d['W']}): {b(r['a'])} → {b(r['b'])} per rank")


def seconds(x: float) -> str:
    """A latency as people read it: milliseconds below a second, seconds above."""
    return f"{x * 1000:,.0f} ms" if x < 1 else f"{x:,.2f} s"


def trace_plan(console: Console, d: dict[str, Any]) -> None:
    """`bsr plan --trace`: the trace, its hits, then one row per restore path (whole plan, each budget B)."""
    span = d["span_s"]
    pace = "its own pace" if d["speedup"] == 1 else f"{d['speedup']:g}× its pace"
    share = d["hit_tokens"] / d["input_tokens"] if d["input_tokens"] else 0.0
    console.print(
        f"[bold]{d['trace']}[/]: {d['requests']:,} requests over {span:,.1f} s at {pace}; "
        f"{d['restores']:,} restore a hit, {d['hit_tokens']:,} of {d['input_tokens']:,} input tokens ({share:.1%})"
    )
    store = (
        f"LRU store of {d['store_capacity_blocks']:,} blocks ({d['evicted_blocks']:,} evicted)"
        if d["store_capacity_blocks"] is not None
        else "store keeps every block"
    )
    console.print(
        f"{d['model']} {d['registration']}  chunk {d['chunk_size']} tokens = {b(d['bytes_per_chunk'])} per rank; "
        f"W={d['W']}: RWS {b(d['rws_bytes'])}; bandwidth {d['bandwidth_bytes_per_s'] / 1e9:,.2f} GB/s per rank; "
        f"{store}"
    )
    big = d["largest_hit"]
    if big:
        console.print(
            f"largest single hit: {big['tokens']:,} tokens = {big['chunks']:,} chunks = "
            f"{b(big['bytes_per_rank'])} per rank (request #{big['request']}, counting from 0)"
        )
    t = Table(title="restore L1 and latency per rank", title_justify="left")
    t.add_column("path")
    t.add_column("B per rank", justify="right")
    t.add_column("peak L1 per rank", justify="right")
    for col in ("latency p50", "p95", "p99", "wait p50", "p95", "p99"):
        t.add_column(col, justify="right")
    t.add_column("in flight (peak)", justify="right")
    t.add_column("queued (peak)", justify="right")
    best = d["smallest_budget_meeting_p99"]
    for row in [d["whole_plan"], *d["bsr"]]:
        whole = row["path"] == "whole_plan"
        lat, wait = row["latency_s"], row["wait_s"]
        label = "whole plan (W=0)" if whole else f"BSR, B = {row['budget_rws']}·RWS"
        style = "bold" if best and row.get("budget_rws") == best["budget_rws"] and not whole else None
        t.add_row(
            label,
            "unbounded" if whole else format_bytes(row["budget_bytes"]),
            format_bytes(row["peak_bytes_per_rank"]),
            *(seconds(lat[p]) for p in ("p50", "p95", "p99")),
            *(seconds(wait[p]) for p in ("p50", "p95", "p99")),
            f"{row['peak_in_flight']:,}",
            f"{row['peak_queued']:,}",
            style=style,
        )
    console.print(t)
    whole = d["whole_plan"]
    target = d["p99_target_s"]
    if target is None:
        console.print("[dim]--p99 SECONDS names the smallest B that meets a p99 restore-latency target[/]")
    elif best:
        console.print(
            f"smallest B with p99 restore latency ≤ {seconds(target)}: [bold]{best['budget_rws']}·RWS = "
            f"{b(best['budget_bytes'])}[/] per rank, against {format_bytes(whole['peak_bytes_per_rank'])} "
            "for the whole plan"
        )
    else:
        tried = ", ".join(f"{r['budget_rws']}·RWS" for r in d["bsr"])
        wp99 = seconds(whole["latency_s"]["p99"])
        if whole["meets_p99"]:
            need = format_bytes(whole["peak_bytes_per_rank"])
            why = f"the whole plan meets it (p99 {wp99}) with {need}: try larger --budgets"
        else:
            why = f"neither does the whole plan (p99 {wp99}): the bandwidth, not B, limits latency here"
        console.print(f"[red]no budget B ({tried}) meets p99 ≤ {seconds(target)}[/]; {why}")
    for p in d.get("plots", []):
        console.print(f"plot: {p}")
    console.print(
        "[dim]model: transfer only, the per-rank bandwidth shared equally by the restores in flight, FIFO "
        "admission under B; see docs/capacity-planning.md[/]"
    )


def trace_replay(console: Console, d: dict[str, Any]) -> None:
    """`bsr bench trace`: the planner's prediction beside the engine's measurement, for the same slice."""
    console.print(
        f"[bold]{d['trace']}[/]: {d['requests']:,} requests from #{d['skip']}, time ×{d['speedup']:g}, tokens "
        f"×{d['block_tokens']}/512; {d['model']} {d['registration']} ({b(d['bytes_per_chunk'])} per chunk per "
        f"rank); W={d['W']}, B = {d['budget_rws']}·RWS = {b(d['budget_bytes'])} per rank; planner bandwidth "
        f"{d['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s per rank"
    )
    cal = d["calibration"]
    if cal:
        console.print(
            f"bandwidth measured by one restore of {cal['chunks']} chunks alone; one chunk alone takes "
            f"{seconds(cal['one_chunk_restore_s'])} (a fixed cost per restore the planner leaves out)"
        )
    p, m = d["predicted"], d["measured"]
    stock = d.get("stock") or {"run": False, "reason": "not recorded"}
    ran = bool(stock.get("run"))
    t = Table(title="planner against engine" + (" and stock LMCache" if ran else ""), title_justify="left")
    t.add_column("")
    t.add_column("predicted", justify="right")
    t.add_column("engine (bsr)", justify="right")
    if ran:
        t.add_column(f"stock LMCache {stock['lmcache']}", justify="right")

    def row(label: str, predicted: str, engine: str, stock_cell: str) -> None:
        t.add_row(label, predicted, engine, *([stock_cell] if ran else []))

    row("restores", f"{p['restores']:,}", f"{m['restores']:,}", f"{stock.get('restores', 0):,}")
    row("restored tokens", f"{p['hit_tokens']:,}", f"{m['hit_tokens']:,}", f"{stock.get('hit_tokens', 0):,}")
    row(
        "peak host memory per rank",
        format_bytes(p["peak_bytes_per_rank"]),
        format_bytes(m["peak_bytes_per_rank"]),
        format_bytes(stock.get("peak_bytes_per_rank", 0)),
    )
    # Stock LMCache stages every restore's whole plan: the planner's model of that is the whole-plan peak.
    row("whole-plan peak per rank", format_bytes(p["whole_plan_peak_bytes_per_rank"]), "", "")
    for q in ("p50", "p95", "p99"):
        row(
            f"restore latency {q}",
            seconds(p["latency_s"][q]),
            seconds(m["latency_s"][q]),
            seconds(stock["latency_s"][q]) if ran else "",
        )
    row("failed requests", "0", f"{m['failed']:,}", f"{stock.get('failed', 0):,}")
    console.print(t)
    c = d["committed"]
    console.print(
        f"committed exactly the predicted tokens: {c['exact']:,} of {d['requests']:,} requests; fewer: {c['fewer']:,} "
        "(a prefix still being stored by an earlier request in flight); more: "
        f"{c['more']:,}"
    )
    peaks = ", ".join(f"rank {r} {format_bytes(v)}" for r, v in m["pool_peak_by_rank"].items())
    console.print(f"pool peak per rank: {peaks} (B {format_bytes(d['budget_bytes'])})")
    if m["first_failure"]:
        console.print(f"[red]first failure[/]: {m['first_failure']}")
    if ran:
        sc = stock["committed"]
        sp = ", ".join(f"rank {r} {format_bytes(v)}" for r, v in stock["l1_peak_by_rank"].items())
        console.print(
            f"stock LMCache: L1 high-water per rank {sp} (L1 {format_bytes(stock['l1_bytes'])}, staging only; "
            "retrieves stage their whole plan, stores their chunks); "
            + (
                "one request at a time per rank, as vLLM's worker calls it"
                if stock.get("calls") == "serial"
                else "every client calls it, retrieves overlap"
            )
        )
        console.print(
            f"stock LMCache loaded exactly the hit's full chunks: {sc['exact']:,} of {d['requests']:,} requests; "
            f"fewer: {sc['fewer']:,}; more: {sc['more']:,}; {stock['hit_tokens']:,} of "
            f"{stock['expected_hit_tokens']:,} tokens ({stock['partial_chunk_tokens']:,} more sit in partial chunks "
            "LMCache does not store by default)"
        )
        if stock["first_failure"]:
            console.print(f"[red]stock LMCache's first failure[/]: {stock['first_failure']}")
    else:
        console.print(f"stock LMCache: not run ({stock['reason']})")
    for name, ok in d["checks"].items():
        console.print(f"{'[green]pass[/]' if ok else '[red]FAIL[/]'} {name.replace('_', ' ')}")
