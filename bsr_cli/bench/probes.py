"""Probes of the machine beneath bsr, used beside the experiments: the disk's read rate and page-cache eviction,
the memory-copy and checksum ceiling, and raw Mooncake clients (the engine's tier class and a raw store)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bsr_cli.bench.evidence import RowStatus, gbps
from bsr_cli.core import wire
from bsr_cli.core.registration import Registration
from bsr_cli.core.units import MiB
from bsr_cli.errors import ServiceError

_MOONCAKE_BATCH = 1024  # keys per raw batch call (the tier issues the same)


# -- what the probes measure (fields in the order of their evidence keys: bsr_cli.api.codec.to_json writes them) --


@dataclass(frozen=True)
class PageEviction:
    """How the fs tier's pages were evicted before a cold restore, and whether that failed."""

    method: str
    # Only what happened: files when posix_fadvise reached some, error when it failed; no null keys.
    files: int | None = wire.field(omit_none=True, default=None)  # files reached (posix_fadvise only)
    error: str | None = wire.field(omit_none=True, default=None)

    @property
    def ok(self) -> bool:
        return self.error is None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class DiskReadRate:
    """The disk alone: ``threads`` threads reading whole files after their pages were evicted."""

    threads: int
    files: int
    bytes: int
    seconds: float
    gbps: float
    evicted_files: int
    error: str | None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class CopyCeiling:
    """One memory-bound operation over a buffer (a torch copy at a thread count, or the object checksum)."""

    op: str
    threads: int
    bytes: int
    gbps_trials: list[float]
    gbps: float


@dataclass(frozen=True)
class RawGetRate:
    """The paired raw GET measured right before a restore."""

    gbps_per_client: float
    gbps_median_client: float
    bytes_per_client: int
    error: str | None


@dataclass(frozen=True)
class MooncakeRate:
    """GET or PUT per client through the tier class or the raw store, isolated or concurrent."""

    kind: str  # always "mooncake": the evidence row's kind
    path: str  # "tier" or "raw"
    op: str  # "get" or "put"
    mode: str  # "isolated" or "concurrent"
    clients: int
    objects_per_client: int
    object_bytes: list[int]
    bytes_per_client: int
    gbps_per_client: float
    gbps_trials: list[float]
    aggregate_gbps: float | None  # concurrent only
    error: str | None
    checks: dict[str, bool]
    status: RowStatus

    @property
    def passed(self) -> bool:
        return self.error is None


# -- filesystem load concurrency --------------------------------------------------------------------------------


def cold_cache_method(fs_dir: Path | None) -> str | None:
    """How this process can evict the fs tier's pages: posix_fadvise on its files when the directory is known
    (targeted, no privilege needed), else the machine-wide drop_caches when writable (root), else none."""
    if fs_dir is not None and fs_dir.is_dir() and hasattr(os, "posix_fadvise"):
        return "posix_fadvise"
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "drop_caches"
    return None


def evict_page_cache(fs_dir: Path | None, method: str) -> PageEviction:
    os.sync()  # only clean pages can be dropped
    try:
        return _evict(fs_dir, method)
    except OSError as e:
        return PageEviction(method, error=str(e))


def _evict(fs_dir: Path | None, method: str) -> PageEviction:
    if method == "posix_fadvise" and fs_dir is not None:
        return PageEviction(method, files=_drop_pages(fs_dir.rglob("*.bsr")))
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    return PageEviction("drop_caches")


def _drop_pages(files: Iterable[Path]) -> int:
    """Evict each file's clean pages from the page cache; returns how many files it reached."""
    done = 0
    for path in files:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done += 1
            finally:
                os.close(fd)
    return done


