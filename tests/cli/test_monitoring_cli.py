"""`bsr monitoring rules`: the alert rules with absolute runbook links under the base an operator gives; the copy
shipped in docs/monitoring/ is its output with the default base."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bsr_cli.cli.commands.monitoring_cmd import DEFAULT_RUNBOOK_BASE, alert_rules

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "docs" / "monitoring" / "bsr-alerts.yml"
PROMTOOL = shutil.which("promtool")


def _links(text: str) -> list[str]:
    doc = yaml.safe_load(text)
    return [r["annotations"]["runbook_url"] for g in doc["groups"] for r in g["rules"]]


def test_the_shipped_rules_are_the_generators_output_with_the_default_base() -> None:
    assert SHIPPED.read_text() == alert_rules(DEFAULT_RUNBOOK_BASE), (
        "docs/monitoring/bsr-alerts.yml is stale: bsr monitoring rules -o docs/monitoring/bsr-alerts.yml"
    )


def test_rules_carry_absolute_runbook_links_under_the_base_given(bsr: Any, tmp_path: Path) -> None:
    base = "https://wiki.example.com/ops/bsr/runbooks"
    r = bsr("monitoring", "rules", "--runbook-base", base + "/")
    assert r.code == 0, r.err
    links = _links(r.out)
    assert len(links) == 9 and all(re.fullmatch(re.escape(base) + r"/[a-z-]+\.md", u) for u in links), links
    assert "placeholder" not in r.err
    # The default base says it is a placeholder, on stderr, and the rules still come out.
    r = bsr("monitoring", "rules")
    assert r.code == 0 and all(u.startswith(DEFAULT_RUNBOOK_BASE + "/") for u in _links(r.out))
    assert "bsr: warning: runbook links point at the placeholder" in r.err
    out = tmp_path / "bsr-alerts.yml"
    r = bsr("monitoring", "rules", "--runbook-base", base, "-o", str(out), "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["runbook_base"] == base and d["written"] == str(out) and len(d["alerts"]) == 9
    assert out.read_text() == d["rules"] == alert_rules(base)
    if PROMTOOL is not None:
        check = subprocess.run([PROMTOOL, "check", "rules", str(out)], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout, check.stdout + check.stderr


@pytest.mark.parametrize("base", ["docs/runbooks", "wiki.example.com/runbooks", "ftp://x/y", "https://x/y?a=1"])
def test_a_base_that_is_not_an_absolute_link_is_refused(bsr: Any, base: str, tmp_path: Path) -> None:
    out = tmp_path / "rules.yml"
    r = bsr("monitoring", "rules", "--runbook-base", base, "-o", str(out))
    assert r.code == 2 and "is not an absolute http(s) URL" in r.err and "bsr: hint:" in r.err
    assert not out.exists(), "nothing half-written"
