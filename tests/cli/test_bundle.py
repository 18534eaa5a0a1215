"""`bsr bundle` against the real embedded engine after an incident (a restore failed closed under an injected
fault): every part is in the archive, secrets and token ids are not, the size cap holds, and the archive reads
back with `bsr describe --record` and `bsr top --replay`'s source (its event log paging through every event)."""

from __future__ import annotations

import gzip
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.evidence import Outcome
from bsr_cli.incident_bundle import RECORDING, redact_text, redact_tokens
from bsr_cli.tui.source import ReplaySource

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(180)]


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        out = {}
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out[m.name] = f.read()
        return out


def test_bundle_after_an_incident(bsr: Any, engine: Any, tmp_path: Path) -> None:
    n, seed = 3000, 950
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    assert bsr("inject-fault", "--rank", "0", "--kind", "restore-fault").code == 0
    r = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--json")
    assert r.code == 10
    req = r.report()["request"]
    # A secret that leaked into an engine log must not leave the machine in a bundle.
    log = next((engine.state_dir / "logs").glob("*.log"))
    with log.open("a") as f:
        f.write(f"debug: Authorization: Bearer {engine.token}\n")
    toks = tmp_path / "prompt.json"
    toks.write_text(json.dumps(list(range(1000, 1700))))
    out = tmp_path / "incident.tar.gz"
    r = bsr("bundle", "-o", str(out), "--synthetic", str(n), "--seed", str(seed), "--tokens-file", str(toks), "--json")
    assert r.code == 0, r.err
    d = r.report()
    assert d["bundle"] == str(out) and d["missing"] == {}, d["missing"]
    files = _members(out)
    for name in (
        "manifest.json",
        "status.json",
        "health.json",
        "info.json",
        "registration.json",
        "markers.json",
        "faults.json",
        "events.jsonl",
        "pool-history.json",
        "segments.json",
        "versions.json",
        RECORDING,
        f"explain/synthetic-{n}-seed-{seed}.json",
        "explain/tokens-prompt.json",
    ):
        assert name in files, name
    assert any(n.startswith("logs/") for n in files)
    manifest = json.loads(files["manifest.json"])
    assert manifest["format"] == "bsr.incident-bundle" and manifest["engine"] == engine.url
    markers = json.loads(files["markers.json"])
    assert [m["request"] for m in markers] == [req]
    events = [json.loads(line) for line in files["events.jsonl"].splitlines()]
    assert any(e["type"] == "restore_failed_closed" and e["request"] == req for e in events)
    hist = json.loads(files["pool-history.json"])
    assert set(hist) == {"0", "1"} and all(h["live_bytes"] is not None for h in hist["1"])
    assert json.loads(files["segments.json"]), "the embedded master's mounted segment"
    assert json.loads(files["versions.json"])["bsr"]
    ex = json.loads(files[f"explain/synthetic-{n}-seed-{seed}.json"])
    assert ex["verdict"] == "force-local-marker" and ex["last_restore"]["request"] == req
    assert json.loads(files["explain/tokens-prompt.json"])["verdict"] == "never-stored"
    # Redaction: the admin token appears nowhere (the recording decompressed too); the log line is kept, masked.
    everything = b"".join(files.values()) + gzip.decompress(files[RECORDING])
    assert engine.token.encode() not in everything
    assert b"Authorization: Bearer ***" in files[f"logs/{log.name}"]
    # Read back: describe from the bundle, and the replay source `bsr top --replay` uses.
    r = bsr("describe", req, "--record", str(out), "--json")
    assert r.code == 0, r.err
    assert r.report()["outcome"]["state"] == "failed closed"
    replay = ReplaySource.load(out)
    frame = replay.frame(0)
    assert frame.view is not None and len(frame.view.gauges) == 2
    # `bsr top --replay`'s event log pages through every event the bundle holds, newest page first, and finds the
    # failed restore's end event (its whole "why").
    replay.position = len(replay) - 1
    paged: list[int] = []
    before = None
    for _ in range(len(events)):  # at most one page per event: a cursor that does not move ends the loop anyway
        page = replay.log_page(before, limit=100)
        paged = [e.seq for e in page.events if e.seq] + paged  # (seq 0: a restart's separator line)
        if page.older is None:
            break
        before = page.older
    assert paged == sorted(int(e["seq"]) for e in events) and page.held == len(events)
    ending = replay.ending(req)
    assert ending is not None and ending.outcome is Outcome.FAILED_CLOSED and ending.failures[0].rank == 0


def test_bundle_size_cap_cuts_logs_then_events(bsr: Any, engine: Any, tmp_path: Path) -> None:
    log = next((engine.state_dir / "logs").glob("*.log"))
    with log.open("a") as f:
        for i in range(2000):
            f.write(f"filler line {i} " + "x" * 200 + "\n")
    out = tmp_path / "small.tar.gz"
    r = bsr("bundle", "-o", str(out), "--max-bytes", "64KiB", "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert any("cut to its last" in note for note in d["notes"]), d["notes"]
    files = _members(out)
    assert sum(len(v) for k, v in files.items() if k != "manifest.json") <= 64 << 10
    assert json.loads(files["manifest.json"])["notes"] == d["notes"]
    r = bsr("bundle", "-o", str(out), "--max-bytes", "1KiB")
    assert r.code == 2 and "at least 64KiB" in r.err


def test_redaction_rules() -> None:
    assert redact_tokens({"tokens": [1, 2, 3], "a": [{"tokens": [4]}], "n": {"tokens": 5}}) == {
        "tokens": {"redacted": 3},
        "a": [{"tokens": {"redacted": 1}}],
        "n": {"tokens": 5},
    }
    text = 'token = "abc123secret" password: hunter22 Authorization: Bearer zzzzzzzzzz keep-me'
    got = redact_text(text, ["keep-me-not-a-secret"])
    assert "abc123secret" not in got and "hunter22" not in got and "zzzzzzzzzz" not in got and "keep-me" in got


def test_size_cap_keeps_the_newest_events_and_their_pool_history() -> None:
    """Many events (a long-lived engine): the cap drops the oldest events and the pool history derived from them,
    and what is left fits."""
    from bsr_cli.core.events import WindowReleased
    from bsr_cli.incident_bundle import Builder

    events = [
        WindowReleased(
            request=f"req-{i // 16:05d}",
            rank=i % 2,
            window=i % 16,
            pool={"live_bytes": 1 << 20, "peak_bytes": 2 << 20},
            seq=i,
            time=float(i),
        )
        for i in range(1, 3001)
    ]
    b = Builder([])
    b.json("status.json", {"ok": True})
    b.events("events.jsonl", [e.to_wire() for e in events])  # as the engine serves them
    from bsr_cli.incident_bundle import pool_history

    b.json("pool-history.json", pool_history(events))
    cap = 64 << 10
    b.fit(cap)
    assert sum(len(v) for v in b.files.values()) <= cap
    kept = [json.loads(line) for line in b.files["events.jsonl"].splitlines()]
    assert kept and kept[-1]["seq"] == 3000 and len(kept) < 3000  # the newest kept, the oldest dropped
    hist = json.loads(b.files["pool-history.json"])
    assert sum(len(v) for v in hist.values()) == len(kept)
    assert any("oldest events dropped" in n for n in b.notes)
