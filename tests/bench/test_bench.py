"""`bsr bench`: reduced versions of every experiment against the real embedded engine, checking the evidence
(bundles validate, peaks equal the bound the core computes, the ladder's rung equals the prediction, the failure
matrix passes, interrupted rows stay out of the summary) and never the timings."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.bench import bundle as bundles
from bsr_cli.bench import experiments as ex
from bsr_cli.bench.evidence import record_of
from bsr_cli.bench.ladder import LadderSummary
from bsr_cli.bench.sweep import SweepSummary
from bsr_cli.core import accounting
from bsr_cli.core.bitmap import full_hit_bitmap
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import AbortAnswer, ManualRestoreResult, SubmitResult
from bsr_cli.core.status import EngineInfo, Health, PoolEntry
from bsr_cli.core.units import MiB
from bsr_cli.errors import EngineTimeout, ExitCode
from bsr_cli.loaders import builtin_registration

REG = builtin_registration("demo")
RWS4 = accounting.rws_bytes(REG, 4)  # the session engine runs W=4 with a pool of 2·RWS(4)


def _bundle(res: Any) -> dict[str, Any]:
    assert res.code == 0, res.err
    data = res.json()
    path = Path(data["files"]["bundle"])
    written = json.loads(path.read_text())
    assert bundles.validation_errors(written) == []
    assert written["run_id"] == data["run_id"] and path.name == f"{data['run_id']}.json"
    return written


def _bench(bsr: Any, experiment: str, out: Path, *args: str) -> dict[str, Any]:
    """Run one experiment against the session engine, JSON out, no plots, and return its validated bundle."""
    return _bundle(bsr("bench", experiment, *args, "--out", str(out), "--json", "--no-plots"))


def _settings_back(engine) -> None:
    with engine.client() as c:
        info = c.info()
    assert info.budget_bytes == RWS4 and info.fs_concurrency == 1


# -- schema and bookkeeping (no engine) --------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_published_schema_is_the_one_the_models_generate() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "bench-schema.json"
    assert json.loads(doc.read_text()) == bundles.schema()
    assert doc.read_text() == bundles.schema_json()


@pytest.mark.timeout(30)
def test_the_validator_names_what_is_wrong() -> None:
    bad = {"schema": "bsr.bench/1", "kind": "bsr.bench", "experiment": "sweep", "run_id": "br-e1-XYZ", "rows": []}
    errors = bundles.validation_errors(bad)
    assert any(e.startswith("$.run_id: ") and "'br-e1-XYZ'" in e for e in errors)
    assert "$: missing 'registration'" in errors


class FakeEngine:
    """Just enough of AdminClient to drive the sweep without an engine: restores succeed with a peak of RWS,
    except the one that is interrupted (Ctrl-C, or an engine timeout)."""

    url = "http://fake"

    def __init__(self, interrupt_at: int, error: BaseException) -> None:
        self.interrupt_at, self.error = interrupt_at, error
        self.restores = 0
        self.settings: dict[str, Any] = {"budget_bytes": 123, "fs_concurrency": 1}
        self.aborted: list[str] = []

    def info(self) -> EngineInfo:
        return EngineInfo.from_wire(
            {
                "api": "v1",
                "registration": {"identity": REG.identity},
                "chunk_size": 256,
                "tiers": ["mooncake", "fs"],
                "pool_bytes": 2 * RWS4,
                "max_tokens": 1 << 20,
                "kv_tokens": 1 << 20,
                **self.settings,
            }
        )

    def registration(self) -> Registration:
        return REG

    def pool(self) -> list[PoolEntry]:
        entries = [
            {"rank": r, "alive": True, "pool": {"capacity_bytes": 2 * RWS4, "peak_bytes": RWS4}} for r in range(2)
        ]
        return [PoolEntry.from_wire(e) for e in entries]

    def update_settings(self, **kw: Any) -> EngineInfo:
        self.settings |= kw
        return self.info()

    def submit(self, prompt: Prompt, **kw: Any) -> SubmitResult:
        assert prompt.synthetic is not None  # the benches ask for synthetic prompts
        n = prompt.synthetic.n
        return SubmitResult.from_wire(
            {
                "request": "req-w",
                "prompt": "p",
                "tokens": n,
                "W": 4,
                "external_tokens": 0,
                "computed_tokens": n,
                "source": "recompute",
                "output_hash": "h",
                "seconds": 0.1,
                "hash_ok": True,
                "stored": {},
            }
        )

    def reset_peak(self) -> None:
        pass

    def health(self) -> Health:
        return Health(ranks=(), tiers={})

    def abort(self, request: str) -> AbortAnswer:
        self.aborted.append(request)
        return AbortAnswer(request, aborting=True)

    def restore(self, prompt: Prompt, *, w: int, on_accepted: Any = None, **kw: Any) -> ManualRestoreResult:
        self.restores += 1
        assert prompt.synthetic is not None  # the benches ask for synthetic prompts
        n = prompt.synthetic.n
        on_accepted(f"req-{self.restores}")
        if self.restores == self.interrupt_at:
            raise self.error
        ranks = [
            {"rank": r, "ok": True, "seconds": 0.5, "bytes_restored": n * 4096, "peak_live_bytes": RWS4}
            for r in range(2)
        ]
        return ManualRestoreResult.from_wire(
            {
                "request": f"req-{self.restores}",
                "prompt": "p",
                "tokens": n,
                "W": w,
                "tier_errors": {},
                "first_break": None,
                "bitmap": full_hit_bitmap(("mooncake", "fs"), 2, REG.group_names, n, 256).to_dict(),
                "outcome": "committed",
                "tiers": ["mooncake"],
                "advertised_tokens": n,
                "committed_tokens": n,
                "windows": -(-n // (256 * w)),
                "seconds": 0.5,
                "bytes": 2 * n * 4096,
                "ranks": ranks,
                "output_hash": "h",
                "canonical_hash": "h",
                "hash_ok": True,
            }
        )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", [KeyboardInterrupt(), EngineTimeout("no answer")])
def test_an_interrupted_row_is_marked_and_kept_out_of_the_summary(error: BaseException) -> None:
    fake = FakeEngine(interrupt_at=2, error=error)
    b = ex.run_sweep(fake, prefixes=[2048, 4096, 8192], w=4, salt=7)  # type: ignore[arg-type]
    assert bundles.validation_errors(b.to_wire()) == []
    assert [r.meta.status for r in b.rows] == ["pass", "interrupted"]  # the block stops at the interruption
    assert b.repeat is None and "repeat" not in b.to_wire()
    assert b.interrupted is True and b.ok is False
    assert b.interrupted_by == ("operator" if isinstance(error, KeyboardInterrupt) else "error")
    summary = record_of(SweepSummary, b.summary)
    assert summary.completed == 1 and summary.interrupted == 1
    assert list(summary.restore_seconds) == ["2048"]  # only the completed row is aggregated
    assert fake.settings["budget_bytes"] == 123  # the budget the sweep changed is put back
    if isinstance(error, KeyboardInterrupt):
        assert fake.aborted == ["req-2"]  # the restore in flight is aborted on the engine


# -- every experiment, reduced, against the real engine ----------------------------------------------------------


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_sweep_peak_equals_rws_for_every_row(engine, bsr, tmp_path: Path) -> None:
    plots = importlib.util.find_spec("matplotlib") is not None  # the optional bench extra
    args = ["--tokens", "2048,4096,8192", "--W", "4", "--out", str(tmp_path), "--json"]
    res = bsr("bench", "sweep", *args, *([] if plots else ["--no-plots"]))
    b = _bundle(res)
    assert b["experiment"] == "sweep" and b["run_id"].startswith("br-e1-")
    assert b["registration"]["identity"] == REG.identity
    assert b["engine"]["info"]["W"] == 4 and b["engine"]["embedded"] is False
    rows = b["rows"] + b["repeat"]["rows"]
    assert [r["tokens"] for r in rows] == [2048, 4096, 8192, 8192]
    assert b["repeat"]["salt"] != b["salt"] and b["repeat"]["run_id"] != b["run_id"]
    for r in rows:
        assert r["status"] == "pass", r["checks"]
        assert r["committed_tokens"] == r["tokens"] and r["tiers"] == ["mooncake"]
        assert r["windows"] == r["tokens"] // 256 // 4
        assert [x["pool_peak_bytes"] for x in r["ranks"]] == [RWS4, RWS4]
        assert r["hash_ok"] is True and r["healthy"] is True
    assert b["summary"]["peak_pool_bytes_per_rank"] == [RWS4] and b["summary"]["peak_equals_rws"] is True
    if plots:
        made = res.json()["files"]["plots"]
        assert {Path(p).name for p in made} >= {"peak-vs-prefix.png", "restore-time-vs-prefix.png"}
        assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in made)
    _settings_back(engine)


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_wlaw_peak_is_w_times_sum_c_plus_aux(engine, bsr, tmp_path: Path) -> None:
    b = _bench(bsr, "wlaw", tmp_path, "--tokens", "4096", "--Ws", "1,2,8")
    assert [r["W"] for r in b["rows"]] == [1, 2, 8]
    for r in b["rows"]:
        assert r["status"] == "pass", r["checks"]
        assert [x["pool_peak_bytes"] for x in r["ranks"]] == [r["W"] * REG.bytes_per_chunk + REG.aux_bytes] * 2
    s = b["summary"]
    assert s["law_holds"] is True and s["fit_slope_bytes_per_W"] == REG.bytes_per_chunk
    assert s["fit_intercept_bytes"] == REG.aux_bytes
    _settings_back(engine)


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_fs_concurrency_changes_nothing_in_rws(engine, bsr, tmp_path: Path) -> None:
    b = _bench(bsr, "fs-concurrency", tmp_path, "--tokens", "4096", "--W", "4", "--trials", "1")
    restores = [r for r in b["rows"] if r["kind"] == "restore"]
    # The engine's state dir is known (BSR_STATE_DIR), so its fs tier's pages are evicted for the cold runs.
    assert b["params"]["cold_method"] == "posix_fadvise"
    assert {(r["cache"], r["concurrency"]) for r in restores} == {("cold", 1), ("cold", 4), ("warm", 1), ("warm", 4)}
    for r in restores:
        assert r["status"] == "pass", r["checks"]
        assert r["tiers"] == ["fs"] and r["excluded_tiers"] == ["mooncake"]
        assert [x["pool_peak_bytes"] for x in r["ranks"]] == [RWS4, RWS4]
    assert b["summary"]["rws_unchanged"] is True and set(b["summary"]["speedup"]) == {"cold", "warm"}
    # The disk alone, same files (the prompt's objects, every rank and group), same total concurrency.
    disk = [r for r in b["rows"] if r["kind"] == "disk"]
    objects = 2 * len(REG.group_names) * (4096 // 256)
    assert sorted((r["concurrency"], r["threads"]) for r in disk) == [(1, 2), (4, 8)]
    assert all(r["status"] == "pass" and r["files"] == objects == r["evicted_files"] for r in disk)
    payload = 2 * 4096 * REG.bytes_per_token  # both ranks' KV of the prompt; each file adds a header and its key
    assert all(payload < r["bytes"] < payload + objects * 512 for r in disk)
    s = b["summary"]
    assert s["disk_headroom"] == pytest.approx(max(s["disk_gbps"].values()) / s["by_config"]["cold/c=1"]["gbps"], 0.01)
    assert [t["name"].startswith("fs load concurrency") for t in b["targets"]] == [True, False]
    _settings_back(engine)


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_store_measures_the_tier_beside_the_copy_ceiling(engine, bsr, tmp_path: Path) -> None:
    b = _bench(
        bsr,
        "store",
        tmp_path,
        "--tokens",
        "4096",
        "--W",
        "4",
        "--trials",
        "1",
        "--raw-bytes",
        "4MiB",
        "--copy-bytes",
        "16MiB",
    )
    kinds = {r["kind"]: r for r in b["rows"]}
    assert all(r["status"] == "pass" for r in b["rows"]), [r.get("checks") for r in b["rows"]]
    mc = kinds["mooncake-set"]["results"]
    assert {(m["path"], m["op"], m["mode"]) for m in mc} == {
        (p, o, m) for p in ("tier", "raw") for o in ("put", "get") for m in ("isolated", "concurrent")
    }
    # The session pool holds 2·RWS(4) = 8 chunks: the whole-plan path is clamped to that prefix.
    assert b["params"]["tokens_restored"] == 8 * 256
    restores = [r for r in b["rows"] if r["kind"] == "restore"]
    assert {(r["W"], r["budget_bytes"]) for r in restores} == {(0, None), (4, RWS4), (4, 2 * RWS4)}
    w0 = next(r for r in restores if r["W"] == 0)
    assert w0["peak_pool_bytes"] == accounting.whole_plan_bytes(REG, 8) and w0["windows"] == 1
    assert all(r["tiers"] == ["mooncake"] for r in restores)
    ratios = b["summary"]["ratios"]
    assert ratios["restore_W,B=2RWS/restore_W0"] is not None and ratios["restore_W,B=2RWS/raw_get (paired)"]
    # Every restore carries the raw GET measured right before it, of the same bytes per client, whole.
    for r in restores:
        assert r["paired_raw_get"]["error"] is None and r["paired_raw_get"]["gbps_per_client"] > 0
        assert r["vs_paired_raw"] == pytest.approx(r["gbps_per_rank"] / r["paired_raw_get"]["gbps_per_client"], 0.01)
    assert set(b["summary"]["memcpy_gbps"]) >= {"1"}
    _settings_back(engine)


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_store_refuses_while_a_rank_does_not_report_its_pool(engine, bsr, tmp_path: Path) -> None:
    """A rank that reports no restore pool (stopped here; restarting or starved elsewhere) leaves the pool unknown:
    `bsr bench store` waits for it, then refuses naming the rank and why, never sizing its prompts by a pool of 0
    bytes (exit 2, "cannot hold one chunk")."""
    from bsr_cli.core.evidence import RankState
    from bsr_cli.engine import supervisor

    pid = next(p.pid for p in supervisor.status(engine.state_dir).processes if p.name == "rank1")
    os.kill(pid, signal.SIGSTOP)
    try:
        with engine.client() as c:
            end = time.monotonic() + 60
            while (rank1 := c.pool()[1]).state is not RankState.STOPPED and time.monotonic() < end:
                time.sleep(0.2)  # polls the engine's view of rank 1
            assert rank1.state is RankState.STOPPED and rank1.pool is None, rank1
        res = bsr("bench", "store", "--tokens", "4096", "--W", "4", "--trials", "1", "--out", str(tmp_path), "--json")
    finally:
        os.kill(pid, signal.SIGCONT)
    with engine.client() as c:
        end = time.monotonic() + 60
        while not c.health().ok and time.monotonic() < end:
            time.sleep(0.2)  # polls the engine's health until rank 1 answers again
        assert c.health().ok
    assert res.code == ExitCode.SERVER_ERROR, (res.code, res.out, res.err)
    err = res.json()
    assert err["message"].startswith("rank 1 did not report its restore pool (") and "stopped" in err["message"], err
    assert "cannot hold one chunk" not in res.out + res.err and err["hint"], err


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_failure_matrix_passes(engine, bsr, tmp_path: Path) -> None:
    b = _bench(bsr, "failures", tmp_path, "--tokens", "2048")
    assert [r["scenario"] for r in b["rows"]] == [
        "remote-unavailable",
        "remote-and-ssd-absent",
        "one-rank-restore-fault",
    ]
    assert all(r["status"] == "pass" for r in b["rows"]) and b["ok"] is True


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_ladder_first_passing_rung_is_the_predicted_one(tmp_path: Path) -> None:
    from bsr_cli.engine import supervisor

    rungs = [8 * MiB, 16 * MiB]
    state = tmp_path / "ladder-engine"
    try:
        b = ex.run_ladder(
            ex.embedded_ladder_factory(state, REG, max_tokens=4096),
            prefixes=[2048, 4096],
            rungs=rungs,
            warm_w=4,
            engine_meta={"embedded": True},
        )
    finally:
        supervisor.down(state)
    assert bundles.validation_errors(b.to_wire()) == []
    assert not supervisor.status(state).running  # every rung's engine was stopped
    assert record_of(LadderSummary, b.summary).engine_starts == 2
    rows = [r.to_wire() for r in b.rows]
    for row in rows:
        need = accounting.whole_plan_bytes(REG, row["chunks"])
        assert row["status"] == "pass", row.get("checks")
        assert row["first_passing_rung"] == row["predicted_rung"] == accounting.ladder_rung(need, rungs)
        assert [x["pool_peak_bytes"] for x in row["ranks"]] == [need, need]
    small, large = rows
    assert small["first_passing_rung"] == 8 * MiB and [a["passed"] for a in small["attempts"]] == [True]
    assert large["first_passing_rung"] == 16 * MiB and [a["passed"] for a in large["attempts"]] == [False, True]
    assert large["attempts"][0]["outcome"] == "refused" and "capacity" in large["attempts"][0]["failure"]


def test_benchmarks_page_and_evidence_agree() -> None:
    """Every bundle docs/benchmarks.md cites is in docs/evidence (or a repeat inside one), and the page's evidence
    list names every bundle kept there."""
    import json
    import re

    docs = Path(__file__).resolve().parents[2] / "docs"
    page = (docs / "benchmarks.md").read_text()
    files = {p.stem: json.loads(p.read_text()) for p in (docs / "evidence").glob("br-*.json")}
    inner = {str(b.get("repeat", {}).get("run_id")) for b in files.values() if isinstance(b.get("repeat"), dict)}
    cited = set(re.findall(r"br-[a-z0-9]+-[0-9a-f]{12}", page))
    assert not cited - set(files) - inner, f"cited but not kept: {sorted(cited - set(files) - inner)}"
    listed = page.split("The bundles behind this page are kept in", 1)[1].split("\n\n", 1)[0]
    assert not set(files) - set(re.findall(r"br-[a-z0-9]+-[0-9a-f]{12}", listed)), "kept but not in the list"


def test_plots_carry_the_ratio_the_spread_and_the_ceiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store plot labels restores with × paired raw GET; the fs plot draws trial spread and the disk-alone
    ceiling; the peak plot is on a log axis (the BSR line would sit on zero on a linear one)."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bsr_cli.bench import plots

    docs = Path(__file__).resolve().parents[2] / "docs" / "evidence"
    store = json.loads((docs / "br-store-4b9e3ecc9a54.json").read_text())
    ratios = plots.store_ratios(bundles.from_wire(store))
    assert ratios["restore W=32,B=2RWS"] == store["summary"]["restore"]["W=32,B=2RWS"]["vs_paired_raw"]
    fs = json.loads((docs / "br-fs-a2c08f441e1a.json").read_text())
    spread = plots.fs_spread(bundles.from_wire(fs))
    assert set(spread) == set(fs["summary"]["by_config"]) and all(lo <= hi for lo, hi in spread.values())

    captured: list = []
    real_save = plots._save

    def keep(fig, path):
        captured.append(fig)
        return real_save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)  # every plot saves through it: the figures, captured
    sweep = json.loads((docs / "br-e1-a6c2f9d328e2.json").read_text())
    plots.peak_vs_prefix(bundles.from_wire(sweep), None, tmp_path / "peak.png")
    plots.fs_concurrency(bundles.from_wire(fs), tmp_path / "fs.png")
    plots.store_bandwidth(bundles.from_wire(store), tmp_path / "store.png")
    peak, fsfig, storefig = (f.axes[0] for f in captured)
    assert peak.get_yscale() == "log"
    assert any("," in t.get_text() for t in peak.get_xticklabels())
    assert any("disk alone" in t.get_text() for t in fsfig.get_legend().get_texts())
    assert any("paired raw GET" in t.get_text() for t in storefig.texts)
    plt.close("all")
