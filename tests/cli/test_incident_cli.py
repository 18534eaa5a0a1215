"""The incident commands against the real embedded engine: settings, markers, abort, events, describe, pool
reset-peak. Each asserts what the engine did, not only that the command printed something."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from bsr_cli.errors import ExitCode

pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]


def test_settings_show_and_set_change_the_running_engine(bsr, engine) -> None:
    before = bsr("settings", "show", "--json").json()["settings"]
    try:
        r = bsr("settings", "set", "--W", "2", "--budget", "2MiB", "--json")
        assert r.code == 0, r.err
        after = r.json()
        assert after["changed"] == ["W", "budget_bytes"]
        assert after["settings"]["W"] == 2 and after["settings"]["budget_bytes"] == 2 << 20
        # The engine itself now reports it (not only the command's echo).
        with engine.client() as c:
            info = c.info()
        assert info.w == 2 and info.budget_bytes == 2 << 20
        assert bsr("settings", "set").code == ExitCode.INVALID_INPUT
    finally:
        with engine.client() as c:
            c.update_settings(W=before["W"], budget_bytes=before["budget_bytes"])


def test_markers_list_events_and_describe_after_a_failed_restore(bsr, engine, tmp_path) -> None:
    assert bsr("submit", "--synthetic", "2048", "--seed", "31").code == 0
    assert bsr("markers", "list", "--json").json()["markers"] == []
    assert bsr("inject-fault", "--rank", "1", "--kind", "remote-unavailable", "--window", "2").code == 0
    r = bsr("restore", "--synthetic", "2048", "--seed", "31", "--W", "2", "--json")
    assert r.code == ExitCode.FAILED_CLOSED

    markers = bsr("markers", "list", "--json").json()["markers"]
    assert len(markers) == 1 and markers[0]["excluded_tiers"] == ["mooncake"]
    assert "excludes mooncake" in bsr("markers", "list").out

    evs = _lines(bsr("events", "--json", "-n", "500").out)
    failed = [e for e in evs if e["type"] == "restore_failed_closed"]
    assert failed, evs
    request = failed[-1]["request"]
    only = _lines(bsr("events", "--json", "--request", request).out)
    assert only and all(e["request"] == request for e in only)
    text = bsr("events", "--request", request).out
    assert "FAILED CLOSED" in text

    d = bsr("describe", request, "--json").json()
    assert d["outcome"]["state"] == "failed closed"
    assert d["failures"] and d["failures"][0]["rank"] == 1 and d["failures"][0]["window"] == 2
    rank1 = [w for w in d["windows"] if w["rank"] == 1]
    # Rank 1 installed window 1 and never installed window 2; rank 0 went on independently.
    assert any(w["window"] == 1 and "installed" in w for w in rank1)
    assert not any(w["window"] == 2 and "installed" in w for w in rank1)
    assert bsr("describe", "no-such-request").code == ExitCode.INVALID_INPUT


def _lines(out: str) -> list[dict]:
    """`bsr events --json` prints JSON lines: one event per line."""
    return [json.loads(line) for line in out.splitlines()]


def test_abort_of_an_unknown_request_is_an_error(bsr, engine) -> None:
    r = bsr("abort", "req-does-not-exist")
    assert r.code == ExitCode.INVALID_INPUT and "no request 'req-does-not-exist' is running" in r.err


def test_an_abort_after_the_restore_ended_says_it_came_too_late(bsr, engine) -> None:
    """The operator's abort of a restore that already committed (its id still on the screen) changes nothing and
    says so, with its own exit code, naming the outcome: not "abort requested ... it will fail closed"."""
    assert bsr("submit", "--synthetic", "2048", "--seed", "34").code == 0
    done = bsr("restore", "--synthetic", "2048", "--seed", "34", "--json")
    assert done.code == 0, done.err
    req = done.json()["request"]
    r = bsr("abort", req)
    assert r.code == ExitCode.ALREADY_ENDED, r.err
    assert f"restore {req} already committed 2,048 tokens before the abort arrived" in r.err and "bsr: hint:" in r.err
    j = bsr("abort", req, "--json")
    assert j.code == ExitCode.ALREADY_ENDED and j.json()["error"] == "already-ended"
    assert j.json()["outcome"] == "committed" and j.json()["exit_code"] == 18


def test_pool_reset_peak_restarts_the_measurement(bsr, engine) -> None:
    assert bsr("submit", "--synthetic", "2048", "--seed", "32").code == 0
    assert bsr("restore", "--synthetic", "2048", "--seed", "32").code == 0
    with engine.client() as c:
        assert max(r.pool["peak_bytes"] for r in c.pool()) > 0
    r = bsr("pool", "reset-peak", "--json")
    assert r.code == 0, r.err
    assert all(x["peak_bytes"] == 0 for x in r.json()["ranks"])
    # `bsr pool` without a subcommand still prints a snapshot.
    snap = bsr("pool", "--json")
    assert snap.code == 0 and snap.json()["frames"] == 1 and "info" in snap.json()


def test_restore_explains_a_peak_above_rws_under_the_budget(bsr, engine) -> None:
    """W=1 under B = 4 MiB: two windows in flight put the peak at 2·RWS(1); the table holds it to B and says why,
    instead of flagging '> RWS' as a breach."""
    assert bsr("submit", "--synthetic", "4096", "--seed", "33").code == 0
    r = bsr("restore", "--synthetic", "4096", "--seed", "33", "--W", "1", "--json")
    assert r.code == 0, r.err
    d = r.report()
    peaks = [x["peak_live_bytes"] for x in d["ranks"]]
    assert d["budget_bytes"] == 4 << 20 and max(peaks) <= d["budget_bytes"]
    text = bsr("restore", "--synthetic", "4096", "--seed", "33", "--W", "1").out
    assert "bound = budget B 4.00 MiB" in text and "> " not in text.split("per rank")[1].split("RWS(W=1)")[0]
    if max(peaks) > d["rws_bytes"]:  # the fetch-ahead happened in this run
        assert "up to 2 are in flight" in text
    assert "wall s" in text and "Σ fetch s" in text


def test_restore_with_nothing_stored_is_its_own_exit_code(bsr, engine) -> None:
    r = bsr("restore", "--synthetic", "2048", "--seed", "990001", "--json")
    assert r.code == ExitCode.NOTHING_TO_RESTORE, r.err
    doc = r.json()  # one document: the error, carrying the restore's result
    assert doc["error"] == "nothing-to-restore" and doc["exit_code"] == ExitCode.NOTHING_TO_RESTORE
    assert doc["report"]["outcome"] == "nothing_to_restore"
    text = bsr("restore", "--synthetic", "2048", "--seed", "990001")
    assert text.code == ExitCode.NOTHING_TO_RESTORE and "nothing to restore" in text.err


def test_restore_tier_means_only_that_tier(bsr, engine) -> None:
    assert bsr("submit", "--synthetic", "2048", "--seed", "35").code == 0
    r = bsr("restore", "--synthetic", "2048", "--seed", "35", "--tier", "fs", "--json")
    assert r.code == 0, r.err
    assert r.report()["tiers"] == ["fs"]  # Mooncake, preferred otherwise, was not used
    assert bsr("restore", "--synthetic", "2048", "--seed", "35", "--tier", "nope").code == ExitCode.INVALID_INPUT
    both = bsr("restore", "--synthetic", "2048", "--seed", "35", "--tier", "fs", "--exclude-tier", "mooncake")
    assert both.code == ExitCode.INVALID_INPUT


def test_events_since_and_until_must_parse_and_not_cross(bsr, engine) -> None:
    r = bsr("events", "--since", "10m", "--until", "1h")  # until (an hour ago) is before since (ten minutes ago)
    assert r.code == ExitCode.INVALID_INPUT and "--until is before --since" in r.err
    r = bsr("events", "--since", "42")
    assert r.code == ExitCode.INVALID_INPUT and "--after SEQ takes a sequence number" in r.err


def test_events_follow_prints_the_new_matching_events_until_ctrl_c(bsr, engine) -> None:
    with engine.client() as c:
        after = c.events(limit=1, newest=True).last_seq
    first = bsr("submit", "--synthetic", "600", "--seed", "977", "--json").json()["request"]
    env = dict(os.environ, **engine.env(), PYTHONUNBUFFERED="1")
    cmd = ["events", "-f", "--json", "--after", str(after), "--kind", "request_finished"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bsr_cli", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True).start()
    seen: list[dict] = []

    def wait_for(request: str) -> None:
        while not any(e["request"] == request for e in seen):
            seen.append(json.loads(lines.get(timeout=60)))  # a deadline, not a pause: the line comes when it comes

    try:
        wait_for(first)  # the listing of what was already there has been printed: it follows from here on
        second = bsr("submit", "--synthetic", "600", "--seed", "978", "--json").json()["request"]
        wait_for(second)  # printed by the follow loop
        assert {e["type"] for e in seen} == {"request_finished"}  # the filter holds on the live stream
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, err
