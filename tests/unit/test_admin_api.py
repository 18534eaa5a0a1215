"""The admin API's request handling, in-process: the real HTTP server and client over a coordinator with fake
ranks (no Mooncake, no rank processes). Authentication, validation, streamed restores, faults and markers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bsr_cli.client import AdminClient
from bsr_cli.errors import BsrError
from bsr_cli.runtime.admin import PREFIX, AdminServer
from unit.conftest import FakeEngine, build_engine

TOKEN = "unit-token"
PROMPT = {"synthetic": {"n": 200, "seed": 5}}


@pytest.fixture
def served() -> Iterator[tuple[FakeEngine, AdminServer]]:
    eng = build_engine()
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
        r = http.post(f"{PREFIX}/restore", json=PROMPT)
        assert r.status_code == 401
        r = http.post(f"{PREFIX}/restore", json=PROMPT, headers={"Authorization": "Bearer wrong"})
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
        assert first["source"] == "recompute"
        events: list[dict[str, Any]] = []
        out = client.restore(PROMPT, w=4, on_event=events.append)
    assert out["outcome"] == "committed" and out["committed_tokens"] == 200  # 13 chunks, the last partial
    assert out["hash_ok"] is True and out["windows"] == 4  # W=4
    assert sum(e.get("type") == "window_released" for e in events) == 4 * len(eng.ranks)


def test_faults_and_markers_round_trip(served: tuple[FakeEngine, AdminServer]) -> None:
    _, server = served
    with AdminClient(server.url, TOKEN, timeout_s=20) as client:
        client.submit(PROMPT)
        with pytest.raises(BsrError, match="unknown fault kind"):
            client.inject_fault({"kind": "meteor"})
        client.inject_fault({"kind": "corrupt", "group": "full"})
        assert [f["kind"] for f in client.faults()["faults"]] == ["corrupt"]
        out = client.restore(PROMPT)
        assert out["outcome"] == "failed_closed" and out["failure_kind"] == "tier"
        assert "checksum mismatch" in out["failures"][0]["reason"]
        assert [m["excluded_tiers"] for m in client.markers()] == [["mooncake"]]
        assert client.clear_markers() == 1 and client.markers() == []
        metrics = client.metrics()
    assert "bsr_" in metrics and "failed" in metrics
