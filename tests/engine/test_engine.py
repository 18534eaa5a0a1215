"""The runtime and the embedded engine against the real stack: mooncake_master, a segment holder, two rank
processes with torch tensors, the admin API over HTTP."""

from __future__ import annotations

import json
import threading
import urllib.request

import httpx
import pytest

from bsr_cli.client import local_engine
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.results import AbortAnswer, ManualRestoreResult, RestoreReport, SubmitResult
from bsr_cli.errors import BadRequest, FaultsDisabled, Unauthorized, VersionMismatch
from bsr_cli.loaders import builtin_registration

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(240)]
REG = builtin_registration("demo")
W = 4  # the session engine's window
RWS = W * REG.bytes_per_chunk


def _warm(c, n: int, seed: int) -> SubmitResult:
    res = c.submit(Prompt.synthetic_of(n, seed))
    assert res.hash_ok is True
    return res


def _report(res: ManualRestoreResult) -> RestoreReport:
    assert res.report is not None, res
    return res.report


def test_probe_matches_what_was_stored_and_the_masters_key_list(engine) -> None:
    with engine.client() as c:
        n, seed = 3 * 256 + 10, 101
        before = c.probe(Prompt.synthetic_of(n, seed))
        assert before.committable_tokens == 0
        assert before.first_break is not None and before.first_break.reason == "missing in every tier"
        _warm(c, n, seed)
        after = c.probe(Prompt.synthetic_of(n, seed))
    bm = after.bitmap
    assert after.committable_tokens == n and after.first_break is None
    assert set(bm.rows.values()) == {"3333"}  # 4 chunks, each on both tiers (bits 0 and 1)
    # The store's own key listing agrees, key for key.
    state = json.loads((engine.state_dir / "state.json").read_text())
    admin = state["services"]["mooncake_master"]["urls"]["admin_url"]
    with urllib.request.urlopen(admin + "/get_all_keys", timeout=10) as r:
        listed = r.read().decode()
    hashes = chunk_hashes(synthetic_tokens(n, seed), 256)
    for rank in range(2):
        for g in REG.group_names:
            for h in hashes:
                assert object_key(REG, rank, g, h) in listed


def test_restore_is_bit_exact_and_bounded_by_rws(engine) -> None:
    with engine.client() as c:
        first = _warm(c, 30 * 256, 102)
        assert first.external_tokens == 0  # a cold prompt is computed locally ...
        res = c.restore(Prompt.synthetic_of(30 * 256, 102))
        again = c.submit(Prompt.synthetic_of(30 * 256, 102))
    assert res.outcome is Outcome.COMMITTED and res.committed_tokens == 30 * 256
    assert _report(res).windows == 8  # ceil(30 / 4)
    assert res.hashes is not None
    assert res.hashes.hash_ok is True and res.hashes.output_hash == first.output_hash  # restore == recompute
    assert [r.peak_live_bytes for r in _report(res).ranks] == [RWS, RWS]
    assert again.external_tokens == 30 * 256 and again.source == "mooncake"  # ... and reused after


@pytest.mark.parametrize("chunks", [3, 17, 120])
def test_peak_pool_equals_rws_whatever_the_prefix(engine, chunks: int) -> None:
    with engine.client() as c:
        _warm(c, chunks * 256, 200 + chunks)
        c.reset_peak()
        res = c.restore(Prompt.synthetic_of(chunks * 256, 200 + chunks))
        pool = c.pool()
    expected = min(chunks, W) * REG.bytes_per_chunk
    assert res.outcome is Outcome.COMMITTED
    assert all(r.peak_live_bytes == expected for r in _report(res).ranks)
    assert all(p.pool["peak_bytes"] == expected for p in pool)
    assert all(p.pool["live_bytes"] == 0 for p in pool)  # every window released


