"""BSRConnector in real vLLM (CPU build) in the other deployments a user runs: LMCache over a real Mooncake master
(and that master killed mid-run), TP=2 (a window failing on one rank only), and LMCache's worker engine failing to
build (said loudly). One vLLM start-up per configuration; a fresh master per test."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllmstage import CHUNK, Driver, chunk_prefix, events_of, lmcache_yaml, vllm_ports

from bsr_cli.mooncake import services

N = 4 * CHUNK + 30
TOKEN = "vllm-stage-token"
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # Mooncake's transfer endpoint on loopback


@pytest.fixture
def master(tmp_path: Path) -> Iterator[services.ServiceHandle]:
    m = services.start_master(tmp_path / "mooncake")
    try:
        yield m
    finally:
        services.stop(m, timeout=5)


def loads(r: dict[str, Any]) -> list[dict[str, Any]]:
    return events_of(r, "bsr_load")


@pytest.mark.timeout(420)
def test_mooncake_backend_then_master_killed(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: services.ServiceHandle
) -> None:
    d = Driver(tmp_path_factory.mktemp("bsr-mooncake"), model_dir, plugin_site)
    p = {"tokens": N, "seed": 3}
    res = d.run(
        {
            "connector": "bsr",
            "extra": {"bsr_window_chunks": 3},
            "scenarios": [
                {"name": "store", **p, "settle_s": 1.0},  # LMCache's puts to Mooncake are asynchronous
                {"name": "load", **p},
                {"name": "master-down", "before": [{"kill_pid": master.pid}, {"sleep_s": 0.5}], **p},
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", None, master),
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )
    store, load, down = (res["by_name"][n] for n in ("store", "load", "master-down"))
    # Stored to and loaded from Mooncake only (no disk tier configured), in windows of 3 chunks.
    (ev,) = loads(load)
    assert ev["ok"] and ev["loaded"] == chunk_prefix(N) and ev["windows"] == [[0, 3 * CHUNK], [3 * CHUNK, 4 * CHUNK]]
    assert load["num_cached_tokens"] == chunk_prefix(N) and load["output"] == store["output"]
    # Master dead: the probe counts nothing (no hang, no -900 taken for a hit), vLLM computes locally.
    (lk,) = events_of(down, "bsr_lookup")
    assert lk["external"] == 0 and not loads(down)
    assert down["num_cached_tokens"] == 0 and down["output"] == store["output"]


@pytest.mark.timeout(480)
def test_tp2_min_over_ranks_and_a_window_failure_on_one_rank(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: services.ServiceHandle
) -> None:
    """TP = 2 over Mooncake. A chunk removed from rank 1 only: each rank's probe server answers its own prefix and
    the scheduler takes the minimum. Then a fault armed on rank 1 only fails the whole request."""
    d = Driver(tmp_path_factory.mktemp("bsr-tp2"), model_dir, plugin_site)
    port = vllm_ports(2)
    rank0, rank1 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
    hole = {"tokens": N, "seed": 6}
    p = {"tokens": N, "seed": 4}
    mc = {"admin": master.admin_url, "metadata": master.metadata_url, "master": master.rpc_address}
    res = d.run(
        {
            "connector": "bsr",
            "tp": 2,
            "extra": {
                "bsr_window_chunks": 2,
                "bsr_admin_port": port,
                "bsr_admin_token": TOKEN,
                "bsr_admin_faults": True,
            },
            "scenarios": [
                {"name": "store-hole", **hole, "settle_s": 1.5},  # LMCache's puts to Mooncake are asynchronous
                {"name": "hole", "before": [{"mooncake_remove": {**mc, "world": 2, "worker": 1}}], **hole},
                {"name": "store", **p, "settle_s": 1.5},
                {"name": "load", **p},
                {
                    "name": "fault-rank1",
                    "before": [
                        {"cli": ["--engine", rank1, "--token", TOKEN, "--json", "inject-fault", "--window", "2"]}
                    ],
                    # Each worker (its own process at TP = 2) serves the marker vLLM's scheduler holds, and the
                    # request's load as failed, also on rank 0 whose own windows completed.
                    "after": [
                        {"cli": ["--engine", url, "--token", TOKEN, "--json", "status"]} for url in (rank0, rank1)
                    ],
                    **p,
                },
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", None, master),
        env={
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        },
    )
    store_hole, hole_r = res["by_name"]["store-hole"], res["by_name"]["hole"]
    removed = hole_r["actions"][0]
    assert removed["gone"] and removed["candidates"] == chunk_prefix(N) // CHUNK, removed
    answers = {e["rank"]: e["tokens"] for e in events_of(hole_r, "bsr_probe")}
    assert answers[0] == chunk_prefix(N) and answers[1] < chunk_prefix(N), answers
    (lk,) = events_of(hole_r, "bsr_lookup")
    assert lk["probed"] == answers[1]  # the minimum over ranks
    assert hole_r["num_cached_tokens"] == answers[1]
    for e in loads(hole_r):  # both ranks load only the common prefix (nothing when the hole is chunk 0)
        assert e["ok"] and e["loaded"] == answers[1]
    assert hole_r["output"] == store_hole["output"]

    store, load, fault = (res["by_name"][n] for n in ("store", "load", "fault-rank1"))
    # Both ranks loaded their shard of every chunk, in the same windows.
    evs = sorted(loads(load), key=lambda e: e["rank"])
    assert [e["rank"] for e in evs] == [0, 1]
    assert all(e["ok"] and e["windows_run"] == 2 and e["loaded"] == chunk_prefix(N) for e in evs)
    assert all(e["lmcache_lookups"] == 0 for e in evs)
    assert load["output"] == store["output"] and load["num_cached_tokens"] == chunk_prefix(N)
    # The fault armed on rank 1 only: rank 0's load completed, rank 1's failed in window 2, and the request as a
    # whole recomputed (nothing of rank 0's valid windows was committed on its own).
    assert json.loads(fault["actions"][0]["stdout"])["kind"] == "restore-fault"
    by_rank = {e["rank"]: e for e in loads(fault)}
    assert by_rank[0]["ok"] and not by_rank[1]["ok"] and by_rank[1]["failed_window"] == 1
    assert len(events_of(fault, "bsr_marker_set")) == 1
    assert fault["output"] == store["output"]
    req = by_rank[1]["req"]
    for rank, status in enumerate(fault["after"]):
        assert status["rc"] == 0, status
        snap = json.loads(status["stdout"])
        assert [m["request"] for m in snap["markers"]] == [req], snap["markers"]
        (load,) = [r for r in snap["recent"] if r["request"] == req]
        assert load["outcome"] == "failed_closed" and load["loaded_tokens"] == 0, load
        assert load["recomputed_tokens"] == chunk_prefix(N), load
        assert load.get("this_rank") == ("committed" if rank == 0 else None), load


@pytest.mark.timeout(300)
def test_lmcache_worker_engine_not_built_is_said_loudly(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path
) -> None:
    """LMCache on CPU with layerwise loading (which no CPU connector supports): LMCache's adapter catches the
    failure and runs degraded. The BSR connector must say so, and vLLM still serves (recompute)."""
    d = Driver(tmp_path_factory.mktemp("bsr-degraded"), model_dir, plugin_site)
    yaml = lmcache_yaml(d.root / "lmcache.yaml", d.disk)
    yaml.write_text(yaml.read_text() + "use_layerwise: true\n")
    p = {"tokens": N, "seed": 5}
    res = d.run({"connector": "bsr", "scenarios": [{"name": "a", **p}, {"name": "b", **p}]}, lmcache=yaml)
    a, b = res["by_name"]["a"], res["by_name"]["b"]
    assert "LMCache's worker engine was NOT built" in res["log"]
    missing = events_of(a, "bsr_engine_missing") or [
        e for r in res["results"] for e in events_of(r, "bsr_engine_missing")
    ]
    assert missing and "use_layerwise" in missing[0]["reason"]
    assert b["num_cached_tokens"] == 0 and not loads(b) and b["output"] == a["output"]
