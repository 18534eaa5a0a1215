"""The BSR runtime over real LMCache 0.5.6 engines (CPU) with a real mooncake_master and segment holder.

Two TP ranks (threads), each with its own LMCache engine: LocalDiskBackend ("fs") and RemoteBackend over Mooncake
("mooncake"), L1 as staging only. Run through scripts/test-plugins (a venv with LMCache); skipped elsewhere.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("lmcache")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep Mooncake's transfer endpoint on loopback

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_bsr.host import LMCacheHost
from lmcache_bsr.window import install_window
from window_spies import StoreSpy, counting_writes

from bsr_cli.api.ranks import SetBudgetRequest
from bsr_cli.core.events import Event, WindowReleased
from bsr_cli.core.evidence import FailureKind, Outcome
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.integrity import sidecar_key
from bsr_cli.core.keys import chunk_hashes, synthetic_tokens
from bsr_cli.core.results import InvalidCell
from bsr_cli.errors import CapacityError, InvalidInput
from bsr_cli.mooncake import services

CS = 256
CHUNKS = 16
LAYERS, HEADS, HEAD = 4, 2, 64
CHUNK_BYTES = 2 * LAYERS * HEADS * HEAD * 2 * CS  # bf16: 512 KiB per chunk per rank
W = 2


def host_config(master: services.ServiceHandle | None, disk: Path, *, tp: int = 2) -> dict[str, Any]:
    lmc: dict[str, Any] = {
        "local_cpu": False,  # L1 is staging only: no hot-cache write-back
        "max_local_cpu_size": 0.0625,  # 64 MiB = 128 chunks, more than any plan here
        "local_disk": str(disk),
        "max_local_disk_size": 1.0,
        "blocking_timeout_secs": 10,
    }
    if master is not None:
        lmc |= {
            "remote_url": f"mooncakestore://{master.rpc_address}/",
            "remote_serde": "naive",
            "extra_config": {
                # The `mooncake_` prefix: LMCache strips it and passes Mooncake 0.3.13 the keys it reads.
                "mooncake_local_hostname": "127.0.0.1",
                "mooncake_metadata_server": master.metadata_url,
                "mooncake_master_server_addr": master.rpc_address,
                "mooncake_protocol": "tcp",
                "mooncake_global_segment_size": 0,  # this process holds no objects; the segment holder does
                "mooncake_local_buffer_size": 64 << 20,
                "save_chunk_meta": False,
                "transfer_timeout": 5,
            },
        }
    return {
        "model": {"name": "bsr/tiny", "layers": LAYERS, "kv_heads": HEADS, "head_size": HEAD, "tp_size": tp},
        "lmcache": lmc,
        "settings": {
            "w": W,
            "tiers": ["mooncake", "fs"] if master is not None else ["fs"],
            "kv_tokens": 16384,
            "faults_enabled": True,
            "fetch_timeout_s": 10.0,
        },
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[services.ServiceHandle, LMCacheHost]]:
    state = tmp_path_factory.mktemp("mooncake")
    master = services.start_master(state)
    holder = None
    host = None
    try:
        holder = services.start_segment_holder(state, master, 256 << 20)
        host = LMCacheHost(host_config(master, tmp_path_factory.mktemp("disk")))
        yield master, host
    finally:
        if host is not None:
            host.close()  # waits for remote puts, destroys the engines
        if holder is not None:
            services.stop(holder, timeout=5)
        services.stop(master, timeout=5)


def _stored_prompt(host: LMCacheHost, seed: int, n_tokens: int) -> list[int]:
    """A prompt computed once through the host (prefill + LMCache store to both tiers)."""
    toks = synthetic_tokens(n_tokens, seed=seed)
    res = host.coordinator.submit(toks, w=W)
    assert res.hash_ok and res.stored is not None and not res.stored.errors, res.stored
    return toks


def _reset_peak_once_l1_is_empty(host: LMCacheHost) -> None:
    """Reset every rank's L1 high-water once LMCache has given back what a store staged there: LMCache frees a
    put's chunks after the objects are already visible (on a loaded host, a while after), and a peak reset while
    they are live starts from them."""
    deadline = time.monotonic() + 60
    pause = threading.Event()
    while any(host.rank(r).tracker.live for r in (0, 1)):
        assert time.monotonic() < deadline, [host.rank(r).pool_stats() for r in (0, 1)]
        pause.wait(0.02)  # polls a condition, with a deadline
    host.coordinator.reset_peak()


@pytest.mark.timeout(120)
def test_bitmap_matches_what_lmcache_stored(stack: tuple[services.ServiceHandle, LMCacheHost]) -> None:
    master, host = stack
    toks = _stored_prompt(host, seed=11, n_tokens=CHUNKS * CS + 100)  # the 100-token tail is never stored
    c = host.coordinator
    # Holes LMCache's prefix lookup cannot see past: rank 0 loses chunk 5 remotely, rank 1 chunk 9 on disk.
    e0, e1 = host.rank(0).engine, host.rank(1).engine
    k0, k1 = host.rank(0).keys(toks), host.rank(1).keys(toks)
    assert len(k0) == CHUNKS
    lm.mooncake_store(e0).remove(lm.key_string(k0[5]), True)
    e1.storage_manager.batched_remove([k1[9]], locations=["LocalDiskBackend"])

    bitmap, errors = c.probe(toks)
    assert errors == {}
    cells = {(row["rank"], row["group"]): row["cells"] for row in bitmap.to_dict()["rows"]}
    # Ground truth, independent of the plugin: the master's key listing and LMCache's disk index files.
    listed = set(urllib.request.urlopen(f"{master.admin_url}/get_all_keys", timeout=5).read().decode().split())
    for r, keys in ((0, k0), (1, k1)):
        disk_dir = Path(host.rank(r).disk_dir or "")
        expect = ""
        for k in keys:
            remote = lm.key_string(k) in listed
            disk = (disk_dir / (lm.key_string(k).replace("/", "-") + ".pt")).exists()
            expect += f"{int(remote) | int(disk) << 1:x}"
        assert cells[(r, "attn")] == expect + "0", (r, cells[(r, "attn")], expect)
    assert cells[(0, "attn")][5] == "2" and cells[(1, "attn")][9] == "1"
    # Probe-only: nothing pinned, no request keys recorded.
    for r in (0, 1):
        st = lm.pinned_state(host.rank(r).engine, host.rank(r).keys(toks))
        assert st["lookup_pins"] == 0 and st["disk_keys_in_request"] == 0 and set(st["disk_pin_counts"]) <= {0}
    # The full bitmap sees past the holes; LMCache's own lookup only counts a prefix.
    assert e1.lookup(torch.tensor(toks), search_range=["LocalDiskBackend"], pin=False) == 9 * CS
    assert bitmap.prefix_tokens(set()) == CHUNKS * CS  # every chunk is in some tier on every rank


@pytest.mark.timeout(180)
def test_lmcaches_own_l1_is_shown_beside_the_windows_not_held_against_b(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    """LMCache's L1 also holds what LMCache itself staged (a store's chunks until they are written): the pool reports
    those as L1, beside the restore windows' bytes that B bounds, so a full L1 with no window live is never shown
    as a pool over B (draining) or at B. Negative control: judged on the L1 total, as the pool did before, it is."""
    _, host = stack
    rk = host.rank(0)
    assert rk.windows is not None
    _reset_peak_once_l1_is_empty(host)
    held = rk.windows._allocate(2)  # two chunks in L1 through LMCache's own allocator, outside any restore window
    assert held is not None
    try:
        rk.set_budget(SetBudgetRequest(CHUNK_BYTES))  # B below what L1 holds now
        entry = next(p for p in host.coordinator.pool() if p.rank == 0).with_draining()
        pool = entry.pool or {}
        assert pool["l1_live_bytes"] >= 2 * CHUNK_BYTES and pool["l1_peak_bytes"] >= 2 * CHUNK_BYTES, pool
        assert pool["live_bytes"] == pool["peak_bytes"] == 0 and pool["windows_live"] == 0, pool
        assert pool["draining"] is False, pool
        l1_total = dict(pool, live_bytes=pool["l1_live_bytes"])  # the control: the L1 total read as the pool
        assert replace(entry, pool=l1_total).with_draining().pool == dict(l1_total, draining=True)
    finally:
        lm.release_objects(held)
        rk.set_budget(SetBudgetRequest(rk.tracker.heap_bytes))


def test_windowed_restore_bit_exact_and_l1_at_window_bound(stack: tuple[services.ServiceHandle, LMCacheHost]) -> None:
    _, host = stack
    c = host.coordinator
    toks = _stored_prompt(host, seed=12, n_tokens=CHUNKS * CS)
    peaks: dict[str, int] = {}
    # B = RWS(W): one window live, serialized, so the peak is exactly one window. B = 2 RWS(W): the next window's
    # fetch may run during this one's install, so up to two windows are live at the peak, never more; how many
    # overlapped depends on when the host lets the fetch run, so the bound is what is checked, not the overlap.
    for tier, exclude, budget in (
        ("mooncake", ["fs"], W * CHUNK_BYTES),
        ("fs", ["mooncake"], W * CHUNK_BYTES),
        ("mooncake", ["fs"], 2 * W * CHUNK_BYTES),
        ("fs", ["mooncake"], 2 * W * CHUNK_BYTES),
    ):
        try:
            for r in (0, 1):
                host.rank(r).set_budget(SetBudgetRequest(budget))
            _reset_peak_once_l1_is_empty(host)
            res = c.restore(toks, w=W, exclude=exclude)
        finally:
            for r in (0, 1):
                host.rank(r).set_budget(SetBudgetRequest(host.rank(r).tracker.heap_bytes))
        report = res.report
        assert report is not None and res.hashes is not None
        assert res.outcome is Outcome.COMMITTED and res.committed_tokens == CHUNKS * CS, report.failures
        assert report.tiers == (tier,) and report.windows == CHUNKS // W
        assert res.hashes.hash_ok is True  # SHA-256 of every installed byte equals the canonical KV: bit-exact
        one_window = W * CHUNK_BYTES
        for o in report.ranks:
            assert one_window <= o.peak_live_bytes <= budget, (tier, budget, o)
            assert o.windows_done == CHUNKS // W and o.install_seconds > 0
        pools = [p.pool or {} for p in c.pool()]
        peaks[tier] = max(p["l1_peak_bytes"] for p in pools)  # LMCache's L1 as its allocator measured it
        assert one_window <= peaks[tier] <= budget
        assert all(one_window <= p["peak_bytes"] <= budget for p in pools), pools  # the windows B admitted

    # Stock LMCache retrieve of the same prefix on rank 0: the whole plan staged in L1 at once. Bit-exact too.
    rk = host.rank(0)
    table = list(range(0, CHUNKS * CS // 16))
    rk.kv.prefill(chunk_hashes(toks, CS), CHUNKS * CS, 0, {"attn": table})
    want = rk.kv.gather_object("attn", table, 0, CHUNKS * CS)
    rk.kv.invalidate({"attn": table})
    _reset_peak_once_l1_is_empty(host)
    ret = lm.stock_retrieve(rk.engine, toks, kvcaches=rk.kvcaches, slot_mapping=rk.slots(table, CHUNKS * CS))
    assert int(ret.sum()) == CHUNKS * CS
    assert torch.equal(rk.kv.gather_object("attn", table, 0, CHUNKS * CS), want)
    stock_peak = rk.tracker.peak
    assert stock_peak == CHUNKS * CHUNK_BYTES
    # W = 0 through the host is the same whole-plan path.
    c.reset_peak()
    whole = c.restore(toks, w=0, exclude=["fs"])
    assert whole.report is not None
    assert whole.outcome is Outcome.COMMITTED
    assert all(o.peak_live_bytes == CHUNKS * CHUNK_BYTES for o in whole.report.ranks)
    print(
        f"\nL1 peak per rank, {CHUNKS} chunks of {CHUNK_BYTES} B: windowed W={W}: mooncake {peaks['mooncake']} B, "
        f"fs {peaks['fs']} B; stock LMCache retrieve {stock_peak} B; W=0 via host "
        f"{whole.report.ranks[0].peak_live_bytes} B"
    )


@pytest.mark.timeout(180)
def test_failed_window_leaves_no_valid_partial_prefix(stack: tuple[services.ServiceHandle, LMCacheHost]) -> None:
    _, host = stack
    c = host.coordinator
    toks = _stored_prompt(host, seed=13, n_tokens=CHUNKS * CS)
    tables: list[dict[str, list[int]]] = []
    orig = c.allocation.allocate

    def spy(n: int, request: str = "") -> tuple[dict[str, list[int]], float]:
        got = orig(n, request)
        tables.append(got[0])
        return got

    c.allocation.allocate = spy  # type: ignore[method-assign]
    try:
        for r in (0, 1):  # a sentinel in every block: scrubbing must show
            for t in host.rank(r).kvcaches:
                t.fill_(1.0)
        # Rank 1's Mooncake reads fail in window 3 (windows 0-2 already installed on both ranks); the fault goes
        # through LMCache's own failure path (its get returns None, retrieve returns a short mask).
        c.inject(FaultRequest("remote-unavailable", rank=1, window=3))
        res = c.restore(toks, w=W, exclude=["fs"])
    finally:
        c.allocation.allocate = orig  # type: ignore[method-assign]
    report = res.report
    assert report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    assert {(f.rank, f.window) for f in report.failures} == {(1, 3)}
    assert "LMCache loaded 0 of 512 tokens" in report.failures[0].reason
    by_rank = {o.rank: o for o in report.ranks}
    assert by_rank[0].ok and not by_rank[1].ok and by_rank[1].windows_done == 3
    assert report.invalid == (InvalidCell(1, "attn"),)  # one invalid cell collapses every rank's prefix
    assert res.marker is not None and res.marker.excluded == {"mooncake"}
    assert report.failure_kind is FailureKind.TIER and report.blamed_tiers == ("mooncake",)  # blames the tier
    blocks = tables[0]["attn"]
    # Rank 1 failed: every block of the request is scrubbed (including the 3 windows it had installed).
    rows1 = host.rank(1).kv.rows("attn", blocks, len(blocks) * 16)
    for t in host.rank(1).kvcaches:
        assert int(t.index_select(0, rows1).count_nonzero()) == 0
    # Rank 0's own windows were valid, but the commit rule commits 0 tokens, so none of them is used. The next
    # submit skips the marked tier and is served from disk, verified.
    again = c.submit(toks, w=W)
    assert again.external_tokens == CHUNKS * CS and again.source == "fs" and again.hash_ok is True
    assert again.marker_cleared is True and c.markers == {}


@pytest.mark.timeout(180)
def test_a_window_transfer_that_raises_fails_closed_and_gives_l1_back(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    _, host = stack
    c = host.coordinator
    toks = _stored_prompt(host, seed=16, n_tokens=CHUNKS * CS)
    broken = lm.key_string(host.rank(1).keys(toks)[2 * W + 1])  # rank 1, window 2
    windows = host.rank(1).windows
    assert windows is not None
    real = windows.store
    # The real store, whose transfer of window 2 raises: that window's L1 objects (allocated before the transfer)
    # and the next window's (its fetch issued ahead) must come back.
    windows.store = StoreSpy(real, fail_when=lambda keys: broken in keys)
    for r in (0, 1):
        host.rank(r).set_budget(SetBudgetRequest(2 * W * CHUNK_BYTES))  # B = 2 RWS: a fetch runs ahead
    try:
        res = c.restore(toks, w=W, exclude=["fs"])
        windows.store = real
        assert res.report is not None
        assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
        assert [(f.rank, f.window) for f in res.report.failures] == [(1, None)]
        assert "transfer broke mid-window" in res.report.failures[0].reason
        for r in (0, 1):
            assert host.rank(r).tracker.live == 0, r  # every fetched object given back to L1
        again = c.restore(toks, w=W, exclude=["fs"])
        assert again.outcome is Outcome.COMMITTED and again.hashes is not None and again.hashes.hash_ok is True
    finally:
        windows.store = real
        c.clear_markers()  # the failure marked mooncake for this prompt; the stack is shared by the module
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(host.rank(r).tracker.heap_bytes))


S = TypeVar("S")


def _restore_at_2rws_through(
    host: LMCacheHost, toks: list[int], wrap: Callable[[Any, list[str]], S]
) -> tuple[S, Any, list[int]]:
    """Restore ``toks`` at B = 2 RWS with rank 0's Mooncake store replaced by ``wrap(real store, rank 0's keys)``,
    then put the store, the budgets and the markers back. Returns the wrapper, the result and each rank's pool
    peak."""
    c, rank = host.coordinator, host.rank(0)
    windows = rank.windows
    assert windows is not None
    real = windows.store
    wrapper = wrap(real, [lm.key_string(k) for k in rank.keys(toks)])
    try:
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(2 * W * CHUNK_BYTES))
        _reset_peak_once_l1_is_empty(host)
        windows.store = wrapper
        res = c.restore(toks, w=W, exclude=["fs"])
        peaks = [p.pool["l1_peak_bytes"] for p in c.pool()]  # the allocator's L1
    finally:
        windows.store = real
        c.clear_markers()
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(host.rank(r).tracker.heap_bytes))
    return wrapper, res, peaks


class _HeldTransfer:
    """The real store (every call goes to it), whose transfer of one window waits until the next window's transfer
    has been issued (an event, with a deadline under the restore's fetch timeout): says whether they were in flight
    together."""

    def __init__(self, store: Any, held: str, following: str) -> None:
        self._store, self._held, self._following = store, held, following
        self.following_issued = threading.Event()
        self.together: bool | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into(self, keys: list[str], *args: Any) -> Any:
        if self._following in keys:
            self.following_issued.set()
        if self._held in keys:
            self.together = self.following_issued.wait(8.0)
        return self._store.batch_get_into(keys, *args)


@pytest.mark.timeout(120)
def test_under_b_2rws_the_next_window_is_fetched_while_the_one_before_is_in_flight(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    """B = 2 RWS holds two windows: once window 0 is installed and given back, window 2's transfer is issued while
    window 1's is still running, so the transport always has the next window to move (the per-call gap of one
    transfer at a time is what kept bsr below the raw GET). The pool still never holds more than B. Fails when the
    next transfer waits for the one before (window 1 is held until window 2 is issued: it would time out)."""
    _, host = stack
    toks = _stored_prompt(host, seed=19, n_tokens=CHUNKS * CS)
    budget = 2 * W * CHUNK_BYTES
    # Window 1 waits for window 2's transfer.
    held, res, peaks = _restore_at_2rws_through(
        host, toks, lambda real, keys: _HeldTransfer(real, held=keys[W], following=keys[2 * W])
    )
    assert held.together is True
    assert res.outcome is Outcome.COMMITTED and res.hashes is not None and res.hashes.hash_ok is True, res.report
    assert res.report is not None and all(o.peak_live_bytes <= budget for o in res.report.ranks)
    assert max(peaks) <= budget, peaks


class _SlowTransfers:
    """The real store (every call goes to it) as a slow tier for two windows: the first one's transfer returns
    ``hold_s`` after the second one's has been issued, and the second one's ``then_s`` (default ``hold_s``) after the
    first one's has returned."""

    def __init__(self, store: Any, first: str, second: str, hold_s: float, then_s: float | None = None) -> None:
        self._store, self._first, self._second, self._hold_s = store, first, second, hold_s
        self._then_s = hold_s if then_s is None else then_s
        self.second_issued, self.first_back = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into(self, keys: list[str], *args: Any) -> Any:
        if self._second in keys:
            self.second_issued.set()
            self.first_back.wait(30.0)
            time.sleep(self._then_s)  # the slow tier itself, not a synchronisation
        out = self._store.batch_get_into(keys, *args)
        if self._first in keys:
            self.second_issued.wait(30.0)
            time.sleep(self._hold_s)
            self.first_back.set()
        return out


