"""Limits that used to let through what could never work, over the real admin API and CLI with fake ranks: fault
counts, windows and lifetimes, ranks the engine does not have, event counts; and the engine's own OpenAPI
document says every one of them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.core.faults import FaultSpec
from bsr_cli.errors import ExitCode
from bsr_cli.server.admin import PREFIX, AdminServer
from unit.fixtures import FakeEngine, build_engine

TOKEN = "limits-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeEngine, AdminServer]]:
    eng = build_engine()
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    monkeypatch.setenv("BSR_ENGINE", server.url)
    monkeypatch.setenv("BSR_TOKEN", TOKEN)
    try:
        yield eng, server
    finally:
        server.stop()
        for r in eng.ranks:
            r.close()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"kind": "timeout", "count": 10**4000}, "count"),
        ({"kind": "timeout", "count": 1001}, "count"),
        ({"kind": "timeout", "window": 2**70}, "window"),
        ({"kind": "timeout", "window": 999}, "beyond the last window"),
        ({"kind": "timeout", "rank": 5}, "rank"),
        ({"kind": "timeout", "ttl_s": 0}, "ttl_s"),
        ({"kind": "timeout", "ttl_s": 86_401}, "ttl_s"),
    ],
)
def test_faults_out_of_bounds_are_refused(served: tuple[FakeEngine, AdminServer], body: dict, needle: str) -> None:
    eng, server = served
    r = httpx.post(server.url + f"{PREFIX}/faults", json=body, headers=AUTH, timeout=20)
    assert r.status_code == 400 and needle in r.json()["message"], r.text
    assert eng.coordinator.list_faults() == []


def test_every_fault_expires(served: tuple[FakeEngine, AdminServer]) -> None:
    eng, server = served
    r = httpx.post(server.url + f"{PREFIX}/faults", json={"kind": "timeout", "count": 0}, headers=AUTH, timeout=20)
    assert r.status_code == 201
    armed = r.json()
    assert armed["expires_at"] is not None and armed["expires_at"] - time.time() == pytest.approx(3600, abs=60)
    # Its life is over (set back, rather than waited for): it no longer fires, and is no longer listed.
    c = eng.coordinator
    ended = [FaultSpec.from_wire(f.to_wire() | {"expires_at": time.time() - 1}) for f in c.faults]
    c.armed_faults.clear()
    for f in ended:
        c.armed_faults.arm(f)
    assert all(f.exhausted() for f in c.faults)
    assert httpx.get(server.url + f"{PREFIX}/faults", headers=AUTH, timeout=20).json()["faults"] == []


def test_the_cli_refuses_a_rank_or_window_the_engine_does_not_have(served: tuple[FakeEngine, AdminServer], bsr) -> None:
    eng, _ = served
    r = bsr("inject-fault", "--rank", "5", "--kind", "timeout")
    assert r.code == ExitCode.INVALID_INPUT and "2 rank(s), 0..1" in r.err, (r.code, r.err)
    r = bsr("inject-fault", "--rank", "1", "--kind", "timeout", "--window", "999")
    assert r.code == ExitCode.INVALID_INPUT and "windows" in r.err, (r.code, r.err)
    assert eng.coordinator.list_faults() == []
    assert bsr("inject-fault", "--rank", "1", "--kind", "timeout", "--window", "2").code == 0  # control


def test_events_needs_a_positive_count(served: tuple[FakeEngine, AdminServer], bsr) -> None:
    r = bsr("events", "-n", "-5")
    assert r.code == ExitCode.INVALID_INPUT, (r.code, r.err)
    assert bsr("events", "-n", "5").code == 0


def test_the_engines_document_says_its_own_limits(served: tuple[FakeEngine, AdminServer]) -> None:
    eng, server = served
    doc = httpx.get(server.url + f"{PREFIX}/openapi.json", headers=AUTH, timeout=20).json()
    s = doc["components"]["schemas"]
    settings = eng.coordinator.settings
    assert s["Synthetic"]["properties"]["n"]["maximum"] == settings.max_tokens
    assert s["ProbeBody"]["properties"]["tokens"]["maxItems"] == settings.max_tokens
    assert s["ProbeBody"]["oneOf"] == [{"required": ["tokens"]}, {"required": ["synthetic"]}]
    fault = s["FaultBody"]["properties"]
    assert fault["rank"]["anyOf"][0]["maximum"] == len(eng.ranks) - 1
    assert fault["group"]["anyOf"][0]["enum"] == list(eng.reg.group_names)
    budget = s["SettingsBody"]["properties"]["budget_bytes"]
    assert (budget["minimum"], budget["maximum"]) == (eng.reg.bytes_per_chunk, settings.pool_bytes)
    # W: at most the chunks of the longest prompt in a request; the default W also within the pool.
    chunks = -(-settings.max_tokens // eng.reg.chunk_size)
    assert [s[b]["properties"]["W"]["anyOf"][0]["maximum"] for b in ("SubmitBody", "RestoreBody")] == [chunks] * 2
    most_w = min(chunks, settings.pool_bytes // eng.reg.bytes_per_chunk)
    assert s["SettingsBody"]["properties"]["W"]["maximum"] == most_w
    restore = {"synthetic": {"n": 64}, "stream": False}
    at_most = httpx.post(server.url + f"{PREFIX}/restore", json=restore | {"W": chunks}, headers=AUTH, timeout=20)
    assert at_most.status_code == 200, at_most.text
    past = httpx.post(server.url + f"{PREFIX}/restore", json=restore | {"W": chunks + 1}, headers=AUTH, timeout=20)
    assert past.status_code == 400 and "chunks of this engine's longest prompt" in past.json()["message"], past.text
    # A valid value at each bound is accepted; one past it is refused.
    ok = httpx.post(server.url + f"{PREFIX}/settings", json={"budget_bytes": budget["maximum"]}, headers=AUTH)
    assert ok.status_code == 200
    over = httpx.post(server.url + f"{PREFIX}/settings", json={"budget_bytes": budget["maximum"] + 1}, headers=AUTH)
    assert over.status_code == 400
    n = settings.max_tokens
    assert httpx.post(server.url + f"{PREFIX}/probe", json={"synthetic": {"n": n}}, headers=AUTH).status_code == 200
    assert httpx.post(server.url + f"{PREFIX}/probe", json={"synthetic": {"n": n + 1}}, headers=AUTH).status_code == 400
    # JSON Schema's integers: 3.0 is one, 3.5 is not.
    assert httpx.post(server.url + f"{PREFIX}/probe", json={"tokens": [3.0, 4]}, headers=AUTH).status_code == 200
    assert httpx.post(server.url + f"{PREFIX}/probe", json={"tokens": [3.5, 4]}, headers=AUTH).status_code == 400


def test_a_budget_cut_binds_new_windows_at_once_and_reports_draining(
    served: tuple[FakeEngine, AdminServer], bsr
) -> None:
    """Windows already staged finish; a new one is admitted only within the new B at once; /pool, /snapshot and
    `bsr status` say "draining" until live ≤ B (a cut used to look like a broken bound, or like nothing)."""
    eng, server = served
    pool = eng.ranks[0].ops.pool
    slot = pool.slot_bytes
    in_flight = pool.acquire(4, timeout_s=5)  # a window of 4 chunks staged on rank 0
    assert in_flight is not None
    try:
        r = httpx.post(server.url + f"{PREFIX}/settings", json={"budget_bytes": 2 * slot}, headers=AUTH, timeout=20)
        assert r.status_code == 200 and r.json()["budget_bytes"] == 2 * slot
        assert pool.acquire(1, timeout_s=1, wait=False) is None  # live 4 slots > B of 2: nothing new fits
        ranks = httpx.get(server.url + f"{PREFIX}/pool", headers=AUTH, timeout=20).json()["ranks"]
        assert [r["pool"]["draining"] for r in ranks] == [True, False]
        snap = httpx.get(server.url + f"{PREFIX}/snapshot?health=0", headers=AUTH, timeout=20).json()
        assert [r["pool"]["draining"] for r in snap["ranks"]] == [True, False]
        status = bsr("status")
        assert status.code == 0 and "draining to B" in status.out, status.out
        view = bsr("pool", "--json")
        assert view.code == 0
        assert [(g["draining"], g["state"]) for g in view.json()["gauges"]] == [(True, "draining"), (False, "ok")]
    finally:
        in_flight.release()
    ranks = httpx.get(server.url + f"{PREFIX}/pool", headers=AUTH, timeout=20).json()["ranks"]
    assert [r["pool"]["draining"] for r in ranks] == [False, False]
    lease = pool.acquire(2, timeout_s=5, wait=False)  # within the new B now
    assert lease is not None
    lease.release()
