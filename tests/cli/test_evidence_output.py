"""Blame by stage, end to end on the embedded engine, and every command's text and JSON output in those scenarios
scanned for what an operator must never read: `None`, a lone `?`, a Python list or dict repr.

Scenarios: an injected fault in rank 1's install (a rank verdict: no tier marked, the prompt recomputed locally), a
failed fetch from Mooncake (a Mooncake verdict: its marker), a refused `--W 8` (the shared engine's budget B is
RWS(4): refused, exit 12) and an operator abort (aborted); neither of the last two counts as failed_closed."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import pytest

from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.prompt import Prompt

pytestmark = [pytest.mark.timeout(300)]

N = 3000
FORBIDDEN = {
    "None": re.compile(r"\bNone\b"),
    "a lone ?": re.compile(r"(^|[\s(=:])\?($|[\s),.;])", re.M),
    "a Python list repr": re.compile(r"\[\s*'"),
    "a Python dict repr": re.compile(r"\{\s*'"),
}
# The commands whose output is scanned after each scenario (text, then --json).
COMMANDS = (("status",), ("markers", "list"), ("faults", "list"), ("pool",))


def _strings(doc: Any, path: str = "") -> list[tuple[str, str]]:
    """Every string of a JSON document (keys too), with where it stands."""
    if isinstance(doc, str):
        return [(path, doc)]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in (*_strings(k, path), *_strings(v, f"{path}.{k}"))]
    if isinstance(doc, list):
        return [s for i, v in enumerate(doc) for s in _strings(v, f"{path}[{i}]")]
    return []


def _clean(where: str, text: str) -> None:
    for what, pattern in FORBIDDEN.items():
        m = pattern.search(text)
        assert m is None, f"{where} shows {what}: ...{text[max(0, m.start() - 80) : m.end() + 80]}..."


def _scan(bsr: Any, *args: str, code: int = 0) -> tuple[str, dict[str, Any]]:
    """Run a command as text and as --json, check both exit with ``code`` and both are clean; the JSON document."""
    text = bsr(*args)
    assert text.code == code, (args, text.out, text.err)
    _clean(f"`bsr {' '.join(args)}`", text.out + text.err)
    js = bsr(*args, "--json")
    assert js.code == code, (args, js.out, js.err)
    doc = json.loads(js.out) if js.out.strip() else {}
    for path, s in _strings(doc):
        _clean(f"`bsr {' '.join(args)} --json` at {path}", s)
    _clean(f"`bsr {' '.join(args)}` (stderr)", js.err)
    return text.out + text.err, doc


def _scan_all(bsr: Any, prompt: tuple[str, ...]) -> dict[str, Any]:
    for cmd in COMMANDS:
        _scan(bsr, *cmd)
    _, explained = _scan(bsr, "explain", *prompt)
    return explained


def _restore_with_fault(bsr: Any, prompt: tuple[str, ...], fault: tuple[str, ...], code: int) -> tuple[str, Any]:
    """The same failing restore as text and as JSON (the fault armed for each)."""
    assert bsr("inject-fault", *fault).code == 0
    text = bsr("restore", *prompt)
    assert text.code == code, text.out + text.err
    _clean("`bsr restore`", text.out + text.err)
    assert bsr("inject-fault", *fault).code == 0
    js = bsr("restore", *prompt, "--json")
    assert js.code == code, js.err
    doc = js.report()
    for path, s in _strings(doc):
        _clean(f"`bsr restore --json` at {path}", s)
    return text.out + text.err, doc


def test_an_install_fault_on_a_rank_is_the_ranks_verdict_everywhere(bsr: Any, engine: Any) -> None:
    prompt = ("--synthetic", str(N), "--seed", "4101")
    assert bsr("submit", *prompt).code == 0
    text, doc = _restore_with_fault(bsr, prompt, ("--rank", "1", "--kind", "restore-fault", "--window", "1"), 10)
    assert "rank 1 failed at install" in text and "no tier blamed" in text
    assert doc["outcome"] == "failed_closed" and doc["failure_kind"] == "rank" and doc["failure_stage"] == "install"
    assert doc["blamed_tiers"] == [] and doc["blamed_ranks"] == [1]
    assert doc["marker"]["excluded_tiers"] == []  # recompute locally, no tier excluded
    status_text, status = _scan(bsr, "status")
    assert "rank 1 last fault" in status_text and "failed at install" in status_text
    assert all(t["ok"] for t in status["tiers"].values()), status["tiers"]  # no tier unhealthy
    markers = bsr("markers", "list", "--json").json()
    key = doc["prompt"]
    assert [m["excluded_tiers"] for m in markers["markers"] if m["prompt"] == key] == [[]]
    explained = _scan_all(bsr, prompt)
    assert explained["verdict"] == "force-local-marker", explained["summary"]
    assert "recompute this prompt locally" in explained["summary"] and "no tier is blamed" in explained["summary"]
    assert explained["next"] == f"bsr markers clear --prompt {key}"
    assert "fix the tier" not in json.dumps(explained)
    # The next admission honours the marker: computed locally, canonical output, and the marker is cleared.
    admitted = bsr("submit", *prompt, "--json").json()
    assert admitted["source"] == "recompute" and admitted["hash_ok"] is True
    assert admitted["force_local"]["cleared"] is True


def test_a_fetch_fault_on_mooncake_is_mooncakes_verdict(bsr: Any, engine: Any) -> None:
    prompt = ("--synthetic", str(N), "--seed", "4102")
    assert bsr("submit", *prompt).code == 0
    fault = ("--rank", "1", "--kind", "remote-unavailable", "--window", "1")
    text, doc = _restore_with_fault(bsr, prompt, fault, 10)
    assert "tier mooncake failed at fetch" in text
    assert doc["failure_kind"] == "tier" and doc["failure_stage"] == "fetch" and doc["blamed_tiers"] == ["mooncake"]
    assert doc["marker"]["excluded_tiers"] == ["mooncake"]
    explained = _scan_all(bsr, prompt)
    assert explained["verdict"] == "force-local-marker" and "excludes mooncake" in explained["summary"]
    assert explained["next"] == f"bsr markers clear --prompt {doc['prompt']}"


def _restores_total(metrics: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"^bsr_restores_total\{([^}]*)\} (\S+)$", metrics, re.M)}


def _failed_closed(metrics: str) -> float:
    return sum(v for k, v in _restores_total(metrics).items() if 'outcome="failed_closed"' in k)


def test_a_refused_window_and_an_abort_are_not_failed_closed(bsr: Any, engine: Any) -> None:
    prompt = ("--synthetic", str(N), "--seed", "4103")
    assert bsr("submit", *prompt).code == 0
    with engine.client() as c:
        before = c.metrics()
    refused = bsr("restore", *prompt, "--W", "8", "--json")  # within the prompt limit, over the budget B
    assert refused.code == 12, refused.err
    doc = refused.json()  # one document: the error, carrying the refused restore's result
    assert doc["error"] == "capacity" and doc["exit_code"] == 12 and doc["hint"]
    assert refused.report()["outcome"] == "refused" and refused.report()["failure_kind"] == "capacity"
    _clean("`bsr restore --W 8`", refused.err)
    text = bsr("restore", *prompt, "--W", "8")
    assert text.code == 12 and "refused" in text.out + text.err
    _clean("`bsr restore --W 8` (text)", text.out + text.err)

    # An operator abort of a restore held up by an injected stall in window 1.
    assert bsr("inject-fault", "--rank", "0", "--kind", "timeout", "--window", "1").code == 0
    box: dict[str, Any] = {}
    accepted = threading.Event()

    def on_accepted(rid: str) -> None:
        box["request"] = rid
        accepted.set()

    with engine.client(timeout_s=60) as c:
        worker = threading.Thread(
            target=lambda: box.setdefault(
                "result", c.restore(Prompt.synthetic_of(N, 4103), w=4, on_accepted=on_accepted)
            )
        )
        worker.start()
        assert accepted.wait(30), "the restore was never accepted"
        with engine.client() as c2:
            c2.abort(box["request"])
        worker.join(60)
        assert not worker.is_alive()
    result = box["result"]
    assert result.outcome is Outcome.ABORTED and result.report.failure_kind is FailureKind.ABORTED
    for path, s in _strings(result.to_wire()):
        _clean(f"an aborted restore's result at {path}", s)
    _scan_all(bsr, prompt)
    with engine.client() as c:
        after = c.metrics()
    assert _failed_closed(after) == _failed_closed(before)
    rose = {k: v - _restores_total(before).get(k, 0.0) for k, v in _restores_total(after).items()}
    assert rose['injected="false",kind="capacity",outcome="refused",stage="admission"'] == 2
    assert sum(v for k, v in rose.items() if 'outcome="aborted"' in k) == 1
