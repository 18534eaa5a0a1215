"""`bsr bench peer` end to end at a small prefix: a real mooncake_master and segment holder, real LMCache 0.5.6
engines in case processes, the CLI writing and validating the bundle. Checks the evidence, never the timings.

Runs through scripts/test-plugins (this interpreter has LMCache; it is handed to the command as its LMCache
Python); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

from bsr_cli.bench import bundle as bundles

CS = 256
CHUNK_BYTES = 4 << 20  # the default peer model: 16 KiB per token per rank
N = 16 * CS  # 64 MiB per rank
W = 2


@pytest.mark.timeout(420)
def test_peer_bench_small_prefix(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, BSR_LMCACHE_PYTHON=sys.executable, XDG_CONFIG_HOME=str(tmp_path), TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bsr_cli",
            "bench",
            "peer",
            "--tokens",
            str(N),
            "-W",
            str(W),
            "--deadline",
            "2",
            "--out",
            str(out),
            "--no-plots",
            "--salt",
            "5",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    # The small prefix may miss the throughput target (exit 0 either way: targets are reported, not enforced);
    # any row failing its checks exits 11.
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    path = Path(data["files"]["bundle"])
    saved = bundles.load(path)
    assert bundles.validation_errors(saved) == []
    assert saved["experiment"] == "peer" and saved["ok"] is True and not saved["interrupted"]

    rows = {(r["kind"], r["l1_bytes"]): r for r in saved["rows"]}
    raw, stock = rows[("raw", 0)], rows[("stock", N // CS * CHUNK_BYTES)]
    contig = rows[("stock_contiguous", N // CS * CHUNK_BYTES)]
    # bsr's L1 is B = 2 RWS(W) by default (the next window's fetch overlaps this one's install).
    bsr, below = rows[("bsr", 2 * W * CHUNK_BYTES)], rows[("stock", 2 * W * CHUNK_BYTES)]
    # Every side moved the whole prefix, verified bit-exact against the canonical KV (stock and bsr).
    assert raw["loaded_tokens"] == stock["loaded_tokens"] == contig["loaded_tokens"] == bsr["loaded_tokens"] == N
    assert stock["hash_ok"] is True and bsr["hash_ok"] is True
    # The contiguous destination's bytes, replayed into the paged KV after the clock, hash to the canonical KV.
    assert contig["hash_ok"] is True and contig["destination"] == "contiguous" and stock["destination"] == "paged"
    # Stock's retrieve by stage: the transfer and the install were each timed inside the call, and the lookup
    # before the contiguous case's clock is recorded apart.
    for r in (stock, contig):
        st = r["stage_seconds"]
        assert st["fetch"] > 0 and st["install"] > 0 and st["lookup"] >= 0
        assert st["fetch"] + st["install"] + st["lookup"] <= r["seconds"] + 1e-3  # rounded to 0.1 ms each
    assert contig["untimed_lookup_seconds"] > 0 and "untimed_lookup_seconds" not in stock
    # Measured L1 peaks: stock staged the whole plan, bsr two windows (one installing, the next arriving).
    assert stock["l1_peak_bytes"] == N // CS * CHUNK_BYTES
    assert bsr["l1_peak_bytes"] == 2 * W * CHUNK_BYTES and bsr["windows"] == N // CS // W
    # Below its rung, stock LMCache loads nothing and its retrieve runs into LMCache's blocking timeout.
    assert below["loaded_tokens"] == 0 and below["timed_out"] is True and below["status"] == "pass"
    # CPU per GB was measured from /proc for every process of the restore.
    for r in (raw, stock, contig, bsr):
        assert set(r["cpu_s_per_gb"]) >= {"process", "master", "segment_holder", "total"}
        assert r["cpu_s_per_gb"]["total"] > 0
    assert bsr["install_cpu_s_per_gb"] > 0 and raw["install_cpu_s_per_gb"] == 0
    # Every case's CPU and wall by stage: the transfer calls' CPU in all of them, bsr's checksum check and its wait
    # for the window ahead, the install wherever one happens; the process's CPU covers the stages.
    for r in (raw, stock, contig, bsr):
        sc = r["stage_costs"]
        assert sc["fetch"]["cpu_s"] > 0 and sc["fetch"]["wall_s"] > 0, r["kind"]
        assert sc["process_cpu_s"] > 0
    for r in (stock, contig, bsr):
        assert r["stage_costs"]["install"]["cpu_s"] > 0 and r["stage_costs"]["install"]["wall_s"] > 0
    assert bsr["stage_costs"]["verify"]["cpu_s"] > 0 and bsr["stage_costs"]["wait"]["wall_s"] > 0
    assert raw["stage_costs"]["install"] == stock["stage_costs"]["verify"] == {"wall_s": 0.0, "cpu_s": 0.0}

    s = saved["summary"]["by_prefix"][str(N)]
    assert s["stock_contiguous"]["loaded_tokens"] == N and s["bsr_vs_stock_contiguous_gbps"] is not None
    assert s["stock_contiguous"]["stage_seconds"]["install"] > 0 and s["bsr"]["stage_seconds"] is None
    assert s["bsr_vs_stock_staging"] == 2 * W / (N // CS)
    assert set(s["bsr"]["stage_costs"]["cpu_s_per_gb"]) == {"fetch", "verify", "install", "wait", "other"}
    assert s["below_rung"][0]["loaded_tokens"] == 0 and s["below_rung"][0]["bsr_committed_at_this_l1"] is True
    names = {t["name"].split(" at ")[0]: t for t in saved["targets"]}
    assert names["bsr commits where stock LMCache returns 0 tokens"]["met"] is True
    # Nothing left running: the case processes were in their own sessions and the services are stopped.
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


# -- the store through a bad minute: a segment holder stopped for 30 s between two cases -------------------------

STOP_S = 30.0


def _peer_with_a_stopped_holder(tmp_path: Path, ttl_s: int) -> tuple[Any, list[Any]]:
    """`bench peer` in-process (this interpreter is its LMCache Python) at a small prefix, its segment holder
    stopped (SIGSTOP) for 30 s as soon as the raw row is in, and always continued; (bundle, rows seen live)."""
    from bsr_cli.bench.peer import run_peer

    workdir = tmp_path / "work"
    seen: list[Any] = []

    def on_row(row: Any) -> None:
        seen.append(row)
        if len(seen) != 1:
            return
        store_case = json.loads(next(workdir.glob("case-*-store.json")).read_text())
        holder = int(store_case["watch_pids"]["segment_holder"])
        os.kill(holder, signal.SIGSTOP)
        try:
            end = time.monotonic() + STOP_S
            while time.monotonic() < end:  # the stop itself is what is tested: no case runs meanwhile
                time.sleep(0.5)
        finally:
            os.kill(holder, signal.SIGCONT)

    result = run_peer(tokens=[N], w=W, deadline_s=2.0, salt=5, workdir=workdir, on_row=on_row, store_client_ttl_s=ttl_s)
    return result, seen


@pytest.mark.timeout(600)
def test_peer_bench_survives_a_segment_holder_stopped_for_30s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bsr_cli.bench.evidence import RowStatus
    from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S

    monkeypatch.setenv("BSR_LMCACHE_PYTHON", sys.executable)
    result, seen = _peer_with_a_stopped_holder(tmp_path, DEFAULT_STORE_CLIENT_TTL_S)
    assert result.interrupted_by is None and seen[0].kind.value == "raw"
    # Every case after the stop read the whole prefix from the same store, verified against the canonical KV.
    rung = N // CS * CHUNK_BYTES
    after = [r for r in result.rows if r.kind.value == "bsr" or (r.l1_bytes == rung and r.kind.value != "raw")]
    assert sorted(r.kind.value for r in after) == ["bsr", "stock", "stock_contiguous"]
    assert all(r.status is RowStatus.PASS and r.measured.loaded_tokens == N for r in after), after
    assert all(r.measured.hash_ok is True for r in after)
    assert all(r.status is not RowStatus.INTERRUPTED and r.store_lost is None for r in result.rows)


@pytest.mark.timeout(600)
def test_a_store_lost_in_the_stop_is_named_in_the_rows_not_a_zero_token_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control (Mooncake's own 10 s TTL): the master drops the stopped holder's segment, and the
    bench says so instead of measuring stock LMCache and bsr at 0 tokens."""
    from rich.console import Console

    from bsr_cli.bench import bundle as bundles
    from bsr_cli.bench.evidence import BundleFiles, Interruption, PublishedBundle, RowStatus
    from bsr_cli.cli.commands.bench.common import exit_for
    from bsr_cli.cli.render.bench import table_for
    from bsr_cli.core.integrity import SIDECAR_BYTES
    from bsr_cli.core.limits import MOONCAKE_DEFAULT_CLIENT_TTL_S
    from bsr_cli.errors import ServerError

    monkeypatch.setenv("BSR_LMCACHE_PYTHON", sys.executable)
    result, seen = _peer_with_a_stopped_holder(tmp_path, MOONCAKE_DEFAULT_CLIENT_TTL_S)
    assert result.interrupted_by is Interruption.ERROR
    raw, lost = seen
    assert raw.kind.value == "raw" and raw.status is RowStatus.PASS
    # The next case never ran on an empty store: its row is the loss, with every object stored on the segment.
    assert lost.kind.value == "stock" and lost.status is RowStatus.INTERRUPTED and lost.measured is None
    loss = lost.store_lost
    assert loss is not None and loss.cause.value in ("unmounted", "remounted_empty")
    # Every object stored on the segment: per chunk (TP 1), its KV and the checksum sidecar bsr writes beside it.
    assert loss.objects_lost == 2 * (N // CS) and loss.bytes_lost == N // CS * (CHUNK_BYTES + SIDECAR_BYTES)
    assert lost.reason == loss.line() and lost.reason.startswith("the store dropped holder ")
    assert f"{2 * (N // CS)} objects (64.00 MiB) lost" in lost.reason and "0 tokens" not in lost.reason
    assert [r.kind.value for r in result.rows] == ["raw", "stock"]  # nothing measured on the empty store

    # The bundle validates, keeps the loss on the row, and the table and the exit say it.
    bundle = result.to_bundle()
    path = bundles.write(bundle, tmp_path / "out")
    saved = bundles.load(path)
    assert bundles.validation_errors(saved) == []
    assert saved["rows"][1]["store_lost"]["objects_lost"] == 2 * (N // CS)
    console = Console(record=True, width=200, color_system=None)
    table_for("peer")(console, PublishedBundle(bundle=bundle, files=BundleFiles(str(path), [])))
    text = console.export_text()
    assert f"store lost: stock at {N:,} tokens: the store dropped holder " in text and "FAIL" not in text
    with pytest.raises(ServerError, match="the experiment stopped early: the store dropped holder "):
        exit_for(bundle, path)
