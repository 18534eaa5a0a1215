"""Chunk hashing, object keys and synthetic prompts.

Chunk hashes are prefix-chained over ``chunk_size`` tokens (a chunk's hash covers every token before it), so a
key names a chunk *in its context*. Keys use LMCache's string form
``model@world_size@worker_id@<chunk hash hex>@<dtype>``; with several KV groups the group is folded into the
model field (``model:group``) so each group's objects are addressable on their own.

The hash is SHA-256 based and independent of PYTHONHASHSEED (the classic cause of "hit rate 0" across processes
with Python's builtin hash).
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Sequence

from bsr_cli.core.registration import Registration
from bsr_cli.errors import InvalidInput

_SEED = hashlib.sha256(b"bsr-chunk-hash-v1").digest()
DEFAULT_VOCAB = 32_000
# The key of the checksum that bsr's LMCache plugins store next to each LMCache object in Mooncake (the object's key
# plus this suffix; its layout: core/integrity.py). A held object without one was stored by stock LMCache: unverified.
CHECKSUM_SIDECAR_SUFFIX = "#bsr-crc32c"


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):
        raise InvalidInput("tokens must be integers in [0, 2^32)", hint="token ids are integers in [0, 2^32)") from None


def chunk_hashes(tokens: Sequence[int], chunk_size: int) -> list[str]:
    """Prefix-chained hash of every chunk (the last may be partial), 16 hex digits each."""
    if chunk_size <= 0:
        raise InvalidInput("chunk_size must be positive", hint="give a positive chunk size")
    raw = tokens_to_bytes(tokens)
    step = 4 * chunk_size
    out: list[str] = []
    prev = _SEED
    for off in range(0, len(raw), step):
        prev = hashlib.sha256(prev + raw[off : off + step]).digest()
        out.append(prev[:8].hex())
    return out


def prompt_hash(tokens: Sequence[int]) -> str:
    """Identity of a whole prompt (used to key force-local markers and requests)."""
    return hashlib.sha256(tokens_to_bytes(tokens)).hexdigest()[:16]


def group_dtype(reg: Registration, group: str) -> str:
    dtypes = {t.dtype for t in reg.tensors_of(group)}
    return dtypes.pop() if len(dtypes) == 1 else "mixed"


def object_key(reg: Registration, rank: int, group: str, chunk_hash: str) -> str:
    model = reg.model if len(reg.groups) == 1 else f"{reg.model}:{group}"
    return f"{model}@{reg.tp_size}@{rank}@{chunk_hash}@{group_dtype(reg, group)}"


def parse_key(key: str) -> tuple[str, int, int, str, str]:
    """Split an LMCache-form key into (model, world_size, worker_id, chunk_hash, dtype)."""
    parts = key.rsplit("@", 4)
    if len(parts) != 5:
        raise InvalidInput(
            f"not an LMCache-form key: {key!r}", hint="LMCache keys read MODEL@WORLD_SIZE@WORKER@HASH@DTYPE"
        )
    model, ws, worker, chash, dtype = parts
    try:
        return model, int(ws), int(worker), chash, dtype
    except ValueError:
        raise InvalidInput(
            f"not an LMCache-form key: {key!r}", hint="LMCache keys read MODEL@WORLD_SIZE@WORKER@HASH@DTYPE"
        ) from None


def synthetic_tokens(n: int, seed: int = 0, vocab: int = DEFAULT_VOCAB) -> list[int]:
    """A deterministic pseudo-random prompt: the same (n, seed) gives the same tokens everywhere."""
    if n < 0:
        raise InvalidInput("--synthetic needs a non-negative token count", hint="e.g. --synthetic 65536")
    words = array("I")
    words.frombytes(random.Random(seed).randbytes(4 * n))
    return [w % vocab for w in words]