def disk_read_rate(files: Sequence[Path], threads: int, chunk_bytes: int = 4 * MiB) -> DiskReadRate:
    """The disk's own rate at a concurrency, without bsr: ``threads`` threads read whole files (``preadv`` in
    chunks into one reused buffer each, as the fs tier reads), after their pages were evicted. Its best rate is the
    ceiling a restore's concurrency speedup can approach: where that ceiling is under 1.5x the serial restore's
    rate, the disk, not the tier, forbids a 1.5x speedup."""
    os.sync()  # only clean pages can be dropped
    evicted = _drop_pages(files)
    queue = list(files)
    lock = threading.Lock()
    moved = [0] * threads
    errors: list[str] = []

    def work(i: int) -> None:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while True:
            with lock:
                if not queue:
                    return
                path = queue.pop()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    pos = 0
                    while (got := os.preadv(fd, [view], pos)) > 0:
                        pos += got
                    moved[i] += pos
                finally:
                    os.close(fd)
            except OSError as e:
                errors.append(f"{path}: {e}")

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work, args=(i,), name=f"bsr-bench-disk-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    secs = time.perf_counter() - t0
    return DiskReadRate(
        threads=threads,
        files=len(files),
        bytes=sum(moved),
        seconds=round(secs, 4),
        gbps=gbps(sum(moved), secs),
        evicted_files=evicted,
        error=errors[0] if errors else None,
    )


# -- store bandwidth -------------------------------------------------------------------------------------------


def memcpy_ceiling(nbytes: int, trials: int, threads: Sequence[int] | None = None) -> list[CopyCeiling]:
    """The machine's memory-copy ceiling: torch copies of an ``nbytes`` buffer (median of ``trials``), and the
    rate of the object checksum (CRC32C) over it."""
    import torch

    from bsr_cli.runtime.checksum import ALGORITHM, crc32c_at

    prev = torch.get_num_threads()
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)  # touch every page before timing
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    out = []
    try:
        for n in threads or sorted({1, prev}):
            torch.set_num_threads(n)
            dst.copy_(src)
            times = []
            for _ in range(trials):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            out.append(_ceiling("copy", n, nbytes, times))
        # The restore verifies every object's checksum: one more pass over every restored byte.
        times = []
        for _ in range(trials):
            t0 = time.perf_counter()
            crc32c_at(src.data_ptr(), nbytes)
            times.append(time.perf_counter() - t0)
        out.append(_ceiling(ALGORITHM, 1, nbytes, times))
    finally:
        torch.set_num_threads(prev)
    return out


