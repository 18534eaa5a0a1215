"""The real tiers against real backends: a mooncake_master + segment holder on loopback, and a directory."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from bsr_cli.core.evidence import ScrubState  # noqa: E402
from bsr_cli.core.scrub import ScrubLimits  # noqa: E402
from bsr_cli.mooncake import health, services  # noqa: E402
from bsr_cli.runtime.scrub import Scrubber, ScrubTarget, quarantine_damaged  # noqa: E402
from bsr_cli.runtime.tiers import (  # noqa: E402
    IO_ERROR,
    MISSING,
    TIMED_OUT,
    UNAVAILABLE,
    StagingSlice,
    TierUnavailable,
)
from bsr_cli.tiers.fs import HEADER_BYTES, FilesystemTier  # noqa: E402

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


# ----------------------------------------------------------------------------------------------- helpers


class Pool:
    """A restore pool: one torch uint8 tensor, cut into staging slices."""

    def __init__(self, size: int) -> None:
        self.tensor = torch.zeros(size, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        self._raw = (ctypes.c_char * size).from_address(self.ptr)
        self.view = memoryview(self._raw).cast("B")

    def slices(self, sizes: Sequence[int], align: int = 4096, tail: int = 0) -> list[StagingSlice]:
        """Slices of ``sizes``, each ``tail`` bytes of room after it (as the engine's pool leaves for a trailer)."""
        out, off = [], 0
        for size in sizes:
            out.append(StagingSlice(self.ptr + off, self.view[off : off + size], tail))
            off += (size + tail + align - 1) // align * align
        assert off <= len(self.view), "pool too small for the test"
        return out

    def clear(self) -> None:
        self.tensor.fill_(0xA5)


def payloads(sizes: Sequence[int], seed: int) -> list[bytearray]:
    """Random payloads in self-owned, writable buffers (a memoryview over one is what callers hand to put)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for size in sizes:
        buf = bytearray(size)
        if size:
            torch.frombuffer(buf, dtype=torch.uint8).copy_(
                torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
            )
        out.append(buf)
    return out


def in_pool(pool: Pool, dest: StagingSlice) -> Any:
    """The pool tensor's slice a staging slice covers."""
    off = dest.ptr - pool.ptr
    return pool.tensor[off : off + len(dest.view)]


def as_tensor(buf: bytearray) -> Any:
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.zeros(0, dtype=torch.uint8)


def crc(data: Any) -> int:
    """A checksum to store: tiers store and return it without checking (the runtime verifies)."""
    from bsr_cli.runtime.checksum import crc32c

    return crc32c(data)


def obj_crc(key: str, data: Any) -> int:
    """The checksum a tier's own repair checks: the object checksum, bound to the key and the length."""
    from bsr_cli.runtime.checksum import object_checksum

    return object_checksum(key, data)


def wait_for_state(pid: int, state: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2] == state:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not reach state {state!r}")


def fresh_keys(n: int) -> list[str]:
    run = uuid.uuid4().hex[:12]
    return [f"test-model@1@0@{run}{i:04x}@bfloat16" for i in range(n)]


# ----------------------------------------------------------------------------------------------- mooncake


@pytest.fixture(scope="module")
def mc_tier(mooncake_stack: Any) -> Iterator[Any]:
    from bsr_cli.tiers.mooncake import MooncakeTier

    tier = MooncakeTier(mooncake_stack.master.rpc_address, mooncake_stack.master.metadata_url, deadline_s=10)
    try:
        yield tier
    finally:
        tier.close()


@pytest.fixture(scope="module")
def mc_pool(mc_tier: Any) -> Pool:
    pool = Pool(48 * MiB)
    mc_tier.register(pool.ptr, len(pool.view))
    return pool


@pytest.mark.engine
def test_services_handles_are_json_and_segment_is_mounted(mooncake_stack: Any) -> None:
    master, holder = mooncake_stack.master, mooncake_stack.holder
    for handle in (master, holder):
        again = services.ServiceHandle.from_wire(json.loads(json.dumps(handle.to_wire())))
        assert again == handle
        assert services.is_alive(handle.pid, handle.start_ticks)
        assert Path(handle.log_path).is_file()
    assert health.master_healthy(master.health_url)
    assert health.master_healthy(master.admin_url)  # the admin /health (JSON) is accepted too
    assert health.tcp_reachable(master.rpc_address)
    mounted = {s.segment_name: s for s in health.segments(master.admin_url)}
    assert holder.info["segment_name"] in mounted
    assert mounted[holder.info["segment_name"]].size_bytes == 512 << 20
    assert not services.is_alive(master.pid, (master.start_ticks or 0) + 1)  # a recycled pid is not "alive"


@pytest.mark.engine
def test_mooncake_round_trip_bit_exact(mc_tier: Any, mc_pool: Pool) -> None:
    sizes = [1 * MiB, 3 * MiB + 7, 1, 0, 16 * MiB]
    data = payloads(sizes, seed=1)
    keys = fresh_keys(len(sizes))
    views: list[Any] = [memoryview(t) for t in data]
    views[2] = bytes(views[2])  # a read-only payload takes the copy path
    mc_tier.put(keys, views, [crc(v) for v in views])

    assert mc_tier.contains(keys, 2.0) == [True] * len(keys)
    mc_pool.clear()
    dests = mc_pool.slices(sizes)
    codes, sums = mc_tier.get_into(keys, dests, 5.0)
    assert codes == sizes
    assert sums == [crc(v) for v in views]
    for dest, buf in zip(dests, data, strict=True):
        assert torch.equal(in_pool(mc_pool, dest), as_tensor(buf))  # bit-exact in the pool tensor


@pytest.mark.engine
def test_mooncake_data_calls_poll_at_low_priority(mc_tier: Any, mc_pool: Pool) -> None:
    """Mooncake busy-polls for completion on the calling thread: puts and gets run on nice-10 threads so the poll
    yields the CPU to the transfer; setup and control calls (and the threads Mooncake starts there) do not."""
    keys = fresh_keys(1)
    view = memoryview(payloads([4096], seed=21)[0])
    mc_tier.put(keys, [view], [crc(view)])
    assert mc_tier.get_into(keys, mc_pool.slices([4096]), 5.0)[0] == [4096]

    def nice_of(tid: int) -> int:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19 of stat, after pid and comm

    by_name = {t.name: t.native_id for t in threading.enumerate() if t.name.startswith("bsr-mooncake")}
    data = [tid for name, tid in by_name.items() if "-ctl-" not in name]
    control = [tid for name, tid in by_name.items() if "-ctl-" in name]
    assert data and control
    base = nice_of(threading.main_thread().native_id)  # the suite itself may run niced (`nice pytest`)
    assert all(nice_of(tid) == max(base, 10) for tid in data if tid is not None)
    assert all(nice_of(tid) == base for tid in control if tid is not None)
    # Every other thread of the process, Mooncake's own transfer threads included, keeps normal priority.
    others = [int(t.name) for t in Path("/proc/self/task").iterdir() if int(t.name) not in data]
    assert len(others) > len(control) + 1 and all(nice_of(tid) == base for tid in others)


def test_mooncake_missing_keys_and_mixed_batch(mc_tier: Any, mc_pool: Pool) -> None:
    keys = fresh_keys(3)
    data = payloads([4096], seed=2)
    mc_tier.put(keys[1:2], [memoryview(data[0])], [crc(memoryview(data[0]))])
    assert mc_tier.contains(keys, 2.0) == [False, True, False]
    codes, sums = mc_tier.get_into(keys, mc_pool.slices([4096] * 3), 2.0)
    assert codes == [MISSING, 4096, MISSING]
    assert sums == [None, crc(memoryview(data[0])), None]
    assert mc_tier.contains([], 1.0) == []
    assert mc_tier.get_into([], [], 1.0) == ([], [])


@pytest.mark.engine
def test_mooncake_checksum_is_returned_not_verified(mc_tier: Any, mc_pool: Pool) -> None:
    """The tier hands back what was stored; verifying is the runtime's job (so injected corruption is caught by
    the same check)."""
    keys = fresh_keys(1)
    view = memoryview(payloads([10_000], seed=3)[0])
    mc_tier.put(keys, [view], [0xDEADBEEF])
    codes, sums = mc_tier.get_into(keys, mc_pool.slices([10_000]), 2.0)
    assert codes == [10_000] and sums == [0xDEADBEEF]


@pytest.mark.engine
def test_mooncake_size_mismatch_and_foreign_object_are_io_errors(mc_tier: Any, mc_pool: Pool) -> None:
    keys = fresh_keys(2)
    view = memoryview(payloads([8192], seed=4)[0])
    mc_tier.put(keys[:1], [view], [crc(view)])
    # A slice smaller or larger than the object.
    codes, sums = mc_tier.get_into([keys[0], keys[0]], mc_pool.slices([4096, 12288]), 2.0)
    assert codes == [IO_ERROR, IO_ERROR] and sums == [None, None]
    # An object with the right total size but no bsr trailer (written by someone else).
    foreign = torch.zeros(8192 + 16, dtype=torch.uint8)
    assert mc_tier._store.put_from(keys[1], foreign.data_ptr(), foreign.numel()) == 0
    codes, _ = mc_tier.get_into(keys[1:], mc_pool.slices([8192]), 2.0)
    assert codes == [IO_ERROR]


class _CountingStore:
    """The tier's real store, its get calls counted by name (the transfers a get makes at the store boundary)."""

    GETS = ("batch_get_into", "batch_get_into_multi_buffers", "get_into")

    def __init__(self, store: Any) -> None:
        self.real, self.calls = store, []

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.real, name)
        if name not in self.GETS:
            return call

        def counted(*args: Any) -> Any:
            self.calls.append(name)
            return call(*args)

        return counted


