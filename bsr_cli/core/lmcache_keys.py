"""LMCache's chunk keys, reproduced so bsr can probe a store that LMCache wrote without running LMCache.

LMCache 0.5.x hashes each full chunk as ``hash((prefix_hash, tuple(chunk_tokens), ()))`` starting from 0, with
Python's builtin ``hash`` when vLLM's hash functions are not importable. ``hash`` of a tuple of ints does not depend
on PYTHONHASHSEED, so these keys are stable across processes. (With vLLM present, LMCache seeds its starting hash
randomly unless PYTHONHASHSEED is set: the classic cause of "hit rate 0" across restarts.) Only full chunks are
stored (``save_unfull_chunk`` is off by default). Keys read ``model@world_size@worker_id@<hash hex>@<dtype>``; the
hex may start with '-'.
"""

from __future__ import annotations

from collections.abc import Sequence

from bsr_cli.errors import InvalidInput

NONE_HASH = 0
# Torch dtype names as LMCache writes them in keys.
LMCACHE_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "uint8": "uint8",
}


def lmcache_chunk_hashes(tokens: Sequence[int], chunk_size: int = 256) -> list[int]:
    if chunk_size <= 0:
        raise InvalidInput("chunk_size must be positive")
    out: list[int] = []
    prefix = NONE_HASH
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        prefix = hash((prefix, tuple(tokens[start : start + chunk_size]), ()))
        out.append(prefix)
    return out


def lmcache_key(model: str, world_size: int, worker_id: int, chunk_hash: int, dtype: str) -> str:
    return f"{model}@{world_size}@{worker_id}@{chunk_hash:x}@{dtype}"
