"""The engine's /metrics against real Prometheus tooling (Debian's `prometheus` package, installed by
scripts/setup): promtool lints a live scrape and validates and unit-tests the alert rules; a real Prometheus
server on loopback scrapes the live embedded engine, evaluates the rules, fires the fail-closed alert after a
restore fails closed, and answers every query of the Grafana dashboard."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt

ROOT = Path(__file__).resolve().parents[2]
MON = ROOT / "docs" / "monitoring"
RULES = MON / "bsr-alerts.yml"
DASHBOARD = MON / "grafana-bsr.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/setup installs it)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (scripts/setup does)")


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
    assert re.search(r'^bsr_restores_total\{kind="none",outcome="committed",stage="none"\} [1-9]', text, re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(engine: Any, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A real Prometheus server on loopback scraping the live engine every 0.5 s, with bsr's rules, always stopped."""
    assert PROMETHEUS is not None
    target = engine.url.removeprefix("http://")
    cfg = tmp_path / "prometheus.yml"
    shutil.copy(RULES, tmp_path / "bsr-alerts.yml")
    cfg.write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
        "rule_files: [bsr-alerts.yml]\n"
        # /metrics needs the engine's token, as every route but /health does (docs/monitoring.md).
        f"scrape_configs:\n  - job_name: bsr\n    authorization: {{credentials: '{engine.token}'}}\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, timeout=5.0)

    def api(path: str, **params: Any) -> Any:
        r = http.get(f"/api/v1/{path}", params=params)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                if http.get("/-/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready within 60 s"
            time.sleep(0.2)
        yield api
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


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
def test_a_real_prometheus_scrapes_the_engine_and_fires_the_fail_closed_alert(
    engine: Any, prometheus: Callable[..., Any]
) -> None:
    api = prometheus
    _until(lambda: [t for t in api("targets")["activeTargets"] if t["health"] == "up"], "the engine target up")
    ranks = _until(lambda: api("query", query="bsr_pool_capacity_bytes")["result"], "pool series")
    assert sorted(s["metric"]["rank"] for s in ranks) == ["0", "1"]
    assert all(s["metric"]["job"] == "bsr" for s in ranks)

    # Let the rules see the counters at zero first, then fail a restore closed.
    _until(lambda: api("query", query='bsr_restores_total{outcome="failed_closed"}')["result"], "the counter")
    time.sleep(1.5)
    prompt = Prompt.synthetic_of(3000, 32)
    with engine.client() as c:
        c.submit(prompt)
        c.inject_fault(FaultRequest("remote-unavailable", rank=1, count=1))  # a fetch from Mooncake fails
        res = c.restore(prompt, w=4)
    assert res.report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.report.failure_kind is FailureKind.TIER

    def firing() -> list[dict[str, Any]]:
        return [
            a
            for a in api("alerts")["alerts"]
            if a["labels"]["alertname"] == "BsrRestoreFailedClosed" and a["state"] == "firing"
        ]

    alert = _until(firing, "BsrRestoreFailedClosed firing")[0]
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["kind"] == "tier"
    # The failed tier is unhealthy for a while: its alert is pending (its `for` has not elapsed).
    pending = _until(
        lambda: [a for a in api("alerts")["alerts"] if a["labels"]["alertname"] == "BsrTierUnhealthy"],
        "BsrTierUnhealthy pending",
    )
    assert pending[0]["state"] in ("pending", "firing")
    # Every rule evaluates without error against the live series.
    rules = [r for g in api("rules")["groups"] for r in g["rules"]]
    assert len(rules) == 9
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    # No alert claims a rank or the engine is down.
    names = {a["labels"]["alertname"] for a in api("alerts")["alerts"]}
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