@pytest.mark.engine
def test_mooncake_an_object_with_room_for_its_trailer_lands_whole_in_one_transfer(mc_tier: Any, mc_pool: Pool) -> None:
    sizes = [3 * MiB + 7, 4096, 1]
    data = payloads(sizes, seed=31)
    keys = fresh_keys(len(sizes))
    mc_tier.put(keys, [memoryview(b) for b in data], [crc(memoryview(b)) for b in data])
    spy = _CountingStore(mc_tier._store)
    mc_tier._store = spy
    try:
        mc_pool.clear()
        dests = mc_pool.slices([*sizes, 4096], tail=16)  # the last one: an object the store does not hold
        codes, sums = mc_tier.get_into([*keys, fresh_keys(1)[0]], dests, 5.0)
        assert spy.calls == ["batch_get_into"]  # the payloads and trailers of every object: one call
        assert codes == [*sizes, MISSING] and sums == [*(crc(memoryview(b)) for b in data), None]
        for dest, buf in zip(dests[:-1], data, strict=True):
            assert torch.equal(in_pool(mc_pool, dest), as_tensor(buf))
            after = dest.ptr - mc_pool.ptr + len(dest.view) + 16
            assert int(mc_pool.tensor[after]) == 0xA5  # nothing written past the room it was given
        # A slice of the wrong size still fails as an io-error, never a short read taken as whole.
        codes, _ = mc_tier.get_into(keys[:2], mc_pool.slices([sizes[0] - 1, 4097], tail=16), 2.0)
        assert codes == [IO_ERROR, IO_ERROR]
        # Negative control: without that room the trailer is a second buffer of every object (two transfers each).
        spy.calls.clear()
        codes, _ = mc_tier.get_into(keys, mc_pool.slices(sizes), 5.0)
        assert codes == sizes and spy.calls == ["batch_get_into_multi_buffers"]
    finally:
        mc_tier._store = spy.real


@pytest.mark.engine
def test_mooncake_remove_helpers(mc_tier: Any) -> None:
    keys = fresh_keys(2)
    view = memoryview(b"x" * 100)
    mc_tier.put(keys, [view, view], [crc(view)] * 2)
    assert mc_tier.contains(keys, 2.0) == [True, True]  # grants a lease; removal is forced anyway
    assert mc_tier.remove(keys[:1]) == [0]
    assert mc_tier.contains(keys, 2.0) == [False, True]
    assert mc_tier.remove_all() >= 1
    assert mc_tier.contains(keys, 2.0) == [False, False]


def _stored(tier: Any, key: str) -> bytes:
    """The whole object as the store holds it (payload and trailer), read through the tier's own client."""
    size = tier._store.get_size(key)
    buf = torch.zeros(max(size, 1), dtype=torch.uint8)
    assert tier._store.get_into(key, buf.data_ptr(), size) == size
    return bytes(buf[:size].numpy())


