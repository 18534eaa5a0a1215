"""`bsr explain`: every verdict kind provoked for real, on the embedded engine (real Mooncake master and segment
holder, fs tier, two rank processes) or on a Mooncake store written in LMCache 0.5.6's key format, and the cause it
names checked against what was done."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_key, vllm_seeded_start
from bsr_cli.core.registration import Registration
from bsr_cli.mooncake import services

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(180)]

N = 5000  # 20 chunks of 256 tokens


def _explain(bsr: Any, *args: str) -> dict[str, Any]:
    r = bsr("explain", *args, "--json")
    assert r.code == 0, r.err
    return dict(r.json())


def _evict(engine: Any, seed: int, chunk: int, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Remove one chunk of a stored prompt from both tiers, for the given ranks and every KV group."""
    from bsr_cli.tiers.fs import FilesystemTier
    from bsr_cli.tiers.mooncake import MooncakeTier

    cfg = json.loads((engine.state_dir / "engine.json").read_text())
    reg = Registration.from_dict(cfg["registration"])
    h = chunk_hashes(synthetic_tokens(N, seed), reg.chunk_size)[chunk]
    keys = [object_key(reg, r, g, h) for r in ranks for g in reg.group_names]
    fs = FilesystemTier(cfg["fs_dir"], create=False)
    try:
        assert all(fs.remove(keys))
    finally:
        fs.close()
    mc = MooncakeTier(cfg["mooncake"]["master_address"], cfg["mooncake"]["metadata_url"])
    try:
        assert all(rc == 0 for rc in mc.remove(keys))
    finally:
        mc.close()


def test_never_stored_then_restorable(bsr: Any, engine: Any) -> None:
    # Seed 7901: a prompt no other test stores (the session's engine keeps every prompt any test stored).
    d = _explain(bsr, "--synthetic", str(N), "--seed", "7901")
    assert d["verdict"] == "never-stored" and not d["reusable"]
    assert d["next"] == f"bsr submit --synthetic {N} --seed 7901"
    assert all(t["held_chunks"] == 0 for t in d["tiers"])
    assert bsr("submit", "--synthetic", str(N), "--seed", "7901").code == 0
    d = _explain(bsr, "--synthetic", str(N), "--seed", "7901")
    assert d["verdict"] == "restorable" and d["reusable"]
    assert {(t["tier"], t["rank"], t["prefix_chunks"]) for t in d["tiers"]} == {
        (tier, r, 20) for tier in ("mooncake", "fs") for r in (0, 1)
    }
    text = bsr("explain", "--synthetic", str(N), "--seed", "7901")
    assert text.code == 0 and "restorable" in text.out and "next: bsr restore" in text.out


def test_evicted_middle_chunk_and_rank_skew(bsr: Any, engine: Any) -> None:
    assert bsr("submit", "--synthetic", str(N), "--seed", "902").code == 0
    _evict(engine, 902, 7)
    d = _explain(bsr, "--synthetic", str(N), "--seed", "902")
    assert d["verdict"] == "evicted", d["summary"]
    assert "chunk 7 is missing in every tier while 12 later chunk(s) are held" in d["summary"]
    assert any("chunks 8-19" in e for e in d["findings"][0]["evidence"])
    assert {t["prefix_chunks"] for t in d["tiers"]} == {7}

    assert bsr("submit", "--synthetic", str(N), "--seed", "903").code == 0
    _evict(engine, 903, 3, ranks=(1,))
    d = _explain(bsr, "--synthetic", str(N), "--seed", "903")
    assert d["verdict"] == "rank-skew", d["summary"]
    assert "breaks at chunk 3 on rank 1 group full, rank 1 group swa only" in d["summary"]
    prefixes = {(t["tier"], t["rank"]): t["prefix_chunks"] for t in d["tiers"]}
    assert prefixes[("mooncake", 0)] == 20 and prefixes[("mooncake", 1)] == 3


