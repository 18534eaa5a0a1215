"""The rank ops that only touch destination KV, shared by every rank host built on PagedKV (the embedded engine's
worker, the LMCache plugin's rank). Kept free of torch so the processes that only route ops need not load it.

A host holds a ``KVOps`` over its KV as its ``kv_ops`` (composition: the host's own state stays its own, and
``KVOps`` needs nothing of the host but the KV); ``runtime/rank_host.RankHost`` serves the four ops from it, for
every host alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from bsr_cli.api.ranks import (
    CanonicalHashRequest,
    CanonicalHashResult,
    InvalidateRequest,
    InvalidateResult,
    OutputHashRequest,
    OutputHashResult,
    PrefillRequest,
    PrefillResult,
)


class KVDestination(Protocol):
    """What the four ops need of a rank's KV (``bsr_cli.runtime.paged_kv.PagedKV`` is one)."""

    def prefill(
        self, chunk_hashes: Sequence[str], n_tokens: int, first_chunk: int, block_tables: Mapping[str, Sequence[int]]
    ) -> int: ...

    def output_hash(self, block_tables: Mapping[str, Sequence[int]], n_tokens: int) -> dict[str, str]: ...

    def canonical_hash(self, chunk_hashes: Sequence[str], n_tokens: int) -> dict[str, str]: ...

    def invalidate(self, block_tables: Mapping[str, Sequence[int]]) -> None: ...


class KVOps:
    """The prefill, output-hash, canonical-hash and invalidate ops (bsr_cli.api.ranks.RankOps) over one KV."""

    def __init__(self, kv: KVDestination) -> None:
        self.kv = kv

    def prefill(self, req: PrefillRequest) -> PrefillResult:
        return PrefillResult(self.kv.prefill(req.hashes, req.n_tokens, req.first_chunk, req.block_tables))

    def output_hash(self, req: OutputHashRequest) -> OutputHashResult:
        return OutputHashResult(self.kv.output_hash(req.block_tables, req.n_tokens))

    def canonical_hash(self, req: CanonicalHashRequest) -> CanonicalHashResult:
        return CanonicalHashResult(self.kv.canonical_hash(req.hashes, req.n_tokens))

    def invalidate(self, req: InvalidateRequest) -> InvalidateResult:
        self.kv.invalidate(req.block_tables)
        return InvalidateResult()