def _ceiling(op: str, threads: int, nbytes: int, times: list[float]) -> CopyCeiling:
    return CopyCeiling(
        op=op,
        threads=threads,
        bytes=nbytes,
        gbps_trials=[round(nbytes / t / 1e9, 4) for t in times],
        gbps=round(nbytes / statistics.median(times) / 1e9, 4),
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Mute fd 2 while Mooncake clients set up: each logs a dozen glog INFO lines there, and this build ignores
    GLOG_minloglevel. Setup failures still surface as return codes."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class StoreClient:
    """One rank-like Mooncake client: the engine's tier class and a raw store, with registered buffers holding
    objects shaped like the registration's (one object per KV group per chunk)."""

    def __init__(self, master: str, metadata: str, sizes: list[int]) -> None:
        import torch
        from mooncake.store import MooncakeDistributedStore

        from bsr_cli.runtime.checksum import crc32c
        from bsr_cli.runtime.tiers import StagingSlice
        from bsr_cli.tiers.mooncake import MooncakeTier

        with _quiet_stderr():
            self.tier = MooncakeTier(master, metadata, deadline_s=30.0, call_timeout_s=300.0)
            self.raw = MooncakeDistributedStore()
            rc = self.raw.setup("127.0.0.1", metadata, 0, 0, "tcp", "", master)
        if rc != 0:
            self.tier.close()
            raise ServiceError(
                f"raw mooncake client setup against {master} failed with code {rc}",
                hint="is the Mooncake master running there? `bsr engine status` lists the engine's services",
            )
        self.sizes = sizes
        total = sum(sizes)
        self.total = total
        self.src = torch.randint(0, 256, (total,), dtype=torch.uint8)
        self.dst = torch.zeros(total, dtype=torch.uint8)
        sp, dp = self.src.data_ptr(), self.dst.data_ptr()
        sview = memoryview((ctypes.c_ubyte * total).from_address(sp)).cast("B")
        dview = memoryview((ctypes.c_ubyte * total).from_address(dp)).cast("B")
        offs = [0]
        for s in sizes[:-1]:
            offs.append(offs[-1] + s)
        self.src_ptrs = [sp + o for o in offs]
        self.dst_ptrs = [dp + o for o in offs]
        self.payloads = [sview[o : o + s] for o, s in zip(offs, sizes, strict=True)]
        # Each op puts these payloads under fresh keys and never verifies them: the bench times the transfer only,
        # so a checksum of the bytes stands in for the object checksums a restore would check.
        self.crcs = [crc32c(p) for p in self.payloads]
        self.dests = [StagingSlice(dp + o, dview[o : o + s]) for o, s in zip(offs, sizes, strict=True)]
        for ptr in (sp, dp):
            self.tier.register(ptr, total)
            self.raw.register_buffer(ptr, total)

    def op(self, path: str, kind: str, keys: list[str]) -> str:
        """Run one measured operation; returns an error description, or "" when every object moved whole."""
        n = len(keys)
        if path == "tier" and kind == "put":
            try:
                self.tier.put(keys, self.payloads, self.crcs)
            except (OSError, RuntimeError) as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - TierUnavailable and friends: reported as the row's failure
                return f"{type(e).__name__}: {e}"
            return ""
        if path == "tier":
            codes, _ = self.tier.get_into(keys, self.dests, 300.0)
            bad = [c for c, s in zip(codes, self.sizes, strict=True) if c != s]
            return f"{len(bad)} of {n} objects failed (first code {bad[0]})" if bad else ""
        rcs: list[int] = []
        for lo in range(0, n, _MOONCAKE_BATCH):
            hi = min(lo + _MOONCAKE_BATCH, n)
            if kind == "put":
                rcs += list(self.raw.batch_put_from(keys[lo:hi], self.src_ptrs[lo:hi], self.sizes[lo:hi]))
            else:
                rcs += list(self.raw.batch_get_into(keys[lo:hi], self.dst_ptrs[lo:hi], self.sizes[lo:hi]))
        want = [0] * n if kind == "put" else self.sizes
        bad = [rc for rc, x in zip(rcs, want, strict=True) if rc != x]
        return f"{len(bad)} of {n} objects failed (first code {bad[0]})" if bad else ""

    def remove(self, keys: list[str]) -> None:
        with contextlib.suppress(Exception):  # best effort: the segment is the engine's, keep it from filling
            self.tier.remove(keys)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing after the measurement; nothing left to report
            self.raw.close()
        with contextlib.suppress(Exception):
            self.tier.close()


def _timed_parallel(
    clients: Sequence[StoreClient], path: str, kind: str, keys: Sequence[list[str]]
) -> tuple[list[float], float, list[str]]:
    """Run one op on every client at once (released together by a barrier): per-client seconds, the wall time
    from the first start to the last end, per-client errors."""
    n = len(clients)
    barrier = threading.Barrier(n)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    errors = [""] * n

    def work(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        errors[i] = clients[i].op(path, kind, keys[i])
        spans[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,), name=f"bsr-bench-store-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return [e - s for s, e in spans], wall, errors


def object_sizes(reg: Registration, bytes_per_client: int) -> list[int]:
    """Objects shaped like the registration's (one per KV group per chunk), about ``bytes_per_client`` in all."""
    per_chunk = [reg.group_bytes_per_chunk(g) for g in reg.group_names]
    return per_chunk * max(1, bytes_per_client // reg.bytes_per_chunk)


@contextlib.contextmanager
def store_clients(master: str, metadata: str, sizes: list[int], n: int) -> Iterator[list[StoreClient]]:
    """``n`` rank-like Mooncake clients, closed afterwards."""
    made: list[StoreClient] = []
    try:
        for _ in range(n):
            made.append(StoreClient(master, metadata, sizes))
        yield made
    finally:
        for c in made:
            c.close()


class PairedRawGet:
    """The raw reference measured beside each restore: the same clients GET the same objects (stored once) with
    ``batch_get_into``, all at once, right before the restore it is compared with. On a noisy machine a ratio of
    two measurements taken seconds apart is far steadier than one against a reference taken minutes earlier."""

    def __init__(self, clients: Sequence[StoreClient], run_id: str) -> None:
        self.clients = clients
        self.keys = [[f"bsr-bench/{run_id}/paired/{i}/{j}" for j in range(len(c.sizes))] for i, c in enumerate(clients)]
        errs = [c.op("raw", "put", k) for c, k in zip(clients, self.keys, strict=True)]
        if any(errs):
            raise ServiceError(
                f"storing the paired raw reference failed: {next(e for e in errs if e)}",
                hint="the Mooncake segment may be full: give the engine a larger --segment-bytes",
            )

    def measure(self) -> RawGetRate:
        """GB/s per client until *every* client is done, as a restore's request-level rate per rank runs until
        its slowest rank is done; the median client's own rate is kept beside it."""
        secs, wall, errs = _timed_parallel(self.clients, "raw", "get", self.keys)
        total = self.clients[0].total
        return RawGetRate(
            gbps_per_client=round(total / wall / 1e9, 4),
            gbps_median_client=round(total / statistics.median(secs) / 1e9, 4),
            bytes_per_client=total,
            error=next((e for e in errs if e), None),
        )

    def remove(self) -> None:
        for c, k in zip(self.clients, self.keys, strict=True):
            c.remove(k)


def mooncake_bandwidth(
    reg: Registration, made: Sequence[StoreClient], *, trials: int, run_id: str
) -> list[MooncakeRate]:
    """GET and PUT per client through the engine's tier class and through the raw store, isolated (one client at
    a time) and concurrent (all at once, as TP ranks restore), after one discarded warm-up round."""
    clients = len(made)
    sizes = made[0].sizes
    total = sum(sizes)
    per_chunk = [reg.group_bytes_per_chunk(g) for g in reg.group_names]
    samples: dict[tuple[str, str, str], list[list[float]]] = {}
    walls: dict[tuple[str, str, str], list[float]] = {}
    errors: dict[tuple[str, str, str], str] = {}
    for trial in range(trials + 1):
        for mode in ("isolated", "concurrent"):
            groups = [[i] for i in range(clients)] if mode == "isolated" else [list(range(clients))]
            for group in groups:
                who = [made[i] for i in group]
                keys = {
                    p: [[f"bsr-bench/{run_id}/{p}/{mode}/{trial}/{i}/{j}" for j in range(len(sizes))] for i in group]
                    for p in ("tier", "raw")
                }
                try:
                    for path in ("tier", "raw"):
                        for kind in ("put", "get"):
                            if kind == "get":
                                for c in who:
                                    c.dst.zero_()  # a stale copy must never pass as this one
                            secs, wall, errs = _timed_parallel(who, path, kind, keys[path])
                            if kind == "get" and not any(errs):
                                errs = ["" if c.dst.equal(c.src) else "wrong bytes" for c in who]
                            k = (path, kind, mode)
                            if any(errs):
                                errors.setdefault(k, next(e for e in errs if e))
                            if trial > 0:
                                samples.setdefault(k, []).append(secs)
                                walls.setdefault(k, []).append(wall)
                finally:
                    for i, c in zip(group, who, strict=True):
                        c.remove(keys["tier"][group.index(i)] + keys["raw"][group.index(i)])
    rows: list[MooncakeRate] = []
    for (path, kind, mode), per_trial in samples.items():
        flat = [s for trial in per_trial for s in trial]
        err = errors.get((path, kind, mode))
        rows.append(
            MooncakeRate(
                kind="mooncake",
                path=path,
                op=kind,
                mode=mode,
                clients=clients,
                objects_per_client=len(sizes),
                object_bytes=per_chunk,
                bytes_per_client=total,
                gbps_per_client=round(total / statistics.median(flat) / 1e9, 4),
                gbps_trials=[round(total / s / 1e9, 4) for s in flat],
                aggregate_gbps=(
                    round(clients * total / statistics.median(walls[(path, kind, mode)]) / 1e9, 4)
                    if mode == "concurrent"
                    else None
                ),
                error=err or None,
                checks={"every_object_whole": not err},
                status=RowStatus.FAIL if err else RowStatus.PASS,
            )
        )
    return rows
