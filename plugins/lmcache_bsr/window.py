"""A window of bsr's restore inside LMCache at the transport's ceiling: one Mooncake transfer per window, straight
into LMCache's L1, checksums included, and one copy per KV tensor into the paged KV.

LMCache's own path for a window (``StorageManager.batched_get``) hops to its storage event loop, then to a thread
for the transfer, then to another for bsr's checksum wrapper, which asks the store for the sidecars in a second
round trip; its connector then installs each chunk with one copy per layer. Here, for the chunks LMCache's Mooncake
backend holds (zero-copy mode, ``save_chunk_meta: false``, naive serde: the layout bsr documents):

* the window's L1 objects are allocated in one call from LMCache's own allocator (so L1 stays LMCache's, measured
  by the same peak tracker and bounded by the same budget B);
* one ``batch_get_into`` moves every object of the window into them and every object's checksum sidecar
  (``core.integrity``: 16 bytes, bound to the key and the length) into a registered side buffer: one transfer call,
  one master round trip;
* each object is verified against its sidecar in place (``integrity.Checksums.judge_loaded``: the same verdicts,
  drops, removals and findings as the wrapper on LMCache's path); a sidecar the transfer could not read (a transfer
  error) is asked for again, alone. The check runs on the restore's own thread once the next window's transfer is
  issued (``WindowFetch.checked``), so it uses the CPU the transfer's completion poll would otherwise spin on;
* ``install_window`` copies the window into the paged KV with one strided or indexed copy per layer, from the L1
  objects themselves (no intermediate tensor), when the window's objects sit at one stride in L1 (the allocator
  hands a window one run); otherwise the connector's copy per chunk.

A failed transfer or check leaves the object out (None), as LMCache's get does, so the window comes back short and
the restore fails closed. ``MooncakeWindows.of`` answers None where LMCache's layout is another one (metadata saved
with the object, another serde, MLA's shared keys): the window then goes through LMCache's own path.
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bsr_cli.core.evidence import TimedStage
from bsr_cli.core.integrity import SIDECAR_BYTES, sidecar_key
from bsr_cli.runtime.stage_clock import StageClock

from . import _lmcache as lm
from .integrity import Checksums

__all__ = ["REMOTE", "MooncakeWindows", "WindowFetch", "fetch_window", "install_window"]

REMOTE = lm.TIER_BACKENDS["mooncake"]  # LMCache's location of the Mooncake backend
_OBJECT_NOT_FOUND = -704  # Mooncake's code for a key it does not hold (a chunk stock LMCache stored: no sidecar)
# Sidecar slots per region (a larger window's sidecars go in several calls), and regions: one per fetch in flight
# (a rank's four transfer threads: two restores at once, each with up to two windows' fetches in flight).
_SIDECARS_PER_REGION = 1024
_REGIONS = 4


class _SidecarRegions:
    """A registered buffer the sidecars land in, cut into regions handed to one transfer at a time."""

    def __init__(self, store: Any) -> None:
        size = _REGIONS * _SIDECARS_PER_REGION * SIDECAR_BYTES
        self._buf = ctypes.create_string_buffer(size)
        self.base = ctypes.addressof(self._buf)
        rc = store.register_buffer(self.base, size)
        if rc != 0:
            raise OSError(f"Mooncake register_buffer for checksum sidecars failed with code {rc}")
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(_REGIONS):
            self._free.put(self.base + i * _SIDECARS_PER_REGION * SIDECAR_BYTES)

    @contextlib.contextmanager
    def region(self) -> Iterator[int]:
        """A region's address, held until the transfer into it has returned (a transfer is never abandoned here:
        the thread that runs it waits for Mooncake to return)."""
        addr = self._free.get()
        try:
            ctypes.memset(addr, 0, _SIDECARS_PER_REGION * SIDECAR_BYTES)  # a stale sidecar must never pass
            yield addr
        finally:
            self._free.put(addr)


class MooncakeWindows:
    """One rank's windows read straight from LMCache's Mooncake store into LMCache's L1 (see the module's doc)."""

    def __init__(self, eng: Any, connector: Any, checksums: Checksums | None) -> None:
        self.store = connector.store  # the real MooncakeDistributedStore LMCache set up (tests may wrap it)
        self.cpu = lm.backends(eng)["LocalCPUBackend"]
        self.shapes, self.dtypes, self.fmt = connector.meta_shapes, connector.meta_dtypes, connector.meta_fmt
        self.checksums = checksums
        self.sidecars = _SidecarRegions(self.store) if checksums is not None else None

    @classmethod
    def of(cls, eng: Any, checksums: Checksums | None) -> MooncakeWindows | None:
        """The direct path for this engine, or None when its remote layout is not the zero-copy one."""
        conn = lm.mooncake_connector(eng)
        backend = lm.backends(eng).get(REMOTE)
        if conn is None or backend is None or "LocalCPUBackend" not in lm.backends(eng):
            return None
        if getattr(conn, "save_chunk_meta", True) or not getattr(conn, "meta_shapes", None):
            return None  # metadata travels with each object: LMCache's own get parses it
        if type(getattr(backend, "deserializer", None)).__name__ != "NaiveDeserializer":
            return None  # another serde: the stored bytes are not the L1 bytes
        if getattr(backend, "_mla_worker_id_as0_mode", False):
            return None  # MLA reads rank 0's keys: LMCache's own get rewrites them
        return cls(eng, conn, checksums)

    def _allocate(self, n: int) -> list[Any] | None:
        return self.cpu.batched_allocate(self.shapes, self.dtypes, n, self.fmt, eviction=False, busy_loop=False)

    def fetch(self, names: list[str]) -> tuple[list[Any | None], list[bytes | None]]:
        """The objects of ``names`` (LMCache key strings, one window's chunks on this backend) in L1, unchecked (None
        for each that did not arrive whole), and the checksum sidecar read with each. Nothing stays allocated on an
        exception."""
        objs: list[Any | None] = list(self._allocate(len(names)) or [])
        if len(objs) != len(names):
            return [None] * len(names), [None] * len(names)  # L1 cannot hold it (B admitted it: another user took L1)
        try:
            return objs, self._transfer(names, objs)
        except BaseException:
            lm.release_objects(objs)
            raise

    def _transfer(self, names: list[str], objs: list[Any | None]) -> list[bytes | None]:
        """One ``batch_get_into`` per ``_SIDECARS_PER_REGION`` objects (one per window here), the sidecars in the
        same call; drops (releases, None) every object that did not arrive whole. Returns each object's sidecar as
        read (b"" when the store holds none; None when the transfer could not say)."""
        size = next(int(o.get_size()) for o in objs if o is not None)
        sides: list[bytes | None] = [None] * len(names)
        for lo in range(0, len(names), _SIDECARS_PER_REGION):
            hi = min(lo + _SIDECARS_PER_REGION, len(names))
            keys, ptrs = names[lo:hi], [int(o.data_ptr) for o in objs[lo:hi] if o is not None]
            sizes = [size] * (hi - lo)
            if self.sidecars is None:
                rcs = self.store.batch_get_into(keys, ptrs, sizes)
                self._drop_short(objs, lo, rcs, size)
                continue
            with self.sidecars.region() as base:
                side_ptrs = [base + i * SIDECAR_BYTES for i in range(hi - lo)]
                rcs = self.store.batch_get_into(
                    keys + [sidecar_key(k) for k in keys], ptrs + side_ptrs, sizes + [SIDECAR_BYTES] * (hi - lo)
                )
                for i, rc in enumerate(rcs[hi - lo :]):
                    if rc >= 0:
                        sides[lo + i] = ctypes.string_at(base + i * SIDECAR_BYTES, rc)
                    elif rc == _OBJECT_NOT_FOUND:
                        sides[lo + i] = b""
            self._drop_short(objs, lo, rcs[: hi - lo], size)
        return sides

    @staticmethod
    def _drop_short(objs: list[Any | None], lo: int, rcs: Sequence[int], size: int) -> None:
        for i, rc in enumerate(rcs):
            obj = objs[lo + i]
            if rc != size and obj is not None:
                obj.ref_count_down()
                objs[lo + i] = None


@dataclass
class WindowFetch:
    """One window's objects in L1 as fetched, in chunk order (None: did not arrive), the positions among them read
    straight from Mooncake whose checksums are still to be checked, and the sidecars read with those."""

    objs: list[Any | None]
    pending: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the pending objects' LMCache keys
    sidecars: list[bytes | None] = field(default_factory=list)

    def checked(self, windows: MooncakeWindows | None) -> list[Any | None]:
        """The objects once every pending one has been checked against its sidecar (one that fails is dropped:
        released, None, and named in the checksums' findings)."""
        if self.pending and windows is not None and windows.checksums is not None:
            sub = [self.objs[i] for i in self.pending]
            for i, obj in zip(
                self.pending, windows.checksums.judge_loaded(self.names, sub, self.sidecars), strict=True
            ):
                self.objs[i] = obj
        self.pending = []
        return self.objs

    def release(self) -> None:
        lm.release_objects(self.objs)


def fetch_window(
    eng: Any, windows: MooncakeWindows | None, keys: Sequence[Any], locations: Sequence[str], clock: StageClock
) -> WindowFetch:
    """One window's objects in L1, in chunk order: the chunks on Mooncake in one transfer straight into L1 with
    their sidecars (``MooncakeWindows``; their checks left to ``WindowFetch.checked``), any other through LMCache's
    own get (checked there). Timed as the fetch stage. Nothing stays allocated on an exception."""
    with clock.timing(TimedStage.FETCH):
        remote = [i for i, loc in enumerate(locations) if loc == REMOTE] if windows is not None else []
        if not remote:
            return WindowFetch(lm.fetch_window(eng, keys, locations))
        out = WindowFetch([None] * len(keys))
        rest = [i for i in range(len(keys)) if i not in set(remote)]
        try:
            if rest:
                got = lm.fetch_window(eng, [keys[i] for i in rest], [locations[i] for i in rest])
                for i, obj in zip(rest, got, strict=True):
                    out.objs[i] = obj
            if windows is not None and eng.is_healthy():
                out.pending, out.names = remote, [lm.key_string(keys[i]) for i in remote]
                objs, out.sidecars = windows.fetch(out.names)
                for i, obj in zip(remote, objs, strict=True):
                    out.objs[i] = obj
        except BaseException:
            out.release()
            raise
        return out


def install_window(
    objs: Sequence[Any], kvcaches: Sequence[torch.Tensor], rows: torch.Tensor, heads: int, head_size: int
) -> bool:
    """The window's objects (full chunks in LMCache's ``[2, layers, tokens, heads * head_size]`` layout) copied into
    the paged KV (one ``[rows, 2, heads, head_size]`` tensor per layer) at ``rows``, one copy per layer: a strided
    view over the window's L1 objects, written into one run of rows with ``copy_`` or into any block table with one
    indexed ``index_put_``. False (nothing written) when the objects do not sit at one stride in L1."""
    n = len(objs)
    if n == 0 or any(o is None for o in objs):
        return False
    first = objs[0]
    shape = first.tensor.shape  # [2, layers, tokens, heads * head_size]
    layers, tokens = int(shape[1]), int(shape[2])
    ptrs = [int(o.data_ptr) for o in objs]
    elem = first.tensor.element_size()
    stride_b = ptrs[1] - ptrs[0] if n > 1 else first.get_size()
    if (
        rows.numel() != n * tokens
        or stride_b < first.get_size()
        or stride_b % elem
        or any(p != ptrs[0] + i * stride_b for i, p in enumerate(ptrs))
        or any(tuple(o.tensor.shape) != tuple(shape) for o in objs)
    ):
        return False
    base = first.tensor  # a view into LMCache's L1 buffer: its storage spans the window's objects
    hd = heads * head_size
    stride = stride_b // elem
    start = int(rows[0])
    run = bool(int(rows[-1]) - start == rows.numel() - 1 and (rows.diff() == 1).all()) if n * tokens > 1 else True
    index = None if run else rows.view(n, tokens)
    for layer, kv in enumerate(kvcaches):
        src = base.as_strided(
            (n, tokens, 2, heads, head_size),
            (stride, hd, layers * tokens * hd, head_size, 1),
            base.storage_offset() + layer * tokens * hd,
        )
        if index is None:
            kv[start : start + n * tokens].view(n, tokens, 2, heads, head_size).copy_(src)
        else:
            kv.index_put_((index,), src)
    return True
