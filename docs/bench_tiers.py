#!/usr/bin/env python
"""Measure the real tiers' throughput on this machine (not a test).

Starts a mooncake_master and a segment holder on free loopback ports, then measures, for 1 MiB and 16 MiB
objects:

* MooncakeTier.put and MooncakeTier.get_into (payload + trailer, scatter/gather into a registered torch pool),
* the raw ``MooncakeDistributedStore.batch_put_from`` / ``batch_get_into`` on the same sizes (the floor the tier
  adds to),
* FilesystemTier.put and get_into with load_concurrency 1 and 4, warm (page cache) and cold (pages dropped
  with posix_fadvise after an fsync).

Usage: python docs/bench_tiers.py [--total-mib 256] [--trials 3] [--fs-dir DIR]
Every number is GB/s (1e9 bytes/s) of payload, the median of the trials after one warm-up round.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from bsr_cli.mooncake import services
from bsr_cli.runtime.tiers import StagingSlice
from bsr_cli.tiers.fs import FilesystemTier
from bsr_cli.tiers.mooncake import MooncakeTier

MiB = 1 << 20
T = TypeVar("T")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def drop_pages(root: Path) -> None:
    """Evict the tier's files from the page cache (clean pages only, hence the sync first)."""
    os.sync()
    for path in root.rglob("*.bsr"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=256, help="payload bytes per measurement (default 256)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--fs-dir", type=Path, default=None, help="directory for the fs tier (default: a temp dir)")
    args = ap.parse_args()
    total = args.total_mib * MiB
    sizes = [1 * MiB, 16 * MiB]

    from mooncake.store import MooncakeDistributedStore

    rows: list[tuple[str, str, list[float]]] = []
    with tempfile.TemporaryDirectory(prefix="bsr-bench-") as tmp:
        state = Path(tmp) / "state"
        master = services.start_master(state)
        holder = None
        try:
            # Room for the tier's and the raw client's copies of one measurement, plus slack.
            holder = services.start_segment_holder(state, master, 2 * total + 256 * MiB)
            tier = MooncakeTier(master.rpc_address, master.metadata_url, deadline_s=10)
            raw = MooncakeDistributedStore()
            if raw.setup("127.0.0.1", master.metadata_url, 0, 0, "tcp", "", master.rpc_address) != 0:
                raise SystemExit("raw mooncake client setup failed")

            src = torch.randint(0, 256, (total,), dtype=torch.uint8)
            pool = torch.zeros(total + MiB, dtype=torch.uint8)
            pool_view = memoryview((ctypes.c_ubyte * pool.numel()).from_address(pool.data_ptr())).cast("B")
            src_view = memoryview((ctypes.c_ubyte * src.numel()).from_address(src.data_ptr())).cast("B")
            tier.register(pool.data_ptr(), pool.numel())
            tier.register(src.data_ptr(), src.numel())
            raw.register_buffer(pool.data_ptr(), pool.numel())
            raw.register_buffer(src.data_ptr(), src.numel())

            fs_root = args.fs_dir or Path(tmp) / "fs"
            fs = FilesystemTier(fs_root)

            for size in sizes:
                n = total // size
                payloads = [src_view[i * size : (i + 1) * size] for i in range(n)]
                crcs = [zlib.crc32(p) for p in payloads]
                dests = [
                    StagingSlice(pool.data_ptr() + i * size, pool_view[i * size : (i + 1) * size]) for i in range(n)
                ]
                label = f"{size // MiB} MiB x {n}"
                results: dict[str, list[float]] = {}

                def record(name: str, value: float, warm: bool, results: dict[str, list[float]] = results) -> None:
                    if not warm:
                        results.setdefault(name, []).append(value)

                for trial in range(args.trials + 1):
                    warmup = trial == 0
                    keys = [f"bench@1@0@{size}-{trial}-{i}@u8" for i in range(n)]
                    raw_keys = [f"raw-{k}" for k in keys]

                    # Mooncake: tier vs raw. Objects are removed after each trial so the segment never fills.
                    t, _ = timed(tier.put, keys, payloads, crcs)
                    record("mooncake tier put", gbps(total, t), warmup)
                    ptrs = [src.data_ptr() + i * size for i in range(n)]
                    t, rcs = timed(raw.batch_put_from, raw_keys, ptrs, [size] * n)
                    assert all(rc == 0 for rc in rcs), f"raw put failed: {sorted(set(rcs))}"
                    record("mooncake raw batch_put_from", gbps(total, t), warmup)

                    pool.zero_()
                    t, (codes, _sums) = timed(tier.get_into, keys, dests, 60.0)
                    assert codes == [size] * n, f"tier get failed: {sorted(set(codes))}"
                    assert torch.equal(pool[:total], src), "tier get returned wrong bytes"
                    record("mooncake tier get_into", gbps(total, t), warmup)

                    t, got = timed(raw.batch_get_into, raw_keys, [d.ptr for d in dests], [size] * n)
                    assert got == [size] * n, f"raw get failed: {sorted(set(got))}"
                    record("mooncake raw batch_get_into", gbps(total, t), warmup)
                    tier.remove(keys)
                    tier.remove(raw_keys)

                    # Filesystem tier.
                    fs.remove_all()
                    t, _ = timed(fs.put, keys, payloads, crcs)
                    record("fs put (no fsync)", gbps(total, t), warmup)
                    for conc in (1, 4):
                        fs.load_concurrency = conc
                        for cold in (False, True):
                            if cold:
                                drop_pages(fs_root)
                            pool.zero_()
                            t, (codes, _sums) = timed(fs.get_into, keys, dests, 120.0)
                            assert codes == [size] * n, f"fs get failed: {sorted(set(codes))}"
                            record(f"fs get_into c={conc} {'cold' if cold else 'warm'}", gbps(total, t), warmup)
                    fs.remove_all()

                for name, values in results.items():
                    rows.append((name, label, values))

            fs.close()
            tier.close()
            raw.close()
        finally:
            if holder is not None:
                services.stop(holder)
            services.stop(master)

    print(
        f"\npayload {args.total_mib} MiB per measurement, median of {args.trials} trials (GB/s); cpus={os.cpu_count()}"
    )
    print(f"{'measurement':34} {'objects':>14} {'median':>8} {'min':>7} {'max':>7}")
    for name, label, values in rows:
        print(f"{name:34} {label:>14} {statistics.median(values):8.2f} {min(values):7.2f} {max(values):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