def test_window_over_budget_names_the_setting(bsr: Any, engine: Any) -> None:
    assert bsr("submit", "--synthetic", str(N), "--seed", "904").code == 0
    d = _explain(bsr, "--synthetic", str(N), "--seed", "904", "--W", "64")
    assert d["verdict"] == "window-over-budget", d["summary"]
    f = d["findings"][0]
    assert "use --W 4 or lower" in f["fix"]  # the session engine's B is RWS(W=4)
    assert "held" in [x["kind"] for x in d["findings"]], "the prefix itself is fine (held, not the verdict)"
    assert _explain(bsr, "--synthetic", str(N), "--seed", "904", "--W", "4")["verdict"] == "restorable"


def test_marker_set_by_a_failed_tier_and_the_last_restore(bsr: Any, engine: Any) -> None:
    assert bsr("submit", "--synthetic", str(N), "--seed", "905").code == 0
    armed = bsr("inject-fault", "--rank", "1", "--kind", "remote-unavailable", "--window", "2", "--count", "0")
    assert armed.code == 0
    d = _explain(bsr, "--synthetic", str(N), "--seed", "905")
    assert d["verdict"] == "fault-armed" and d["next"] == "bsr faults clear"
    assert bsr("faults", "clear").code == 0
    # A fetch from Mooncake fails (a rank's install fault would blame the rank instead: test_evidence_output.py).
    assert bsr("inject-fault", "--rank", "1", "--kind", "remote-unavailable", "--window", "2").code == 0
    r = bsr("restore", "--synthetic", str(N), "--seed", "905", "--json")
    assert r.code == 10
    req = r.report()["request"]
    d = _explain(bsr, "--synthetic", str(N), "--seed", "905")
    assert d["verdict"] == "force-local-marker", d["summary"]
    assert f"set when restore {req} failed" in d["summary"]
    assert "the next admission serves it from fs (20/20 chunks there)" in d["summary"]
    last = d["last_restore"]
    assert last["request"] == req and last["outcome"] == "failed_closed" and last["failure_kind"] == "tier"
    assert [(f["rank"], f["window"]) for f in last["failures"]] == [(1, 1)]
    assert {r["rank"]: r["windows_released"] for r in last["ranks"]}.get(1, 0) == 1, "rank 1 released window 1 only"
    assert d["next"] == f"bsr markers clear --prompt {d['prompt']}"  # this prompt's marker only
    # The tier that just failed is reported unhealthy too, as information: fs holds the whole prompt.
    tier = next(f for f in d["findings"] if f["kind"] == "tier-unhealthy")
    assert tier["summary"].startswith("tier mooncake is unhealthy") and not tier["blocks"]
    # The request itself: failed closed because the tier failed, and the marker it left.
    d = _explain(bsr, req)
    assert d["verdict"] == "restore-failed-tier" and "force-local marker now excludes mooncake" in d["summary"]
    assert any("rank 1 window G2" in e for e in d["findings"][0]["evidence"])
    text = bsr("explain", req)
    assert text.code == 0 and "restore-failed-tier" in text.out


def _request_of(r: Any) -> str:
    """The request id of a `bsr restore --json` run, whatever its outcome."""
    return str(r.report()["request"])


def test_partial_tail(bsr: Any, engine: Any) -> None:
    assert bsr("submit", "--synthetic", str(N), "--seed", "907").code == 0
    for c in (17, 18, 19):
        _evict(engine, 907, c)
    d = _explain(bsr, "--synthetic", str(N), "--seed", "907")
    assert d["verdict"] == "partial", d["summary"]
    assert "the tiers hold chunks 0..16 and nothing after" in d["summary"]


