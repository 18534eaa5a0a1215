"""What a stored object's checksum covers, and how bsr's LMCache plugins store it beside an object in Mooncake.

The checksum is bound to the object's identity: CRC32C over ``identity_prefix(key, length) || payload``, where the
prefix is the key's UTF-8 length (u32 LE), the key, and the payload's length (u64 LE). A checksum over the bytes
alone cannot tell which chunk they belong to: an object written under the wrong key (a writer's bug, a copy between
deployments, a key collision) carries a checksum that matches its bytes, loads, and silently changes the output.
Bound to the key and the length, the same object fails under any key but its own and at any length but its own.
The prefix is a few dozen bytes, hashed first; the payload is then folded in with ``google_crc32c.extend``, so the
payload is still read once (``bsr_cli.runtime.checksum``).

Every path bsr writes uses it: the embedded engine's Mooncake tier (in the object's trailer), its filesystem tier
(in the header, format 3) and the LMCache plugin's sidecar (below), which the vLLM connector uses too.

The sidecar: the object's key + ``CHECKSUM_SIDECAR_SUFFIX`` holds ``magic "BSC2" | crc32c u32 BE | length u64 BE``.
A sidecar of 4 bytes was written by an older bsr (a CRC32C of the bytes alone): it is read as no checksum
(``SidecarKind.LEGACY``), as is an object with no sidecar at all (``SidecarKind.NONE``: stock LMCache stored it).
docs/mixed-deployments.md says what a load does with each.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import StrEnum

from bsr_cli.core.keys import CHECKSUM_SIDECAR_SUFFIX

__all__ = [
    "LEGACY_SIDECAR_BYTES",
    "SIDECAR_BYTES",
    "Sidecar",
    "SidecarKind",
    "decode_sidecar",
    "encode_sidecar",
    "identity_prefix",
    "sidecar_key",
]

_KEY_LEN = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_SIDECAR = struct.Struct(">4sIQ")
_SIDECAR_MAGIC = b"BSC2"
SIDECAR_BYTES = _SIDECAR.size  # 16
LEGACY_SIDECAR_BYTES = 4  # an older bsr's sidecar: CRC32C of the bytes alone, big-endian


def identity_prefix(key: str, length: int) -> bytes:
    """What the checksum covers before the payload: the key (its length first, so no two keys' prefixes run into
    each other) and the payload's length."""
    k = key.encode("utf-8")
    return _KEY_LEN.pack(len(k)) + k + _LENGTH.pack(length)


class SidecarKind(StrEnum):
    """What a sidecar key holds."""

    BOUND = "bound"  # this format: a checksum bound to the key and the length
    LEGACY = "legacy"  # an older bsr's: a checksum of the bytes alone (read as no checksum)
    NONE = "none"  # nothing (stock LMCache stored the object) or bytes of no known format


@dataclass(frozen=True)
class Sidecar:
    """A decoded sidecar: its kind and, for ``BOUND``, the checksum and the payload length it was written for."""

    kind: SidecarKind
    crc: int = 0
    length: int = 0


def sidecar_key(key: str) -> str:
    return key + CHECKSUM_SIDECAR_SUFFIX


def encode_sidecar(crc: int, length: int) -> bytes:
    return _SIDECAR.pack(_SIDECAR_MAGIC, crc & 0xFFFFFFFF, length)


def decode_sidecar(raw: bytes | None) -> Sidecar:
    """The sidecar's content (Mooncake's ``get`` answers b"" for a missing key)."""
    if raw is not None and len(raw) == SIDECAR_BYTES:
        magic, crc, length = _SIDECAR.unpack(raw)
        if magic == _SIDECAR_MAGIC:
            return Sidecar(SidecarKind.BOUND, crc, length)
    if raw is not None and len(raw) == LEGACY_SIDECAR_BYTES:
        return Sidecar(SidecarKind.LEGACY)
    return Sidecar(SidecarKind.NONE)
