"""LMCache 0.5.6's chunk keys, reproduced so bsr can probe a store LMCache wrote without running LMCache.

What LMCache does (``lmcache/utils.py`` CacheEngineKey, ``lmcache/v1/token_database.py``), and what this module
reproduces:

* Key string: ``model@world_size@worker_id@<chunk hash hex>@<dtype>[@tag%value...]``. The hex is Python's
  ``f"{h:x}"`` of a signed int, so it may start with '-'. The dtype is LMCache's own name for the torch dtype
  (``half``, ``float``, ``bfloat16``, ``fp8_e4m3fn``, ...), not torch's. Request tags (``lmcache.tag.<k>`` entries
  of a request's configs) follow as ``@k%v`` in the order the request gave them.
* Chunk hashes: with the default ``pre_caching_hash_algorithm: builtin``, chunk i's hash is
  ``hash((prefix, tuple(chunk_tokens), ()))`` with ``prefix`` the previous chunk's hash. Python's ``hash`` of a
  tuple of ints does not depend on PYTHONHASHSEED. With ``save_unfull_chunk: False`` only full chunks are stored;
  with ``save_unfull_chunk: True`` the partial last chunk is stored too, hashed the same way over its fewer tokens.
* Tag values may hold '@' (``user%alice@example.com``): a key's fields after the dtype are tags, and a piece with
  no '%' continues the previous tag's value.
* The chain's start: 0 when vLLM is not importable. When it is (LMCache inside vLLM), LMCache takes vLLM's
  ``NONE_HASH`` instead, which vLLM sets to ``hash(os.environ["PYTHONHASHSEED"])`` (the seed's *string*, hashed
  by the builtin hash of a process running with that seed), or to 32 random bytes when PYTHONHASHSEED is unset:
  then no other process can ever reproduce the keys. `vllm_seeded_start` computes that start without running
  vLLM: CPython's SipHash-1-3 string hash (3.11 and later) keyed the way CPython keys it from PYTHONHASHSEED.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from bsr_cli.errors import InvalidInput

NONE_HASH = 0

# LMCache's dtype name in keys (TORCH_DTYPE_TO_STR_DTYPE in lmcache/utils.py), for every spelling an operator may
# type: bsr's short names, torch's names and LMCache's own.
_LMCACHE_NAMES = {
    "half": ("fp16", "float16", "half"),
    "bfloat16": ("bf16", "bfloat16"),
    "float": ("fp32", "float32", "float"),
    "double": ("fp64", "float64", "double"),
    "int8": ("int8",),
    "uint8": ("uint8",),
    "int16": ("int16",),
    "int32": ("int32",),
    "int64": ("int64",),
    "bool": ("bool",),
    "fp8_e4m3fn": ("fp8", "fp8_e4m3", "fp8_e4m3fn", "float8_e4m3fn"),
    "fp8_e4m3fnuz": ("fp8_e4m3fnuz", "float8_e4m3fnuz"),
    "fp8_e5m2": ("fp8_e5m2", "float8_e5m2"),
    "fp8_e5m2fnuz": ("fp8_e5m2fnuz", "float8_e5m2fnuz"),
}
LMCACHE_DTYPES: dict[str, str] = {alias: name for name, aliases in _LMCACHE_NAMES.items() for alias in aliases}
KEY_DTYPES = frozenset(_LMCACHE_NAMES)
# bsr's flag spelling for each LMCache key dtype (what a diagnosis tells the user to pass).
DTYPE_FLAG = {name: aliases[0] for name, aliases in _LMCACHE_NAMES.items()}


def lmcache_dtype(name: str) -> str:
    """LMCache's key name for a dtype spelled any usual way (``fp16`` -> ``half``)."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in LMCACHE_DTYPES:
        raise InvalidInput(
            f"unknown KV dtype {name!r} for LMCache keys", hint="use one of: " + ", ".join(sorted(LMCACHE_DTYPES))
        )
    return LMCACHE_DTYPES[key]