def test_request_verdicts_committed_capacity_admitted_aborted(bsr: Any, engine: Any) -> None:
    import threading

    s = bsr("submit", "--synthetic", str(N), "--seed", "908", "--json")
    assert s.code == 0
    d = _explain(bsr, s.json()["request"])
    assert d["verdict"] == "admitted" and f"{N:,} computed" in d["summary"]
    r = bsr("restore", "--synthetic", str(N), "--seed", "908", "--json")
    assert r.code == 0
    d = _explain(bsr, _request_of(r))
    assert d["verdict"] == "restore-committed" and d["reusable"]
    assert [x["windows_released"] for x in d["last_restore"]["ranks"]] == [5, 5]  # 20 chunks in windows of 4
    r = bsr("restore", "--synthetic", str(N), "--seed", "908", "--W", "8", "--json")
    assert r.code == 12
    d = _explain(bsr, _request_of(r))
    assert d["verdict"] == "restore-failed-capacity", d["summary"]
    # An operator abort: a timeout fault holds the restore until the abort cuts it short.
    assert bsr("inject-fault", "--kind", "timeout", "--rank", "0", "--window", "3").code == 0
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
    r = bsr("restore", "--synthetic", str(N), "--seed", "908", "--json")
    t.join(60)
    assert r.code == 130 and aborted
    d = _explain(bsr, aborted[0])
    assert d["verdict"] == "restore-aborted", d["summary"]
    r = bsr("explain", "req-99999")
    assert r.code == 2 and "no events of request 'req-99999'" in r.err


def test_an_unhealthy_tier_is_the_verdict_only_when_it_is_the_only_full_holder() -> None:
    """Pure: the same probe, with the only tier that holds the prompt unhealthy, and with a healthy copy elsewhere."""
    from bsr_cli.core.bitmap import HitBitmap
    from bsr_cli.core.explain import FindingKind, explain_engine
    from bsr_cli.core.status import EngineInfo, Health
    from bsr_cli.loaders import builtin_registration

    reg = builtin_registration("demo")
    n = 4 * reg.chunk_size
    rows = [{"rank": r, "group": g, "cells": "1111"} for r in range(2) for g in reg.group_names]  # mooncake only
    bitmap = {
        "tokens": n,
        "chunk_size": reg.chunk_size,
        "tiers": ["mooncake", "fs"],
        "ranks": 2,
        "groups": list(reg.group_names),
        "rows": rows,
    }
    info = EngineInfo.from_wire(
        {"W": 4, "budget_bytes": 4 * reg.bytes_per_chunk, "pool_bytes": 8 * reg.bytes_per_chunk, "engine": "t"}
    )
    health = Health.from_wire(
        {"ranks": [], "tiers": {"mooncake": {"ok": False, "detail": ["holder gone"]}, "fs": {"ok": True}}}
    )
    kw = dict(prompt="p", prompt_flags="--synthetic 1", registration=reg, n_tokens=n, info=info)
    kw |= dict(markers=[], faults=[], w=None, last_restore=None)
    d = explain_engine(bitmap=HitBitmap.from_dict(bitmap), health=health, **kw)  # type: ignore[arg-type]
    assert d.verdict is FindingKind.TIER_UNHEALTHY and not d.reusable
    both = [{"rank": r, "group": g, "cells": "3333"} for r in range(2) for g in reg.group_names]  # and fs
    d = explain_engine(bitmap=HitBitmap.from_dict(bitmap | {"rows": both}), health=health, **kw)  # type: ignore[arg-type]
    assert d.verdict is FindingKind.RESTORABLE
    assert [f.kind for f in d.findings] == [FindingKind.RESTORABLE, FindingKind.TIER_UNHEALTHY]


def _pid(state: Path, rank: int) -> int:
    st = json.loads((state / "state.json").read_text())
    return int(next(r["pid"] for r in st["ranks"] if r["rank"] == rank))


