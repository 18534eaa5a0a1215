"""Token bookkeeping for the LMCache host (pure Python, no LMCache or torch).

bsr's coordinator addresses chunks by bsr's own prefix-chained chunk hashes and sends ranks only those hashes;
LMCache computes its keys from token ids (its own hash chain). The host therefore remembers, for every prompt it
is asked about, which tokens each bsr chunk hash stands for, and the ranks turn hashes back into tokens here.
Keys stay LMCache-native, so a probe sees exactly what a vLLM + LMCache deployment stored.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from bsr_cli.errors import InvalidInput


class TokenRegistry:
    """chunk hash -> (the prompt's tokens, chunk index), bounded LRU."""

    def __init__(self, chunk_size: int, max_chunks: int = 1 << 20) -> None:
        self.chunk_size = chunk_size
        self.max_chunks = max_chunks
        self._by_hash: OrderedDict[str, tuple[tuple[int, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    def register(self, tokens: Sequence[int], hashes: Sequence[str]) -> None:
        toks = tuple(tokens)
        with self._lock:
            for i, h in enumerate(hashes):
                self._by_hash[h] = (toks, i)
                self._by_hash.move_to_end(h)
            while len(self._by_hash) > self.max_chunks:
                self._by_hash.popitem(last=False)

    def tokens_for(self, hashes: Sequence[str]) -> tuple[int, ...]:
        """The tokens the chunk hashes cover (the last chunk may be partial)."""
        if not hashes:
            return ()
        with self._lock:
            got = self._by_hash.get(hashes[-1])
        if got is None or got[1] != len(hashes) - 1:
            raise InvalidInput(
                "this LMCache host cannot resolve chunk hashes it was not given tokens for: LMCache keys are "
                "computed from token ids",
                hint="send the prompt's tokens (probe/submit/restore with tokens or --synthetic)",
            )
        toks, i = got
        return toks[: min((i + 1) * self.chunk_size, len(toks))]

    def tokens_for_hash(self, chunk_hash: str) -> tuple[int, ...]:
        with self._lock:
            got = self._by_hash.get(chunk_hash)
        if got is None:
            raise InvalidInput(f"unknown chunk hash {chunk_hash}: this host was never given its tokens")
        toks, i = got
        return toks[: min((i + 1) * self.chunk_size, len(toks))]


def full_chunks(n_tokens: int, chunk_size: int) -> int:
    """LMCache stores full chunks only (save_unfull_chunk=False): the partial tail is never a hit."""
    return n_tokens // chunk_size
