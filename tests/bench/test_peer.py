"""`bsr bench peer` without LMCache: the one-line error naming the setup command, and the summary's arithmetic on
rows shaped like the case processes report them. The end-to-end run (real LMCache, real Mooncake) is
tests/plugins/test_peer.py, in the LMCache venv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bsr_cli.bench import peer as pe
from bsr_cli.bench.evidence import RowStatus

REG = pe.registration(pe.DEFAULT_MODEL, 1)
CHUNK = REG.bytes_per_chunk


@pytest.mark.timeout(30)
def test_missing_lmcache_python_is_one_line_with_the_setup_command(bsr: Any, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(pe.ENV_PYTHON, str(tmp_path / "nowhere" / "python"))
    res = bsr("bench", "peer", "--tokens", "4096", "--out", str(tmp_path))
    assert res.code == 13, res.err
    lines = [x for x in res.err.splitlines() if x.strip()]
    assert "no Python with LMCache 0.5.6" in lines[0] and "Traceback" not in res.err
    assert "scripts/test-plugins" in res.err
    assert not list(tmp_path.glob("br-*.json"))  # nothing measured, nothing written


def _case(loaded: int, seconds: float, peak: int, cpu: float, *, timed_out: bool = False) -> dict[str, Any]:
    return {
        "outcome": "loaded" if loaded else "timed_out",
        "loaded_tokens": loaded,
        "seconds": seconds,
        "l1_peak_bytes": peak,
        "hash_ok": True if loaded else None,
        "timed_out": timed_out,
        "windows": 1,
        "cpu": {"process": cpu, "master": 0.0, "segment_holder": 0.0},
        "install_cpu_seconds": cpu / 4,
    }


def _row(kind: str, n: int, l1: int, trial: int, case: dict[str, Any], reg: Any, w: int | None) -> pe.PeerRow:
    """The row of a case whose process printed ``case`` (its JSON line)."""
    return pe.case_row(pe.PeerKind(kind), n, l1, trial, pe.CaseResult.from_wire(case), reg, w)


def _targets(s: pe.PeerPrefix, w: int) -> list:
    return pe.targets(pe.PeerSummary({str(s.tokens): s}, w, w * CHUNK))


@pytest.mark.timeout(30)
def test_summary_ratios_and_targets_from_one_run() -> None:
    n = 131_072
    whole = n // 256 * CHUNK  # 2 GiB at 16 KiB per token
    w = 16
    rows = [
        _row("raw", n, 0, 0, _case(n, 2.0, 0, 1.0) | {"install_cpu_seconds": 0.0}, REG, None),
        _row("stock", n, whole, 0, _case(n, 4.0, whole, 2.0), REG, None),
        _row("bsr", n, w * CHUNK, 0, _case(n, 3.2, w * CHUNK, 1.2), REG, w),
        _row("stock", n, w * CHUNK, 0, _case(0, 10.0, w * CHUNK, 0.5, timed_out=True), REG, None),
    ]
    assert [r.status for r in rows] == ["pass"] * 4
    s = pe.summarize(rows, REG, w).by_prefix[str(n)]
    assert s.bsr_vs_stock_gbps == 1.25 and s.stock_vs_raw_gbps == 0.5
    assert s.bsr_vs_stock_staging == w * CHUNK / whole == 1 / 32
    assert s.bsr_vs_raw_cpu == pytest.approx(1.2, abs=1e-3) and s.stock_vs_raw_cpu == pytest.approx(2.0, abs=1e-3)
    assert s.below_rung == (
        pe.BelowRung(
            l1_bytes=w * CHUNK,
            loaded_tokens=0,
            outcome="timed_out",
            timed_out=True,
            seconds=10.0,
            bsr_committed_at_this_l1=True,
        ),
    )
    met = {t.name.split(" at ")[0].split(" against a")[0]: t.met for t in _targets(s, w)}
    assert met == {
        "bsr against stock LMCache": True,
        "bsr commits where stock LMCache returns 0 tokens": True,
        "CPU seconds per GB restored": True,
        # No contiguous row in this run: bsr's CPU against stock's faster install is unknown, never met.
        "CPU seconds per GB restored against stock LMCache's faster install,": None,
    }
    # A bsr restore whose L1 peak exceeds its budget (its case's L1) fails its row, whatever its speed.
    over = _row("bsr", n, w * CHUNK, 0, _case(n, 1.0, 2 * w * CHUNK, 1.0), REG, w)
    assert over.status == RowStatus.FAIL and over.checks["l1_peak_at_most_budget"] is False
    # Two windows within a budget of two pass; a peak that is not whole chunks does not.
    two = _row("bsr", n, 2 * w * CHUNK, 0, _case(n, 1.0, 2 * w * CHUNK, 1.0), REG, w)
    assert two.status == RowStatus.PASS
    odd = _row("bsr", n, 2 * w * CHUNK, 0, _case(n, 1.0, 2 * w * CHUNK - 4096, 1.0), REG, w)
    assert odd.status == RowStatus.FAIL and odd.checks["l1_peak_whole_chunks"] is False


@pytest.mark.timeout(30)
def test_stock_contiguous_is_summarized_and_the_target_holds_against_the_faster_stock() -> None:
    n = 131_072
    whole = n // 256 * CHUNK
    w = 32
    staged = {"lookup": 0.05, "fetch": 1.6, "install": 0.4}

    def trial(t: int, bsr_s: float, contig_s: float) -> list[pe.PeerRow]:
        return [
            _row("raw", n, 0, t, _case(n, 1.6, 0, 1.0) | {"install_cpu_seconds": 0.0}, REG, None),
            _row("stock", n, whole, t, _case(n, 2.2, whole, 2.0) | {"stage_seconds": staged}, REG, None),
            _row(
                pe.PeerKind.STOCK_CONTIGUOUS,
                n,
                whole,
                t,
                _case(n, contig_s, whole, 1.8) | {"stage_seconds": staged | {"install": 0.1}},
                REG,
                None,
            ),
            _row("bsr", n, 2 * w * CHUNK, t, _case(n, bsr_s, 2 * w * CHUNK, 1.2), REG, w),
        ]

    # bsr beats stock into the paged KV in every trial, but not stock into a contiguous destination.
    rows = trial(0, 2.0, 1.9) + trial(1, 2.0, 1.9) + trial(2, 2.0, 1.9)
    assert all(r.status == RowStatus.PASS for r in rows)
    assert rows[1].to_wire()["stage_seconds"] == staged and "stage_seconds" not in rows[0].to_wire()
    s = pe.summarize(rows, REG, w).by_prefix[str(n)]
    assert s.bsr_vs_stock_gbps == pytest.approx(1.1, abs=1e-3)
    assert s.bsr_vs_stock_contiguous_gbps == pytest.approx(0.95, abs=1e-3)
    assert s.stock_contiguous_vs_raw_gbps == pytest.approx(1.6 / 1.9, abs=1e-3)
    assert s.per_trial["bsr_vs_stock"] == pytest.approx([1.1, 1.1, 1.1], abs=1e-3)
    assert s.per_trial["bsr_vs_stock_contiguous"] == pytest.approx([0.95, 0.95, 0.95], abs=1e-3)
    assert s.stock_contiguous.stage_seconds == {"lookup": 0.05, "fetch": 1.6, "install": 0.1}
    assert s.bsr.stage_seconds is None
    first = _targets(s, w)[0]
    # Ahead of the paged install alone would have met the target; against the faster install it is not met.
    assert first.met is False and "contiguous 0.9" in str(first.measured) and str(first.measured).startswith("0.9")
    # Where bsr is ahead of both, the target is met.
    ahead = pe.summarize(trial(0, 1.5, 1.9), REG, w).by_prefix[str(n)]
    assert _targets(ahead, w)[0].met is True
    # Ahead of the contiguous install but less than 1.15x stock into the paged KV: not met.
    close = pe.summarize(trial(0, 1.95, 2.0), REG, w).by_prefix[str(n)]
    assert close.bsr_vs_stock_gbps == pytest.approx(2.2 / 1.95, abs=1e-3) and _targets(close, w)[0].met is False
    # bsr's CPU per GB (1.2 s) against stock contiguous's (1.8 s): met; above it, not.
    cpu = _targets(ahead, w)[3]
    assert cpu.name.startswith("CPU seconds per GB restored against stock") and cpu.met is True
    costly = [
        r if r.kind != "bsr" else _row("bsr", n, 2 * w * CHUNK, 0, _case(n, 1.5, 2 * w * CHUNK, 2.0), REG, w)
        for r in trial(0, 1.5, 1.9)
    ]
    assert _targets(pe.summarize(costly, REG, w).by_prefix[str(n)], w)[3].met is False


@pytest.mark.timeout(60)
def test_show_renders_both_stock_installs_and_stocks_stages(bsr: Any) -> None:
    evidence = Path(__file__).resolve().parents[2] / "docs" / "evidence"
    res = bsr("bench", "show", str(evidence / "br-peer-432b3b25ed0b.json"))
    assert res.code == 0, res.err
    assert "contig GB/s" in res.out and "bsr/contig" in res.out
    stages = [
        x.split() for x in res.out.splitlines() if x.split()[:2] in (["131,072", "paged"], ["131,072", "contiguous"])
    ]
    assert [s[1] for s in stages] == ["paged", "contiguous"] and all(len(s) == 8 for s in stages)
    assert "None" not in res.out and "?" not in res.out
    # A bundle from before the contiguous row renders with a dash there and no stage table.
    old = bsr("bench", "show", str(evidence / "br-peer-5478bdec7f7d.json"))
    assert old.code == 0 and "stock LMCache's retrieve by stage" not in old.out and "None" not in old.out


@pytest.mark.timeout(30)
def test_each_cases_stage_costs_reach_its_row_and_the_summary_per_gb() -> None:
    n = 131_072
    gb = n * REG.bytes_per_token / 1e9
    costs = {
        "fetch": {"wall_s": 2.0, "cpu_s": 0.4 * gb},
        "verify": {"wall_s": 0.3, "cpu_s": 0.1 * gb},
        "install": {"wall_s": 0.5, "cpu_s": 0.2 * gb},
        "wait": {"wall_s": 0.7, "cpu_s": 0.0},
        "process_cpu_s": 1.0 * gb,
    }
    bsr = _row("bsr", n, 64 * CHUNK, 0, _case(n, 2.0, 64 * CHUNK, 1.2) | {"stage_costs": costs}, REG, 32)
    older = _row("raw", n, 0, 0, _case(n, 2.0, 0, 1.0) | {"install_cpu_seconds": 0.0}, REG, None)
    assert bsr.to_wire()["stage_costs"] == costs and "stage_costs" not in older.to_wire()
    s = pe.summarize([bsr, older], REG, 32).by_prefix[str(n)]
    assert s.raw.stage_costs is None  # a case of an older build reported none
    side = s.bsr.stage_costs
    assert side is not None and side.wall_s == {"fetch": 2.0, "verify": 0.3, "install": 0.5, "wait": 0.7}
    # Per GB restored; "other" is the process's CPU the stages leave (the transport's own threads).
    assert side.cpu_s_per_gb == pytest.approx({"fetch": 0.4, "verify": 0.1, "install": 0.2, "wait": 0.0, "other": 0.3})
