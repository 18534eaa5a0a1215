"""bsr's probe-only vLLM lookup and per-worker admin API, over real LMCache 0.5.6 engines (CPU), without vLLM.

Two TP ranks (LMCacheHost threads, real LocalDiskBackend and RemoteBackend over a real mooncake_master), one bsr
probe server per rank on a real ZMQ ipc socket, and the scheduler-side client asking both. What runs only inside
vLLM (the connector swapping LMCache's lookup client, the worker starting these servers) is not exercised here.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from lmcache_bsr import _lmcache as lm
from lmcache_bsr.host import LMCacheHost
from vllm_bsr.probe_lookup import ProbeLookupClient, ProbeLookupServer, probe_socket_path
from vllm_bsr.worker_admin import WorkerAdmin

from bsr_cli.api.ranks import StoreRequest, UnsupportedOp
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.mooncake import services

CS = 256
CHUNKS = 8
HOLE = 5  # rank 1 loses this chunk in every tier


def _config(master: services.ServiceHandle, disk: Path) -> dict[str, Any]:
    return {
        "model": {"name": "bsr/tiny", "layers": 2, "kv_heads": 2, "head_size": 64, "tp_size": 2},
        "lmcache": {
            "local_cpu": False,
            "max_local_cpu_size": 0.0625,
            "local_disk": str(disk),
            "max_local_disk_size": 1.0,
            "blocking_timeout_secs": 10,
            "remote_url": f"mooncakestore://{master.rpc_address}/",
            "remote_serde": "naive",
            "extra_config": {
                "mooncake_local_hostname": "127.0.0.1",
                "mooncake_metadata_server": master.metadata_url,
                "mooncake_master_server_addr": master.rpc_address,
                "mooncake_protocol": "tcp",
                "mooncake_global_segment_size": 0,
                "mooncake_local_buffer_size": 64 << 20,
                "save_chunk_meta": False,
                "transfer_timeout": 5,
            },
        },
        "settings": {"w": 2, "tiers": ["mooncake", "fs"], "kv_tokens": 8192, "fetch_timeout_s": 10.0},
    }


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LMCacheHost, list[int]]]:
    """Two ranks with one prompt stored in both tiers, then chunk HOLE removed from every tier on rank 1."""
    state = tmp_path_factory.mktemp("mooncake")
    master = services.start_master(state)
    holder = host = None
    try:
        holder = services.start_segment_holder(state, master, 128 << 20)
        host = LMCacheHost(_config(master, tmp_path_factory.mktemp("disk")))
        toks = synthetic_tokens(CHUNKS * CS + 40, seed=31)  # the 40-token tail is never stored
        res = host.coordinator.submit(toks, w=2)
        assert res.hash_ok and res.stored is not None and not res.stored.errors, res.stored
        r1 = host.rank(1)
        k = r1.keys(toks)[HOLE]
        lm.mooncake_store(r1.engine).remove(lm.key_string(k), True)
        r1.engine.storage_manager.batched_remove([k], locations=["LocalDiskBackend"])
        yield host, toks
    finally:
        if host is not None:
            host.close()
        if holder is not None:
            services.stop(holder, timeout=5)
        services.stop(master, timeout=5)


def _assert_nothing_pinned(host: LMCacheHost, toks: list[int]) -> None:
    for r in (0, 1):
        st = lm.pinned_state(host.rank(r).engine, host.rank(r).keys(toks))
        assert st["lookup_pins"] == 0 and st["disk_keys_in_request"] == 0 and set(st["disk_pin_counts"]) <= {0}, st


@pytest.mark.timeout(120)
def test_scheduler_client_takes_the_min_over_rank_probe_servers(stored: tuple[LMCacheHost, list[int]]) -> None:
    host, toks = stored
    engine_id = f"t{uuid.uuid4().hex[:8]}"
    paths = [probe_socket_path(engine_id, r) for r in (0, 1)]
    servers = [ProbeLookupServer(lambda r=r: host.rank(r).engine, paths[r]) for r in (0, 1)]
    eng0 = host.rank(0).engine
    client = ProbeLookupClient(eng0.config, eng0.metadata, paths, timeout_ms=1500)
    only0 = ProbeLookupClient(eng0.config, eng0.metadata, paths[:1], timeout_ms=1500)
    try:
        # Rank 0 alone holds every full chunk; rank 1 has a hole at HOLE: the committable prefix stops there.
        assert only0.lookup(toks, "req-rank0") == CHUNKS * CS
        assert client.lookup(toks, "req-both") == HOLE * CS
        assert client.lookup_cache("req-both") == HOLE * CS  # LMCache's per-request result cache, unchanged
        # Probe-only: no lookup pins, no disk pin counts, no request keys recorded, on either rank.
        _assert_nothing_pinned(host, toks)
        # LMCache's own pinned lookup on rank 1 (for contrast) sees the same prefix, but pins it.
        got = host.rank(1).engine.lookup(tokens=toks, lookup_id="contrast", pin=True)
        assert got == HOLE * CS and lm.pinned_state(host.rank(1).engine, [])["lookup_pins"] == 1
        host.rank(1).engine.lookup_unpin("contrast")
        _assert_nothing_pinned(host, toks)

        # A rank whose server is gone: 0 external tokens, within the one deadline, and not cached.
        servers[1].close()
        t0 = time.monotonic()
        assert client.lookup(toks, "req-dead") == 0
        assert time.monotonic() - t0 < 3.0
        assert client.lookup_cache("req-dead") == -1  # asked again at the next scheduling step
        # The live rank still answers through its recreated socket.
        assert only0.lookup(toks, "req-rank0-again") == CHUNKS * CS
    finally:
        client.close()
        only0.close()
        for s in servers:
            if s.thread.is_alive():
                s.close()
    assert not any(s.thread.is_alive() for s in servers)


@pytest.mark.timeout(60)
def test_unreachable_rank_costs_one_deadline_not_one_per_rank(stored: tuple[LMCacheHost, list[int]]) -> None:
    host, toks = stored
    eng0 = host.rank(0).engine
    # Neither socket has a server behind it.
    paths = [probe_socket_path(f"gone{uuid.uuid4().hex[:8]}", r) for r in (0, 1)]
    client = ProbeLookupClient(eng0.config, eng0.metadata, paths, timeout_ms=3000)
    try:
        t0 = time.monotonic()
        assert client.lookup(toks, "req-x") == 0
        # One deadline is 3 s, one per rank would be 6 s: the bound sits 1.5 s from each.
        assert time.monotonic() - t0 < 4.5
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_per_worker_admin_server_answers_probe_for_its_rank(stored: tuple[LMCacheHost, list[int]]) -> None:
    host, toks = stored
    admins = [WorkerAdmin(lambda r=r: host.rank(r).engine, r, token="w0rk", port=0) for r in (0, 1)]
    try:
        got = {}
        for r, admin in enumerate(admins):
            req = urllib.request.Request(
                f"{admin.url}/bsr/v1/probe",
                data=json.dumps({"tokens": toks}).encode(),
                headers={"Authorization": "Bearer w0rk", "Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                got[r] = json.loads(resp.read())
            assert admin.coordinator.info().engine == f"vllm-lmcache tp-rank {r}"
        assert got[0]["committable_tokens"] == CHUNKS * CS
        assert got[1]["committable_tokens"] == HOLE * CS
        row1 = got[1]["bitmap"]["rows"][0]["cells"]
        assert row1[HOLE] == "0" and set(row1[:HOLE]) == {"3"}  # mooncake (bit 0) and fs (bit 1) elsewhere
        _assert_nothing_pinned(host, toks)
        # Submit/restore are vLLM's job in a deployment: refused with a clear 400.
        req = urllib.request.Request(
            f"{admins[0].url}/bsr/v1/restore",
            data=json.dumps({"tokens": toks, "stream": False}).encode(),
            headers={"Authorization": "Bearer w0rk", "Content-Type": "application/json"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400 and "vLLM" in e.value.read().decode()
        # An op the worker's rank ops do not serve answers the typed refusal, over the same seam as every op...
        with pytest.raises(UnsupportedOp, match="op 'store' is not served from a vLLM worker") as refused:
            admins[0].rank.submit(StoreRequest(["h"], CS, {"attn": [0]}, {"fs": [0]})).result(timeout=10)
        assert refused.value.exit_code == 7 and refused.value.hint
        # ...and the coordinator's call to every rank raises it as is (the admin API answers it as a 400).
        with pytest.raises(UnsupportedOp, match="op 'set_fs_concurrency' is not served from a vLLM worker"):
            admins[0].coordinator.set_fs_concurrency(2)
        # Over HTTP, a settings change is refused as a whole, before any check of values a worker has no use for.
        req = urllib.request.Request(
            f"{admins[0].url}/bsr/v1/settings",
            data=json.dumps({"fs_concurrency": 2}).encode(),
            headers={"Authorization": "Bearer w0rk", "Content-Type": "application/json"},
            method="POST",
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        body = e.value.read().decode()
        assert e.value.code == 400 and "changing restore settings is not served from a vLLM worker" in body, body
    finally:
        for a in admins:
            a.stop()


def _get(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url, headers={"Authorization": "Bearer w0rk"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read()))


@pytest.mark.timeout(60)
def test_worker_admin_serves_the_schedulers_markers_its_loads_and_the_connectors_settings(
    stored: tuple[LMCacheHost, list[int]], tmp_path: Path
) -> None:
    """What the connector hands the worker's admin API, served over real HTTP from a real LMCache engine: the
    markers the scheduler published (vllm_bsr/board.py, as the scheduler-side connector writes it), a failed load
    recorded as the connector saw it (its events as the embedded engine writes a failed restore, and the marker it
    left under the id `markers list` shows), and the connector's W and vLLM's limits."""
    from vllm_bsr import board
    from vllm_bsr.logic import LoadResult, SchedulerState, load_report, windows
    from vllm_bsr.worker_admin import WorkerLimits

    from bsr_cli.core.keys import prompt_hash

    host, toks = stored
    path = str(tmp_path / "board.json")
    limits = WorkerLimits(window_chunks=2, max_model_len=4096, kv_tokens=65536, staging_bytes=1 << 26, board=path)
    admin = WorkerAdmin(lambda: host.rank(0).engine, 0, token="w0rk", port=0, limits=limits)
    try:
        base = f"{admin.url}/bsr/v1"
        info = _get(f"{base}/info")
        assert (info["W"], info["max_tokens"], info["kv_tokens"], info["pool_bytes"]) == (2, 4096, 65536, 1 << 26)
        assert info["budget_bytes"] == info["rws_bytes"] == 2 * admin.ops.slot_bytes > 0
        assert info["worker"]["scheduler_published"] is False
        snap = _get(f"{base}/snapshot")
        assert snap["markers"] == [] and snap["scheduler"]["published"] is False
        # The scheduler marks the prefix of a failed load; the worker recorded that load.
        sched = SchedulerState(CS)
        sched.external_tokens("q1", 4 * CS, 0, toks)
        sched.on_alloc("q1", ([1, 2],), 4 * CS)
        sched.on_load_errors([1])
        board.publish(path, sched.published())
        bad = LoadResult(False, 0, 1, "RuntimeError: injected restore-fault (fault 1) in window G2")
        admin.record_load(
            load_report(
                request="q1",
                prompt=prompt_hash(toks[: 4 * CS]),  # as the connector names a load: its prefix's hash
                vllm_cached_tokens=0,
                end_token=4 * CS,
                wins=windows(0, 4 * CS, CS, 2),
                windows_run=2,
                result=bad,
                w=2,
                chunk_size=CS,
                bytes_per_chunk=admin.ops.slot_bytes,
                tiers=["mooncake", "fs"],
                fault_kind="restore-fault",
            )
        )
        (m,) = _get(f"{base}/markers")["markers"]
        assert m["request"] == "q1" and m["prefix_tokens"] == 4 * CS
        assert sorted(m["excluded_tiers"]) == ["fs", "mooncake"]  # a vLLM marker means local compute
        assert m["failed_window"] == 1 and "failed at window G2" in m["reason"]
        snap = _get(f"{base}/snapshot")
        (load,) = snap["recent"]
        assert (load["advertised_tokens"], load["loaded_tokens"], load["recomputed_tokens"]) == (4 * CS, 0, 4 * CS)
        # The load's events (docs/events.md): started, the one window it finished released, the rank's failure
        # naming window G2 and its chunks, the restore's end, then the marker under the prefix's id.
        evs = [e for e in _get(f"{base}/events")["events"] if e.get("request") == "q1"]
        kinds = ["restore_started", "window_released", "restore_failed", "restore_failed_closed", "marker_set"]
        assert [e["type"] for e in evs] == kinds
        started, released, failed, closed, marker = evs
        assert started["prompt"] == marker["prompt"] == m["prompt"] and released["window"] == 0
        assert (failed["window"], failed["chunks"], failed["stage"], failed["rank"]) == (1, [2, 4], "install", 0)
        assert closed["failures"][0]["window"] == 1 and closed["committed_tokens"] == 0
        assert marker["reason"] == m["reason"] and marker["excluded_tiers"] == ["mooncake", "fs"]
    finally:
        admin.stop()
