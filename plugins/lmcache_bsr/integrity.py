"""A CRC32C that travels with every chunk bsr's plugins store in Mooncake through LMCache, verified on every load.

LMCache 0.5.6 stores no checksum: a flipped byte in a stored chunk is loaded into the model's KV and silently
changes the output. bsr wraps LMCache's Mooncake connector (the object that moves the stored bytes, under every
LMCache store and retrieve path: the vLLM connector's and the LMCache host's):

* put: for each object not yet in the store, its CRC32C goes to a sidecar key in the same Mooncake store (the
  object's key + ``CHECKSUM_SIDECAR_SUFFIX``, 4 bytes big-endian), written *before* the object, so a chunk that
  is present always has its checksum (a sidecar whose object never landed is harmless: the next put rewrites it);
* get: every object that arrived is checked against its sidecar. A mismatch drops the object (LMCache's retrieve
  then comes back short and bsr's windowed load fails closed: the request recomputes), removes it and its sidecar
  from the store (so the recompute stores the chunk afresh) and is recorded with its key for the caller to name
  the chunk and the tier. An object without a sidecar (stored by stock LMCache) is
  *unverified*: dropped the same way unless ``load_unverified`` is set.

Why the connector and not LMCache's metadata: LMCache's ``save_chunk_meta`` header holds shapes and dtypes only,
and the zero-copy path (``save_chunk_meta: false``, the one bsr documents) keeps no remote metadata at all; a
sidecar survives both paths and any serde (the checksum covers the bytes as stored, after LMCache's serializer).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import google_crc32c

from bsr_cli.core.keys import CHECKSUM_SIDECAR_SUFFIX

from . import _lmcache as lm

log = logging.getLogger("lmcache_bsr.integrity")

TIER = "mooncake"  # the tier whose objects are verified (bsr's name for LMCache's RemoteBackend on Mooncake)
CRC_BYTES = 4


class Verdict(StrEnum):
    """What the check of one arrived object found."""

    OK = "ok"
    MISMATCH = "mismatch"  # the stored checksum disagrees with the bytes: corrupted at rest or in flight
    UNVERIFIED = "unverified"  # no checksum stored with it (stock LMCache wrote it)


@dataclass(frozen=True)
class Finding:
    """One object that did not verify: its LMCache key, what was wrong, and whether it was dropped."""

    key: str
    verdict: Verdict
    dropped: bool
    tier: str = TIER
    removed: bool = False  # a mismatching object (and its checksum) was removed from the store


class ChecksumError(RuntimeError):
    """A loaded chunk failed verification: the load fails closed (its message names the chunk and the tier)."""


def sidecar_key(key: str) -> str:
    return key + CHECKSUM_SIDECAR_SUFFIX


def encode(crc: int) -> bytes:
    return int(crc).to_bytes(CRC_BYTES, "big")


def decode(raw: bytes | None) -> int | None:
    """The stored checksum, or None when there is none (Mooncake's ``get`` answers b"" for a missing key)."""
    if raw is None or len(raw) != CRC_BYTES:
        return None
    return int.from_bytes(raw, "big")


def crc_of(obj: Any) -> int:
    """CRC32C of a memory object's bytes, read in place (no copy)."""
    size = int(obj.get_size())
    if size == 0:
        return 0
    return int(google_crc32c.value((ctypes.c_ubyte * size).from_address(int(obj.data_ptr))))


def verdict(stored: int | None, actual: int) -> Verdict:
    if stored is None:
        return Verdict.UNVERIFIED
    return Verdict.OK if stored == actual else Verdict.MISMATCH


class Checksums:
    """The wrapper installed on one LMCache engine's Mooncake connector. ``findings`` keeps what did not verify
    since the caller last took them (``take``); ``counts`` every verdict since start, for operators."""

    def __init__(self, connector: Any, *, load_unverified: bool) -> None:
        self.connector = connector
        self.store = connector.store
        self.load_unverified = load_unverified
        self._lock = threading.Lock()
        self._findings: dict[str, Finding] = {}  # by LMCache key (a fetch run ahead may add another window's)
        self.counts: dict[Verdict, int] = dict.fromkeys(Verdict, 0)
        self._orig_batched_put = connector.batched_put
        self._orig_put = connector.put
        self._orig_batched_get = connector.batched_get
        connector.batched_put = self._batched_put
        connector.put = self._put
        connector.batched_get = self._batched_get

    # -- store -------------------------------------------------------------------------------------------------
    def _write_sidecars(self, keys: Sequence[Any], objs: Sequence[Any]) -> None:
        names = [k.to_string() for k in keys]
        held = self.store.batch_is_exist(names)
        # An object already held keeps the checksum it was stored with (its put is refused by Mooncake anyway).
        new = [(name, obj) for name, obj, h in zip(names, objs, held, strict=True) if h != 1]
        if not new:
            return
        # One batched call for the window's checksums (one per object would cost a master round trip each).
        rc = self.store.upsert_batch([sidecar_key(n) for n, _ in new], [encode(crc_of(o)) for _, o in new])
        if rc != 0:
            log.warning("bsr: %d checksum(s) not stored (Mooncake rc %s): they will load as unverified", len(new), rc)

    async def _batched_put(self, keys: list[Any], memory_objs: list[Any]) -> Any:
        await asyncio.to_thread(self._write_sidecars, keys, memory_objs)
        return await self._orig_batched_put(keys, memory_objs)

    async def _put(self, key: Any, memory_obj: Any) -> Any:
        await asyncio.to_thread(self._write_sidecars, [key], [memory_obj])
        return await self._orig_put(key, memory_obj)

    # -- load --------------------------------------------------------------------------------------------------
    async def _batched_get(self, keys: list[Any]) -> list[Any]:
        objs = await self._orig_batched_get(keys)
        return await asyncio.to_thread(self.verify, keys, objs)

    def verify(self, keys: Sequence[Any], objs: list[Any]) -> list[Any]:
        """Check every arrived object against its stored checksum; drop (release, None) the ones that fail."""
        idx = [i for i, o in enumerate(objs) if o is not None]
        if not idx:
            return objs
        names = [keys[i].to_string() for i in idx]
        stored = self.store.get_batch([sidecar_key(n) for n in names])
        found: list[Finding] = []
        for i, name, raw in zip(idx, names, stored, strict=True):
            v = verdict(decode(raw), crc_of(objs[i]))
            self.counts[v] += 1
            if v is Verdict.OK:
                continue
            drop = v is Verdict.MISMATCH or not self.load_unverified
            # A corrupted object is removed with its checksum: LMCache never overwrites a key it holds, so the
            # recompute that follows could not store the chunk afresh, and every later load would fail again.
            removed = v is Verdict.MISMATCH and self._remove(name)
            found.append(Finding(name, v, drop, removed=removed))
            if drop:
                objs[i].ref_count_down()
                objs[i] = None
        if found:
            with self._lock:
                self._findings.update((f.key, f) for f in found)
            for f in found:
                if f.verdict is Verdict.MISMATCH:
                    log.error("bsr: checksum mismatch in %s (tier %s): not loaded", f.key, f.tier)
        return objs

    def _remove(self, name: str) -> bool:
        try:
            rc = self.store.remove(name, True)
            self.store.remove(sidecar_key(name), True)
        except Exception as e:  # noqa: BLE001 - the load fails closed either way; removal only spares later ones
            log.warning("bsr: corrupted object %s not removed: %s", name, e)
            return False
        return bool(rc == 0)

    def take(self, keys: Sequence[Any] | None = None) -> list[Finding]:
        """What did not verify since the last call: everything, or only the objects of ``keys`` (LMCache keys or
        their strings, in the caller's order)."""
        with self._lock:
            if keys is None:
                out, self._findings = list(self._findings.values()), {}
                return out
            names = [k if isinstance(k, str) else k.to_string() for k in keys]
            return [f for f in (self._findings.pop(n, None) for n in names) if f is not None]


def install(eng: Any, *, load_unverified: bool) -> Checksums | None:
    """Wrap the engine's Mooncake connector (None when LMCache has no Mooncake remote backend: nothing to do)."""
    conn = lm.mooncake_connector(eng)
    if conn is None:
        return None
    existing = getattr(conn, "bsr_checksums", None)
    if isinstance(existing, Checksums):
        existing.load_unverified = load_unverified
        return existing
    cs = Checksums(conn, load_unverified=load_unverified)
    conn.bsr_checksums = cs
    return cs


def chunk_of(keys: Sequence[Any], key: str) -> int | None:
    """The index, among a request's chunk keys (in order), of the chunk whose LMCache key is ``key``."""
    for i, k in enumerate(keys):
        if (k if isinstance(k, str) else k.to_string()) == key:
            return i
    return None
