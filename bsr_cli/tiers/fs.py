"""`FilesystemTier`: the local-SSD tier, one file per object under a directory.

File name: ``<root>/<h[:2]>/<h>.bsr`` with ``h = sha256(key)`` (fixed length, filesystem-safe for any key; the
two-character fan-out keeps directories small). The key itself is kept in the header, so a file maps back to its
key and a misplaced or colliding file is detected rather than served.

File layout: a 24-byte header, the key (UTF-8), then the payload::

    magic "BSRF" | version u16 | key length u16 | object checksum u32 | header crc32c u32 | payload length u64

The object checksum is CRC32C over the key, the payload length and the payload (``core.integrity``): the runtime
verifies it against the key it asked for, so a payload that belongs to another chunk fails as a damaged one.
``header crc32c`` covers the header (with that field zero) and the key, so any damage to the header is reported as
IO_ERROR, as is a file holding another key or a payload length other than the one asked for. Files of earlier
formats (version 1: zlib CRC32; version 2: a checksum of the payload alone) are evicted when read, or when a scrub
reaches them: that read fails closed, and the next pass recomputes and rewrites them (docs/mixed-deployments.md).

Health is what a write sees: ``health()`` writes (and removes) a small probe file, and remembers the last put's
failure, so a full (ENOSPC) or read-only (EROFS) directory is reported with its reason even while it still lists.
A damaged object is not just refused: the tier is a ``RepairableTier``. After a failed restore (and in a scrub,
bsr_cli/runtime/scrub.py) the rank reads objects back whole (``check_stored``, ``check_all``) and, when one's stored
bytes fail their bound checksum (``core.integrity``, over key, length and payload) or its header, moves it under
``<root>/quarantine/`` (``set_aside``, with a small JSON note of key, reason and time) where the incident bundle
finds it; the tier then no longer holds the chunk, and the next store writes it again from a good source.

Reads go straight from the file into the staging slice (``os.preadv`` into its memoryview: no intermediate
buffer), in chunks so the deadline is checked between chunks. Writes are atomic: a temporary file in the same
directory, optionally fsync'ed, then ``os.replace``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from bsr_cli.api.ranks import QuarantinedObject
from bsr_cli.core.evidence import TierCondition
from bsr_cli.core.units import format_bytes
from bsr_cli.runtime.checksum import crc32c, object_checksum
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

__all__ = ["HEADER_BYTES", "FilesystemTier"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<4sHHIIQ")
_MAGIC = b"BSRF"
_VERSION = 3  # 3: the object checksum covers the key and the length (2: the payload alone)
HEADER_BYTES = _HEADER.size  # 24
_SUFFIX = ".bsr"
_MAX_KEY_BYTES = 0xFFFF
_DEFAULT_CHUNK = 4 << 20
# After the deadline, loads already running stop at their next chunk boundary; wait this long for them so that
# no thread writes into a staging slice after get_into returned.
_STRAGGLER_GRACE_S = 2.0
QUARANTINE_DIR = "quarantine"
_PROBE_BYTES = 4096  # one page: a full filesystem refuses even this


def _write_condition(exc: OSError) -> TierCondition:
    """What a failed write says about the directory."""
    if exc.errno == errno.EROFS:
        return TierCondition.READ_ONLY
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierCondition.FULL
    return TierCondition.NOT_WRITABLE


def _os_error(exc: OSError) -> str:
    """An OSError as one line with its errno name: "No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(exc.errno or 0)
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def _older_format(version: int) -> str:
    return f"written by an older bsr (format v{version}, its checksum covers the bytes alone)"


