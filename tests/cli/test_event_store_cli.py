"""The durable event store as an operator meets it, against the real embedded engine: the first restore's evidence
outlives far more events than the old 2,000-event ring held and an engine restart (`bsr explain`, `bsr describe`),
the restart shows in `bsr events`, filters combine, `--json` is JSON lines, and a bundle taken after an incident
replays it frame by frame, with the structured failure logs of the engine and each rank inside."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.client import local_engine
from bsr_cli.core.events import EngineStarted, RestoreStarted, WindowReleased, parse_event
from bsr_cli.core.evidence import EventKind
from bsr_cli.errors import ExitCode, InvalidInput
from bsr_cli.tui.source import ReplaySource

# Engine tests are marked by the fixtures they use (tests/conftest.py); the settings check starts no engine.
pytestmark = [pytest.mark.timeout(420)]

OLD_RING = 2000  # the in-memory ring the engine used to keep: the evidence must outlive it
TOKENS = 16_384  # 64 chunks: at W=1 one restore writes ~390 events (cheap, and a handful overflow the old ring)


@dataclass
class OwnEngine:
    state: Path
    opts: Any

    def connect(self, monkeypatch: pytest.MonkeyPatch) -> None:
        conn = local_engine.connection(self.state)
        assert conn is not None
        for k, v in {"BSR_ENGINE": conn[0], "BSR_TOKEN": conn[1], "BSR_STATE_DIR": str(self.state)}.items():
            monkeypatch.setenv(k, v)

    def client(self) -> Any:
        from bsr_cli.client import AdminClient

        conn = local_engine.connection(self.state)
        assert conn is not None
        return AdminClient(conn[0], conn[1])


@pytest.fixture
def own_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnEngine]:
    """An engine of this test's own (it is restarted): W=1, 2 ranks, faults enabled, a small Mooncake segment."""
    from bsr_cli.engine import supervisor
    from bsr_cli.loaders import builtin_registration

    state = tmp_path_factory.mktemp("durable-engine")
    opts = supervisor.EngineOptions(
        builtin_registration("demo"),
        w=1,
        max_tokens=TOKENS,
        kv_tokens=TOKENS,
        faults_enabled=True,
        fetch_timeout_s=5.0,
        segment_bytes=256 << 20,
        event_retention_s=3 * 86400.0,
        event_store_bytes=64 << 20,
    )
    try:
        supervisor.up(state, opts)
        yield OwnEngine(state, opts)
    finally:
        supervisor.down(state)


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines()]


