"""`MooncakeTier`: the external tier over a real Mooncake store (``MooncakeDistributedStore``, TCP on loopback).

Object layout: one Mooncake object per key holding ``payload || trailer``, where the 16-byte trailer is
``magic "BSM3" | object checksum (u32 LE) | payload length (u64 LE)``; the object checksum is CRC32C over the key,
the payload length and the payload (``core.integrity``), so an object put under another chunk's key fails as a
damaged one. Keeping the checksum inside the object (instead of a companion ``<key>#crc`` object) costs no extra
object, round trip or lease, and the payload and its checksum can never be out of step. A put gathers it: the
payload goes straight from the caller's buffer (zero copy), the trailer from a small per-worker side buffer. A get
lands the whole object in the staging slice when the pool left room for the trailer after it (``StagingSlice.tail``:
one transfer per object), else scatters the trailer into the side buffer (two transfers per object: on TCP the
16-byte one costs as much CPU as the payload's).

Failure behaviour of Mooncake 0.3.13 this module defends against (see docs/ecosystem notes):
  * ``setup()`` against a dead master blocks ~90 s, and calls on a store whose setup failed can segfault, so the
    constructor probes the master over HTTP/TCP first and never touches a store whose setup did not return 0;
  * with the master gone every call blocks ~4.3 s before returning -900, so each call runs on a worker thread
    (the binding releases the GIL) and is abandoned at the caller's deadline; after an RPC failure or timeout the
    tier probes the master before each call and fails fast while it is down;
  * the store's own ``health_check()`` keeps answering 0 with the master dead, so `health()` probes HTTP.

A damaged object is removed, not just refused: the tier is a ``RepairableTier``. After a failed restore (and in a
scrub, bsr_cli/runtime/scrub.py: the rest of that prompt, or `bsr scrub`) the rank reads objects back whole
(``check_stored``; ``check_all`` walks the master's key listing) and removes one whose trailer, length or checksum
is wrong (``set_aside``: Mooncake has no place to set it apart; the tier remembers what it removed for
``bsr status``), so the next store writes it afresh. Objects an older bsr wrote ("BSM2": a checksum of the payload
alone; "BSM1": zlib CRC32) are read as IO_ERROR and removed the same way (docs/mixed-deployments.md).

Caveat: an abandoned call keeps running in its worker until Mooncake returns. A timed-out ``get_into`` can still
write its staging slices later (seen when a cut link comes back mid-transfer), so `pending_writes()` hands the
restore those calls and it keeps their pool slots out of use until each returns; `inflight()` counts every
abandoned call still running.

Over 500 lines on purpose: one class, and every call in it goes through the same deadline and master-probe guard.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from bsr_cli.api.ranks import QuarantinedObject
from bsr_cli.core.keys import parse_key
from bsr_cli.errors import InvalidInput, ServiceError
from bsr_cli.mooncake.health import all_keys, health_url_for, master_healthy, segments, tcp_reachable
from bsr_cli.runtime.checksum import object_checksum
from bsr_cli.runtime.stage_clock import report_call_cpu
from bsr_cli.runtime.tiers import (
    IO_ERROR,
    MISSING,
    TIMED_OUT,
    UNAVAILABLE,
    StagingSlice,
    StoredCheck,
    TierHealth,
    TierUnavailable,
)

__all__ = ["TRAILER_BYTES", "MooncakeTier", "mooncake_code_name"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRAILER = struct.Struct("<4sIQ")
_TRAILER_MAGIC = b"BSM3"
# Trailers of earlier builds: "BSM1" carried zlib CRC32, "BSM2" a CRC32C of the payload alone (not bound to the key).
_OLDER_MAGICS = (b"BSM1", b"BSM2")
TRAILER_BYTES = _TRAILER.size  # 16
_REMOVED_KEPT = 256  # removed objects the tier remembers for `bsr status` (the events keep them all)

# Mooncake ErrorCode values (mooncake-store/include/types.h); the Python binding returns them as plain ints.
_MC_CODES = {
    -200: "NO_AVAILABLE_HANDLE",  # no segment space (or no segment holder)
    -600: "INVALID_PARAMS",  # also "buffer too small" on gets
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",  # also "buffers larger than the object" on gets
    -900: "RPC_FAIL",  # master gone
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_TRANSFER_FAIL = -800
_MASTER_DOWN = frozenset({-900, -901, -1010, -1011})

# Trailer slots per worker; larger batches are issued as several store calls of this many keys.
_SLOTS_PER_WORKER = 1024
# Probe budget while failing fast: connection refused on loopback answers in microseconds.
_PROBE_TIMEOUT_S = 0.25


def _probe_budget(timeout_s: float) -> float:
    """The slice of a call's own deadline kept for a master probe (so call + probe never overrun it)."""
    return max(min(_PROBE_TIMEOUT_S, timeout_s / 4), 0.001)


