"""A checksum that travels with every chunk bsr's plugins store in Mooncake through LMCache, verified on every load.

LMCache 0.5.6 stores no checksum: a flipped byte in a stored chunk is loaded into the model's KV and silently
changes the output. bsr wraps LMCache's Mooncake connector (the object that moves the stored bytes, under every
LMCache store and retrieve path: the vLLM connector's and the LMCache host's):

* put: for each object not yet in the store, its checksum goes to a sidecar key in the same Mooncake store (the
  object's key + ``CHECKSUM_SIDECAR_SUFFIX``; ``core.integrity``: CRC32C over the object's key, its length and its
  bytes, and the length), written *before* the object, so a chunk that is present always has its checksum (a
  sidecar whose object never landed is harmless: the next put rewrites it);
* get: every object that arrived is checked against its sidecar, as the object of *this* key at *this* length. A
  mismatch (flipped bytes, another chunk's object copied here with its checksum, a stale registration's object, a
  grown or cut one) drops the object (LMCache's retrieve then comes back short and bsr's windowed load fails closed:
  the request recomputes), removes it and its sidecar from the store (so the recompute stores the chunk afresh)
  and is recorded with its key for the caller to name the chunk and the tier. An object the store holds that did
  not arrive is looked at too: held at another length than its sidecar's (bytes appended or cut: LMCache's get
  refuses it), it is named and removed the same way, instead of failing every load of its prefix for ever;
* an object with no checksum of this format is *unverified* (docs/mixed-deployments.md): without a sidecar (stock
  LMCache stored it) it is dropped unless ``load_unverified`` is set, and left in the store (it may be another
  deployment's); with an older bsr's sidecar (a checksum of the bytes alone, which cannot tell whose bytes they
  are) it is dropped the same way and, when dropped, removed with its sidecar, so the next store writes it again
  with a checksum bound to its key. bsr never upgrades a checksum it could not verify.

Why the connector and not LMCache's metadata: LMCache's ``save_chunk_meta`` header holds shapes and dtypes only,
and the zero-copy path (``save_chunk_meta: false``, the one bsr documents) keeps no remote metadata at all; a
sidecar survives both paths and any serde (the checksum covers the bytes as stored, after LMCache's serializer).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from bsr_cli.core.integrity import Sidecar, SidecarKind, decode_sidecar, encode_sidecar, sidecar_key
from bsr_cli.runtime.checksum import object_checksum_at

from . import _lmcache as lm

log = logging.getLogger("lmcache_bsr.integrity")

TIER = "mooncake"  # the tier whose objects are verified (bsr's name for LMCache's RemoteBackend on Mooncake)
# What an object without a checksum of this format is, in words.
_NO_CHECKSUM = {
    SidecarKind.NONE: "no checksum (stored without bsr, e.g. by stock LMCache)",
    SidecarKind.LEGACY: "an older bsr's checksum (of the bytes alone, not bound to the chunk)",
}


class Verdict(StrEnum):
    """What the check of one object found."""

    OK = "ok"
    MISMATCH = "mismatch"  # not this chunk's object: its bytes, its length or the key its checksum is bound to
    UNVERIFIED = "unverified"  # no checksum of this format stored with it (stock LMCache, or an older bsr)


@dataclass(frozen=True)
class Finding:
    """One object that did not verify: its LMCache key, what was wrong, and whether it was dropped and removed."""

    key: str
    verdict: Verdict
    dropped: bool
    tier: str = TIER
    removed: bool = False  # the object (and its checksum) was removed from the store: the next store rewrites it
    detail: str = ""  # what was wrong, in words ("checksum mismatch", "wrong length (...)", "no checksum (...)")

    def describe(self, chunk: int | None) -> str:
        """One line naming the chunk, the tier and the key: ``checksum mismatch in chunk 2 (tier mooncake, key K)``."""
        where = f"chunk {chunk}" if chunk is not None else "a chunk"
        removed = "; removed from the store" if self.removed else ""
        return f"{self.detail or self.verdict.value} in {where} (tier {self.tier}, key {self.key}){removed}"


class ChecksumError(RuntimeError):
    """A loaded chunk failed verification: the load fails closed (its message names the chunk and the tier)."""


def judge(side: Sidecar, size: int, checksum: Callable[[], int] | None) -> tuple[Verdict, str]:
    """The verdict on an object of ``size`` bytes given its sidecar; ``checksum`` computes the object's checksum
    (None: the object did not arrive, so only its length can be judged)."""
    if side.kind is not SidecarKind.BOUND:
        return Verdict.UNVERIFIED, _NO_CHECKSUM[side.kind]
    if size != side.length:
        return Verdict.MISMATCH, f"wrong length ({size:,} bytes, its checksum is for {side.length:,})"
    if checksum is not None and checksum() != side.crc:
        return Verdict.MISMATCH, "checksum mismatch"
    return Verdict.OK, ""


def checksum_of(key: str, obj: Any) -> int:
    """The object checksum of a memory object's bytes under ``key``, read in place (no copy)."""
    return object_checksum_at(key, int(obj.data_ptr), int(obj.get_size()))


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
        sides = [encode_sidecar(checksum_of(n, o), int(o.get_size())) for n, o in new]
        rc = self.store.upsert_batch([sidecar_key(n) for n, _ in new], sides)
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
        """Check every arrived object against its stored checksum (its sidecar, read in one batched call) and drop
        the ones that fail (``judge_loaded``)."""
        return self.judge_loaded([k.to_string() for k in keys], objs, [None] * len(objs))

    def judge_loaded(self, names: Sequence[str], objs: list[Any], sidecars: Sequence[bytes | None]) -> list[Any]:
        """Check every arrived object of ``names`` against its sidecar and drop (release, None) the ones that fail;
        look at the held objects that did not arrive for a length their checksum was not written for.
        ``sidecars``: each object's sidecar as read with it (b"": none stored), None where it was not read (then
        read here, in one batched call)."""
        arrived = [i for i, o in enumerate(objs) if o is not None]
        unread = [i for i in arrived if sidecars[i] is None]
        read = (
            dict(zip(unread, self.store.get_batch([sidecar_key(names[i]) for i in unread]), strict=True))
            if unread
            else {}
        )
        found: list[Finding] = []
        for i in arrived:
            obj, name = objs[i], names[i]
            side = decode_sidecar(read[i] if i in read else sidecars[i])
            verdict, detail = judge(side, int(obj.get_size()), functools.partial(checksum_of, name, obj))
            finding = self._judged(name, verdict, detail, side.kind)
            if finding is not None:
                found.append(finding)
                if finding.dropped:
                    obj.ref_count_down()
                    objs[i] = None
        if len(arrived) < len(objs):
            found += self._not_arrived([names[i] for i, o in enumerate(objs) if o is None])
        self._record(found)
        return objs

    def _not_arrived(self, names: Sequence[str]) -> list[Finding]:
        """The objects the store holds that LMCache's get could not load: named when they are held at another length
        than their checksum's (bytes appended or cut: LMCache refuses them, and every later load would too) or carry
        no checksum of this format; held at their length, what failed was the transfer (nothing to say)."""
        held = self.store.batch_is_exist(list(names))
        present = [n for n, h in zip(names, held, strict=True) if h == 1]
        if not present:
            return []
        meta = int(self.connector.remote_metadata_bytes) if getattr(self.connector, "save_chunk_meta", False) else 0
        out = []
        for name, raw in zip(present, self.store.get_batch([sidecar_key(n) for n in present]), strict=True):
            side = decode_sidecar(raw)
            size = int(self.store.get_size(name))
            if size < 0:
                continue  # gone meanwhile, or the store cannot say
            verdict, detail = judge(side, size - meta, None)
            if verdict is Verdict.OK:
                continue
            finding = self._judged(name, verdict, detail, side.kind)
            if finding is not None and finding.dropped:
                out.append(finding)
        return out

    def _judged(self, name: str, verdict: Verdict, detail: str, kind: SidecarKind) -> Finding | None:
        """The finding for one verdict (None when it is OK): dropped unless an unverified object may be loaded;
        removed with its sidecar when it is not this chunk's object, or an older bsr's that was refused."""
        self.counts[verdict] += 1
        if verdict is Verdict.OK:
            return None
        drop = verdict is Verdict.MISMATCH or not self.load_unverified
        # LMCache never overwrites a key it holds: without the removal the recompute that follows could not store
        # the chunk afresh, and every later load would fail again. A stock LMCache object is never removed (it may
        # be another deployment's, which has no other copy of its checksum-less bytes).
        remove = drop and (verdict is Verdict.MISMATCH or kind is SidecarKind.LEGACY)
        return Finding(name, verdict, drop, removed=remove and self._remove(name), detail=detail)

    def _record(self, found: Sequence[Finding]) -> None:
        if not found:
            return
        with self._lock:
            self._findings.update((f.key, f) for f in found)
        for f in found:
            if f.verdict is Verdict.MISMATCH:
                log.error("bsr: %s: not loaded", f.describe(None))

    def _remove(self, name: str) -> bool:
        try:
            rc = self.store.remove(name, True)
            self.store.remove(sidecar_key(name), True)
        except Exception as e:  # noqa: BLE001 - the load fails closed either way; removal only spares later ones
            log.warning("bsr: object %s not removed: %s", name, e)
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