def test_the_first_restores_evidence_outlives_the_old_ring_and_a_restart(
    bsr: Any, own_engine: OwnEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bsr_cli.engine import supervisor

    own_engine.connect(monkeypatch)
    # The retention the engine was started with is what its store applies.
    assert json.loads((own_engine.state / "engine.json").read_text())["events"] == {
        "max_age_s": 3 * 86400.0,
        "max_bytes": 64 << 20,
    }
    assert (own_engine.state / "events.sqlite").is_file()
    prompt = ("--synthetic", str(TOKENS), "--seed", "2101")
    assert bsr("submit", *prompt).code == 0
    assert bsr("inject-fault", "--rank", "1", "--kind", "restore-fault", "--window", "3").code == 0
    r = bsr("restore", *prompt, "--W", "1", "--json")
    assert r.code == ExitCode.FAILED_CLOSED, r.err
    first = r.report()["request"]

    def evidence_of_the_first() -> None:
        d = bsr("explain", first, "--json")
        assert d.code == 0, d.err
        x = d.json()
        assert x["verdict"] == "restore-failed-rank"  # an install fault is the rank's, never a tier's
        last = x["last_restore"]
        assert last["windows"] == 64 and last["W"] == 1
        # Rank 0 went on through all 64 windows; rank 1 released windows 1 and 2, then failed in window 3.
        assert {r["rank"]: r["windows_released"] for r in last["ranks"]} == {0: 64, 1: 2}
        assert [(f["rank"], f["window"]) for f in last["failures"]] == [(1, 2)]
        t = bsr("describe", first, "--json")
        assert t.code == 0, t.err
        tl = t.json()
        assert tl["outcome"]["state"] == "failed closed"
        assert sum(1 for w in tl["windows"] if w["rank"] == 0 and "released" in w) == 64
        assert tl["failures"] and tl["failures"][0]["rank"] == 1 and tl["failures"][0]["window"] == 3

    evidence_of_the_first()
    with own_engine.client() as c:
        c.clear_faults()
        c.clear_markers()
        first_seq = c.events(request=first, newest=True, limit=1).events[-1]["seq"]
        restores = 0
        while c.events().last_seq - first_seq <= OLD_RING:
            assert bsr("restore", *prompt, "--W", "1").code == 0
            restores += 1
            assert restores <= 12, "each restore should add ~390 events"
    evidence_of_the_first()  # the old ring would have dropped every one of its events by now

    supervisor.down(own_engine.state)
    supervisor.up(own_engine.state, own_engine.opts)
    own_engine.connect(monkeypatch)
    evidence_of_the_first()
    starts = [parse_event(e) for e in _lines(bsr("events", "--kind", "engine_started", "--json").out)]
    assert [type(e) for e in starts] == [EngineStarted, EngineStarted]
    assert not starts[0].restart and starts[1].restart and starts[1].previous_stop == "clean"  # type: ignore[attr-defined]
    stopped = _lines(bsr("events", "--kind", "engine_stopped", "--json").out)
    assert len(stopped) == 1 and stopped[0]["seq"] < starts[1].seq
    assert "engine restarted after a clean stop" in bsr("events", "-n", "5").out
    # A new engine over the same store numbers its requests after the ones its evidence names.
    r = bsr("restore", *prompt, "--W", "1", "--json")
    assert r.code == 0 and int(r.report()["request"].removeprefix("req-")) > int(first.removeprefix("req-")) + restores


def test_events_filters_combine_and_json_is_json_lines(bsr: Any, engine: Any) -> None:
    prompt = ("--synthetic", "2048", "--seed", "2102")  # 8 chunks
    assert bsr("submit", *prompt).code == 0
    r = bsr("restore", *prompt, "--W", "2", "--json")
    assert r.code == 0, r.err
    req = r.report()["request"]
    released = _lines(bsr("events", "--since", "10m", "--request", req, "--kind", "window_released", "--json").out)
    assert len(released) == 4 * 2  # 4 windows on each of 2 ranks
    assert all(isinstance(parse_event(e), WindowReleased) and e["request"] == req for e in released)
    both = bsr("events", "--since", "1h", "--request", req, "--kind", "restore_started", "-k", "restore_committed")
    assert both.code == 0 and len(both.out.splitlines()) == 2 and "started" in both.out and "committed" in both.out
    started = _lines(bsr("events", "--request", req, "--kind", "restore_started", "--json").out)
    assert [type(parse_event(e)) for e in started] == [RestoreStarted]
    at = started[0]["time"]
    iso_before = datetime.fromtimestamp(at - 1).isoformat(timespec="seconds")
    iso_after = datetime.fromtimestamp(at + 3600).isoformat(timespec="seconds")
    assert len(_lines(bsr("events", "--since", iso_before, "--request", req, "--json").out)) > 8
    assert bsr("events", "--since", iso_after, "--request", req, "--json").out == ""
    # The export: every line one event, the newest restore among them.
    export = bsr("events", "--since", "1d", "--json")
    assert export.code == 0
    lines = _lines(export.out)
    assert len(lines) == len(export.out.splitlines()) and any(e["request"] == req for e in lines if "request" in e)
    assert {parse_event(e).kind for e in lines} >= {EventKind.RESTORE_STARTED, EventKind.WINDOW_RELEASED}
    # Bad input is one line and exit 2.
    for bad in (("-n", "0"), ("--since", "5x"), ("--kind", "no_such_kind"), ("--since", "10m", "--until", "20m")):
        got = bsr("events", *bad)
        assert got.code == ExitCode.INVALID_INPUT, (bad, got.out, got.err)
        assert "Traceback" not in got.err


def test_a_bundle_replays_the_incident_frame_by_frame_with_the_failure_logs(
    bsr: Any, engine: Any, tmp_path: Path
) -> None:
    prompt = ("--synthetic", "4096", "--seed", "2103")  # 16 chunks
    assert bsr("submit", *prompt).code == 0
    assert bsr("inject-fault", "--rank", "1", "--kind", "restore-fault", "--window", "6").code == 0
    r = bsr("restore", *prompt, "--W", "1", "--json")
    assert r.code == ExitCode.FAILED_CLOSED
    req = r.report()["request"]
    out = tmp_path / "incident.tar.gz"
    assert bsr("bundle", "-o", str(out), "--since", "10m").code == 0

    src = ReplaySource.load(out)
    assert len(src) > 2, "the bundle replays more than one frame without --record having run"
    views = [src.frame(i).view for i in range(len(src))]
    failed_at = next(
        i
        for i, v in enumerate(views)
        if v and any(e.type == EventKind.RESTORE_FAILED_CLOSED and e.request == req for e in v.events)
    )
    assert failed_at > 0
    assert src.next_failure() is not None and src.next_failure() <= failed_at  # type: ignore[operator]
    # Frames before the failure show the restore in flight and its pool filling, window by window.
    during = [v for v in views[:failed_at] if v and any(a.request == req for a in v.active)]
    assert len(during) >= 2 and any(g.high_water_bytes > 0 for v in during for g in v.gauges)
    assert [a.current_window for a in during[0].active] != [a.current_window for a in during[-1].active]

    with tarfile.open(out, "r:gz") as tar:
        names = tar.getnames()
        assert "logs/bsr-engine.log" in names and "logs/bsr-rank1.log" in names
        member = tar.extractfile("logs/bsr-engine.log")
        assert member is not None
        lines = [json.loads(line) for line in member.read().decode().splitlines()]
    mine = [x for x in lines if x.get("request") == req]
    closed = next(x for x in mine if x["event"] == "restore_failed_closed")
    assert closed["level"] == "error" and closed["rank"] == 1 and closed["window"] == 5 and closed["reason"]
    assert {"time", "level", "request", "rank", "window", "reason"} <= set(closed)
    assert any(
        parse_event(e).kind is EventKind.RESTORE_FAILED_CLOSED for e in _events_of(out) if e.get("request") == req
    )


def _events_of(bundle: Path) -> list[dict[str, Any]]:
    with tarfile.open(bundle, "r:gz") as tar:
        f = tar.extractfile("events.jsonl")
        assert f is not None
        return [json.loads(line) for line in f.read().decode().splitlines()]


def test_retention_settings_are_checked_before_anything_starts(bsr: Any, tmp_path: Path) -> None:
    """`bsr engine up --event-retention/--event-store-max` and the config file: bad values are refused before
    anything starts (exit 2); good ones come with their source."""
    state = tmp_path / "state"
    for bad in (("--event-retention", "30s"), ("--event-retention", "forever"), ("--event-store-max", "10KiB")):
        got = bsr("--state-dir", str(state), "engine", "up", *bad)
        assert got.code == ExitCode.INVALID_INPUT, (bad, got.err)
    assert not (state / "engine.json").exists()
    cfg = tmp_path / "config.toml"
    cfg.write_text('event_retention = "2d"\nevent_store_max = "64MiB"\n')
    from bsr_cli.settings import SettingFlags, load_settings

    s = load_settings(SettingFlags(config=str(cfg)))
    assert (s.event_retention_s, s.event_store_bytes) == (2 * 86400.0, 64 << 20)
    assert s.sources["event_retention_s"].startswith("config")
    cfg.write_text('event_retention = "1s"\n')
    with pytest.raises(InvalidInput, match="at least 1m"):
        load_settings(SettingFlags(config=str(cfg)))