_CLOSE_WAIT_S = 5.0

# Stores whose setup never returned (or failed) are kept referenced forever: destroying or closing them can crash.
_ABANDONED_STORES: list[Any] = []


def mooncake_code_name(code: int) -> str:
    return _MC_CODES.get(code, f"code {code}")


def object_damage(key: str, data: bytes) -> str | None:
    """Why a whole stored object (payload and trailer, as read back) is not a sound object of ``key``; None when
    it is."""
    if len(data) < TRAILER_BYTES:
        return f"{len(data)} bytes, shorter than its trailer"
    end = len(data) - TRAILER_BYTES
    magic, crc, length = _TRAILER.unpack_from(data, end)
    if magic in _OLDER_MAGICS:
        return f"written by an older bsr (trailer {magic.decode()}, its checksum covers the bytes alone)"
    if magic != _TRAILER_MAGIC:
        return f"no bsr trailer at its end ({len(data)} bytes: bytes appended or cut, or not written by bsr)"
    if length != end:
        return f"its trailer says {length} bytes of payload, the object holds {end}"
    if object_checksum(key, memoryview(data)[:end]) != crc:
        return "checksum mismatch (its bytes, or the chunk they belong to)"
    return None


def _map_get_code(rc: int) -> int:
    if rc == _OBJECT_NOT_FOUND:
        return MISSING
    if rc in _MASTER_DOWN:
        return UNAVAILABLE
    return IO_ERROR


class _CallTimedOut(Exception):
    pass


class _DaemonWorkers:
    """A minimal thread pool of *daemon* threads. concurrent.futures' workers are joined at interpreter exit, so
    one call stuck in Mooncake (90 s in setup against a dead master) would hold up process exit."""

    def __init__(self, workers: int, name: str, nice: int = 0) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._local = threading.local()
        self._nice = nice
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(max(workers, 1))
        ]
        for t in self._threads:
            t.start()

    def index(self) -> int:
        """The calling worker's index (0..workers-1); only meaningful inside a submitted function."""
        return int(self._local.index)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._q.put((fn, fut))
        return fut

    def _loop(self, index: int) -> None:
        self._local.index = index
        if self._nice and sys.platform.startswith("linux"):  # Linux: PRIO_PROCESS with a thread id sets that thread
            with contextlib.suppress(OSError, AttributeError):  # best effort: only the scheduling weight changes
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued: its deadline passed before it started
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put(None)


def _buffer_address(view: memoryview, keep: list[Any]) -> int:
    """Address of a C-contiguous byte view. Read-only views (e.g. over bytes) cannot be addressed through ctypes
    and are copied once; `keep` holds whatever must stay alive while the store reads from the address."""
    if len(view) == 0:
        return 0
    if view.readonly:
        copy = bytearray(view)
        keep.append(copy)
        view = memoryview(copy)
    cbuf = (ctypes.c_char * len(view)).from_buffer(view)
    keep.append(cbuf)
    return ctypes.addressof(cbuf)


