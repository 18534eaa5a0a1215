"""The checksum every stored object carries: CRC32C (Castagnoli), computed by google-crc32c's C library.

The restore verifies it over every restored byte, so its speed is part of the restore's CPU budget: on the
reference machine CRC32C runs at ~13 GB/s on one core against ~4.2 GB/s for zlib's CRC32 (a ~3x smaller share of
the restore). google-crc32c is already a dependency of LMCache, so deployments carrying the plugins have it.

Large buffers are checksummed with the GIL released. google-crc32c's extension releases it only for ``bytes`` of
1 MiB or more, and the restore checksums staging memory (never ``bytes``), so through the extension a window's
verify held the GIL for every object: the install that was meant to run beside it (torch copies, which release
it) waited for the GIL instead, and so did every other Python thread of the process (a vLLM worker's among them).
The wheel's own C library (``crc32c_extend``) is called through ctypes instead, which drops the GIL for the call;
small buffers, where the GIL's hand-over costs more than the sum, stay on the extension. Where that library cannot
be found (a source build), the extension is used for everything and ``RELEASES_GIL`` is False.

A stored object's checksum (``object_checksum``) is bound to its key and length (``core.integrity``): the short
identity prefix is hashed first and the payload folded in with ``extend``, so the payload is still read once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
from collections.abc import Callable, Iterator

import google_crc32c

from bsr_cli.core.integrity import identity_prefix

__all__ = [
    "ALGORITHM",
    "IMPLEMENTATION",
    "RELEASES_GIL",
    "crc32c",
    "crc32c_at",
    "object_checksum",
    "object_checksum_at",
]

log = logging.getLogger(__name__)

ALGORITHM = "crc32c"
# "c" (hardware or table-driven C) or "python" (a pure-Python fallback, far too slow for restores).
IMPLEMENTATION: str = google_crc32c.implementation
if IMPLEMENTATION != "c":
    log.warning("google-crc32c has no C extension here: object checksums will be very slow")


# Below this many bytes the extension (GIL held for a few microseconds) is cheaper than handing the GIL over.
_RELEASE_GIL_FROM_BYTES = 64 * 1024


def _library_candidates() -> Iterator[str]:
    """Where google-crc32c's C library may be: vendored beside the package by its wheel (``google_crc32c.libs``
    on Linux, ``.dylibs`` on macOS), else installed on the system (looked up only then: it runs ldconfig)."""
    here = os.path.dirname(google_crc32c.__file__)
    yield from sorted(glob.glob(f"{here}.libs/libcrc32c*.so*")) + sorted(glob.glob(f"{here}/.dylibs/libcrc32c*"))
    system = ctypes.util.find_library("crc32c")
    if system:
        yield system


def _unlocked_extend() -> Callable[[int, int, int], int] | None:
    """``crc32c_extend(crc, ptr, size)`` of google-crc32c's C library through ctypes (which releases the GIL for
    the call), checked against the extension on a known buffer; None where no such library loads or agrees."""
    probe = bytes(range(256)) * 5
    for path in _library_candidates():
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        buf = ctypes.create_string_buffer(probe, len(probe))
        if fn(7, ctypes.addressof(buf), len(probe)) == google_crc32c.extend(7, probe):
            return lambda crc, ptr, size: int(fn(crc, ptr, size))
    return None


_unlocked = _unlocked_extend() if IMPLEMENTATION == "c" else None
# True: checksums of large buffers let the process's other threads run (see the module docstring).
RELEASES_GIL = _unlocked is not None
if not RELEASES_GIL:
    log.debug("google-crc32c's C library was not found: object checksums hold the GIL")


def _extend_at(crc: int, ptr: int, size: int) -> int:
    if size == 0:
        return crc
    if _unlocked is not None and size >= _RELEASE_GIL_FROM_BYTES:
        return _unlocked(crc, ptr, size)
    return int(google_crc32c.extend(crc, (ctypes.c_ubyte * size).from_address(ptr)))


def _extend(crc: int, data: bytes | bytearray | memoryview) -> int:
    """``crc`` extended over a C-contiguous buffer, without copying it unless it is read-only and not ``bytes``."""
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    view = data if isinstance(data, memoryview) else memoryview(data)
    if not view.c_contiguous:
        raise ValueError("checksum of a non-contiguous buffer")
    n = view.nbytes
    if n == 0:
        return crc
    if view.readonly:
        return int(google_crc32c.extend(crc, view.tobytes()))  # rare: read-only payloads (tests, bytes slices)
    return _extend_at(crc, ctypes.addressof((ctypes.c_ubyte * n).from_buffer(view.cast("B"))), n)


def crc32c_at(ptr: int, size: int) -> int:
    """CRC32C of ``size`` bytes at address ``ptr`` (a staging slice of the restore pool)."""
    return _extend_at(0, ptr, size)


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC32C of a C-contiguous buffer, without copying it unless it is read-only and not ``bytes``."""
    return _extend(0, data)


def _identity(key: str, length: int) -> int:
    return int(google_crc32c.value(identity_prefix(key, length)))


def object_checksum(key: str, data: bytes | bytearray | memoryview) -> int:
    """The checksum a stored object carries: CRC32C over its key, its length and its bytes (one pass over them)."""
    view = data if isinstance(data, (bytes, memoryview)) else memoryview(data)
    return _extend(_identity(key, view.nbytes if isinstance(view, memoryview) else len(view)), view)


def object_checksum_at(key: str, ptr: int, size: int) -> int:
    """``object_checksum`` of ``size`` bytes at address ``ptr`` (a staging slice, an LMCache memory object)."""
    return _extend_at(_identity(key, size), ptr, size)
