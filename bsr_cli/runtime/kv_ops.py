"""The rank ops that only touch destination KV, shared by every rank host built on PagedKV (the embedded engine's
worker, the LMCache plugin's rank). Kept free of torch so the processes that only route ops need not load it."""

from __future__ import annotations

from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from bsr_cli.runtime.paged_kv import PagedKV


class KVOps:
    kv: PagedKV

    def prefill(self, req: PrefillRequest) -> PrefillResult:
        return PrefillResult(self.kv.prefill(req.hashes, req.n_tokens, req.first_chunk, req.block_tables))

    def output_hash(self, req: OutputHashRequest) -> OutputHashResult:
        return OutputHashResult(self.kv.output_hash(req.block_tables, req.n_tokens))

    def canonical_hash(self, req: CanonicalHashRequest) -> CanonicalHashResult:
        return CanonicalHashResult(self.kv.canonical_hash(req.hashes, req.n_tokens))

    def invalidate(self, req: InvalidateRequest) -> InvalidateResult:
        self.kv.invalidate(req.block_tables)
        return InvalidateResult()
