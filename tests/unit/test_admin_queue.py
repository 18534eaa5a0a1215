"""Requests that wait for engine capacity queue instead of being refused: over the real uvicorn-served admin API and
HTTP clients, fake ranks behind it. A submit waiting for destination KV holds neither a serving slot nor one of the
server's worker threads, so more of them than there are of either wait, the operator is still answered meanwhile,
and all of them finish once the blocks are free. What is still refused (the queue full, the wait's deadline passed)
says when to retry and what to change. Synchronised on the queue's own state (``await_blocks_waiting``), never on
sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.client import AdminClient
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.prompt import Prompt
from bsr_cli.errors import CapacityError
from bsr_cli.server.admin import PREFIX, AdminServer
from unit.fixtures import HANG_DEADLINE_S, FakeEngine, hold_blocks

TOKEN = "queue-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAITER_TOKENS = 2000  # each waiter needs 500 "full" blocks: more than the 274 the holder leaves
SLOTS = 4  # serving slots for requests with the token
WAITERS = 48  # more than the slots, and more than the server's worker threads (40)


@pytest.fixture
def server(kv_engine: FakeEngine) -> Iterator[AdminServer]:
    s = AdminServer(kv_engine.coordinator, token=TOKEN, max_connections=SLOTS, max_queued=WAITERS)
    s.start()
    try:
        yield s
    finally:
        kv_engine.ranks[0].release.set()
        s.stop()


def _submit(server: AdminServer, i: int) -> Any:
    """Waiter ``i`` over HTTP: every other one streamed (the CLI's way), the rest as one JSON answer."""
    tokens = synthetic_tokens(WAITER_TOKENS, seed=100 + i)
    if i % 2:
        with AdminClient(server.url, TOKEN, timeout_s=HANG_DEADLINE_S) as client:
            return client.submit(Prompt.of_tokens(tokens), verify=True).to_wire()
    r = httpx.post(
        server.url + f"{PREFIX}/requests",
        json={"tokens": tokens, "stream": False},
        headers=AUTH,
        timeout=HANG_DEADLINE_S,
    )
    return r.json() if r.status_code == 200 else (r.status_code, r.text)


@pytest.mark.timeout(240)
def test_more_requests_wait_for_kv_than_there_are_serving_slots_or_threads(
    kv_engine: FakeEngine, server: AdminServer
) -> None:
    """48 submits wait for destination KV behind a request that holds it, on a server with 4 serving slots and 40
    worker threads: none is refused, the operator's reads are answered while they wait, and every one of them
    finishes with the canonical hash once the blocks are free (it used to be 503 busy from the fifth on, the
    operator's reads included)."""
    holder, _ = hold_blocks(kv_engine)
    with ThreadPoolExecutor(max_workers=WAITERS) as pool:
        futures: list[Future[Any]] = [pool.submit(_submit, server, i) for i in range(WAITERS)]
        waited = kv_engine.coordinator.await_blocks_waiting(WAITERS, 60)
        early = [f.result() for f in futures if f.done()]  # a refusal would have ended its request at once
        assert waited, (kv_engine.coordinator.blocks_waiting(), early)
        assert server.guard.queued == WAITERS and server.guard.serving[True] == 0
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
            assert http.get(f"{PREFIX}/info").status_code == 200
            assert http.get(f"{PREFIX}/snapshot?health=0").json()["admission"]["waiting_for_blocks"] == WAITERS
            # Past the queue's limit a submit is refused at once, saying when to retry and what to change.
            full = http.post(f"{PREFIX}/requests", json={"synthetic": {"n": 8}, "stream": False})
            assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
            assert f"fewer than {WAITERS} submits and restores" in full.json()["hint"]
        kv_engine.ranks[0].release.set()  # the holder finishes and frees its blocks
        answers = [f.result(timeout=HANG_DEADLINE_S) for f in futures]
    holder.join(20)
    refused = [a for a in answers if not isinstance(a, dict)]
    assert refused == [], refused[:3]
    assert all(a["hash_ok"] is True and a["computed_tokens"] == WAITER_TOKENS for a in answers)
    assert server.guard.queued == 0 and kv_engine.coordinator.blocks_waiting() == []


@pytest.mark.parametrize("kv_engine", [{"kv_wait_s": 0.2}], indirect=True)
def test_a_request_past_its_wait_is_refused_with_when_to_retry(kv_engine: FakeEngine, server: AdminServer) -> None:
    """Still waiting for KV at its deadline: a 409 that says Retry-After and what to change (streamed: the same in
    its error line, read back by the client)."""
    holder, _ = hold_blocks(kv_engine)
    try:
        tokens = synthetic_tokens(WAITER_TOKENS, seed=7)
        r = httpx.post(
            server.url + f"{PREFIX}/requests", json={"tokens": tokens, "stream": False}, headers=AUTH, timeout=30
        )
        assert r.status_code == 409 and r.headers["retry-after"] == "5", (r.status_code, r.headers)
        body = r.json()
        assert body["error"] == "capacity" and "after waiting 0.2s" in body["message"]
        assert "--kv-tokens" in body["hint"] and "--kv-wait" in body["hint"]
        with AdminClient(server.url, TOKEN, timeout_s=30) as client, pytest.raises(CapacityError) as e:
            client.submit(Prompt.of_tokens(tokens))
        assert e.value.retry_after_s == 5 and "--kv-wait" in (e.value.hint or "")
    finally:
        kv_engine.ranks[0].release.set()
        holder.join(20)
