"""The admin API's request handling, in-process: the real HTTP server and client over a coordinator with fake
ranks (no Mooncake, no rank processes). Authentication, validation, streamed restores, faults and markers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.client import AdminClient
from bsr_cli.core.events import Event, WindowReleased, request_of
from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.errors import BsrError
from bsr_cli.server.admin import PREFIX, AdminServer
from unit.fixtures import FakeEngine, build_engine

TOKEN = "unit-token"
PROMPT = Prompt.synthetic_of(200, 5)


@pytest.fixture
def served() -> Iterator[tuple[FakeEngine, AdminServer]]:
    eng = build_engine(fetch_timeout_s=20.0)
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    try:
        yield eng, server
    finally:
        server.stop()
        for r in eng.ranks:
            r.close()


def test_mutations_need_the_token_and_reads_do_not(served: tuple[FakeEngine, AdminServer]) -> None:
    _, server = served
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get(f"{PREFIX}/health").status_code == 200
        r = http.post(f"{PREFIX}/restore", json=PROMPT.to_wire())
        assert r.status_code == 401
        r = http.post(f"{PREFIX}/restore", json=PROMPT.to_wire(), headers={"Authorization": "Bearer wrong"})
        assert r.status_code in (401, 403)


@pytest.mark.parametrize(
    "body",
    [
        {"synthetic": {"n": 200}, "tokens": [1]},  # both prompt forms
        {"synthetic": {"n": 200}, "bogus": 1},  # an unknown field
        {"synthetic": {"n": 10**9}},  # over the engine's limit
        {"tokens": []},
        {"tokens": [1, -2]},
        {"synthetic": {"n": 50}, "W": -1},
    ],
)
def test_bad_restore_bodies_are_refused_before_any_rank_is_called(
    served: tuple[FakeEngine, AdminServer], body: dict[str, Any]
) -> None:
    eng, server = served
    with httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        r = http.post(f"{PREFIX}/restore", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json().get("error") or r.json().get("message")
    assert all("restore" not in rk.calls and "probe" not in rk.calls for rk in eng.ranks)


def test_a_streamed_restore_reports_its_windows_and_commits(served: tuple[FakeEngine, AdminServer]) -> None:
    eng, server = served
    with AdminClient(server.url, TOKEN, timeout_s=20) as client:
        first = client.submit(PROMPT)
        assert first.source == "recompute"
        events: list[Event] = []
        out = client.restore(PROMPT, w=4, on_event=events.append)
    assert out.report is not None and out.hashes is not None
    assert out.outcome is Outcome.COMMITTED and out.committed_tokens == 200  # 13 chunks, the last partial
    assert out.hashes.hash_ok is True and out.report.windows == 4  # W=4
    assert sum(isinstance(e, WindowReleased) for e in events) == 4 * len(eng.ranks)


def test_faults_and_markers_round_trip(served: tuple[FakeEngine, AdminServer]) -> None:
    _, server = served
    with AdminClient(server.url, TOKEN, timeout_s=20) as client:
        client.submit(PROMPT)
        with pytest.raises(BsrError, match="unknown fault kind"):
            client.inject_fault(FaultRequest("meteor"))
        client.inject_fault(FaultRequest("corrupt", group="full"))
        assert [f.kind for f in client.faults().faults] == ["corrupt"]
        out = client.restore(PROMPT)
        assert out.report is not None
        assert out.outcome is Outcome.FAILED_CLOSED and out.report.failure_kind is FailureKind.TIER
        assert "checksum mismatch" in out.report.failures[0].reason
        assert [m.excluded_tiers for m in client.markers()] == [("mooncake",)]
        assert client.clear_markers() == 1 and client.markers() == []
        metrics = client.metrics()
    assert "bsr_" in metrics and "failed" in metrics


def test_a_client_that_goes_away_mid_stream_aborts_the_restore_fail_closed(
    served: tuple[FakeEngine, AdminServer],
) -> None:
    """No explicit abort call: the streamed restore's connection is closed while rank 0 stalls on an injected
    timeout (20 s here), and the server ends the restore as aborted, nothing committed, the pool empty.

    The client holds its line iterator for as long as it means to stay connected: httpx closes the connection when
    a half-read iterator is garbage-collected, which is a client going away at a moment nobody chose."""
    eng, server = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with AdminClient(server.url, TOKEN, timeout_s=20) as client:
        client.submit(PROMPT)
        client.inject_fault(FaultRequest("timeout", rank=0, window=1))
    c = eng.coordinator
    seq = c.events.last_seq
    with (
        httpx.Client(base_url=server.url, timeout=20) as http,
        http.stream("POST", f"{PREFIX}/restore", json=PROMPT.to_wire() | {"W": 4}, headers=auth) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        assert first["type"] == "accepted"
        rid = first["request"]
        for line in lines:  # connected until the restore has started (the stream says so)
            msg = json.loads(line)
            assert msg["type"] == "event", msg
            if msg["event"]["type"] == "restore_started":
                break
        kinds = [e.kind for e in c.events.since(seq, limit=10_000) if request_of(e) == rid]
        assert "abort_requested" not in kinds, kinds
    # The connection is gone; the restore must end without anyone asking for it.
    ended = _wait_for_event(c, seq, rid, "restore_aborted")
    assert ended["failure_kind"] == "aborted", ended
    assert [r.outcome for r in c.recent if r.request == rid] == [Outcome.ABORTED]
    assert all(rk.live_bytes == 0 for rk in c.pool())


def _wait_for_event(c: Any, seq: int, request: str, kind: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """The first event of ``kind`` for ``request`` after ``seq``, long-polling the event log (no sleeps)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in c.events.since(seq, wait_s=min(1.0, max(0.0, deadline - time.monotonic())), limit=10_000):
            seq = max(seq, e.seq)
            if request_of(e) == request and e.kind == kind:
                return e.to_wire()
    raise AssertionError(f"no {kind} event for {request} within {timeout_s:g}s")


def test_events_page_back_from_the_newest_and_say_how_many_are_held(served: tuple[FakeEngine, AdminServer]) -> None:
    """GET /events?newest=1&limit=N, then &before=<the oldest seq read>, walks the log back page by page to its
    oldest event, each once; every answer says how many events the engine holds and the oldest one's seq."""
    eng, server = served
    log = eng.coordinator.events
    for w in range(25):
        log.append(WindowReleased(request="req-00009", rank=w % 2, window=w, windows=25, bytes=4096))
    with AdminClient(server.url, TOKEN) as client:
        first = client.events(newest=True, limit=10)
        held, oldest = log.extent()
        assert (first.held, first.oldest_seq, first.last_seq) == (held, oldest, log.last_seq) and held >= 25
        assert [int(e["seq"]) for e in first.events] == list(range(log.last_seq - 9, log.last_seq + 1))
        seen = [int(e["seq"]) for e in first.events]
        before = seen[0]
        for _ in range(held):  # at most one page per event: a cursor that did not move ends the loop anyway
            page = client.events(newest=True, limit=10, before=before)
            if not page.events:
                break
            seqs = [int(e["seq"]) for e in page.events]
            assert seqs == sorted(seqs) and seqs[-1] < before
            seen = seqs + seen
            before = seqs[0]
        assert seen == list(range(oldest, log.last_seq + 1))
        with pytest.raises(BsrError):
            client.events(before=0)  # a cursor is a sequence number from 1
