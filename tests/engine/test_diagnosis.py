"""A restore debugger must not misdiagnose: capacity is not a tier fault, a frozen rank fails a restore within
seconds and is named, a dead segment holder or a fault's failure shows the tier unhealthy (an armed fault alone
changes no health), and the client keeps its --timeout. Against the real embedded engine (mooncake_master, segment
holder, rank processes, admin API)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from own_engine import own_engine as start_own_engine

from bsr_cli.core.events import Event, WindowReleased
from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.status import Health
from bsr_cli.errors import CapacityError, ExitCode
from bsr_cli.loaders import builtin_registration
from bsr_cli.runtime.pool import RestorePool

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(240)]
REG = builtin_registration("demo")
FETCH_TIMEOUT_S = 2.0


def _status(bsr) -> tuple[int, dict]:
    r = bsr("status", "--json")
    return r.code, r.report()


# -- finding 1: capacity and configuration are not tier faults ------------------------------------------------------


def test_window_over_budget_is_capacity_with_no_marker(bsr, engine) -> None:
    """The shared engine has W=4 and B = RWS(4): W=8 can never be admitted. Exit 12, a hint naming the setting,
    no force-local marker against the healthy Mooncake tier."""
    n, seed = 12 * 256, 901
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    r = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--W", "8", "--json")
    assert r.code == ExitCode.CAPACITY, (r.code, r.err)
    res = r.report()
    assert res["outcome"] == "refused" and res["committed_tokens"] == 0  # capacity: no fault
    assert res["failure_kind"] == "capacity" and res["blamed_tiers"] == []
    assert "marker" not in res
    assert "--W 4" in r.err and "budget" in r.err  # the hint names the setting and a value that fits
    st = _status(bsr)[1]
    assert st["markers"] == []
    assert st["tiers"]["mooncake"]["ok"] is True  # a capacity refusal does not make the tier look broken
    # The whole-plan path (W=0) against the pool (8 chunks): 12 chunks never fit.
    r0 = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--W", "0", "--json")
    assert r0.code == ExitCode.CAPACITY and r0.report()["failure_kind"] == "capacity"
    assert "--pool" in r0.err and _status(bsr)[1]["markers"] == []
    # And the admission path computes locally without a marker, saying why.
    s = bsr("submit", "--synthetic", str(n), "--seed", str(seed), "--W", "8", "--json")
    assert s.code == 0, s.err
    sub = s.json()
    assert sub["passes"][0]["failure_kind"] == "capacity" and len(sub["passes"]) == 1
    assert sub["force_local"]["history"] == [] and sub["source"] == "recompute" and sub["hash_ok"] is True


def test_dry_run_checks_w_against_the_budget_and_pool(bsr, engine) -> None:
    n, seed = 12 * 256, 902
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    ok = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--dry-run", "--json")
    assert ok.code == 0 and ok.report()["capacity"]["fits"] is True
    bad = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--dry-run", "--W", "64", "--json")
    assert bad.code == ExitCode.CAPACITY, bad.err
    assert bad.report()["capacity"]["fits"] is False and "budget B" in bad.err
    text = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--dry-run", "--W", "0")
    assert text.code == ExitCode.CAPACITY and "does not fit" in text.out and "--pool" in text.err


def test_a_budget_cut_while_waiting_is_reported_as_capacity_at_once() -> None:
    """A window waiting for admission when B is cut below it can never fit: it is refused as such, not after the
    admission deadline as a generic timeout."""
    slot = 1024
    buf = bytearray(8 * slot)
    pool = RestorePool(0, memoryview(buf), slot, budget_bytes=4 * slot)
    held = pool.acquire(3, timeout_s=1)
    assert held is not None
    got: dict[str, BaseException] = {}

    def waiter() -> None:
        try:
            pool.acquire(2, timeout_s=60)
        except BaseException as e:  # noqa: BLE001 - inspected below
            got["e"] = e

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while pool.stats().waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.set_budget(1 * slot)
    t.join(30)
    held.release()
    assert not t.is_alive()
    assert isinstance(got.get("e"), CapacityError) and "budget B" in got["e"].message


def test_an_operator_abort_exits_130_and_blames_no_tier(bsr, engine) -> None:
    n, seed = 40 * 256, 903
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    assert bsr("inject-fault", "--kind", "timeout", "--rank", "0", "--window", "3").code == 0  # holds the restore
    aborted: list[str] = []

    def abort_it() -> None:
        with engine.client() as c:
            end = time.monotonic() + 60
            while time.monotonic() < end and not aborted:
                for a in c.snapshot(health=False).active:
                    c.abort(a.request)
                    aborted.append(a.request)
                time.sleep(0.05)

    t = threading.Thread(target=abort_it, daemon=True)
    t.start()
    r = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--json")
    t.join(60)
    assert aborted, "the restore was never seen running"
    assert r.code == ExitCode.INTERRUPTED, (r.code, r.err)
    res = r.report()
    assert res["failure_kind"] == "aborted" and res["committed_tokens"] == 0 and "marker" not in res
    assert "aborted" in r.err and "no tier blamed" in r.err
    st = _status(bsr)[1]
    assert st["markers"] == [] and st["tiers"]["mooncake"]["ok"] is True


# -- findings 2 and 3 against an engine of our own (these freeze ranks and kill services) ---------------------------


@pytest.fixture(scope="module")
def own_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    settings = dict(w=4, max_tokens=4096, kv_tokens=4096, fetch_timeout_s=FETCH_TIMEOUT_S, segment_bytes=256 << 20)
    with start_own_engine(tmp_path_factory.mktemp("diag-engine"), **settings) as e:
        yield e.state_dir, e.url, e.token


@pytest.fixture
def own(own_engine, monkeypatch: pytest.MonkeyPatch):
    state, url, token = own_engine
    for k, v in {"BSR_ENGINE": url, "BSR_TOKEN": token, "BSR_STATE_DIR": str(state)}.items():
        monkeypatch.setenv(k, v)
    from bsr_cli.client import AdminClient

    with AdminClient(url, token) as c:
        c.clear_faults()
        c.clear_markers()
    return state, url, token


def _pid(state: Path, what: str) -> int:
    st = json.loads((state / "state.json").read_text())
    if what.startswith("rank"):
        return int(next(r["pid"] for r in st["ranks"] if r["rank"] == int(what[4:])))
    return int(st["services"][what]["pid"])


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _wait_healthy(client, deadline_s: float = 60.0) -> Health:
    end = time.monotonic() + deadline_s
    h = client.health()
    while not h.ok and time.monotonic() < end:
        time.sleep(0.2)
        h = client.health()
    return h


def test_a_request_waits_for_destination_blocks_and_proceeds_when_they_free(bsr, own) -> None:
    """kv_tokens = max_tokens: while a stopped rank's restore call still holds every block (quarantined until it
    returns), another request waits for them, visible in `bsr status` and the metrics, instead of being refused;
    once the rank runs again and its call returns, the waiting request proceeds and succeeds."""
    state, url, token = own
    from bsr_cli.client import AdminClient

    n, seed = 4096, 950
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    pid = _pid(state, "rank1")
    stopped = threading.Event()
    out: dict = {}
    with AdminClient(url, token) as c:
        c.inject_fault(FaultRequest("timeout", rank=1, window=1))  # rank 1 is mid-call when it is stopped

        def on_event(ev: Event) -> None:
            if isinstance(ev, WindowReleased) and ev.rank == 1 and not stopped.is_set():
                os.kill(pid, signal.SIGSTOP)
                stopped.set()

        try:
            res = c.restore(Prompt.synthetic_of(n, seed), on_event=on_event)
            assert stopped.is_set() and res.report is not None
            assert res.report.failure_kind is FailureKind.RANK  # its blocks stay held: the call still runs

            def run() -> None:
                out["r"] = bsr("submit", "--synthetic", "1000", "--seed", "951")

            t = threading.Thread(target=run, daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while c.snapshot().admission.waiting_for_blocks != 1 and time.monotonic() < deadline:
                time.sleep(0.1)  # polls the engine's state, not a timing
            code, st = _status(bsr)
            text = bsr("status").out
            metrics = c.metrics()
        finally:
            os.kill(pid, signal.SIGCONT)
        t.join(120)
        after = c.metrics()
        healthy = _wait_healthy(c).ok
    assert st["admission"]["waiting_for_blocks"] == 1, (code, st["admission"])  # a stuck rank: status exits 9
    assert "waiting for destination KV" in text
    assert "bsr_requests_waiting_for_blocks 1.0" in metrics
    assert out["r"].code == 0, (out["r"].code, out["r"].err)  # it proceeded once the blocks were freed
    assert "bsr_requests_gave_up_waiting_for_blocks_total 0.0" in after and healthy


def test_a_stopped_rank_fails_a_restore_in_seconds_and_is_named(bsr, own) -> None:
    state, url, token = own
    from bsr_cli.client import AdminClient

    n, seed = 12 * 256, 960
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    with AdminClient(url, token) as c:
        # Rank 1 stalls in its second window; the moment its first window is released, freeze the process.
        c.inject_fault(FaultRequest("timeout", rank=1, window=1))
        pid = _pid(state, "rank1")
        stopped = threading.Event()

        def on_event(ev: Event) -> None:
            if isinstance(ev, WindowReleased) and ev.rank == 1 and not stopped.is_set():
                os.kill(pid, signal.SIGSTOP)
                stopped.set()

        try:
            t0 = time.monotonic()
            res = c.restore(Prompt.synthetic_of(n, seed), on_event=on_event)
            elapsed = time.monotonic() - t0
            assert stopped.is_set()
            h = c.health()
            metrics = c.metrics()
            code, st = _status(bsr)
            text = bsr("status")
            r = bsr("restore", "--synthetic", str(n), "--seed", str(seed))  # the rank is still stopped
            t1 = time.monotonic()
            p = bsr("--timeout", "30", "probe", "--synthetic", str(n), "--seed", str(seed))
            probe_s = time.monotonic() - t1
        finally:
            os.kill(pid, signal.SIGCONT)
        report = res.report
        assert report is not None
        assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
        assert report.failure_kind is FailureKind.RANK and report.blamed_tiers == ()
        assert any(f.rank == 1 and f.kind is FailureKind.RANK and "heartbeat" in f.reason for f in report.failures)
        assert elapsed < 60  # bounded by the heartbeat (2 s here), not the old multi-minute restore budget
        assert h.ok is False and h.unhealthy_ranks == [1]
        assert 'bsr_rank_healthy{rank="1"} 0' in metrics and 'bsr_rank_healthy{rank="0"} 1' in metrics
        assert code == ExitCode.SERVER_ERROR and text.code == ExitCode.SERVER_ERROR
        assert "rank 1" in text.err and "rank 1 unhealthy" in text.out
        assert [rk["healthy"] for rk in st["ranks"]] == [True, False] and st["markers"] == []
        assert r.code == ExitCode.FAILED_CLOSED and "rank 1" in r.err and "no tier blamed" in r.err
        assert p.code == ExitCode.SERVER_ERROR and "rank 1" in p.err and probe_s < 25
        # Resumed, the rank beats again, finishes its aborted restore (its blocks come back) and serves.
        h2 = _wait_healthy(c)
        assert h2.ok is True, h2
        assert c.markers() == []
        c.clear_faults()  # the injected stall never got to report that it fired
        again = c.restore(Prompt.synthetic_of(n, seed))
    assert again.outcome is Outcome.COMMITTED and again.hashes is not None and again.hashes.hash_ok is True


def test_client_honours_timeout(bsr) -> None:
    """An engine that accepts and never answers: `bsr --timeout 2 probe` gives up after ~2 s (exit 4), it does not
    wait 120 s."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    conns: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conns.append(srv.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        t0 = time.monotonic()
        r = bsr("--engine", f"http://127.0.0.1:{port}", "--timeout", "2", "probe", "--synthetic", "300")
        elapsed = time.monotonic() - t0
    finally:
        srv.close()
        for s in conns:
            s.close()
    assert r.code == ExitCode.ENGINE_TIMEOUT, (r.code, r.err)
    assert elapsed < 60