@pytest.mark.timeout(120)
def test_a_window_fetched_ahead_gets_the_whole_fetch_timeout_after_the_one_before_it(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    """Two windows in flight share the transport, so a window's deadline counts its share of it, not the clock from
    its issue: each still gets fetch_timeout_s (10 s here) of the tier to itself, as when one fetch ran at a time.
    Here window 2 arrives 12 s after its issue, 6 s of them beside window 1 and 6 alone (a share of 9 s): it commits
    (counted from its issue it would time out)."""
    _, host = stack
    toks = _stored_prompt(host, seed=23, n_tokens=CHUNKS * CS)
    slow, res, _ = _restore_at_2rws_through(
        host, toks, lambda real, keys: _SlowTransfers(real, first=keys[W], second=keys[2 * W], hold_s=6.0)
    )
    assert slow.second_issued.is_set() and slow.first_back.is_set()
    assert res.outcome is Outcome.COMMITTED and res.hashes is not None and res.hashes.hash_ok is True, res.report


@pytest.mark.timeout(120)
def test_the_first_window_shares_the_transport_with_the_second_and_gets_the_whole_fetch_timeout(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    """The restore's first two windows are issued together, so the first shares the transport with the second for
    its whole transfer: its deadline counts its share. Here window 0 arrives 12 s after its issue, all of them beside
    window 1 (a share of 6 s of the 10 s deadline): it commits (counted on the clock from its issue it timed out)."""
    _, host = stack
    toks = _stored_prompt(host, seed=29, n_tokens=CHUNKS * CS)
    slow, res, _ = _restore_at_2rws_through(
        host, toks, lambda real, keys: _SlowTransfers(real, first=keys[0], second=keys[W], hold_s=12.0, then_s=0.0)
    )
    assert slow.second_issued.is_set() and slow.first_back.is_set()
    assert res.outcome is Outcome.COMMITTED and res.hashes is not None and res.hashes.hash_ok is True, res.report


def test_a_window_over_the_budget_is_capacity_and_blames_no_tier(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    _, host = stack
    c = host.coordinator
    toks = _stored_prompt(host, seed=15, n_tokens=4 * CS)
    try:
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(CHUNK_BYTES))  # one chunk: a window of W=2 can never be admitted
        res = c.restore(toks, w=W, exclude=["fs"])
    finally:
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(host.rank(r).tracker.heap_bytes))
    assert res.report is not None
    assert res.outcome is Outcome.REFUSED and res.committed_tokens == 0
    assert res.report.failure_kind is FailureKind.CAPACITY and res.report.blamed_tiers == () and res.report.hint
    assert res.marker is None and c.markers == {}
    again = c.restore(toks, w=W, exclude=["fs"])
    assert again.outcome is Outcome.COMMITTED and again.hashes is not None and again.hashes.hash_ok is True


@pytest.mark.timeout(120)
def test_admin_api_and_cli_against_the_lmcache_host(
    stack: tuple[services.ServiceHandle, LMCacheHost], tmp_path: Path
) -> None:
    _, host = stack
    import json
    import subprocess
    import sys

    admin = host.serve(token="t0k")
    try:
        env = dict(os.environ, BSR_ENGINE=admin.url, BSR_TOKEN="t0k", XDG_CONFIG_HOME=str(tmp_path))

        def bsr(*args: str, rc: int = 0) -> dict[str, Any]:
            out = subprocess.run(
                [sys.executable, "-m", "bsr_cli", *args, "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == rc, out.stderr + out.stdout
            return dict(json.loads(out.stdout))

        sub = bsr("submit", "--synthetic", str(6 * CS), "--seed", "21")
        assert sub["hash_ok"] is True
        probe = bsr("probe", "--synthetic", str(6 * CS), "--seed", "21")
        assert "rows" in json.dumps(probe)
        bsr("inject-fault", "--kind", "restore-fault", "--rank", "0", "--window", "2")
        # Exit code 10: the CLI says "failed closed"; its one JSON document is the error, carrying the result.
        failed = bsr("restore", "--synthetic", str(6 * CS), "--seed", "21", "--exclude-tier", "fs", rc=10)
        assert failed["error"] == "failed-closed" and failed["exit_code"] == 10
        rest = failed["report"]
        assert rest["outcome"] == "failed_closed" and rest["committed_tokens"] == 0
        assert {f["window"] for f in rest["failures"]} == {1}  # --window 2 is 1-based
        status = bsr("status")
        assert "ranks" in json.dumps(status)
        with pytest.raises(InvalidInput):
            host.coordinator.inject(FaultRequest("corrupt"))
    finally:
        host.admin = None
        admin.stop()


@pytest.mark.timeout(60)
def test_dead_master_is_refused_before_lmcache_setup(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = services.ServiceHandle(
        kind="master",
        pid=0,
        argv=[],
        log_path="",
        ports={},
        urls={"rpc_address": f"127.0.0.1:{port}", "metadata_url": f"http://127.0.0.1:{port}/metadata"},
    )
    t0 = time.monotonic()
    with pytest.raises(CapacityError, match="not healthy"):
        LMCacheHost(host_config(dead, tmp_path, tp=1))
    assert time.monotonic() - t0 < 10  # instead of LMCache's ~90 s setup stall


def _released_on_rank0(events: list[Event]) -> list[int]:
    """The sequence numbers of a request's window_released events on rank 0, in order."""
    return [e.seq for e in events if isinstance(e, WindowReleased) and e.rank == 0]


@pytest.mark.timeout(180)
def test_a_window_is_one_transfer_and_one_copy_per_layer(stack: tuple[services.ServiceHandle, LMCacheHost]) -> None:
    _, host = stack
    c = host.coordinator
    toks = _stored_prompt(host, seed=17, n_tokens=CHUNKS * CS)
    ranks = [host.rank(r) for r in (0, 1)]
    real = [rk.windows.store for rk in ranks if rk.windows is not None]
    assert len(real) == 2
    spies = [StoreSpy(store) for store in real]
    try:
        for rk, spy in zip(ranks, spies, strict=True):
            assert rk.windows is not None
            rk.windows.store = spy
        with counting_writes(ranks) as writes:
            res = c.restore(toks, w=W, exclude=["fs"])
    finally:
        for rk, store in zip(ranks, real, strict=True):
            assert rk.windows is not None
            rk.windows.store = store
    assert res.outcome is Outcome.COMMITTED and res.hashes is not None and res.hashes.hash_ok is True
    windows = CHUNKS // W
    for rk, spy in zip(ranks, spies, strict=True):
        keys = [lm.key_string(k) for k in rk.keys(toks)]
        # One store call per window, carrying its W objects and their W checksum sidecars; nothing else read.
        # Two windows' transfers can be in flight at once (on two threads), so the calls are compared as a set.
        expected = {
            ("batch_get_into", (*window, *map(sidecar_key, window)))
            for window in (keys[i * W : (i + 1) * W] for i in range(windows))
        }
        assert len(spy.calls) == windows and set(spy.calls) == expected, spy.calls
    # One copy per layer per window into the paged KV, on each rank.
    assert len(writes) == 2 * windows * LAYERS, writes

    # Negative control: the same counters on LMCache's own window path (the connector's get, bsr's checksum
    # wrapper, the connector's install) see two store calls and a copy per chunk per layer.
    rk = ranks[0]
    conn, sums = lm.mooncake_connector(rk.engine), rk.checksums
    assert conn is not None and sums is not None
    spy = StoreSpy(conn.store)
    conn.store, sums.store = spy, spy
    try:
        got = lm.fetch_window(rk.engine, rk.keys(toks)[:W], ["RemoteBackend"] * W)
        with counting_writes([rk]) as writes:
            lm.install_window(
                rk.engine,
                got,
                [0, CS],
                [CS, 2 * CS],
                kvcaches=rk.kvcaches,
                slot_mapping=rk.slots(list(range(64)), W * CS),
            )
        lm.release_objects(got)
    finally:
        conn.store, sums.store = spy.real, spy.real
    assert [call for call, _ in spy.calls] == ["batch_get_into", "get_batch"]
    assert len(writes) == W * LAYERS


@pytest.mark.timeout(120)
def test_the_window_install_writes_what_the_connector_writes_into_any_block_table(
    stack: tuple[services.ServiceHandle, LMCacheHost],
) -> None:
    _, host = stack
    rk = host.rank(0)
    windows = rk.windows
    assert windows is not None
    objs = windows.cpu.batched_allocate(windows.shapes, windows.dtypes, W, windows.fmt, eviction=False, busy_loop=False)
    assert objs is not None and len(objs) == W
    try:
        gen = torch.Generator().manual_seed(3)
        for o in objs:
            o.tensor.copy_(torch.randn(o.tensor.shape, generator=gen).to(o.tensor.dtype))
        n_blocks = W * CS // 16
        for table in (list(range(700, 700 + n_blocks)), [700 + (7 * i) % n_blocks for i in range(n_blocks)]):
            rows = rk.slots(table, W * CS)
            for kv in rk.kvcaches:
                kv.index_fill_(0, rows, 0)
            with counting_writes([rk]) as writes:
                assert install_window(objs, rk.kvcaches, rows, HEADS, HEAD) is True
            assert len(writes) == LAYERS, writes  # one copy per layer for the whole window, run or not
            mine = [kv.index_select(0, rows).clone() for kv in rk.kvcaches]
            for kv in rk.kvcaches:
                kv.index_fill_(0, rows, 0)
            rk.connector.batched_to_gpu(objs, [0, CS], [CS, 2 * CS], kvcaches=rk.kvcaches, slot_mapping=rows)
            assert all(torch.equal(a, kv.index_select(0, rows)) for a, kv in zip(mine, rk.kvcaches, strict=True))
            assert any(bool(a.count_nonzero()) for a in mine)
        # Objects that are not at one stride in L1 (here: in reverse) are left to the connector: nothing written.
        with counting_writes([rk]) as writes:
            assert install_window(list(reversed(objs)), rk.kvcaches, rows, HEADS, HEAD) is False
        assert writes == []
    finally:
        lm.release_objects(objs)


@pytest.mark.timeout(240)
def test_two_restores_overlap_inside_lmcache_under_b_2rws(stack: tuple[services.ServiceHandle, LMCacheHost]) -> None:
    """Admission under B, not the engine lock, bounds restores inside LMCache: with B = 2 RWS a second restore
    starts while the first is still running (its first window is released before the first restore's last), and
    the pool never holds more than B. Synchronised on the restores' own window events: request 1's rank 0 waits
    (at most 15 s) after its first window for request 2's first window; a rank that held LMCache for the whole
    restore would keep request 2 out until request 1 ended."""
    _, host = stack
    c = host.coordinator
    first = _stored_prompt(host, seed=21, n_tokens=CHUNKS * CS)
    second = _stored_prompt(host, seed=22, n_tokens=CHUNKS * CS)
    budget = 2 * W * CHUNK_BYTES
    seen1: list[Event] = []
    seen2: list[Event] = []
    # The control of the measure itself: one restore after the other never overlaps.
    a = c.restore(first, w=W, exclude=["fs"], progress=seen1.append)
    b = c.restore(second, w=W, exclude=["fs"], progress=seen2.append)
    assert a.outcome is b.outcome is Outcome.COMMITTED
    assert _released_on_rank0(seen2)[0] > _released_on_rank0(seen1)[-1]

    seen1.clear()
    seen2.clear()
    second_released = threading.Event()
    out: dict[str, Any] = {}

    def on_second(ev: Event) -> None:
        seen2.append(ev)
        if isinstance(ev, WindowReleased) and ev.rank == 0:
            second_released.set()

    def run_second() -> None:
        out["second"] = c.restore(second, w=W, exclude=["fs"], progress=on_second)

    runner = threading.Thread(target=run_second, daemon=True)

    def on_first(ev: Event) -> None:
        seen1.append(ev)
        if isinstance(ev, WindowReleased) and ev.rank == 0 and not runner.is_alive() and "t" not in out:
            out["t"] = True
            runner.start()  # request 2 arrives while request 1 is mid-restore (its rank 0 holds here)
            second_released.wait(15)

    try:
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(budget))
        _reset_peak_once_l1_is_empty(host)
        out["first"] = c.restore(first, w=W, exclude=["fs"], progress=on_first)
        runner.join(120)
        peaks = [p.pool["l1_peak_bytes"] for p in c.pool()]  # the allocator's L1
    finally:
        for r in (0, 1):
            host.rank(r).set_budget(SetBudgetRequest(host.rank(r).tracker.heap_bytes))
    for res in (out["first"], out["second"]):
        assert res.outcome is Outcome.COMMITTED and res.hashes is not None, res.report
        assert res.hashes.hash_ok is True, res.report
    first_released, second_first = _released_on_rank0(seen1), _released_on_rank0(seen2)
    assert len(first_released) == len(second_first) == CHUNKS // W
    assert second_first[0] < first_released[-1], (second_first, first_released)  # they overlapped in time
    assert max(peaks) <= budget, peaks