def parse_tags(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` items (the ``lmcache.tag.`` prefix optional) as LMCache's ordered tag pairs. A value may hold
    '@' (LMCache writes it verbatim); the key may not hold '@' or '%' (the key string could not be read back)."""
    out = []
    for item in items:
        k, sep, v = item.partition("=")
        k = k.strip().removeprefix("lmcache.tag.")
        # After an '@', "x%y" would read back as a new tag x=y.
        ambiguous = any(piece.partition("%")[0] and "%" in piece for piece in v.split("@")[1:])
        if not sep or not k or "@" in k or "%" in k or ambiguous:
            raise InvalidInput(
                f"bad tag {item!r}",
                hint="write --tag KEY=VALUE (no '@' or '%' in the key; in the value, no 'x%y' after an '@')",
            )
        out.append((k, v))
    return tuple(out)


def lmcache_chunk_hashes(
    tokens: Sequence[int], chunk_size: int = 256, start: int = NONE_HASH, *, limit: int | None = None
) -> list[int]:
    """LMCache's prefix-chained hash of every full chunk (the first `limit` only, if given), from `start`."""
    if chunk_size <= 0:
        raise InvalidInput("chunk_size must be positive", hint="give a positive chunk size")
    out: list[int] = []
    prefix = start
    end = len(tokens) - chunk_size + 1
    if limit is not None:
        end = min(end, limit * chunk_size)
    for i in range(0, end, chunk_size):
        prefix = hash((prefix, tuple(tokens[i : i + chunk_size]), ()))
        out.append(prefix)
    return out


def lmcache_tail_hash(tokens: Sequence[int], chunk_size: int, last_full_hash: int) -> int | None:
    """The hash of the partial last chunk, which LMCache stores only with ``save_unfull_chunk: True``; None when
    the prompt ends on a chunk boundary. `last_full_hash` is the last full chunk's hash (the start if none)."""
    tail = len(tokens) % chunk_size
    if not tail:
        return None
    return hash((last_full_hash, tuple(tokens[len(tokens) - tail :]), ()))


def next_chunk_hash(prefix_hash: int, chunk_tokens: Sequence[int]) -> int:
    """The chain's next link: what LMCache hashes a chunk to after the chunk whose hash is `prefix_hash`."""
    return hash((prefix_hash, tuple(chunk_tokens), ()))


def lmcache_key(
    model: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str, tags: Sequence[tuple[str, str]] = ()
) -> str:
    """The key string LMCache writes; `dtype` is LMCache's name (see `lmcache_dtype`)."""
    s = f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}"
    if tags:
        s += "@" + "@".join(f"{k}%{v}" for k, v in tags)
    return s


@dataclass(frozen=True)
class ParsedKey:
    model: str
    world_size: int
    worker_id: int
    chunk_hash: str  # hex as written
    dtype: str  # LMCache's name
    tags: tuple[tuple[str, str], ...] = ()
    layer_id: int | None = None  # LayerCacheEngineKey (layerwise mode)


_INT = re.compile(r"\d+")
_HEX = re.compile(r"-?[0-9a-f]+")


def parse_lmcache_key(key: str) -> ParsedKey | None:
    """A key string LMCache wrote, or None when it is not one. Finds the fields by their shape, so a model name with
    '@' in it and trailing tags both parse (LMCache itself splits from the left)."""
    parts = key.strip().split("@")
    for i in range(1, len(parts) - 3):
        ws, wid, h, dt = parts[i : i + 4]
        if not (_INT.fullmatch(ws) and _INT.fullmatch(wid) and _HEX.fullmatch(h) and dt in KEY_DTYPES):
            continue
        rest = parts[i + 4 :]
        layer = None
        if rest and _INT.fullmatch(rest[0]):
            layer = int(rest[0])
            rest = rest[1:]
        tags = _tags_of(rest)
        if tags is None:
            continue
        return ParsedKey("@".join(parts[:i]), int(ws), int(wid), h, dt, tags, layer)
    return None


def _tags_of(pieces: Sequence[str]) -> tuple[tuple[str, str], ...] | None:
    """The ``k%v`` tags after a key's dtype. A piece without '%' belongs to the previous tag's value (a value
    with '@' in it); None when the first piece is not a tag."""
    tags: list[tuple[str, str]] = []
    for piece in pieces:
        k, sep, v = piece.partition("%")
        if sep and k:
            tags.append((k, v))
        elif tags:
            tags[-1] = (tags[-1][0], f"{tags[-1][1]}@{piece}")
        else:
            return None
    return tuple(tags)


# -- vLLM's seeded start: CPython's str hash under a given PYTHONHASHSEED -----------------------------------------
_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573

    def rnd() -> None:
        nonlocal v0, v1, v2, v3
        v0 = (v0 + v1) & _M64
        v2 = (v2 + v3) & _M64
        v1 = _rotl(v1, 13) ^ v0
        v3 = _rotl(v3, 16) ^ v2
        v0 = _rotl(v0, 32)
        v2 = (v2 + v1) & _M64
        v0 = (v0 + v3) & _M64
        v1 = _rotl(v1, 17) ^ v2
        v3 = _rotl(v3, 21) ^ v0
        v2 = _rotl(v2, 32)

    n = len(data)
    full = n - n % 8
    for i in range(0, full, 8):
        m = int.from_bytes(data[i : i + 8], "little")
        v3 ^= m
        rnd()
        v0 ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(data[full:], "little")
    v3 ^= b
    rnd()
    v0 ^= b
    v2 ^= 0xFF
    rnd()
    rnd()
    rnd()
    return (v0 ^ v1) ^ (v2 ^ v3)


def python_str_hash(text: str, hashseed: int) -> int:
    """``hash(text)`` in a CPython >= 3.11 process started with ``PYTHONHASHSEED=hashseed`` (64-bit build).

    CPython fills its 24-byte hash secret from the seed with an LCG (seed 0 leaves it zero), keys SipHash-1-3 with
    its first 16 bytes and hashes the string's 1/2/4-byte-per-character buffer."""
    if not 0 <= hashseed <= 4294967295:
        raise InvalidInput(
            f"PYTHONHASHSEED must be in [0, 4294967295], got {hashseed}",
            hint="--vllm-hash-seed takes the PYTHONHASHSEED vLLM ran with (0..4294967295), 'none' or 'auto'",
        )
    if not text:
        return 0
    secret = bytearray(24)
    x = hashseed
    if x:
        for i in range(24):
            x = (x * 214013 + 2531011) & 0xFFFFFFFF
            secret[i] = (x >> 16) & 0xFF
    width = max(1 if ord(c) < 256 else 2 if ord(c) < 65536 else 4 for c in text)
    data = b"".join(ord(c).to_bytes(width, "little") for c in text)
    h = _siphash13(int.from_bytes(secret[:8], "little"), int.from_bytes(secret[8:16], "little"), data)
    if h >= 1 << 63:
        h -= 1 << 64
    return -2 if h == -1 else h


def vllm_seeded_start(seed: str) -> int:
    """The chain start LMCache uses inside vLLM that ran with ``PYTHONHASHSEED=seed`` (default ``builtin`` hash)."""
    s = str(seed).strip()
    if not s.isdigit():
        raise InvalidInput(
            f"--vllm-hash-seed must be the PYTHONHASHSEED vLLM ran with (an integer), got {seed!r}",
            hint="with PYTHONHASHSEED unset or 'random', vLLM seeds the chain with random bytes: no other process "
            "can find those keys; set PYTHONHASHSEED for vLLM and store again",
        )
    return python_str_hash(s, int(s))


__all__ = [
    "DTYPE_FLAG",
    "KEY_DTYPES",
    "LMCACHE_DTYPES",
    "NONE_HASH",
    "ParsedKey",
    "lmcache_chunk_hashes",
    "lmcache_dtype",
    "lmcache_key",
    "lmcache_tail_hash",
    "next_chunk_hash",
    "parse_lmcache_key",
    "parse_tags",
    "python_str_hash",
    "vllm_seeded_start",
]
