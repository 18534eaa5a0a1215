"""A rank the host is starting again, seen through the real admin server and the real CLI (fake ranks, in-process):
503 ``rank-restarting`` with Retry-After and the rank, one error line with a hint and exit 16 for a write, a read
the client retries once the rank is back, and no other status a runtime condition maps to 500."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.core.events import RankUnresponsive
from bsr_cli.errors import ExitCode
from bsr_cli.server.admin import PREFIX, AdminServer
from unit.fakes import RestartSchedule
from unit.fixtures import FakeEngine, build_engine

TOKEN = "unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def restarting(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeEngine, AdminServer]]:
    """An engine whose rank 1 is down, with the host starting it again in 2.5 s; BSR_* point at it."""
    eng = build_engine()
    eng.coordinator.restart_ranks_with(RestartSchedule(2.5))
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    monkeypatch.setenv("BSR_ENGINE", server.url)
    monkeypatch.setenv("BSR_TOKEN", TOKEN)
    eng.ranks[1].dead = True
    try:
        yield eng, server
    finally:
        server.stop()
        for r in eng.ranks:
            r.close()


def test_every_call_that_meets_the_rank_answers_503_with_retry_after(restarting) -> None:
    eng, server = restarting
    prompt = {"synthetic": {"n": 64}}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=20) as http:
        for path, body in (
            ("/probe", prompt),
            ("/requests", prompt),
            ("/restore", prompt | {"stream": False}),
            ("/settings", {"budget_bytes": 2 * eng.reg.bytes_per_chunk}),
            ("/pool/reset-peak", {}),
        ):
            r = http.post(PREFIX + path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "3", (path, r.status_code, r.text)
            err = r.json()
            assert (err["error"], err["rank"], err["retry_after_s"]) == ("rank-restarting", 1, 3), err
            assert err["message"].startswith("rank 1 is down") and "starts it again in 3s" in err["message"], err
        line = http.post(PREFIX + "/restore", json=prompt).text.splitlines()[-1]
        assert '"status": 503' in line and '"retry_after_s": 3' in line, line
        health = http.get(PREFIX + "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "3"
        assert health.json()["unhealthy_ranks"] == [1]


def test_the_cli_says_the_rank_is_restarting_in_one_line_and_exits_16(restarting, bsr) -> None:
    r = bsr("restore", "--synthetic", "64")
    assert r.code == ExitCode.RANK_RESTARTING == 16, (r.code, r.err)
    lines = r.err.strip().splitlines()
    assert lines[0].startswith("bsr: error: rank 1 is down") and lines[1].startswith("bsr: hint: retry in 3s"), lines
    assert "Traceback" not in r.err
    eng, _ = restarting
    r = bsr("--json", "settings", "set", "--budget", str(2 * eng.reg.bytes_per_chunk))
    assert r.code == 16
    assert {k: r.json()[k] for k in ("error", "exit_code", "rank", "retry_after_s")} == {
        "error": "rank-restarting",
        "exit_code": 16,
        "rank": 1,
        "retry_after_s": 3,
    }


def test_a_read_waits_for_the_rank_to_be_back(restarting, bsr) -> None:
    """`bsr probe` (a read) met the restarting rank: it waits the engine's Retry-After and asks again, and is
    answered once the rank is back."""
    eng, _ = restarting
    done: list[int] = []
    probe = threading.Thread(target=lambda: done.append(bsr("probe", "--synthetic", "64").code), daemon=True)
    met = threading.Event()
    eng.events.observe(lambda ev: met.set() if isinstance(ev, RankUnresponsive) and ev.rank == 1 else None)
    probe.start()
    assert met.wait(20), "the probe never met the down rank"
    eng.ranks[1].dead = False  # started again
    probe.join(25)
    assert done == [0]


def test_a_rank_the_kernel_finds_gone_mid_call_is_restarting_before_its_client_notices() -> None:
    """The judge and the restarts agree: a rank whose process the kernel no longer has (its pid is gone) is judged
    dead during a call even while its client has not yet seen it go (``alive()`` still true), and the call is
    answered 503 rank-restarting with when to retry, as for a rank whose client knows it is down."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: /proc has no such pid any more
    eng = build_engine(call_timeout_s=4.0)
    eng.coordinator.restart_ranks_with(RestartSchedule(2.5))
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    stuck = eng.ranks[1]
    stuck.pid = gone.pid  # type: ignore[attr-defined]  # the process rank 1 ran in
    stuck.hang = {"reset_peak"}  # its call never returns: only the judge can end the wait
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
            r = http.post(PREFIX + "/pool/reset-peak", json={})
        assert stuck.alive(), "the client must not know yet: the kernel is what says the process is gone"
        assert r.status_code == 503 and r.headers.get("retry-after") == "3", (r.status_code, r.text)
        err = r.json()
        assert (err["error"], err["rank"], err["retry_after_s"]) == ("rank-restarting", 1, 3), err
        assert "its process is not running during reset_peak" in err["message"], err
    finally:
        server.stop()
        for rank in eng.ranks:
            rank.close()