def test_whole_plan_path_needs_the_whole_prefix(engine) -> None:
    """W=0 stages all N chunks: with a pool of 2·RWS(4) = 8 chunks, 6 chunks fit and 12 do not."""
    with engine.client() as c:
        _warm(c, 6 * 256, 301)
        ok = c.restore(Prompt.synthetic_of(6 * 256, 301), w=0)
        _warm(c, 12 * 256, 302)
        too_big = c.restore(Prompt.synthetic_of(12 * 256, 302), w=0)
        pool = c.pool()
    assert ok.outcome is Outcome.COMMITTED
    assert [r.peak_live_bytes for r in _report(ok).ranks] == [6 * REG.bytes_per_chunk] * 2
    assert too_big.outcome is Outcome.REFUSED and too_big.committed_tokens == 0  # capacity: no fault
    assert "capacity" in _report(too_big).failures[0].reason
    assert all(p.pool["live_bytes"] == 0 for p in pool)


@pytest.mark.parametrize(
    ("seed", "fault", "fallback"),
    [
        (401, FaultRequest("remote-unavailable"), "fs"),
        (402, FaultRequest("remote-and-ssd-absent", count=0), "recompute"),
        # A rank's own install fault blames no tier: the prompt is recomputed locally.
        (403, FaultRequest("restore-fault", rank=1, window=1), "recompute"),
        (404, FaultRequest("restore-fault", rank=0, group="swa"), "recompute"),
        (405, FaultRequest("timeout", rank=1), "fs"),
        (406, FaultRequest("corrupt", rank=0, window=2), "fs"),
    ],
)
def test_every_fault_fails_closed_then_falls_back_canonically(
    engine, seed: int, fault: FaultRequest, fallback: str
) -> None:
    n = 12 * 256
    with engine.client() as c:
        _warm(c, n, seed)
        c.inject_fault(fault)
        res = c.submit(Prompt.synthetic_of(n, seed))
        pool = c.pool()
        health = c.health()
    first = res.passes[0].restore
    assert first is not None
    assert first.outcome is Outcome.FAILED_CLOSED and first.committed_tokens == 0
    assert first.advertised_tokens == n
    assert first.invalid, "the failing rank/group is reported invalid"
    assert res.marker_history and res.marker_cleared is True
    assert (res.source if res.external_tokens else "recompute") == fallback
    assert res.hash_ok is True
    assert health.ok is True
    assert all(p.pool["live_bytes"] == 0 for p in pool)


def test_a_failed_manual_restore_leaves_a_marker_the_next_admission_uses(engine) -> None:
    n, seed = 8 * 256, 501
    with engine.client() as c:
        _warm(c, n, seed)
        c.inject_fault(FaultRequest("remote-unavailable", rank=1, window=1))  # a fetch from Mooncake fails
        res = c.restore(Prompt.synthetic_of(n, seed))
        markers = c.markers()
        nxt = c.submit(Prompt.synthetic_of(n, seed))
        after = c.markers()
    assert res.outcome is Outcome.FAILED_CLOSED
    assert res.marker is not None and res.marker.excluded == {"mooncake"}
    assert [m.prompt for m in markers] == [res.prompt]
    assert nxt.passes[0].excluded_tiers == ("mooncake",)  # the marker keeps it off the faulty tier
    assert nxt.source == "fs" and nxt.hash_ok is True
    assert after == []  # cleared by the successful admission


def test_budget_is_never_exceeded_by_concurrent_restores(engine) -> None:
    prompts = [Prompt.synthetic_of(24 * 256, 600 + i) for i in range(3)]
    with engine.client() as c:
        for p in prompts:
            c.submit(p)
        c.update_settings(budget_bytes=2 * RWS)
        try:
            c.reset_peak()
            results: list[ManualRestoreResult] = []

            def run(p: dict) -> None:
                with engine.client() as c2:
                    results.append(c2.restore(p))

            threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            pool = c.pool()
        finally:
            c.update_settings(budget_bytes=RWS)
    assert len(results) == 3 and all(r.outcome is Outcome.COMMITTED for r in results)
    assert all(p.pool["peak_bytes"] <= 2 * RWS for p in pool)
    assert max(p.pool["peak_bytes"] for p in pool) == 2 * RWS  # the budget was actually used


