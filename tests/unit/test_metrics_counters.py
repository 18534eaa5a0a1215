"""The coordinator's counters are exact: incremented where each thing happens, from the coordinator's start, in
whatever order ranks report. Checked in-process over the fake ranks (the real stack serves the same registry:
tests/engine/test_prometheus.py), at a scale that keeps the fast lane fast."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("prometheus_client")  # the engine extra's, as the server's

from bsr_cli.core.events import Event, WindowReleased
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.runtime.events import EventLog
from unit.fixtures import FakeEngine, build_engine

TOKENS = 1024  # 64 chunks of 16 tokens: 64 windows per rank at W=1


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    eng = build_engine(pool_chunks=8)
    try:
        yield eng
    finally:
        for r in eng.ranks:
            r.close()


def _scrape(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` in a Prometheus text exposition: label string -> value."""
    return {m[0]: float(m[1]) for m in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def test_every_released_window_is_counted_on_its_rank_in_whatever_order_it_arrives(engine: FakeEngine) -> None:
    """One W=1 restore of 64 windows per rank, with rank 0's first release held back until rank 1 has released
    one: the events reach the log out of order (the old observer, deduplicating by sequence number, dropped the
    late one). The counter must rise by exactly the windows each rank released."""
    from bsr_cli.server.metrics import exposition

    c = engine.coordinator
    prompt = synthetic_tokens(TOKENS, 1)
    c.submit(prompt)
    before = _scrape(exposition(c), "bsr_restore_windows_total")
    rank1_released = threading.Event()
    held: list[bool] = []

    def progress(ev: Event) -> None:  # runs on the releasing rank's thread, inside its emit
        if not isinstance(ev, WindowReleased):
            return
        if ev.rank == 1:
            rank1_released.set()
        elif not held:
            held.append(rank1_released.wait(10))

    result = c.restore(prompt, w=1, progress=progress)
    assert result.report is not None
    assert result.outcome is Outcome.COMMITTED and held == [True]
    released = {rank.rank: rank.windows_done for rank in result.report.ranks}
    assert released == {0: TOKENS // 16, 1: TOKENS // 16}
    after = _scrape(exposition(c), "bsr_restore_windows_total")
    rose = {lbl: after[lbl] - before.get(lbl, 0.0) for lbl in after}
    assert rose == {'rank="0"': released[0], 'rank="1"': released[1]}


def test_counters_count_from_the_start_not_from_the_first_scrape() -> None:
    """Restores that ended before anyone scraped, and events the log no longer holds, are still counted."""
    from bsr_cli.server.metrics import exposition

    engine = build_engine(pool_chunks=8, events=EventLog(capacity=10))  # a log that forgets almost everything
    try:
        c = engine.coordinator
        p = synthetic_tokens(TOKENS, 7)
        c.submit(p)
        for _ in range(3):
            assert c.restore(p, w=1).outcome is Outcome.COMMITTED
        text = exposition(c)
    finally:
        for r in engine.ranks:
            r.close()
    assert _scrape(text, "bsr_restores_total")['injected="false",kind="none",outcome="committed",stage="none"'] == 3
    assert _scrape(text, "bsr_restore_windows_total") == {'rank="0"': 3 * 64, 'rank="1"': 3 * 64}
    assert _scrape(text, "bsr_requests_submitted_total") == {} and "bsr_requests_submitted_total 1.0" in text


def _metrics_text(http: httpx.Client, auth: dict[str, str]) -> str:
    r = http.get("/metrics", headers=auth)  # /metrics needs the token unless the engine serves it openly
    assert r.status_code == 200, r.text
    return r.text


def test_200_restores_from_16_parallel_clients_add_exactly_200(engine: FakeEngine) -> None:
    from bsr_cli.server.admin import PREFIX, AdminServer

    server = AdminServer(engine.coordinator, token="t")
    server.start()
    auth = {"Authorization": "Bearer t"}
    body = {"synthetic": {"n": 48, "seed": 3}, "stream": False}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.post(f"{PREFIX}/requests", json=body, headers=auth).status_code == 200
            before = _scrape(_metrics_text(http, auth), "bsr_restores_total")
        outcomes: list[str] = []
        lock = threading.Lock()

        def client(n: int) -> None:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                for _ in range(n):
                    r = http.post(f"{PREFIX}/restore", json=body, headers=auth)
                    assert r.status_code == 200, r.text
                    with lock:
                        outcomes.append(r.json()["outcome"])

        shares = [200 // 16 + (1 if i < 200 % 16 else 0) for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            for f in [pool.submit(client, n) for n in shares]:
                f.result()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            after = _scrape(_metrics_text(http, auth), "bsr_restores_total")
    finally:
        server.stop()
    assert len(outcomes) == 200 and set(outcomes) == {"committed"}
    rose: dict[str, Any] = {lbl: after[lbl] - before.get(lbl, 0.0) for lbl in after if after[lbl] != before.get(lbl)}
    assert rose == {'injected="false",kind="none",outcome="committed",stage="none"': 200.0}
    assert sum(after.values()) - sum(before.values()) == 200