def _format_version(path: Path) -> int | None:
    """The format version in a bsr object file's header; None when it is not one (or cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        return None
    if len(head) != HEADER_BYTES:
        return None
    magic, version, *_ = _HEADER.unpack(head)
    return int(version) if magic == _MAGIC else None


def _header_crc(header_with_zero_crc: bytes, key: bytes) -> int:
    return crc32c(header_with_zero_crc + key)


def _encode_header(key: bytes, payload_crc: int, length: int) -> bytes:
    bare = _HEADER.pack(_MAGIC, _VERSION, len(key), payload_crc & 0xFFFFFFFF, 0, length)
    return _HEADER.pack(_MAGIC, _VERSION, len(key), payload_crc & 0xFFFFFFFF, _header_crc(bare, key), length) + key


class FilesystemTier:
    """The `Tier` over a directory. `load_concurrency` objects are read at once (1 = the serial loader, in the
    caller's thread; N > 1 = a pool of N threads filling the same preallocated slices). `fsync=True` makes each
    put durable before it returns (slower); without it a crash can lose recent puts but never leaves a torn
    object, since files only appear by rename."""

    name = "fs"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        load_concurrency: int = 1,
        fsync: bool = False,
        create: bool = True,
        read_chunk_bytes: int = _DEFAULT_CHUNK,
    ) -> None:
        self.root = Path(root)
        if create:
            # Stored KV is the users' prompts: owner-only, whatever the umask (objects 0600, directories 0700).
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                self.root.chmod(0o700)
        elif not self.root.is_dir():
            raise TierUnavailable(f"fs tier directory {self.root} does not exist")
        if read_chunk_bytes <= 0:
            raise ValueError("read_chunk_bytes must be positive")
        self.fsync = fsync
        self.read_chunk_bytes = read_chunk_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._load_concurrency = 1
        self.load_concurrency = load_concurrency
        # The last put's failure (None once a put succeeds): a directory with room for the health probe but not
        # for an object is still full for the objects.
        self._write_fault: tuple[TierCondition, str] | None = None

    # ------------------------------------------------------------------------------------------- knobs

    @property
    def load_concurrency(self) -> int:
        return self._load_concurrency

    @load_concurrency.setter
    def load_concurrency(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"load_concurrency must be >= 1, got {value}")
        old = None
        with self._pool_lock:
            if value != self._load_concurrency:
                old, self._pool = self._pool, None
            self._load_concurrency = value
        if old is not None:
            old.shutdown(wait=False)  # loads already submitted to it still run to completion

    def _submit_all(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], deadline: float
    ) -> list[Future[tuple[int, int | None]]]:
        # Under the lock, so a concurrent change of load_concurrency cannot shut the pool down mid-submission.
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._load_concurrency, thread_name_prefix="bsr-fs-load")
            return [self._pool.submit(self._load_one, k, d, deadline) for k, d in zip(keys, dests, strict=True)]

    # ------------------------------------------------------------------------------------------- paths

    def path_for(self, key: str) -> Path:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.root / digest[:2] / f"{digest}{_SUFFIX}"

    def _files(self) -> Iterator[Path]:
        yield from self.root.glob(f"??/*{_SUFFIX}")

    def read_key(self, path: str | os.PathLike[str]) -> str:
        """The key stored in an object file's header (the reverse of `path_for`). Raises OSError if corrupt."""
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            if len(head) != HEADER_BYTES:
                raise OSError(f"{path}: truncated header")
            magic, version, key_len, _crc, _hcrc, _len = _HEADER.unpack(head)
            if magic != _MAGIC or version != _VERSION:
                raise OSError(f"{path}: not a bsr object file")
            key = f.read(key_len)
        return key.decode("utf-8", "replace")

    def keys(self) -> list[str]:
        """Every key the tier holds (reads each header; for tests and tooling, not the hot path)."""
        found = []
        for path in self._files():
            with contextlib.suppress(OSError):
                found.append(self.read_key(path))
        return found

    # ------------------------------------------------------------------------------------------- Tier

    def health(self) -> TierHealth:
        if not self.root.is_dir():
            return TierHealth(False, f"directory {self.root} does not exist", TierCondition.DIRECTORY_GONE)
        probe = self.root / f".health.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, bytes(_PROBE_BYTES))
            finally:
                os.close(fd)
        except OSError as exc:
            return TierHealth(
                False, f"directory {self.root}: a write fails: {_os_error(exc)}{self._space()}", _write_condition(exc)
            )
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        fault = self._write_fault
        if fault is not None:
            return TierHealth(False, f"directory {self.root}: the last put failed: {fault[1]}{self._space()}", fault[0])
        return TierHealth(
            True, f"directory {self.root} writable{self._space()}; load_concurrency={self._load_concurrency}"
        )

    def _space(self) -> str:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return ""
        return f"; {format_bytes(st.f_bavail * st.f_frsize)} free of {format_bytes(st.f_blocks * st.f_frsize)}"

    def _evict_stale(self, path: Path, version: int) -> None:
        log.warning("fs tier: evicting %s, written by an earlier bsr (format v%d, now v%d)", path, version, _VERSION)
        with contextlib.suppress(OSError):  # already gone, or not ours to remove: the read fails closed either way
            path.unlink()

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        """stat() only. Keys not probed by the deadline count as absent (a false miss is safe: it recomputes)."""
        if keys and not self.root.is_dir():
            raise TierUnavailable(f"fs tier directory {self.root} is gone")
        deadline = time.monotonic() + timeout_s
        hits = []
        for key in keys:
            if time.monotonic() > deadline:
                hits.append(False)
                continue
            try:
                st = os.stat(self.path_for(key))
            except OSError:
                hits.append(False)
                continue
            hits.append(stat.S_ISREG(st.st_mode) and st.st_size >= HEADER_BYTES)
        return hits

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        """Write each object atomically (tmp + rename). Raises TierUnavailable if the directory is gone, OSError
        naming the key otherwise; objects written before a failure stay (each is complete and immutable)."""
        n = len(keys)
        if len(payloads) != n or len(checksums) != n:
            raise ValueError(f"put: {n} keys, {len(payloads)} payloads, {len(checksums)} checksums")
        if n and not self.root.is_dir():
            raise TierUnavailable(f"fs tier directory {self.root} is gone")
        for key, payload, crc in zip(keys, payloads, checksums, strict=True):
            try:
                self._write_one(key, payload, crc)
            except OSError as exc:
                self._write_fault = (_write_condition(exc), _os_error(exc))
                raise OSError(exc.errno, f"fs put of {key!r} failed: {_os_error(exc)}") from exc
        if n:
            self._write_fault = None

    def _write_one(self, key: str, payload: memoryview, crc: int) -> None:
        """One object file; ``crc`` is its object checksum (``runtime.checksum.object_checksum``)."""
        keyb = key.encode("utf-8")
        if len(keyb) > _MAX_KEY_BYTES:
            raise ValueError(f"key longer than {_MAX_KEY_BYTES} bytes")
        view = payload if isinstance(payload, memoryview) else memoryview(payload)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        path = self.path_for(key)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            try:
                pending = [memoryview(_encode_header(keyb, crc, len(view))), view]
                while pending:  # writev may write less than asked
                    done = os.writev(fd, pending)
                    while pending and done >= len(pending[0]):
                        done -= len(pending[0])
                        pending.pop(0)
                    if pending and done:
                        pending[0] = pending[0][done:]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:  # make the rename itself durable
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        n = len(keys)
        if len(dests) != n:
            raise ValueError(f"get_into: {n} keys but {len(dests)} destinations")
        if n == 0:
            return [], []
        if not self.root.is_dir():
            return [UNAVAILABLE] * n, [None] * n
        deadline = time.monotonic() + timeout_s
        codes: list[int] = [TIMED_OUT] * n
        sums: list[int | None] = [None] * n
        if self._load_concurrency == 1 or n == 1:
            for i, (key, dest) in enumerate(zip(keys, dests, strict=True)):
                if time.monotonic() > deadline:
                    break  # the rest stay TIMED_OUT
                codes[i], sums[i] = self._load_one(key, dest, deadline)
            return codes, sums

        futs = self._submit_all(keys, dests, deadline)
        wait(futs, timeout=max(deadline - time.monotonic(), 0.0))
        for fut in futs:
            fut.cancel()  # not started by the deadline: stays TIMED_OUT
        running = [f for f in futs if not f.done()]
        if running:  # they notice the deadline at their next chunk; never return while one may still write
            _, late = wait(running, timeout=_STRAGGLER_GRACE_S)
            if late:
                log.warning("fs tier: %d load(s) still running %.1f s past the deadline", len(late), _STRAGGLER_GRACE_S)
        for i, fut in enumerate(futs):
            if fut.done() and not fut.cancelled():
                exc = fut.exception()
                if exc is None:
                    codes[i], sums[i] = fut.result()
                else:
                    codes[i] = IO_ERROR
        return codes, sums

    def _load_one(self, key: str, dest: StagingSlice, deadline: float) -> tuple[int, int | None]:
        """Read one object into its slice: (bytes written, its stored object checksum) or (negative code, None)."""
        if time.monotonic() > deadline:
            return TIMED_OUT, None
        keyb = key.encode("utf-8")
        view = dest.view
        size = len(view)
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return (MISSING if self.root.is_dir() else UNAVAILABLE), None
        except OSError:
            return IO_ERROR, None
        try:
            head = os.pread(fd, HEADER_BYTES + len(keyb), 0)  # header and key in one read: we know the key
            if len(head) != HEADER_BYTES + len(keyb):
                return IO_ERROR, None
            magic, version, key_len, crc, hcrc, length = _HEADER.unpack_from(head)
            if magic == _MAGIC and version < _VERSION:
                self._evict_stale(path, version)
                return IO_ERROR, None
            if magic != _MAGIC or version != _VERSION or key_len != len(keyb):
                return IO_ERROR, None
            bare = _HEADER.pack(magic, version, key_len, crc, 0, length)
            if hcrc != _header_crc(bare, head[HEADER_BYTES:]) or head[HEADER_BYTES:] != keyb:
                return IO_ERROR, None
            if length != size:
                return IO_ERROR, None
            offset = HEADER_BYTES + key_len
            pos = 0
            while pos < size:
                if time.monotonic() > deadline:
                    return TIMED_OUT, None
                got = os.preadv(fd, [view[pos : pos + self.read_chunk_bytes]], offset + pos)
                if got <= 0:
                    return IO_ERROR, None  # file shorter than its header says
                pos += got
            return size, crc
        except OSError:
            return IO_ERROR, None
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # ------------------------------------------------------------------------------------------- repair

    def _damage(self, data: bytes, path: Path, key: str | None) -> tuple[str | None, str | None]:
        """(the key the file holds, why its bytes are damaged or None when intact). ``key``: the key it must hold
        (None: any, as long as the file lies where that key's file belongs)."""
        if len(data) < HEADER_BYTES:
            return None, "truncated header"
        magic, version, key_len, crc, hcrc, length = _HEADER.unpack_from(data)
        stored_key = data[HEADER_BYTES : HEADER_BYTES + key_len]
        if magic == _MAGIC and version < _VERSION:  # an older bsr's: not trusted, evicted by ``set_aside``
            return stored_key.decode("utf-8", "replace") or None, _older_format(version)
        if magic != _MAGIC or version != _VERSION:
            return None, "not a bsr object file of this format"
        if hcrc != _header_crc(_HEADER.pack(magic, version, key_len, crc, 0, length), stored_key):
            return None, "header checksum mismatch"
        held = stored_key.decode("utf-8", "replace")
        if (key is not None and stored_key != key.encode("utf-8")) or self.path_for(held) != path:
            return held, "the file holds another key"
        payload = memoryview(data)[HEADER_BYTES + key_len :]
        if len(payload) != length:
            return held, f"payload is {len(payload)} bytes, its header says {length}"
        if object_checksum(held, payload) != crc:
            return held, "checksum mismatch (its bytes, or the chunk they belong to)"
        return held, None

    def _check_file(self, path: Path, key: str | None) -> StoredCheck:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            if not self.root.is_dir():
                raise TierUnavailable(f"fs tier directory {self.root} is gone") from None
            return StoredCheck(ref=str(path), key=key, held=False)
        except OSError as exc:
            return StoredCheck(ref=str(path), key=key, damage=f"unreadable: {_os_error(exc)}")
        held, why = self._damage(data, path, key)
        version = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        return StoredCheck(ref=str(path), key=key or held, bytes=len(data), damage=why, version=version)

    def check_stored(self, key: str) -> StoredCheck:
        """The object of ``key`` read back whole from disk and checked (header, key, length, and the object checksum
        over key, length and payload)."""
        return self._check_file(self.path_for(key), key)

    def check_all(self, shard: int, shards: int) -> Iterator[StoredCheck]:
        """Every object file in this shard's fan-out directories (directory ``xy`` belongs to shard
        ``0xxy % shards``), each read back and checked when reached. A file whose header cannot be read is still
        checked (and damaged): it is found by where it lies, not by its key."""
        if not self.root.is_dir():
            raise TierUnavailable(f"fs tier directory {self.root} is gone")
        for sub in sorted(self.root.glob("??")):
            try:
                mine = int(sub.name, 16) % max(shards, 1) == shard
            except ValueError:
                continue  # not a fan-out directory
            if not mine or not sub.is_dir():
                continue
            for path in sorted(sub.glob(f"*{_SUFFIX}")):
                found = self._check_file(path, None)
                if found.held:
                    yield found

    def set_aside(self, found: StoredCheck, reason: str) -> QuarantinedObject | None:
        """Move a damaged object file under ``quarantine/`` with a JSON note (key, reason, time, size), unless it
        changed since it was checked (a store rewrote it: that object is not the damaged one). A file of an older
        format is evicted instead, as a read evicts it: bsr wrote it, so nothing is lost (docs/mixed-deployments.md)."""
        path = Path(found.ref)
        qdir = self.root / QUARANTINE_DIR
        at = time.time()
        dest = qdir / f"{path.stem}.{time.time_ns()}{_SUFFIX}"
        try:
            st = path.stat()
            if found.version and f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}" != found.version:
                return None
            if (version := _format_version(path)) is not None and version < _VERSION:
                return self._evict_older(path, found, reason, st.st_size)
            qdir.mkdir(mode=0o700, exist_ok=True)
            os.replace(path, dest)
        except FileNotFoundError:
            return None  # not held any more (set apart by a concurrent check, or removed)
        except OSError as exc:
            # Could not set it apart (read-only directory): remove nothing, the restore already failed closed.
            log.warning("fs tier: could not quarantine %s (%s): %s", path, reason, exc)
            return None
        key = found.key or f"(unreadable header) {path.name}"
        entry = QuarantinedObject(key=key, file=str(dest), reason=reason, at=at, bytes=st.st_size)
        with contextlib.suppress(OSError):  # the note is for people; the moved file is what matters
            dest.with_suffix(".json").write_text(
                json.dumps({"key": key, "reason": reason, "at": at, "bytes": st.st_size}) + "\n"
            )
        log.warning("fs tier: quarantined %s for key %s: %s", dest, key, reason)
        return entry

    def _evict_older(self, path: Path, found: StoredCheck, reason: str, size: int) -> QuarantinedObject | None:
        try:
            path.unlink()
        except FileNotFoundError:
            return None  # a read evicted it first
        except OSError as exc:
            log.warning("fs tier: could not evict %s (%s): %s", path, reason, exc)
            return None
        key = found.key or f"(older format) {path.name}"
        log.warning("fs tier: evicted %s for key %s: %s", path, key, reason)
        return QuarantinedObject(key=key, file="", reason=reason, at=time.time(), bytes=size)

    def quarantined(self, limit: int) -> tuple[list[QuarantinedObject], int]:
        """The newest ``limit`` quarantined objects, and how many there are."""
        qdir = self.root / QUARANTINE_DIR
        entries = []
        for note in qdir.glob("*.json"):
            try:
                d = json.loads(note.read_text())
                entries.append(
                    QuarantinedObject(
                        key=str(d["key"]),
                        file=str(note.with_suffix(_SUFFIX)),
                        reason=str(d["reason"]),
                        at=float(d["at"]),
                        bytes=int(d["bytes"]),
                    )
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a note someone damaged or is writing: the object itself is still there
        entries.sort(key=lambda e: e.at, reverse=True)
        return entries[: max(limit, 0)], len(entries)

    # ------------------------------------------------------------------------------------------- extras

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Delete objects; True per key that existed."""
        out = []
        for key in keys:
            try:
                os.unlink(self.path_for(key))
                out.append(True)
            except FileNotFoundError:
                out.append(False)
        return out

    def remove_all(self) -> int:
        """Delete every object file (and leftover temporary files). Returns the number of objects removed."""
        count = 0
        for path in list(self._files()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                count += 1
        for tmp in self.root.glob("??/.*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return count

    def __enter__(self) -> FilesystemTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