def _replace(tier: Any, key: str, data: bytes) -> None:
    """Write ``data`` as the object of ``key`` in the real store, replacing what is there (a raw client's upsert)."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert tier._store.upsert_from(key, buf.data_ptr(), len(data)) == 0


@pytest.mark.engine
def test_mooncake_damaged_objects_are_removed_sound_ones_stay(mc_tier: Any, mc_pool: Pool) -> None:
    """What the rank's repair does after a failed restore: every kind of wrong object is named and removed (another
    chunk's object with its own trailer, bytes appended, bytes cut, an older bsr's trailer); a sound one stays."""
    keys = fresh_keys(6)
    size = 8192
    views = [memoryview(p) for p in payloads([size] * 6, seed=31)]
    mc_tier.put(keys, views, [obj_crc(k, v) for k, v in zip(keys, views, strict=True)])
    whole = [_stored(mc_tier, k) for k in keys]
    _replace(mc_tier, keys[0], whole[5])  # chunk 5's object, trailer and all, under chunk 0's key
    _replace(mc_tier, keys[1], whole[1] + b"\x00" * 512)  # grown
    _replace(mc_tier, keys[2], whole[2][:-100])  # truncated
    older = whole[3][:-16] + b"BSM2" + crc(views[3]).to_bytes(4, "little") + size.to_bytes(8, "little")
    _replace(mc_tier, keys[3], older)  # an older bsr's object: a CRC32C of the bytes alone
    # The restore's fetch: the transplanted object arrives whole (only the runtime's check can tell), the others
    # cannot arrive as objects of this size and format.
    codes, sums = mc_tier.get_into(keys[:5], mc_pool.slices([size] * 5), 5.0)
    assert codes == [size, IO_ERROR, IO_ERROR, IO_ERROR, size]
    assert sums[0] == obj_crc(keys[5], views[5]) != obj_crc(keys[0], views[5])
    removed = quarantine_damaged(mc_tier, {k: f"chunk {i} group g" for i, k in enumerate(keys[:5])})
    why = {q.key: q.reason for q in removed}
    assert list(why) == keys[:4], why  # keys[4] reads back sound: what failed was the transfer, it stays
    assert why[keys[0]] == "checksum mismatch (its bytes, or the chunk they belong to): chunk 0 group g"
    assert why[keys[1]].startswith(f"no bsr trailer at its end ({size + 16 + 512} bytes")
    assert why[keys[2]].startswith(f"no bsr trailer at its end ({size + 16 - 100} bytes")
    assert why[keys[3]].startswith("written by an older bsr (trailer BSM2")
    assert all(q.file == "" and q.bytes > 0 for q in removed)  # removed: nothing kept
    assert mc_tier.contains(keys, 2.0) == [False] * 4 + [True, True]
    listed, total = mc_tier.quarantined(2)
    assert total >= 4 and [q.key for q in listed] == [keys[3], keys[2]]  # the newest first
    # The next store writes them afresh; the tier's check then finds them sound.
    mc_tier.put(keys[:4], views[:4], [obj_crc(k, v) for k, v in zip(keys[:4], views[:4], strict=True)])
    assert quarantine_damaged(mc_tier, {k: "again" for k in keys}) == []
    codes, sums = mc_tier.get_into(keys[:4], mc_pool.slices([size] * 4), 5.0)
    assert codes == [size] * 4 and sums == [obj_crc(k, v) for k, v in zip(keys[:4], views[:4], strict=True)]


def _worker_keys(worker: int, n: int) -> list[str]:
    run = uuid.uuid4().hex[:12]
    return [f"test-model@1@{worker}@{run}{i:04x}@bfloat16" for i in range(n)]


@pytest.mark.engine
def test_mooncake_scrub_of_every_object_removes_the_damaged_ones_of_its_shard(mooncake_stack: Any) -> None:
    """`bsr scrub --tier mooncake --all` on one rank: the master's key listing, split by the worker id in each key,
    every object of the rank's shard read back whole and checked against its key-bound trailer; the damaged ones
    (another chunk's object, bytes appended, an older bsr's trailer) are removed and named, the sound ones stay, and
    another shard's damaged object is left to its own rank. The worker ids are this test's own (997 and 998 of
    1,000 shards), so the other tests' objects in the shared store are not in its shard."""
    from bsr_cli.tiers.mooncake import MooncakeTier

    master = mooncake_stack.master
    tier = MooncakeTier(master.rpc_address, master.metadata_url, admin_url=master.admin_url, deadline_s=10)
    try:
        keys, other = _worker_keys(997, 5), _worker_keys(998, 1)
        size = 4096
        views = [memoryview(p) for p in payloads([size] * 6, seed=37)]
        tier.put(keys + other, views, [obj_crc(k, v) for k, v in zip(keys + other, views, strict=True)])
        whole = [_stored(tier, k) for k in keys + other]
        _replace(tier, keys[0], whole[4])  # chunk 4's object under chunk 0's key
        _replace(tier, keys[1], whole[1] + b"\x00" * 64)  # grown
        older = whole[2][:-16] + b"BSM2" + crc(views[2]).to_bytes(4, "little") + size.to_bytes(8, "little")
        _replace(tier, keys[2], older)  # an older bsr's object
        _replace(tier, other[0], whole[5] + b"\x00")  # damaged too, but another rank's
        assert [tier.check_stored(k).damage is not None for k in keys + other] == [True] * 3 + [False] * 2 + [True]
        events: list[Any] = []
        done = Scrubber(997, {"mooncake": tier}, events.append).scrub_all("mooncake", shards=1000, limits=ScrubLimits())
        p = done.progress
        assert (p.state, p.checked, p.damaged, p.quarantined) == (ScrubState.COMPLETE, 5, 3, 3), p
        why = {q.key: q.reason for q in done.quarantined}
        assert set(why) == set(keys[:3]) and all(q.file == "" for q in done.quarantined)
        assert why[keys[0]].startswith("checksum mismatch") and why[keys[2]].startswith("written by an older bsr")
        assert tier.contains(keys + other, 2.0) == [False] * 3 + [True] * 3
        assert {e.key for e in events if type(e).__name__ == "ObjectQuarantined"} == set(keys[:3])
        assert tier.quarantined(3)[1] == 3  # `bsr status` lists what it removed
        # The same prompt scrubbed again: what is gone is missing, what stays is sound.
        again = Scrubber(997, {"mooncake": tier}, events.append).scrub_prompt(
            "mooncake", [ScrubTarget(k, i, "g") for i, k in enumerate(keys)], prompt="p", limits=ScrubLimits()
        )
        assert again is not None and (again.progress.checked, again.progress.missing) == (2, 3)
        assert again.progress.damaged == 0
    finally:
        tier.remove(keys + other)
        tier.close()


