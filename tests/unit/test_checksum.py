"""The object checksum (bound to the key and the length, one pass over the bytes) and the LMCache sidecar format."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable

import google_crc32c

from bsr_cli.core.integrity import (
    LEGACY_SIDECAR_BYTES,
    SIDECAR_BYTES,
    Sidecar,
    SidecarKind,
    decode_sidecar,
    encode_sidecar,
    identity_prefix,
    sidecar_key,
)
from bsr_cli.core.keys import CHECKSUM_SIDECAR_SUFFIX
from bsr_cli.runtime.checksum import RELEASES_GIL, crc32c, crc32c_at, object_checksum, object_checksum_at

KEY = "m@1@0@00aa@bfloat16"


def test_the_object_checksum_is_crc32c_over_key_length_and_bytes() -> None:
    data = bytes(range(256)) * 40
    assert object_checksum(KEY, data) == google_crc32c.value(identity_prefix(KEY, len(data)) + data)
    # The same whatever the buffer: bytes, a writable memoryview, raw memory.
    buf = bytearray(data)
    assert object_checksum(KEY, memoryview(buf)) == object_checksum(KEY, data)
    raw = (ctypes.c_ubyte * len(data)).from_buffer(buf)
    assert object_checksum_at(KEY, ctypes.addressof(raw), len(data)) == object_checksum(KEY, data)
    assert object_checksum(KEY, b"") == google_crc32c.value(identity_prefix(KEY, 0))
    # The bytes-only CRC is unchanged (the fs header's own checksum and the benches use it).
    assert crc32c(data) == google_crc32c.value(data) == crc32c_at(ctypes.addressof(raw), len(data))


def test_the_same_bytes_under_another_key_or_length_do_not_verify() -> None:
    data = b"\x01" * 4096
    crc = object_checksum(KEY, data)
    assert object_checksum("m@1@0@00ab@bfloat16", data) != crc  # another chunk's key
    assert object_checksum(KEY, data + b"\x00") != crc  # grown
    assert object_checksum(KEY, data[:-1]) != crc  # truncated
    # The key's length is hashed first, so no two keys' prefixes run into each other.
    assert identity_prefix("ab", 1) != identity_prefix("a", 1)[:-8] + b"b" + identity_prefix("a", 1)[-8:]
    assert identity_prefix("ab", 7).startswith((2).to_bytes(4, "little") + b"ab")


def test_sidecar_round_trip_and_the_formats_it_tells_apart() -> None:
    raw = encode_sidecar(0xDEADBEEF, 12345)
    assert len(raw) == SIDECAR_BYTES
    assert decode_sidecar(raw) == Sidecar(SidecarKind.BOUND, 0xDEADBEEF, 12345)
    # An older bsr's 4-byte sidecar (a CRC of the bytes alone) is read as no checksum of this format.
    assert decode_sidecar((0xDEADBEEF).to_bytes(LEGACY_SIDECAR_BYTES, "big")).kind is SidecarKind.LEGACY
    for nothing in (None, b"", b"abc", b"XXXX" + raw[4:]):  # missing, empty, unknown size, unknown magic
        assert decode_sidecar(nothing).kind is SidecarKind.NONE
    assert sidecar_key(KEY) == KEY + CHECKSUM_SIDECAR_SUFFIX


def test_large_and_small_buffers_give_the_extensions_checksum() -> None:
    """Large buffers go through the C library with the GIL released, small ones through the extension: the same
    CRC32C either way, at every size around the switch and from any start value."""
    data = os.urandom(300 * 1024)
    raw = (ctypes.c_ubyte * len(data)).from_buffer(bytearray(data))
    for size in (1, 4095, 64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1, 300 * 1024):
        expected = google_crc32c.value(data[:size])
        assert crc32c_at(ctypes.addressof(raw), size) == expected
        assert crc32c(memoryview(bytearray(data[:size]))) == expected
        assert object_checksum_at(KEY, ctypes.addressof(raw), size) == object_checksum(KEY, data[:size])


def _other_thread_ran_during(checksum: Callable[[], object], attempts: int = 400) -> bool:
    """Whether another Python thread ran while ``checksum`` (one C call over a large buffer) was running. The
    interpreter is told not to switch threads on its own, so the other thread runs only while a call has let the
    GIL go; it sleeps between looks, never keeping this thread waiting. Tried until seen, up to ``attempts`` calls
    (a busy host may not schedule it during the first few)."""
    state = {"inside": False, "seen": 0, "stop": False}

    def other() -> None:
        while not state["stop"]:
            if state["inside"]:
                state["seen"] += 1
            time.sleep(0.0005)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    thread = threading.Thread(target=other, daemon=True)
    try:
        thread.start()
        for _ in range(attempts):
            state["inside"] = True
            checksum()
            state["inside"] = False
            if state["seen"]:
                return True
        return False
    finally:
        state["stop"] = True
        thread.join(10)
        sys.setswitchinterval(switch)


def test_a_large_checksum_lets_the_other_threads_run() -> None:
    """A window's verify runs beside its install, and in a vLLM worker beside vLLM's own threads: a checksum over
    staging memory must not hold the GIL for its whole length. (The wheels bsr installs carry the C library: a
    build without it is a regression here, not a skip.)"""
    assert RELEASES_GIL
    buf = bytearray(32 << 20)
    raw = (ctypes.c_ubyte * len(buf)).from_buffer(buf)
    assert _other_thread_ran_during(lambda: object_checksum_at(KEY, ctypes.addressof(raw), len(buf)))
    # Negative control: the extension over the same memory (what the checksum did before) holds the GIL throughout,
    # and the check says so.
    assert not _other_thread_ran_during(lambda: google_crc32c.extend(0, raw), attempts=20)