def test_abort_ends_a_restore_fail_closed(engine) -> None:
    n, seed = 120 * 256, 700
    with engine.client() as c:
        _warm(c, n, seed)
        c.inject_fault(FaultRequest("timeout", rank=0, window=5))  # holds the restore long enough to abort it
        accepted = threading.Event()
        rid: list[str] = []

        def on_accepted(r: str) -> None:
            rid.append(r)
            accepted.set()

        out: list[ManualRestoreResult] = []
        t = threading.Thread(
            target=lambda: out.append(c.restore(Prompt.synthetic_of(n, seed), on_accepted=on_accepted))
        )
        t.start()
        assert accepted.wait(30)
        with engine.client() as c2:
            c2.abort(rid[0])
        t.join(60)
    assert out and out[0].outcome is Outcome.ABORTED and out[0].committed_tokens == 0
    assert any("aborted" in f.reason for f in _report(out[0]).failures)


def test_admin_api_guards(engine) -> None:
    with engine.client() as c:
        info = c.info()
        assert info.api == "v1" and info.ranks == 2 and info.registration.identity == REG.identity
    from bsr_cli.client import AdminClient

    with AdminClient(engine.url, None) as no_token, pytest.raises(Unauthorized):
        no_token.inject_fault(FaultRequest("timeout"))
    with AdminClient(engine.url, "wrong") as bad, pytest.raises(Unauthorized):
        bad.submit(Prompt.synthetic_of(10, 1))
    with engine.client() as c:
        with pytest.raises(BadRequest, match="exceeds this engine's limit"):
            c.probe(Prompt.synthetic_of(10**6, 1))
        with pytest.raises(BadRequest, match="unknown fault kind"):
            c.inject_fault(FaultRequest("meteor"))
        assert c.abort("req-never-opened") == AbortAnswer(request="req-never-opened", aborting=False)
    auth = {"Authorization": f"Bearer {engine.token}"}
    bogus = {"synthetic": {"n": 10, "seed": 1}, "bogus": 1}  # a body the typed client cannot send
    r = httpx.post(engine.url + "/bsr/v1/probe", json=bogus, headers=auth, timeout=10)
    assert r.status_code == 400 and "unknown field" in r.json()["message"]
    r = httpx.get(engine.url + "/bsr/v2/info", timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "version-mismatch"
    metrics = httpx.get(engine.url + "/metrics", headers=auth, timeout=10).text
    assert 'bsr_pool_capacity_bytes{rank="0"}' in metrics


def test_client_maps_version_mismatch() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"api": "v9"})

    from bsr_cli.client import AdminClient

    with (
        AdminClient("http://engine.invalid", transport=httpx.MockTransport(handler)) as c,
        pytest.raises(VersionMismatch),
    ):
        c.info()


@pytest.mark.timeout(120)
@pytest.mark.engine
def test_engine_without_faults_refuses_them(tmp_path) -> None:
    from bsr_cli.engine import supervisor

    opts = supervisor.EngineOptions(REG, w=4, max_tokens=4096, remote=False)
    try:
        up = supervisor.up(tmp_path, opts)
        assert up.healthy
        again = supervisor.up(tmp_path, opts)
        assert again.already_running is True  # idempotent
        url, token = local_engine.connection(tmp_path)
        from bsr_cli.client import AdminClient

        with AdminClient(url, token) as c, pytest.raises(FaultsDisabled):
            c.inject_fault(FaultRequest("timeout"))
    finally:
        down = supervisor.down(tmp_path)
    from bsr_cli.mooncake import services

    assert down.stopped and all(not services.is_alive(pid) for _name, pid in down.stopped)
    assert supervisor.status(tmp_path).running is False