@pytest.mark.engine
def test_mooncake_scrub_of_every_object_without_the_masters_listing_fails_saying_why(mc_tier: Any) -> None:
    """A tier given no admin URL cannot list the store: the scrub ends failed (`bsr scrub` exits 21), never clean."""
    done = Scrubber(0, {"mooncake": mc_tier}, lambda ev: None).scrub_all("mooncake", shards=1, limits=ScrubLimits())
    assert done.progress.state is ScrubState.FAILED and "no admin URL" in done.progress.reason


@pytest.mark.engine
def test_mooncake_put_is_idempotent(mc_tier: Any, mc_pool: Pool) -> None:
    keys = fresh_keys(1)
    view = memoryview(payloads([5000], seed=5)[0])
    mc_tier.put(keys, [view], [crc(view)])
    mc_tier.put(keys, [view], [crc(view)])  # an existing immutable object counts as stored
    assert mc_tier.get_into(keys, mc_pool.slices([5000]), 2.0)[0] == [5000]


class _TransferFailsFirst:
    """The real store, except that a put of one of ``failing`` answers TRANSFER_FAIL without storing it, the first
    ``times`` times it is sent (a TCP transfer that failed: Mooncake revokes the object). A TCP transfer cannot be
    made to fail on demand on loopback, so the failure is injected here, at the store call; every object that is
    stored is stored by the real store."""

    def __init__(self, store: Any, failing: set[str], times: int) -> None:
        self._store, self._failing, self._left = store, failing, dict.fromkeys(failing, times)
        self.sent: list[list[str]] = []

    def batch_put_from_multi_buffers(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self.sent.append(list(keys))
        fail = [k in self._failing and self._left[k] > 0 for k in keys]
        for k, f in zip(keys, fail, strict=True):
            if f:
                self._left[k] -= 1
        pass_on = [i for i, f in enumerate(fail) if not f]
        rcs = self._store.batch_put_from_multi_buffers(
            [keys[i] for i in pass_on], [ptrs[i] for i in pass_on], [sizes[i] for i in pass_on]
        )
        out = [-800] * len(keys)
        for i, rc in zip(pass_on, rcs, strict=True):
            out[i] = rc
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.engine
@pytest.mark.parametrize("times", [1, 2], ids=["fails-once", "fails-twice"])
def test_mooncake_put_sends_a_failed_transfer_once_more(
    mc_tier: Any, mc_pool: Pool, monkeypatch: pytest.MonkeyPatch, times: int
) -> None:
    """An object whose transfer failed is sent again once: a transient failure stores every object; one that fails
    again (the control) fails the put naming it, and nothing of it is stored."""
    sizes = [4096, 5000, 6000, 7000]
    data = payloads(sizes, seed=11)
    keys = fresh_keys(len(sizes))
    views = [memoryview(t) for t in data]
    store = _TransferFailsFirst(mc_tier._store, {keys[1], keys[3]}, times)
    monkeypatch.setattr(mc_tier, "_store", store)
    if times == 1:
        mc_tier.put(keys, views, [crc(v) for v in views])
        assert store.sent == [keys, [keys[1], keys[3]]], "the failed objects, and only they, sent once more"
        codes, sums = mc_tier.get_into(keys, mc_pool.slices(sizes), 5.0)
        assert codes == sizes and sums == [crc(v) for v in views]
    else:
        with pytest.raises(OSError, match=r"mooncake put failed for 2 of 4 objects .*TRANSFER_FAIL"):
            mc_tier.put(keys, views, [crc(v) for v in views])
        assert len(store.sent) == 2, "sent again once, not more"
        assert mc_tier.contains(keys, 2.0) == [True, False, True, False]


@pytest.mark.engine
@pytest.mark.timeout(30)
def test_mooncake_constructor_fails_fast_without_master() -> None:
    pytest.importorskip("mooncake.store")
    from bsr_cli.tiers.mooncake import MooncakeTier

    rpc, http = services.free_ports(2)
    start = time.monotonic()
    with pytest.raises(TierUnavailable, match="master unavailable"):
        MooncakeTier(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata", deadline_s=5)
    assert time.monotonic() - start < 3  # not the ~90 s setup() stall


@pytest.mark.engine
@pytest.mark.timeout(90)
def test_mooncake_master_killed_is_unavailable_within_bounded_time(private_stack: Any) -> None:
    from bsr_cli.tiers.mooncake import MooncakeTier

    master = private_stack.master
    tier = MooncakeTier(master.rpc_address, master.metadata_url, deadline_s=10)
    try:
        pool = Pool(4 * MiB)
        tier.register(pool.ptr, len(pool.view))
        keys = fresh_keys(2)
        view = memoryview(payloads([MiB], seed=6)[0])
        tier.put(keys, [view, view], [crc(view)] * 2)
        assert tier.get_into(keys, pool.slices([MiB, MiB]), 2.0)[0] == [MiB, MiB]

        os.kill(master.pid, signal.SIGKILL)
        services.stop(master, timeout=2)  # reap it

        # Without bsr's own deadline a call on a dead master blocks ~4.3 s (or longer); with it, a call ends by its
        # deadline. The bound leaves 2 s of slack for a loaded 2-core machine and still sits below that stall.
        timeout = 1.0
        bound = timeout + 2.0
        for _ in range(3):  # the first call may hit the dead connection, later ones the fast-fail probe
            start = time.monotonic()
            codes, sums = tier.get_into(keys, pool.slices([MiB, MiB]), timeout)
            assert time.monotonic() - start < bound
            assert codes == [UNAVAILABLE, UNAVAILABLE] and sums == [None, None]

            start = time.monotonic()
            with pytest.raises(TierUnavailable):
                tier.contains(keys, timeout)
            assert time.monotonic() - start < bound

            start = time.monotonic()
            with pytest.raises(TierUnavailable):
                tier.put(fresh_keys(1), [view], [crc(view)])
            assert time.monotonic() - start < tier.call_timeout_s + 1.0
        health = tier.health()
        assert not health.ok and "health probe" in health.detail
    finally:
        tier.close()


@pytest.mark.engine
@pytest.mark.timeout(90)
def test_mooncake_hung_master_deadline_honoured_then_recovers(private_stack: Any) -> None:
    """A frozen master (SIGSTOP) accepts TCP but answers nothing: every call must still end at its deadline."""
    from bsr_cli.tiers.mooncake import MooncakeTier

    master = private_stack.master
    tier = MooncakeTier(master.rpc_address, master.metadata_url, deadline_s=10)
    keys = fresh_keys(1)
    view = memoryview(payloads([MiB], seed=7)[0])
    pool = Pool(2 * MiB)
    tier.put(keys, [view], [crc(view)])
    os.kill(master.pid, signal.SIGSTOP)
    try:
        wait_for_state(master.pid, "T")  # SIGSTOP is asynchronous: be sure the master is frozen before calling
        # A frozen master answers nothing: without bsr's deadline the call would wait as long as the master stays
        # frozen (the test holds it 30 s and more). The bound is the 0.5 s deadline plus generous slack.
        start = time.monotonic()
        codes, _ = tier.get_into(keys, pool.slices([MiB]), 0.5)
        assert time.monotonic() - start < 0.5 + 2.5
        assert codes[0] in (TIMED_OUT, UNAVAILABLE)
        start = time.monotonic()
        with pytest.raises(TierUnavailable):
            tier.contains(keys, 0.5)
        assert time.monotonic() - start < 0.5 + 2.5
        assert not tier.health().ok
    finally:
        os.kill(master.pid, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 30
        while True:  # the abandoned calls finish and the fast-fail probe clears once the master answers
            codes, sums = tier.get_into(keys, pool.slices([MiB]), 2.0)
            if codes == [MiB] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert codes == [MiB] and sums == [crc(view)]
        assert tier.health().ok
    finally:
        tier.close()


# The child of the test below: an object read back whole by the tier's own check (the repair's read), abandoned at
# its deadline while the segment holder is frozen; its bytes land once the holder runs again. Buffers of the read's
# size taken right after the abandon hold a pattern: a read whose buffer was given back at its deadline writes its
# late bytes into one of them (the allocator hands the freed memory out again), or into freed memory (the process
# then dies of it at a later allocation). argv: master RPC address, metadata URL, holder pid. Prints one JSON line.
_LATE_READ_CHILD = """
import ctypes, json, os, signal, sys, time, uuid
from bsr_cli.runtime.checksum import object_checksum
from bsr_cli.runtime.tiers import TierUnavailable
from bsr_cli.tiers.mooncake import TRAILER_BYTES, MooncakeTier

master, metadata, holder = sys.argv[1], sys.argv[2], int(sys.argv[3])
size = (64 << 10) + TRAILER_BYTES  # the whole object; below glibc's mmap threshold, so a heap chunk
tier = MooncakeTier(master, metadata, deadline_s=10, call_timeout_s=1.0)
key = f"test-model@1@0@{uuid.uuid4().hex[:12]}0001@bfloat16"
payload = bytearray(os.urandom(size - TRAILER_BYTES))
tier.put([key], [memoryview(payload)], [object_checksum(key, payload)])
pattern = []
os.kill(holder, signal.SIGSTOP)
try:
    tier.check_stored(key)
    abandoned = ""
except TierUnavailable as e:
    abandoned = str(e)
    pattern = [ctypes.create_string_buffer(b"\\xa5" * size, size) for _ in range(8)]
finally:
    os.kill(holder, signal.SIGCONT)
in_flight = tier.inflight()
end = time.monotonic() + 30
while tier.inflight() and time.monotonic() < end:
    time.sleep(0.05)
written = sum(b.raw != b"\\xa5" * size for b in pattern)
churn = [bytearray(size) for _ in range(256)]  # the heap is used again after the late bytes landed
del churn
again = tier.check_stored(key)
print(json.dumps({"abandoned": abandoned, "in_flight": in_flight, "left": tier.inflight(), "written": written,
                  "damage": again.damage}))
tier.close()
"""


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_mooncake_repair_read_abandoned_at_its_deadline_keeps_its_buffer_until_it_returns(
    private_stack: Any,
) -> None:
    """The repair reads an object back whole into a buffer of its own. Abandoned at its deadline (the holder does
    not answer: a frozen process here, a cut link in a partition), the read goes on inside Mooncake and its bytes
    land when the holder answers again: the buffer must still be the read's then. The process survives that, and
    the object still reads back sound. In a child process, since the failure is the process dying."""
    master, holder = private_stack.master, private_stack.holder
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LATE_READ_CHILD, master.rpc_address, master.metadata_url, str(holder.pid)],
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        os.kill(holder.pid, signal.SIGCONT)  # whatever happened to the child, the holder runs again
    died = f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exit {done.returncode}"
    assert done.returncode == 0, f"the process died ({died}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "did not finish within 1 s" in out["abandoned"], out  # the read was abandoned at its deadline ...
    assert out["in_flight"] == 1 and out["left"] == 0, out  # ... still ran in the tier, and then returned
    assert out["written"] == 0, out  # its late bytes landed in its own buffer, in none given out since
    assert out["damage"] is None, out


# ----------------------------------------------------------------------------------------------- filesystem


@pytest.fixture
def fs_tier(tmp_path: Path) -> Iterator[FilesystemTier]:
    tier = FilesystemTier(tmp_path / "ssd")
    try:
        yield tier
    finally:
        tier.close()


def test_fs_round_trip_bit_exact(fs_tier: FilesystemTier) -> None:
    sizes = [1 * MiB, 3 * MiB + 7, 1, 0, 9 * MiB]
    data = payloads(sizes, seed=11)
    keys = fresh_keys(len(sizes))
    views: list[Any] = [memoryview(t) for t in data]
    views[2] = bytes(views[2])
    fs_tier.put(keys, views, [crc(v) for v in views])
    assert fs_tier.contains(keys + fresh_keys(1), 1.0) == [True] * len(keys) + [False]
    assert sorted(fs_tier.keys()) == sorted(keys)  # file names map back to keys through the header
    pool = Pool(16 * MiB)
    pool.clear()
    dests = pool.slices(sizes)
    codes, sums = fs_tier.get_into(keys, dests, 5.0)
    assert codes == sizes
    assert sums == [crc(v) for v in views]
    for dest, buf in zip(dests, data, strict=True):
        assert torch.equal(in_pool(pool, dest), as_tensor(buf))
    assert not list(fs_tier.root.glob("??/.*.tmp"))  # atomic writes leave no temporaries


def test_fs_missing_and_overwrite(fs_tier: FilesystemTier) -> None:
    keys = fresh_keys(2)
    pool = Pool(MiB)
    codes, sums = fs_tier.get_into(keys, pool.slices([100, 100]), 1.0)
    assert codes == [MISSING, MISSING] and sums == [None, None]
    fs_tier.put(keys[:1], [memoryview(b"a" * 100)], [1])
    fs_tier.put(keys[:1], [memoryview(b"b" * 100)], [2])  # replaced atomically
    codes, sums = fs_tier.get_into(keys, pool.slices([100, 100]), 1.0)
    assert codes == [100, MISSING] and sums == [2, None]
    assert fs_tier.remove(keys) == [True, False]
    assert fs_tier.contains(keys, 1.0) == [False, False]


def test_fs_concurrency_4_equals_concurrency_1(tmp_path: Path) -> None:
    sizes = [(i * 37_123) % (2 * MiB) + 1 for i in range(40)]
    data = payloads(sizes, seed=12)
    keys = fresh_keys(len(sizes))
    keys[5] = "absent-" + keys[5]
    with FilesystemTier(tmp_path / "ssd") as tier:
        tier.put(
            [k for i, k in enumerate(keys) if i != 5],
            [memoryview(t) for i, t in enumerate(data) if i != 5],
            [crc(memoryview(t)) for i, t in enumerate(data) if i != 5],
        )
        results = {}
        for conc in (1, 4):
            tier.load_concurrency = conc
            pool = Pool(64 * MiB)
            pool.clear()
            codes, sums = tier.get_into(keys, pool.slices(sizes), 10.0)
            results[conc] = (codes, sums, bytes(pool.view))
        assert results[1] == results[4]
        assert results[1][0][5] == MISSING
        assert all(c == s for i, (c, s) in enumerate(zip(results[1][0], sizes, strict=True)) if i != 5)


def test_fs_corrupt_files_are_detected(fs_tier: FilesystemTier) -> None:
    keys = fresh_keys(7)
    size = 64 * 1024
    view = memoryview(payloads([size], seed=13)[0])
    fs_tier.put(keys, [view] * len(keys), [crc(view)] * len(keys))
    keylen = len(keys[0].encode())

    def patch(key: str, offset: int, value: bytes) -> None:
        with open(fs_tier.path_for(key), "r+b") as f:
            f.seek(offset)
            f.write(value)

    patch(keys[0], 0, b"XXXX")  # magic
    patch(keys[1], 16, b"\x00\x00\x00\x00")  # header crc
    patch(keys[2], 8, b"\x01\x02\x03\x04")  # payload crc field (caught by the header crc)
    patch(keys[3], HEADER_BYTES, b"#")  # stored key
    os.truncate(fs_tier.path_for(keys[4]), HEADER_BYTES + keylen + size - 1)  # short payload
    os.truncate(fs_tier.path_for(keys[5]), 10)  # torn header
    patch(keys[6], HEADER_BYTES + keylen + 100, b"\xff\x00")  # payload bit rot: only the checksum can tell

    for conc in (1, 4):
        fs_tier.load_concurrency = conc
        pool = Pool(len(keys) * size + MiB)
        codes, sums = fs_tier.get_into(keys, pool.slices([size] * len(keys)), 5.0)
        assert codes[:6] == [IO_ERROR] * 6
        assert sums[:6] == [None] * 6
        assert codes[6] == size and sums[6] == crc(view)
        assert crc(pool.slices([size] * len(keys))[6].view) != sums[6]
    # A slice of the wrong size is an error too, never a partial read.
    codes, _ = fs_tier.get_into(keys[6:], Pool(MiB).slices([size - 1]), 1.0)
    assert codes == [IO_ERROR]


@pytest.mark.parametrize("version", [1, 2])  # 1: zlib CRC32; 2: a CRC32C of the payload alone
def test_fs_object_from_an_earlier_format_fails_closed_and_is_evicted(fs_tier: FilesystemTier, version: int) -> None:
    keys = fresh_keys(2)
    size = 4096
    view = memoryview(payloads([size], seed=15)[0])
    fs_tier.put(keys, [view] * 2, [crc(view)] * 2)
    with open(fs_tier.path_for(keys[0]), "r+b") as f:
        f.seek(4)
        f.write(version.to_bytes(2, "little"))  # an earlier format: unreadable now
    pool = Pool(MiB)  # held: the tier writes into its memory
    codes, sums = fs_tier.get_into(keys, pool.slices([size, size]), 5.0)
    assert codes == [IO_ERROR, size] and sums == [None, crc(view)]
    # Evicted: the next probe misses it, so the next pass recomputes and rewrites it in the current format.
    assert fs_tier.contains(keys, 1.0) == [False, True]
    fs_tier.put(keys[:1], [view], [crc(view)])
    codes, _ = fs_tier.get_into(keys[:1], pool.slices([size]), 5.0)
    assert codes == [size]


@pytest.mark.timeout(30)
def test_fs_deadline_honoured(tmp_path: Path) -> None:
    n, size = 48, 2 * MiB
    data = payloads([size], seed=14)[0]
    keys = fresh_keys(n)
    with FilesystemTier(tmp_path / "ssd", read_chunk_bytes=64 * 1024) as tier:
        tier.put(keys, [memoryview(data)] * n, [crc(memoryview(data))] * n)
        pool = Pool(n * size)
        for conc in (1, 4):
            tier.load_concurrency = conc
            codes, sums = tier.get_into(keys, pool.slices([size] * n, align=1), 0.0)
            assert codes == [TIMED_OUT] * n and sums == [None] * n

            start = time.monotonic()
            codes, _ = tier.get_into(keys, pool.slices([size] * n, align=1), 0.005)
            # The deadline is proven by the objects left TIMED_OUT below; the clock only guards against a hang.
            assert time.monotonic() - start < 5.0
            assert set(codes) <= {size, TIMED_OUT}
            assert TIMED_OUT in codes  # 96 MiB in 5 ms is more than this machine can read
            for i, code in enumerate(codes):
                if code == size:
                    assert bytes(pool.view[i * size : (i + 1) * size]) == bytes(memoryview(data))


def test_fs_directory_gone_is_unavailable(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    with FilesystemTier(root) as tier:
        keys = fresh_keys(1)
        tier.put(keys, [memoryview(b"z" * 10)], [crc(b"z" * 10)])
        assert tier.health().ok
        for child in root.iterdir():
            for f in child.iterdir():
                f.unlink()
            child.rmdir()
        root.rmdir()
        assert not tier.health().ok
        codes, sums = tier.get_into(keys, Pool(4096).slices([10]), 1.0)
        assert codes == [UNAVAILABLE] and sums == [None]
        with pytest.raises(TierUnavailable):
            tier.contains(keys, 1.0)
        with pytest.raises(TierUnavailable):
            tier.put(keys, [memoryview(b"z" * 10)], [0])
    with pytest.raises(TierUnavailable):
        FilesystemTier(root, create=False)


# ----------------------------------------------------------------------------------------------- fs health and repair


def test_fs_full_tier_is_unhealthy_with_its_reason_until_a_put_succeeds(small_tmpfs: Any) -> None:
    from bsr_cli.core.evidence import TierCondition

    view = memoryview(payloads([8192], seed=21)[0])
    with FilesystemTier(small_tmpfs.path / "ssd") as tier:
        assert tier.health().ok
        small_tmpfs.fill()
        h = tier.health()
        assert not h.ok and h.condition is TierCondition.FULL, h
        assert "No space left on device (ENOSPC)" in h.detail and "free of" in h.detail
        with pytest.raises(OSError) as exc:
            tier.put(fresh_keys(1), [view], [crc(view)])
        assert exc.value.errno == errno.ENOSPC and "ENOSPC" in str(exc.value)
        assert not list(tier.root.glob("??/.*.tmp"))  # the failed write left no temporary behind
        small_tmpfs.unfill()
        # Room for the probe again, but the last put failed: still full for objects until one is written.
        assert tier.health().condition is TierCondition.FULL
        tier.put(fresh_keys(1), [view], [crc(view)])
        assert tier.health().ok and tier.health().condition is TierCondition.OK


def test_fs_read_only_tier_is_unhealthy_and_still_serves_reads(small_tmpfs: Any) -> None:
    from bsr_cli.core.evidence import TierCondition

    view = memoryview(payloads([8192], seed=22)[0])
    keys = fresh_keys(1)
    with FilesystemTier(small_tmpfs.path / "ssd") as tier:
        tier.put(keys, [view], [crc(view)])
        small_tmpfs.remount("ro")
        try:
            h = tier.health()
            assert not h.ok and h.condition is TierCondition.READ_ONLY and "(EROFS)" in h.detail, h
            with pytest.raises(OSError) as exc:
                tier.put(fresh_keys(1), [view], [crc(view)])
            assert exc.value.errno == errno.EROFS
            pool = Pool(MiB)
            codes, sums = tier.get_into(keys, pool.slices([8192]), 5.0)
            assert codes == [8192] and sums == [crc(view)]
        finally:
            small_tmpfs.remount("rw")


def test_fs_damaged_objects_are_quarantined_intact_ones_stay(fs_tier: FilesystemTier) -> None:
    keys = fresh_keys(4)
    size = 64 * 1024
    view = memoryview(payloads([size], seed=23)[0])
    fs_tier.put(keys, [view] * 4, [obj_crc(k, view) for k in keys])
    keylen = len(keys[0].encode())
    with open(fs_tier.path_for(keys[0]), "r+b") as f:  # payload bit rot, on disk
        f.seek(HEADER_BYTES + keylen + 1000)
        f.write(b"\x5a")
    with open(fs_tier.path_for(keys[1]), "r+b") as f:  # a damaged header
        f.seek(16)
        f.write(b"\x00\x00\x00\x00")
    damaged = {p.name: p.read_bytes() for p in (fs_tier.path_for(keys[0]), fs_tier.path_for(keys[1]))}
    moved = quarantine_damaged(fs_tier, {k: f"chunk {i} group g" for i, k in enumerate(keys[:3])})
    assert [q.key for q in moved] == keys[:2]  # keys[2] reads back intact (a transfer fault): it stays
    assert moved[0].reason == "checksum mismatch (its bytes, or the chunk they belong to): chunk 0 group g"
    assert moved[1].reason.startswith("header checksum mismatch")
    assert fs_tier.contains(keys, 1.0) == [False, False, True, True]
    qdir = fs_tier.root / "quarantine"
    for q in moved:  # kept, byte for byte, under the tier's quarantine directory, never served again
        assert Path(q.file).parent == qdir and Path(q.file).read_bytes() in damaged.values()
    assert sorted(fs_tier.keys()) == sorted(keys[2:])
    listed, total = fs_tier.quarantined(1)
    assert total == 2 and len(listed) == 1 and listed[0].key in keys[:2]
    # The next store rewrites the chunk from a good source; the next read of it succeeds.
    fs_tier.put(keys[:1], [view], [obj_crc(keys[0], view)])
    pool = Pool(MiB)
    codes, sums = fs_tier.get_into(keys[:1], pool.slices([size]), 5.0)
    assert codes == [size] and sums == [obj_crc(keys[0], view)] == [obj_crc(keys[0], pool.slices([size])[0].view)]
    assert fs_tier.quarantined(10)[1] == 2  # the quarantined copies stay for the incident bundle


def _rot(tier: FilesystemTier, key: str, at: int) -> None:
    """One flipped byte ``at`` bytes into the object's file, on disk."""
    with open(tier.path_for(key), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_fs_scrub_of_every_object_finds_all_the_damage_in_shards(fs_tier: FilesystemTier) -> None:
    """Two ranks sharing the directory split it by fan-out directory: together they read every object once, and
    set apart every damaged one, a file whose header no longer names its key included."""
    keys = fresh_keys(40)
    view = memoryview(payloads([4096], seed=5)[0])
    fs_tier.put(keys, [view] * len(keys), [obj_crc(k, view) for k in keys])
    keylen = len(keys[0].encode())
    for k in keys[3:40:9]:
        _rot(fs_tier, k, HEADER_BYTES + keylen + 100)  # payload
    _rot(fs_tier, keys[1], 20)  # the header's length field: the header checksum fails, its key is unreadable
    bad = set(keys[3:40:9]) | {keys[1]}
    events: list[Any] = []
    scrubber = Scrubber(0, {"fs": fs_tier}, events.append)
    results = [scrubber.scrub_all("fs", shards=2, limits=ScrubLimits(), scrub=f"s{r}") for r in (0, 1)]
    # rank 1's share, read by the same scrubber with rank 1's shard index
    one = Scrubber(1, {"fs": fs_tier}, events.append).scrub_all("fs", shards=2, limits=ScrubLimits())
    assert [r.progress.state for r in (results[0], one)] == [ScrubState.COMPLETE] * 2
    assert results[0].progress.checked + one.progress.checked == len(keys)
    moved = results[0].quarantined + one.quarantined
    assert len(moved) == len(bad) and fs_tier.contains(keys, 1.0) == [k not in bad for k in keys]
    assert {q.key for q in moved} - bad == {q.key for q in moved if q.key.startswith("(unreadable header)")}
    assert results[1].progress.damaged == 0  # rank 0's share again: every damaged object is set apart already
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("ScrubStarted") == kinds.count("ScrubFinished") == 3
    assert kinds.count("ObjectQuarantined") == len(bad)


def test_fs_scrub_stops_at_its_limits_and_skips_beyond_its_concurrency(fs_tier: FilesystemTier) -> None:
    keys = fresh_keys(10)
    view = memoryview(payloads([4096], seed=6)[0])
    fs_tier.put(keys, [view] * len(keys), [obj_crc(k, view) for k in keys])
    targets = [ScrubTarget(k, i, "g") for i, k in enumerate(keys)]
    scrubber = Scrubber(0, {"fs": fs_tier}, lambda ev: None, max_concurrent=1)
    cut = scrubber.scrub_prompt("fs", targets, prompt="p", limits=ScrubLimits(max_objects=4))
    assert cut is not None and cut.progress.state is ScrubState.CUT and cut.progress.checked == 4
    assert "limit of 4 objects" in cut.progress.reason
    by_bytes = scrubber.scrub_prompt("fs", targets, prompt="p", limits=ScrubLimits(max_bytes=3 * 4096))
    assert by_bytes is not None and by_bytes.progress.state is ScrubState.CUT and by_bytes.progress.checked == 3
    # A scrub runs while another is admitted: the rank's limit of one makes the second skip, and say why.
    gate, release = threading.Event(), threading.Event()
    real = fs_tier.check_stored

    def slow(key: str) -> Any:
        gate.set()
        release.wait(10)
        return real(key)

    fs_tier.check_stored = slow  # type: ignore[method-assign]
    try:
        scrubber.scrub_prompt("fs", targets[:1], prompt="p", limits=ScrubLimits(), background=True)
        assert gate.wait(10)
        skipped = scrubber.scrub_prompt("fs", targets, prompt="q", limits=ScrubLimits())
        assert skipped is not None and skipped.progress.state is ScrubState.SKIPPED
        assert "already runs 1 scrub(s)" in skipped.progress.reason
        assert [p.state for p in scrubber.progress("fs")][:1] == [ScrubState.RUNNING]
    finally:
        release.set()
        fs_tier.check_stored = real  # type: ignore[method-assign]


def test_fs_a_damaged_object_rewritten_before_it_is_moved_stays(fs_tier: FilesystemTier) -> None:
    """The check and the move are not one step: a store that rewrote the object in between wins (the good copy is
    never set apart)."""
    (key,) = fresh_keys(1)
    view = memoryview(payloads([4096], seed=7)[0])
    fs_tier.put([key], [view], [obj_crc(key, view)])
    _rot(fs_tier, key, HEADER_BYTES + len(key.encode()) + 7)
    found = fs_tier.check_stored(key)
    assert found.damage == "checksum mismatch (its bytes, or the chunk they belong to)"
    fs_tier.put([key], [view], [obj_crc(key, view)])  # the next store's good copy
    assert fs_tier.set_aside(found, "test") is None
    assert fs_tier.check_stored(key).damage is None and fs_tier.quarantined(5)[1] == 0


def test_fs_scrub_evicts_an_older_formats_file_as_a_read_would(fs_tier: FilesystemTier) -> None:
    """An older bsr's file (format 2: a checksum of the bytes alone) is not trusted: the scrub counts it damaged and
    evicts it, as a read does (bsr wrote it, nothing is lost), instead of keeping it in quarantine."""
    keys = fresh_keys(2)
    view = memoryview(payloads([4096], seed=41)[0])
    fs_tier.put(keys, [view] * 2, [obj_crc(k, view) for k in keys])
    with open(fs_tier.path_for(keys[0]), "r+b") as f:
        f.seek(4)  # the header's version
        f.write((2).to_bytes(2, "little"))
    done = Scrubber(0, {"fs": fs_tier}, lambda ev: None).scrub_prompt(
        "fs", [ScrubTarget(k, i, "g") for i, k in enumerate(keys)], prompt="p", limits=ScrubLimits()
    )
    assert done is not None and (done.progress.damaged, done.progress.quarantined) == (1, 1)
    (q,) = done.quarantined
    assert q.key == keys[0] and q.file == "" and q.reason.startswith("written by an older bsr (format v2")
    assert fs_tier.contains(keys, 1.0) == [False, True] and fs_tier.quarantined(5)[1] == 0


def test_fs_another_chunks_object_under_this_key_is_quarantined(fs_tier: FilesystemTier) -> None:
    """A file whose header names this key but whose payload and checksum are another chunk's (a writer that put
    the wrong chunk under this key): the header is sound, the object checksum is bound to the other key."""
    keys = fresh_keys(2)
    size = 8192
    mine, theirs = (memoryview(p) for p in payloads([size, size], seed=29))
    fs_tier.put(keys[:1], [theirs], [obj_crc(keys[1], theirs)])
    pool = Pool(MiB)
    codes, sums = fs_tier.get_into(keys[:1], pool.slices([size]), 5.0)
    assert codes == [size] and sums[0] != obj_crc(keys[0], pool.slices([size])[0].view)  # the runtime's check fails
    (q,) = quarantine_damaged(fs_tier, {keys[0]: "chunk 0 group g"})
    assert q.reason.startswith("checksum mismatch") and fs_tier.contains(keys[:1], 1.0) == [False]
    fs_tier.put(keys[:1], [mine], [obj_crc(keys[0], mine)])
    assert quarantine_damaged(fs_tier, {keys[0]: "chunk 0 group g"}) == []  # rewritten: sound
