"""The object checksum (bound to the key and the length, one pass over the bytes) and the LMCache sidecar format."""

from __future__ import annotations

import ctypes

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
from bsr_cli.runtime.checksum import crc32c, crc32c_at, object_checksum, object_checksum_at

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
