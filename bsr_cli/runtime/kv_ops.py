"""The rank ops that only touch destination KV, shared by every rank host built on PagedKV (the embedded engine's
worker, the LMCache plugin's rank). Kept free of torch so the processes that only route ops need not load it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bsr_cli.runtime.paged_kv import PagedKV


class KVOps:
    kv: PagedKV

    def op_prefill(self, hashes: list[str], n_tokens: int, first_chunk: int, block_tables: dict[str, list[int]]) -> int:
        return self.kv.prefill(hashes, n_tokens, first_chunk, block_tables)

    def op_output_hash(self, block_tables: dict[str, list[int]], n_tokens: int) -> dict[str, str]:
        return self.kv.output_hash(block_tables, n_tokens)

    def op_canonical_hash(self, hashes: list[str], n_tokens: int) -> dict[str, str]:
        return self.kv.canonical_hash(hashes, n_tokens)

    def op_invalidate(self, block_tables: dict[str, list[int]]) -> None:
        self.kv.invalidate(block_tables)