def _as_bytes(view: memoryview) -> memoryview:
    mv = view if isinstance(view, memoryview) else memoryview(view)
    if not mv.c_contiguous:
        raise ValueError("payload must be a C-contiguous buffer")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class _RemovedObjects:
    """The damaged objects a tier removed: the newest ``_REMOVED_KEPT`` (for `bsr status`) and how many in all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: list[QuarantinedObject] = []  # oldest first
        self._total = 0

    def add(self, removed: Sequence[QuarantinedObject]) -> None:
        with self._lock:
            self._kept = (self._kept + list(removed))[-_REMOVED_KEPT:]
            self._total += len(removed)

    def newest(self, limit: int) -> tuple[list[QuarantinedObject], int]:
        with self._lock:
            return list(reversed(self._kept))[: max(limit, 0)], self._total


class MooncakeTier:
    """The `Tier` over a Mooncake store. Thread-safe; every store call is bounded by a deadline.

    `master_address` is the master's RPC ``host:port``; `metadata_url` its HTTP metadata endpoint
    (``http://host:port/metadata``, or ``P2PHANDSHAKE``); `deadline_s` bounds the constructor (probe + setup).
    `call_timeout_s` bounds calls that take no timeout of their own (`put`, `register`, `remove*`).
    `segment_bytes=0`: this client holds no data (a segment holder process does).
    `local_buffer_bytes=0`: every data path here is zero-copy (``*_from`` / ``*_into``); Mooncake's local bounce
    buffer is only used by ``put()``/``get()`` of Python bytes, which this tier never calls."""

    name = "mooncake"

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        *,
        deadline_s: float = 10.0,
        health_url: str | None = None,
        admin_url: str | None = None,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        segment_bytes: int = 0,
        local_buffer_bytes: int = 0,
        call_timeout_s: float = 10.0,
        workers: int = 4,
        poll_nice: int = 10,
    ) -> None:
        self.master_address = master_address
        self.metadata_url = metadata_url
        self.health_url = health_url or (health_url_for(metadata_url) if metadata_url.startswith("http") else None)
        # The master's admin API (it lists the mounted segments): health then also requires a segment holder,
        # since with none every get fails though the master answers.
        self.admin_url = admin_url
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._inflight = 0
        self._abandoned: set[Future[Any]] = set()  # data calls given up at a deadline, still running
        self._suspect = False  # set after an RPC failure/timeout: probe the master before each call
        self._closed = False
        self._registered: dict[int, int] = {}
        self._removed = _RemovedObjects()
        # One registered trailer region per worker: a worker runs one call at a time (an abandoned call keeps its
        # worker, hence its region, until it returns), and registering later could fail with the master down.
        workers = max(workers, 1)
        self._arena = ctypes.create_string_buffer(workers * _SLOTS_PER_WORKER * TRAILER_BYTES)
        self._arena_base = ctypes.addressof(self._arena)
        self._arena_view = memoryview(self._arena).cast("B")

        deadline = time.monotonic() + deadline_s
        store_class = self._store_class(deadline_s)
        if local_hostname.startswith("127.") or local_hostname == "localhost":
            # Advertise this client's transfer endpoint on loopback too (Mooncake otherwise picks the first NIC).
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        # This Mooncake build waits for a transfer by polling its status in a loop (no event-driven completion):
        # the calling thread burns a core until the bytes land. Data calls (put, get_into) run on lower-priority
        # threads so that the poll yields the CPU to the transfer itself (socket copies, the segment holder) and
        # to the restore's install and checksum where cores are few; a poll that runs less often only notices
        # completion later. Every other call, setup first (Mooncake's own threads start there and inherit the
        # creating thread's priority), runs on control threads at normal priority.
        self._control = _DaemonWorkers(2, "bsr-mooncake-ctl")
        self._workers = _DaemonWorkers(workers, "bsr-mooncake", nice=poll_nice)
        store = store_class()
        self._set_up(
            store,
            lambda: store.setup(
                local_hostname,
                metadata_url,
                segment_bytes,
                local_buffer_bytes,
                protocol,
                device_name,
                master_address,
            ),
            deadline,
            deadline_s,
        )
        self._store = store
        self._register_trailers(deadline)

    def _store_class(self, deadline_s: float) -> Any:
        """Mooncake's store class, once the master answers; raises TierUnavailable when it does not, or when the
        client library cannot be loaded."""
        # setup() against a dead master blocks ~90 s and leaves a store that segfaults on use: probe first.
        down = self._master_down_reason(min(2.0, max(deadline_s, 0.1)))
        if down:
            raise TierUnavailable(f"mooncake master unavailable, not connecting: {down}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            hint = " (apt-get install -y libibverbs1)" if "libibverbs" in str(exc) else ""
            raise TierUnavailable(f"cannot load the Mooncake client: {exc}{hint}") from exc
        return MooncakeDistributedStore

    def _set_up(self, store: Any, setup: Callable[[], int], deadline: float, deadline_s: float) -> None:
        """Run the store's setup within the constructor's deadline. A store whose setup timed out or failed is
        never touched again (kept referenced forever) and the workers are stopped."""
        try:
            rc = self._run("setup", setup, deadline - time.monotonic(), check_closed=False)
        except _CallTimedOut:
            _ABANDONED_STORES.append(store)
            self._shutdown_workers()
            raise TierUnavailable(
                f"mooncake setup against {self.master_address} did not finish within {deadline_s:g} s"
            ) from None
        if rc != 0:
            _ABANDONED_STORES.append(store)
            self._shutdown_workers()
            raise TierUnavailable(f"mooncake setup against {self.master_address} failed with code {rc}")

    def _register_trailers(self, deadline: float) -> None:
        """Register the trailer arena with the set-up store; closes the tier and raises TierUnavailable when it
        cannot."""
        try:
            rc = self._run(
                "register_buffer",
                lambda: self._store.register_buffer(self._arena_base, len(self._arena)),
                max(deadline - time.monotonic(), 0.5),
            )
        except _CallTimedOut:
            rc = -901
        if rc != 0:
            self.close()
            raise TierUnavailable(f"mooncake register_buffer for trailers failed: {mooncake_code_name(rc)}")

    # ------------------------------------------------------------------------------------------- plumbing

    def _master_down_reason(self, timeout: float) -> str | None:
        """Why the master is not usable right now, or None; takes at most `timeout` in all. HTTP health catches a
        hung master (its TCP backlog would still accept connections); the TCP connect checks the RPC port."""
        end = time.monotonic() + timeout
        if self.health_url and not master_healthy(self.health_url, timeout=timeout):
            return f"health probe {self.health_url} failed"
        if not tcp_reachable(self.master_address, timeout=max(end - time.monotonic(), 0.001)):
            return f"RPC port {self.master_address} refuses connections"
        return None

    def _run(
        self, what: str, fn: Callable[[], T], timeout_s: float, *, check_closed: bool = True, data: bool = False
    ) -> T:
        """Run a blocking store call on a worker (a data worker for puts and gets, else the control worker); raise
        _CallTimedOut at the deadline (the call is abandoned)."""
        if check_closed and self._closed:
            raise TierUnavailable("mooncake tier is closed")

        def tracked() -> T:
            with self._lock:
                self._inflight += 1
            try:
                return fn()
            finally:
                with self._lock:
                    self._inflight -= 1

        fut = (self._workers if data else self._control).submit(tracked)
        try:
            return fut.result(timeout=max(timeout_s, 0.0))
        except FutureTimeout:
            if not fut.cancel() and data:  # cancel works only while still queued
                # Abandoned while it runs: it may still write the caller's buffers (pending_writes()).
                with self._lock:
                    self._abandoned.add(fut)
                fut.add_done_callback(self._forget_abandoned)
            self._suspect = True
            raise _CallTimedOut(what) from None

    def _forget_abandoned(self, fut: Future[Any]) -> None:
        with self._lock:
            self._abandoned.discard(fut)

    def _fast_fail(self, budget_s: float = _PROBE_TIMEOUT_S) -> str | None:
        """After a failure, refuse quickly while the master is down instead of blocking ~4.3 s per call."""
        if not self._suspect:
            return None
        reason = self._master_down_reason(budget_s)
        if reason is None:
            self._suspect = False
        return reason

    def _trailer_region(self) -> tuple[int, memoryview]:
        """The calling worker's trailer region: (address, view) of `_SLOTS_PER_WORKER` trailers."""
        size = _SLOTS_PER_WORKER * TRAILER_BYTES
        off = self._workers.index() * size
        return self._arena_base + off, self._arena_view[off : off + size]

    def _shutdown_workers(self) -> None:
        self._workers.shutdown()
        self._control.shutdown()

    # ------------------------------------------------------------------------------------------- Tier

    def health(self) -> TierHealth:
        if self._closed:
            return TierHealth(False, "closed")
        reason = self._master_down_reason(1.0)
        if reason:
            return TierHealth(False, reason)
        detail = f"master {self.master_address} healthy"
        if self.admin_url:
            try:
                mounted = [s for s in segments(self.admin_url, timeout=1.0) if s.mounted]
            except ServiceError as e:
                return TierHealth(False, f"cannot list segments: {e.message}")
            if not mounted:
                return TierHealth(False, "the master lists no mounted segment: no segment holder, so no object")
            detail += f", {len(mounted)} segment(s) mounted"
        stuck = self.inflight()
        return TierHealth(True, detail + (f"; {stuck} store call(s) in flight" if stuck else ""))

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        """``batch_is_exist``: 1 is a hit; 0, -1 and any other negative are not. All keys failing means the tier
        is unavailable. (Mooncake grants each probed key its default 10 s lease, which delays eviction.)"""
        if not keys:
            return []
        deadline = time.monotonic() + timeout_s
        down = self._fast_fail(_probe_budget(timeout_s))
        if down:
            raise TierUnavailable(f"mooncake master unavailable: {down}")
        try:
            rcs = self._run("contains", lambda: self._store.batch_is_exist(list(keys)), deadline - time.monotonic())
        except _CallTimedOut:
            raise TierUnavailable(f"mooncake batch_is_exist did not answer within {timeout_s:g} s") from None
        if len(rcs) != len(keys):
            raise TierUnavailable(f"mooncake batch_is_exist answered {len(rcs)} results for {len(keys)} keys")
        if all(rc < 0 for rc in rcs):
            self._suspect = True
            raise TierUnavailable(f"mooncake batch_is_exist failed for all keys: {mooncake_code_name(rcs[0])}")
        return [rc == 1 for rc in rcs]

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        """Store each payload with its trailer holding its object checksum (``runtime.checksum.object_checksum``),
        ``batch_put_from_multi_buffers`` per 1024 keys, zero-copy from writable payloads (read-only ones are copied
        once). A key that already exists counts as stored (objects are immutable). Raises TierUnavailable when the
        master is down or the call times out, OSError naming the failed keys otherwise."""
        n = len(keys)
        if len(payloads) != n or len(checksums) != n:
            raise ValueError(f"put: {n} keys, {len(payloads)} payloads, {len(checksums)} checksums")
        if n == 0:
            return
        down = self._fast_fail()
        if down:
            raise TierUnavailable(f"mooncake master unavailable: {down}")
        keep: list[Any] = []
        views = [_as_bytes(p) for p in payloads]
        addrs = [_buffer_address(v, keep) for v in views]
        crcs = [c & 0xFFFFFFFF for c in checksums]

        def call(idx: Sequence[int]) -> list[int]:
            # Runs on a worker: the trailers go into that worker's registered region, in chunks of its size.
            _ = keep  # the payload buffers must outlive an abandoned call
            base, region = self._trailer_region()
            rcs: list[int] = []
            for lo in range(0, len(idx), _SLOTS_PER_WORKER):
                part = idx[lo : lo + _SLOTS_PER_WORKER]
                ptrs: list[list[int]] = []
                sizes: list[list[int]] = []
                for j, i in enumerate(part):
                    size = len(views[i])
                    _TRAILER.pack_into(region, j * TRAILER_BYTES, _TRAILER_MAGIC, crcs[i], size)
                    t = base + j * TRAILER_BYTES
                    ptrs.append([addrs[i], t] if size else [t])
                    sizes.append([size, TRAILER_BYTES] if size else [TRAILER_BYTES])
                rcs += self._store.batch_put_from_multi_buffers([keys[i] for i in part], ptrs, sizes)
            return rcs

        try:
            rcs = self._run("put", lambda: call(range(n)), self.call_timeout_s, data=True)
            # A transfer that failed stored nothing (Mooncake revokes the object): those objects are sent once more.
            # Over TCP the first transfers to a holder fail now and then while its connections are set up (seen on
            # an idle host: 120 of 1,024 objects of the first put after the engine started).
            again = [i for i, rc in enumerate(rcs) if rc == _TRANSFER_FAIL]
            if again:
                for i, rc in zip(
                    again, self._run("put", lambda: call(again), self.call_timeout_s, data=True), strict=True
                ):
                    rcs[i] = rc
        except _CallTimedOut:
            raise TierUnavailable(
                f"mooncake put of {n} objects did not finish within {self.call_timeout_s:g} s"
            ) from None
        failed = [(k, rc) for k, rc in zip(keys, rcs, strict=True) if rc not in (0, _OBJECT_ALREADY_EXISTS)]
        if not failed:
            return
        if all(rc in _MASTER_DOWN for _, rc in failed):
            self._suspect = True
            raise TierUnavailable(f"mooncake put failed, master unavailable: {mooncake_code_name(failed[0][1])}")
        key, rc = failed[0]
        raise OSError(f"mooncake put failed for {len(failed)} of {n} objects (first {key!r}: {mooncake_code_name(rc)})")

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        """One batch call per 1024 keys: each object lands whole in its slice and the room the pool left after it
        (``batch_get_into``), or, in a slice without that room, its payload there and its trailer in the worker's
        side buffer (``batch_get_into_multi_buffers``); the trailer's length must equal the slice length, and its
        object checksum is returned unverified (the runtime verifies it against the key). At the deadline:
        UNAVAILABLE if the master does not answer a probe, else TIMED_OUT."""
        n = len(keys)
        if len(dests) != n:
            raise ValueError(f"get_into: {n} keys but {len(dests)} destinations")
        if n == 0:
            return [], []
        deadline = time.monotonic() + timeout_s
        reserve = _probe_budget(timeout_s)
        down = "closed" if self._closed else self._fast_fail(reserve)
        if down:
            log.debug("mooncake get_into refused: %s", down)
            return [UNAVAILABLE] * n, [None] * n
        sizes = [len(d.view) for d in dests]
        # With room for the trailer after every slice (the pool lays its slots out so), each object lands whole in
        # one buffer: one transfer per object instead of two (a 16-byte trailer is a transfer of its own, and on
        # TCP that costs as much CPU as a large one).
        whole = all(d.tail >= TRAILER_BYTES for d in dests)

        def call() -> tuple[list[int], bytes, float]:
            cpu0 = time.thread_time()  # this worker's CPU for the call (the completion poll): the fetch stage's
            if whole:
                rcs, trailers = self._get_whole(keys, dests, sizes)
                return rcs, trailers, time.thread_time() - cpu0
            base, _region = self._trailer_region()
            rcs = []
            trailers = b""
            for lo in range(0, n, _SLOTS_PER_WORKER):
                hi = min(lo + _SLOTS_PER_WORKER, n)
                ctypes.memset(base, 0, (hi - lo) * TRAILER_BYTES)  # a stale trailer must never pass as this one
                ptrs: list[list[int]] = []
                lens: list[list[int]] = []
                for j, i in enumerate(range(lo, hi)):
                    t = base + j * TRAILER_BYTES
                    ptrs.append([dests[i].ptr, t] if sizes[i] else [t])
                    lens.append([sizes[i], TRAILER_BYTES] if sizes[i] else [TRAILER_BYTES])
                rcs += self._store.batch_get_into_multi_buffers(list(keys[lo:hi]), ptrs, lens)
                trailers += ctypes.string_at(base, (hi - lo) * TRAILER_BYTES)  # copied before the region is reused
            return rcs, trailers, time.thread_time() - cpu0

        try:
            rcs, trailers, cpu = self._run("get_into", call, deadline - time.monotonic() - reserve, data=True)
            report_call_cpu(cpu)
        except _CallTimedOut:
            # Tell "slow" from "down" within the reserved slice of the deadline.
            code = UNAVAILABLE if self._master_down_reason(max(deadline - time.monotonic(), 0.001)) else TIMED_OUT
            return [code] * n, [None] * n
        if len(rcs) != n:
            log.warning("mooncake batch get answered %d results for %d keys", len(rcs), n)
            return [IO_ERROR] * n, [None] * n
        codes: list[int] = []
        sums: list[int | None] = []
        for i, rc in enumerate(rcs):
            if rc < 0:
                codes.append(_map_get_code(rc))
                sums.append(None)
                continue
            magic, crc, length = _TRAILER.unpack_from(trailers, i * TRAILER_BYTES)
            if rc != sizes[i] + TRAILER_BYTES or magic != _TRAILER_MAGIC or length != sizes[i]:
                codes.append(IO_ERROR)  # not a bsr object, or its size differs from the slice
                sums.append(None)
            else:
                codes.append(sizes[i])
                sums.append(crc)
        if UNAVAILABLE in codes:
            self._suspect = True
        return codes, sums

    def _get_whole(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], sizes: Sequence[int]
    ) -> tuple[list[int], bytes]:
        """``batch_get_into`` of each whole object (payload and trailer) into its slice and the room after it; the
        trailers are read back from there. Runs on a worker."""
        for d, size in zip(dests, sizes, strict=True):
            ctypes.memset(d.ptr + size, 0, TRAILER_BYTES)  # a stale trailer must never pass as this one
        rcs: list[int] = []
        for lo in range(0, len(keys), _SLOTS_PER_WORKER):
            hi = min(lo + _SLOTS_PER_WORKER, len(keys))
            rcs += self._store.batch_get_into(
                list(keys[lo:hi]), [d.ptr for d in dests[lo:hi]], [s + TRAILER_BYTES for s in sizes[lo:hi]]
            )
        trailers = b"".join(ctypes.string_at(d.ptr + size, TRAILER_BYTES) for d, size in zip(dests, sizes, strict=True))
        return rcs, trailers

    def close(self) -> None:
        """Close the store client. If an abandoned call is still inside Mooncake after a short wait, the store
        is left open (closing it under a running call can crash the process)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.inflight():
            log.warning("mooncake tier closed with %d store call(s) still running; store left open", self.inflight())
            _ABANDONED_STORES.append((self._store, self._arena))  # the running call may still use both
        else:
            self._store.close()
        self._shutdown_workers()

    # ------------------------------------------------------------------------------------------- repair

    def _read_whole(self, key: str) -> bytes | None:
        """The stored object as it is (payload and trailer, whatever its size); None when the store does not hold
        it. Raises TierUnavailable when the store cannot answer for it (then nothing can be said about it)."""
        size = self._call_checked("get_size", lambda: self._store.get_size(key))
        if size in _MASTER_DOWN:
            self._suspect = True
            raise TierUnavailable(f"mooncake get_size failed, master unavailable: {mooncake_code_name(size)}")
        if size < 0:
            return None
        try:
            step, rc, data = self._run(
                "get_into", lambda: self._read_into_own_buffer(key, size), self.call_timeout_s, data=True
            )
        except _CallTimedOut:
            raise TierUnavailable(f"mooncake read of {key!r} did not finish within {self.call_timeout_s:g} s") from None
        if step == "get_into" and rc == size:
            return data
        if step == "get_into" and rc == _OBJECT_NOT_FOUND:
            return None  # removed since its size was read
        if rc in _MASTER_DOWN:
            self._suspect = True
        raise TierUnavailable(f"mooncake {step} for a read of {key!r} ({size} bytes) failed: {mooncake_code_name(rc)}")

    def _read_into_own_buffer(self, key: str, size: int) -> tuple[str, int, bytes]:
        """Runs on a data worker: register a buffer of its own, read ``key`` into it, unregister it. The buffer
        belongs to this call, not to the caller: a read abandoned at its deadline (a cut link) goes on and its
        bytes land later, so the memory must live, and stay registered, until the call itself returns (freed
        earlier, the late write lands in the heap and the rank dies of the corruption). Answers the step that
        ended it, its code, and the bytes."""
        buf = ctypes.create_string_buffer(max(size, 1))
        ptr = ctypes.addressof(buf)
        rc = self._store.register_buffer(ptr, len(buf))
        if rc != 0:
            return "register_buffer", rc, b""
        try:
            rc = self._store.get_into(key, ptr, size)
            return "get_into", rc, buf.raw[:size] if rc == size else b""
        finally:
            with contextlib.suppress(Exception):  # the read's own answer is what counts
                self._store.unregister_buffer(ptr)

    def check_stored(self, key: str) -> StoredCheck:
        """The object of ``key`` read back whole and checked (its trailer, length, and the object checksum over key,
        length and payload: ``object_damage``)."""
        data = self._read_whole(key)
        if data is None:
            return StoredCheck(ref=key, key=key, held=False)
        return StoredCheck(ref=key, key=key, bytes=len(data), damage=object_damage(key, data))

    def check_all(self, shard: int, shards: int) -> Iterator[StoredCheck]:
        """Every object the master lists (its admin API's key listing) whose key, in LMCache's form, names a worker
        of ``shard`` (worker id modulo ``shards``: each rank reads back its own objects), each read back and checked
        when reached. A key in no such form is not an object this tier wrote and is left alone. The embedded engine's
        store is its own (`bsr engine up` starts its master), so every other listed key is one of its objects."""
        if not self.admin_url:
            raise TierUnavailable("cannot list the store's objects: no admin URL of its master was given")
        try:
            listed = all_keys(self.admin_url, timeout=self.call_timeout_s)
        except OSError as exc:
            raise TierUnavailable(f"cannot list the store's objects at {self.admin_url}: {exc}") from None
        for key in sorted(listed):
            try:
                worker = parse_key(key)[2]
            except InvalidInput:
                continue
            if worker % max(shards, 1) == shard and (found := self.check_stored(key)).held:
                yield found

    def set_aside(self, found: StoredCheck, reason: str) -> QuarantinedObject | None:
        """Remove a damaged object from the store: Mooncake has nowhere to set it apart, so its bytes are gone and
        the tier remembers what it removed (``quarantined``). bsr's put never replaces a held object, so what is
        removed is what was checked, unless it was removed and stored again in between (a window of one call)."""
        key = found.key or found.ref
        rc = self.remove([found.ref])[0]
        if rc == _OBJECT_NOT_FOUND:
            return None  # removed already (by a concurrent check)
        if rc != 0:
            log.warning("mooncake: could not remove damaged object %s (%s): %s", key, reason, mooncake_code_name(rc))
            return None
        entry = QuarantinedObject(key=key, file="", reason=reason, at=time.time(), bytes=found.bytes)
        log.warning("mooncake: removed damaged object %s: %s", key, reason)
        self._removed.add([entry])
        return entry

    def quarantined(self, limit: int) -> tuple[list[QuarantinedObject], int]:
        """The newest ``limit`` damaged objects this tier removed since it started, and how many in all."""
        return self._removed.newest(limit)

    # ------------------------------------------------------------------------------------------- extras

    def pending_writes(self) -> list[Future[Any]]:
        """Data calls abandoned at their deadline that have not returned: they may still write the buffers they
        were given (the restore keeps those pool slots out of use until each is done)."""
        with self._lock:
            return list(self._abandoned)

    def inflight(self) -> int:
        """Store calls currently running on workers (non-zero after a call was abandoned at its deadline)."""
        with self._lock:
            return self._inflight

    def register(self, ptr: int, size: int) -> None:
        """Register a caller's buffer (the restore pool) for zero-copy transfers. Needed for RDMA; over TCP the
        store also works from unregistered memory, but registering keeps the code path the same."""
        rc = self._call_checked("register_buffer", lambda: self._store.register_buffer(ptr, size))
        if rc != 0:
            raise OSError(f"mooncake register_buffer({size} bytes) failed: {mooncake_code_name(rc)}")
        with self._lock:
            self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        rc = self._call_checked("unregister_buffer", lambda: self._store.unregister_buffer(ptr))
        with self._lock:
            self._registered.pop(ptr, None)
        if rc != 0:
            raise OSError(f"mooncake unregister_buffer failed: {mooncake_code_name(rc)}")

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Force-remove keys (ignores leases). Returns Mooncake's code per key (0 removed, -704 absent)."""
        if not keys:
            return []
        return list(self._call_checked("batch_remove", lambda: self._store.batch_remove(list(keys), True)))

    def remove_all(self) -> int:
        """Force-remove every object in the store (all clients'!). Returns the count, or raises."""
        rc = self._call_checked("remove_all", lambda: self._store.remove_all(True))
        if rc < 0:
            if rc in _MASTER_DOWN:
                raise TierUnavailable(f"mooncake remove_all failed: {mooncake_code_name(rc)}")
            raise OSError(f"mooncake remove_all failed: {mooncake_code_name(rc)}")
        return int(rc)

    def _call_checked(self, what: str, fn: Callable[[], T]) -> T:
        down = self._fast_fail()
        if down:
            raise TierUnavailable(f"mooncake master unavailable: {down}")
        try:
            return self._run(what, fn, self.call_timeout_s)
        except _CallTimedOut:
            raise TierUnavailable(f"mooncake {what} did not finish within {self.call_timeout_s:g} s") from None

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
