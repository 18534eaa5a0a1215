"""The engine's /metrics against real Prometheus tooling (Debian's `prometheus` package, installed by
scripts/setup): promtool lints a live scrape and validates and unit-tests the alert rules; a real Prometheus
server on loopback scrapes the live embedded engine, evaluates the rules and answers every query of the Grafana
dashboard; and a drill (`bsr drill`, an injected corrupt object) leaves every shipped alert inactive while the same
failure for real (an object rotten on the fs tier's disk) fires them."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import prometheus_server
import pytest
import yaml
from own_engine import OwnEngine, own_engine
from prometheus_server import needs_prometheus

from bsr_cli.client import AdminClient
from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "docs" / "monitoring"
RULES = MON / "bsr-alerts.yml"
DASHBOARD = MON / "grafana-bsr.json"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/setup installs it)")


def _promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=MON)


@needs_promtool
def test_promtool_validates_and_unit_tests_the_rules() -> None:
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 9 rules found" in r.stdout
    r = _promtool("test", "rules", "bsr-alerts.test.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_live_metrics_follow_prometheus_conventions(engine: Any) -> None:
    with engine.client() as c:
        c.submit(Prompt.synthetic_of(3000, 31))
        assert c.restore(Prompt.synthetic_of(3000, 31), w=4).outcome is Outcome.COMMITTED
        text = c.metrics()
    r = _promtool("check", "metrics", stdin=text)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for name, kind in families.items():
        assert name.startswith("bsr_")
        assert name.endswith("_total") == (kind == "counter"), name
    assert 'bsr_pool_live_bytes{rank="0"}' in text and 'bsr_pool_live_bytes{rank="1"}' in text
    assert re.search(r'^bsr_tier_fetch_bytes_total\{rank="0",tier="(mooncake|fs)"\} [1-9]', text, re.M)
    assert re.search(r'^bsr_restore_windows_total\{rank="1"\} [1-9]', text, re.M)
    # prometheus_client writes labels in name order.
    assert re.search(
        r'^bsr_restores_total\{injected="false",kind="none",outcome="committed",stage="none"\} [1-9]', text, re.M
    )


@contextlib.contextmanager
def _prometheus(url: str, token: str, tmp_path: Path, rules: str) -> Iterator[Callable[..., Any]]:
    """A real Prometheus server on loopback scraping the engine at ``url`` every 0.5 s with ``rules``, evaluating
    them every 0.5 s, always stopped. Yields a caller of its HTTP API (the answer's ``data``)."""
    target = url.removeprefix("http://")
    (tmp_path / "bsr-alerts.yml").write_text(rules)
    config = (
        "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
        "rule_files: [bsr-alerts.yml]\n"
        # /metrics needs the engine's token, as every route but /health does (docs/monitoring.md).
        f"scrape_configs:\n  - job_name: bsr\n    authorization: {{credentials: '{token}'}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    with prometheus_server.running(config, tmp_path) as base, httpx.Client(base_url=base, timeout=30.0) as http:

        def api(path: str, **params: Any) -> Any:
            r = http.get(f"/api/v1/{path}", params=params)
            body = r.json()
            assert body["status"] == "success", body
            return body["data"]

        yield api


@pytest.fixture
def prometheus(engine: Any, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A real Prometheus server on loopback scraping the shared engine with bsr's rules as shipped."""
    with _prometheus(engine.url, engine.token, tmp_path, RULES.read_text()) as api:
        yield api


def _until(cond: Callable[[], Any], what: str, timeout: float = 45.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


@needs_prometheus
@pytest.mark.timeout(200)
def test_a_real_prometheus_scrapes_the_engine_and_evaluates_every_rule(
    engine: Any, prometheus: Callable[..., Any]
) -> None:
    api = prometheus
    _until(lambda: [t for t in api("targets")["activeTargets"] if t["health"] == "up"], "the engine target up")
    ranks = _until(lambda: api("query", query="bsr_pool_capacity_bytes")["result"], "pool series")
    assert sorted(s["metric"]["rank"] for s in ranks) == ["0", "1"]
    assert all(s["metric"]["job"] == "bsr" for s in ranks)

    # A restore failed closed by an injected fault is counted as injected, and pages nobody (the alerts firing on a
    # real failure: test_a_drill_pages_nobody_and_the_same_failure_for_real_does).
    prompt = Prompt.synthetic_of(3000, 32)
    with engine.client() as c:
        c.submit(prompt)
        c.inject_fault(FaultRequest("remote-unavailable", rank=1, count=1))  # a fetch from Mooncake fails
        res = c.restore(prompt, w=4)
    assert res.report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.report.failure_kind is FailureKind.TIER
    query = 'sum(bsr_restores_total{injected="true",outcome="failed_closed"})'
    seen = _until(lambda: (v := _value(api, query)) is not None and v[1] >= 1 and v, "the injected failure scraped")
    _until(lambda: _evaluated_since(api, seen[0]), "the rules evaluated over it")
    names = {a["labels"]["alertname"] for a in api("alerts")["alerts"]}
    assert not names & {"BsrRestoreFailedClosed", "BsrTierUnhealthy"}, names
    # Every rule evaluates without error against the live series.
    rules = [r for g in api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == 9
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # No alert claims a rank or the engine is down.
    assert not names & {"BsrRankDown", "BsrRankHeartbeatLost", "BsrEngineDown"}

    # Every query of the Grafana dashboard is valid PromQL and names series the engine exports.
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        q = expr.replace("$instance", ".*")
        api("query", query=q)  # a parse error fails here
        for name in set(re.findall(r"\b(bsr_[a-z_]+)\b", q)):
            assert api("query", query=f"count({name})")["result"], f"{name} (dashboard) is not exported"


# -- a drill pages nobody; the same failure for real does ---------------------------------------------------------
DRILL_N = 2048  # 8 chunks of 256 tokens
# The alerts what a fault injection moves could set off. Their `for` is cut to a second in this test's copy of the
# rules, so that evaluations a few seconds after the drill's effects were scraped would have fired them. The rank and
# engine alerts keep theirs: a heartbeat blip on a busy machine is not what this test is about.
DRILL_ALERTS = (
    "BsrRestoreFailedClosed",
    "BsrRestoreFailedClosedRateHigh",
    "BsrTierUnhealthy",
    "BsrForceLocalMarkersPilingUp",
    "BsrPoolAtBudget",
)


def _fast_rules() -> str:
    doc = yaml.safe_load(RULES.read_text())
    for rule in doc["groups"][0]["rules"]:
        if rule["alert"] in DRILL_ALERTS and "for" in rule:
            rule["for"] = "1s"
    return yaml.safe_dump(doc, sort_keys=False)


@pytest.fixture(scope="module")
def drill_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnEngine]:
    """An engine of this test's own (its fs tier gets a rotten object): both tiers, faults enabled."""
    with own_engine(tmp_path_factory.mktemp("drill-engine"), segment_bytes=256 << 20) as eng:
        yield eng


def _value(api: Callable[..., Any], query: str) -> tuple[float, float] | None:
    """(Prometheus' evaluation time, the value) of a query with one result; None when it has none."""
    got = api("query", query=query)["result"]
    return (float(got[0]["value"][0]), float(got[0]["value"][1])) if got else None


def _evaluated_since(api: Callable[..., Any], at: float) -> bool:
    """Every rule group was last evaluated after ``at`` (Prometheus' clock, Unix seconds)."""
    groups = api("rules")["groups"]

    def when(text: str) -> float:  # RFC 3339 with nanoseconds: Python reads microseconds
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")).timestamp()

    return bool(groups) and all(when(g["lastEvaluation"]) > at for g in groups)


def _rot_fs_object(state: Path, seed: int) -> None:
    """One flipped payload byte, on disk, in the fs tier's object of chunk 3 (rank 0, KV group full)."""
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.core.registration import Registration
    from bsr_cli.tiers.fs import FilesystemTier

    cfg = json.loads((state / "engine.json").read_text())
    reg = Registration.from_dict(cfg["registration"])
    h = chunk_hashes(synthetic_tokens(DRILL_N, seed), reg.chunk_size)[3]
    path = FilesystemTier(cfg["fs_dir"], create=False).path_for(object_key(reg, 0, "full", h))
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF
    path.write_bytes(damaged)


@needs_prometheus
@pytest.mark.timeout(360)
def test_a_drill_pages_nobody_and_the_same_failure_for_real_does(
    drill_engine: OwnEngine, bsr: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url, token, state = drill_engine.url, drill_engine.token, drill_engine.state_dir
    for k, v in drill_engine.env().items():
        monkeypatch.setenv(k, v)
    with _prometheus(url, token, tmp_path, _fast_rules()) as api:
        _until(lambda: [t for t in api("targets")["activeTargets"] if t["health"] == "up"], "the engine target up")

        # Arming a fault changes no health: it is shown as armed.
        assert bsr("inject-fault", "--kind", "remote-unavailable", "--count", "0").code == 0
        _until(lambda: (_value(api, "bsr_faults_armed") or (0, 0))[1] == 1, "the armed fault scraped")
        healthy = _value(api, 'bsr_tier_healthy{tier="mooncake",injected="false"}')
        assert healthy is not None and healthy[1] == 1
        assert bsr("faults", "clear").code == 0

        # The drill, then an injected corrupt object and a restore that meets it.
        r = bsr("drill", "--yes", "--tokens", str(DRILL_N))
        assert r.code == 0, r.out + r.err
        prompt = ("--synthetic", str(DRILL_N), "--seed", "71")
        assert bsr("submit", *prompt).code == 0
        assert bsr("inject-fault", "--kind", "corrupt").code == 0
        r = bsr("restore", *prompt, "--json")
        assert r.code == 10 and r.report()["failure_kind"] == "tier", r.out + r.err
        tier = bsr("status", "--json").json()["tiers"]["mooncake"]
        assert tier["ok"] is False and tier["injected"] is True, tier

        # Prometheus holds what the engine counts now (every failure injected), then evaluates the rules over it.
        with AdminClient(url, token) as c:
            text = c.metrics()
        counted = sum(
            float(v)
            for v in re.findall(
                r'^bsr_restores_total\{injected="true",kind="\w+",outcome="failed_closed"[^}]*\} (\S+)', text, re.M
            )
        )
        assert counted >= 4, "the drill's three scenarios (tier and rank) and the corrupt restore failed closed"
        total = 'sum(bsr_restores_total{injected="true",outcome="failed_closed"})'
        seen = _until(lambda: (v := _value(api, total)) is not None and v[1] == counted and v, "the drill scraped")
        down = _value(api, 'bsr_tier_healthy{tier="mooncake",injected="true"}')
        assert down is not None and down[1] == 0, "the tier is unhealthy, and says a drill did it"
        _until(lambda: _evaluated_since(api, seen[0] + 3), "the rules evaluated for 3 s over the drill")
        alerts = api("alerts")["alerts"]
        assert not [a for a in alerts if a["state"] == "firing"], alerts
        assert not [a for a in alerts if a["labels"]["alertname"] in DRILL_ALERTS], alerts
        rules = [r for g in api("rules")["groups"] for r in g["rules"]]
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

        # The same failure for real: a byte of an object rots on the fs tier's disk, and a restore from it fails
        # closed at verify. Both alerts fire.
        assert bsr("faults", "clear").code == 0
        prompt = ("--synthetic", str(DRILL_N), "--seed", "72")
        assert bsr("submit", *prompt).code == 0
        _rot_fs_object(state, 72)
        r = bsr("restore", *prompt, "--tier", "fs", "--json")
        assert r.code == 10 and r.report()["failure_kind"] == "tier", r.out + r.err

        def firing() -> set[tuple[str, str]]:
            return {
                (a["labels"]["alertname"], a["labels"].get("kind") or a["labels"].get("tier", ""))
                for a in api("alerts")["alerts"]
                if a["state"] == "firing"
            }

        _until(
            lambda: {("BsrRestoreFailedClosed", "tier"), ("BsrTierUnhealthy", "fs")} <= firing(),
            "the fail-closed and tier alerts firing on the real failure",
            timeout=90,
        )