@contextlib.contextmanager
def _frozen(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_frozen_rank(bsr: Any, engine: Any) -> None:
    assert bsr("submit", "--synthetic", str(N), "--seed", "906").code == 0
    with engine.client() as c:
        with _frozen(_pid(engine.state_dir, 1)):
            deadline = time.monotonic() + 60
            while c.health().ok:
                assert time.monotonic() < deadline, "the frozen rank was never reported"
                time.sleep(0.2)
            d = _explain(bsr, "--synthetic", str(N), "--seed", "906")
            r = bsr("restore", "--synthetic", str(N), "--seed", "906", "--json")  # fails in seconds, blames the rank
            req = _request_of(r)
            by_req = _explain(bsr, req)
        deadline = time.monotonic() + 60
        while not c.health().ok:
            assert time.monotonic() < deadline, "the rank did not come back"
            time.sleep(0.2)
    assert d["verdict"] == "rank-unhealthy", d["summary"]
    assert d["summary"].startswith("rank 1 ")
    assert d["next"] == "bsr status"
    assert r.code == 10
    assert by_req["verdict"] == "restore-failed-rank", by_req["summary"]
    assert "because rank 1 stopped making progress" in by_req["summary"]


# -- a Mooncake store in LMCache's key format ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = tmp_path_factory.mktemp("mc-explain")
    master = services.start_master(d)
    seg = None
    try:
        seg = services.start_segment_holder(d, master, 32 << 20)
        yield master
    finally:
        if seg is not None:
            services.stop(seg)
        services.stop(master)


def _write(master: Any, keys: list[str]) -> None:
    from bsr_cli.runtime.checksum import crc32c
    from bsr_cli.tiers.mooncake import MooncakeTier

    tier = MooncakeTier(master.rpc_address, master.metadata_url)
    try:
        payload = memoryview(bytearray(1024))
        tier.put(keys, [payload] * len(keys), [crc32c(payload)] * len(keys))
    finally:
        tier.close()


def _store_args(master: Any, tf: Path, *extra: str) -> list[str]:
    return [
        "--store",
        f"mooncake://{master.rpc_address}",
        "--metadata",
        master.metadata_url,
        "--master-admin",
        master.admin_url,
        "--tokens-file",
        str(tf),
        *extra,
    ]


def test_store_key_format_mismatch_names_dtype_world_size_and_hash_seed(bsr: Any, store: Any, tmp_path: Path) -> None:
    toks = synthetic_tokens(4 * 256, 77)
    seeded = lmcache_chunk_hashes(toks, start=vllm_seeded_start("42"))
    _write(store, [lmcache_key("explain/model", 2, w, h, "half") for w in (0, 1) for h in seeded])
    tf = tmp_path / "p.json"
    tf.write_text(json.dumps(toks))
    ok = _explain(bsr, *_store_args(store, tf, "--model", "explain/model", "--world-size", "2", "--dtype", "fp16"))
    assert ok["verdict"] == "restorable"
    for extra, flag, field in (
        (["--world-size", "2", "--dtype", "bf16"], "--dtype fp16", "dtype"),
        (["--world-size", "1", "--dtype", "fp16"], "--world-size 2", "world size"),
        (["--world-size", "2", "--dtype", "fp16", "--vllm-hash-seed", "none"], "--vllm-hash-seed 42", "hash seed"),
    ):
        d = _explain(bsr, *_store_args(store, tf, "--model", "explain/model", *extra))
        assert d["verdict"] == "key-format-mismatch", (extra, d["summary"])
        assert f"differs in {field}" in d["summary"] and flag in d["findings"][0]["fix"], d["findings"][0]
        assert flag in d["next"]
    never = _explain(bsr, *_store_args(store, tf, "--model", "other/model", "--world-size", "2", "--dtype", "fp16"))
    assert never["verdict"] == "never-stored"
    assert any("no keys for model 'other/model'" in e for e in never["findings"][0]["evidence"])


@pytest.mark.timeout(120)
@pytest.mark.engine
def test_store_holder_gone(bsr: Any, tmp_path: Path) -> None:
    master = services.start_master(tmp_path)
    seg = services.start_segment_holder(tmp_path, master, 32 << 20)
    try:
        toks = synthetic_tokens(6 * 256, 78)
        _write(master, [lmcache_key("gone/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks)])
        tf = tmp_path / "p.json"
        tf.write_text(json.dumps(toks))
        args = _store_args(master, tf, "--model", "gone/model", "--vllm-hash-seed", "none")
        assert _explain(bsr, *args)["verdict"] == "restorable"
        services.stop(seg)
        seg = None
        d = _explain(bsr, *args)
        if d["verdict"] == "never-stored":
            pytest.skip("the master dropped the gone holder's keys before the probe ran")
        assert d["verdict"] == "holder-gone", d["summary"]
        assert "the process holding them is gone: only 0 chunk(s) can really be read" in d["summary"]
    finally:
        if seg is not None:
            services.stop(seg)
        services.stop(master)


@pytest.mark.timeout(120)
@pytest.mark.engine
def test_store_puts_lost_on_a_gone_holder(bsr: Any, tmp_path: Path) -> None:
    """A holder dies (not unmounted: a killed vLLM instance's) and the master, until its client TTL, still places
    new objects on its segment, where the puts fail: the chunks missing are blamed on the gone holder, not called
    evicted. Control: a chunk missing while every holder answers is still "evicted"."""
    from bsr_cli.runtime.checksum import crc32c
    from bsr_cli.tiers.mooncake import MooncakeTier

    master = services.start_master(tmp_path)  # bsr's client TTL (120 s): longer than this test
    holders = [services.start_segment_holder(tmp_path, master, 32 << 20) for _ in range(2)]
    try:
        tf = tmp_path / "p.json"
        evicted = synthetic_tokens(6 * 256, 80)
        hashes = lmcache_chunk_hashes(evicted)
        _write(master, [lmcache_key("lost/model", 1, 0, h, "bfloat16") for i, h in enumerate(hashes) if i != 2])
        tf.write_text(json.dumps(evicted))
        args = _store_args(master, tf, "--model", "lost/model", "--vllm-hash-seed", "none")
        assert _explain(bsr, *args)["verdict"] == "evicted"

        gone = holders.pop(0)
        services.stop(gone)
        toks = synthetic_tokens(12 * 256, 81)
        toks_hashes = lmcache_chunk_hashes(toks)
        tier = MooncakeTier(master.rpc_address, master.metadata_url)
        failed = []
        try:
            payload = memoryview(bytearray(4096))
            for i, h in enumerate(toks_hashes):  # one put each: the ones placed on the gone fail
                try:
                    tier.put([lmcache_key("lost/model", 1, 0, h, "bfloat16")], [payload], [crc32c(payload)])
                except OSError:
                    failed.append(i)
        finally:
            tier.close()
        if not failed:
            pytest.skip("the master placed every put on the live holder")
        tf.write_text(json.dumps(toks))
        d = _explain(bsr, *args)
        assert d["verdict"] == "holder-gone", d["summary"]
        assert "whose holder is gone" in d["summary"], d["summary"]
        # The first lost put is named: as a missing chunk, or, when every put after it was lost too (the master
        # placed the tail on the gone holder), as the end of the prefix the tiers hold.
        if failed != list(range(failed[0], len(toks_hashes))):
            assert f"chunk {failed[0]} is missing" in d["summary"], (failed, d["summary"])
        elif failed[0] > 0:
            assert f"chunks 0..{failed[0] - 1} and nothing after" in d["summary"], (failed, d["summary"])
        name = gone.info["segment_name"]
        assert any(e.startswith(f"segment {name} at ") for e in d["findings"][0]["evidence"]), d["findings"][0]
    finally:
        for h in holders:
            services.stop(h)
        services.stop(master)


def test_bad_input(bsr: Any) -> None:
    r = bsr("explain")
    assert r.code == 2 and "give a request id, or exactly one of" in r.err
    r = bsr("explain", "req-1", "--synthetic", "10")
    assert r.code == 2 and "not both" in r.err