def test_an_armed_fault_is_shown_armed_and_the_failure_it_causes_shows_the_tier_unhealthy(bsr, own) -> None:
    """Arming a fault changes no health (the tier says it is armed); the restore it fails makes the tier unhealthy,
    marked injected, until a committed restore from it."""
    n, seed = 8 * 256, 970
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    assert _status(bsr)[1]["tiers"]["mooncake"]["ok"] is True
    assert bsr("inject-fault", "--kind", "remote-unavailable", "--count", "1").code == 0
    armed = _status(bsr)[1]["tiers"]["mooncake"]
    assert armed["ok"] is True and any("remote-unavailable armed" in d for d in armed["faults_armed"]), armed
    assert "fault #" in bsr("status").out and "remote-unavailable armed" in bsr("status").out
    from bsr_cli.client import AdminClient

    with AdminClient(own[1], own[2]) as c:
        assert c.health().degraded_tiers == []
    r = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--json")
    assert r.code == ExitCode.FAILED_CLOSED and r.report()["blamed_tiers"] == ["mooncake"]
    assert bsr("faults", "list", "--json").json()["faults"] == []  # fired once and spent: no longer armed
    assert bsr("markers", "clear", "--all", "--yes").code == 0
    recent = _status(bsr)[1]["tiers"]["mooncake"]
    assert recent["ok"] is False and any("failed" in d and "ago" in d for d in recent["detail"]), recent
    assert recent["injected"] is True and "faults_armed" not in recent
    assert "unhealthy (restore failed, injected)" in bsr("status").out
    ok = bsr("restore", "--synthetic", str(n), "--seed", str(seed), "--json")
    assert ok.code == 0 and ok.report()["tiers"] == ["mooncake"]
    assert _status(bsr)[1]["tiers"]["mooncake"]["ok"] is True  # a committed restore from it clears it


def test_a_stopped_master_shows_the_tier_unhealthy_while_health_stays_quick(bsr, own) -> None:
    """/health asks the ranks about their tiers but never waits long for them: with the master frozen the engine is
    still healthy (200: it serves from fs or by recomputing) and `mooncake` is degraded."""
    from bsr_cli.client import AdminClient
    from bsr_cli.engine import supervisor

    state = own[0]
    pid = _pid(state, "mooncake_master")
    with _stopped(pid), AdminClient(own[1], own[2]) as c:
        end = time.monotonic() + 60
        h = c.health()
        while "mooncake" not in h.degraded_tiers and time.monotonic() < end:
            time.sleep(0.5)
            h = c.health()
        t0 = time.monotonic()
        again = c.health()
        quick = time.monotonic() - t0
        engine = supervisor.status(state)
    assert h.ok is True and h.degraded_tiers == ["mooncake"], h
    assert any("health probe" in d or "refuses" in d for d in h.tiers["mooncake"].detail), h
    assert again.ok is True and quick < 2.0  # generous: the wait is 0.5 s, the client's own timeout is 5 s
    assert engine.healthy is True  # so `bsr engine up` does not restart an engine whose remote tier is down
    with AdminClient(own[1], own[2]) as c:  # resumed, the master serves again and the tier turns healthy
        end = time.monotonic() + 60
        h = c.health()
        while h.degraded_tiers and time.monotonic() < end:
            time.sleep(0.5)
            h = c.health()
    assert h.degraded_tiers == [], h


def test_a_dead_segment_holder_shows_the_tier_unhealthy(bsr, own) -> None:
    """Last in this module: it kills the engine's segment holder."""
    state = own[0]
    n, seed = 8 * 256, 980
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    pid = _pid(state, "segment_holder")
    os.kill(pid, signal.SIGKILL)
    # The master drops the holder's segment once its heartbeat lapses: then health names the missing holder.
    end = time.monotonic() + 90
    tier = _status(bsr)[1]["tiers"]["mooncake"]
    while tier["ok"] and time.monotonic() < end:
        time.sleep(1)
        tier = _status(bsr)[1]["tiers"]["mooncake"]
    assert tier["ok"] is False and any("segment" in d for d in tier["detail"]), tier
    code, st = _status(bsr)
    assert code == 0 and all(rk["healthy"] for rk in st["ranks"])  # the ranks are fine: the tier is not
    from bsr_cli.client import AdminClient

    with AdminClient(own[1], own[2]) as c:
        h = c.health()
    assert h.ok is True and h.degraded_tiers == ["mooncake"] and h.tiers["fs"].ok is True


def test_a_failure_from_an_injected_fault_is_forgotten_when_faults_are_cleared(bsr, engine) -> None:
    """An injected fault fails a restore and the tier shows it; `bsr faults clear` ends the drill, and the tier is
    healthy again (a real failure would stay until its TTL or the tier's next committed restore)."""
    n, seed = 8 * 256, 907
    assert bsr("submit", "--synthetic", str(n), "--seed", str(seed)).code == 0
    assert bsr("inject-fault", "--rank", "1", "--kind", "remote-unavailable", "--window", "1").code == 0
    assert bsr("restore", "--synthetic", str(n), "--seed", str(seed)).code == ExitCode.FAILED_CLOSED
    assert bsr("faults", "list", "--json").json()["faults"] == []  # it fired and is spent
    st = _status(bsr)[1]
    assert st["tiers"]["mooncake"]["ok"] is False  # the failure is remembered
    assert bsr("faults", "clear").code == 0
    assert _status(bsr)[1]["tiers"]["mooncake"]["ok"] is True
