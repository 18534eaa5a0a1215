"""LMCache's KV transfer for vLLM's CPU build: copies between LMCache memory objects and vLLM's CPU paged KV cache.

LMCache 0.5.6 ships paged connectors for CUDA, XPU, MUSA and HPU only; on a CPU-only vLLM its
``CreateGPUConnector`` raises ``No supported cpu connector found`` and LMCache's vLLM adapter runs degraded (stores
and loads nothing). This is the missing piece.

vLLM's CPU attention backend (``CPU_ATTN``) keeps one tensor per layer, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``, contiguous per block, but the interior of a block is packed for the attention kernel of the
host's instruction set (vec, vec16, AMX, NEON, ...): there is no per-token K/V row to copy. So this connector moves
whole blocks: a chunk of LMCache (``chunk_size`` tokens, a multiple of vLLM's ``block_size``) is the interiors of
its ``chunk_size / block_size`` blocks, in token order, laid into LMCache's ``[2, num_layers, tokens,
num_kv_heads * head_size]`` buffer (same number of elements per layer). What LMCache stores is therefore vLLM-CPU
block interiors: readable by vLLM CPU deployments of the same model, dtype, block size and attention ISA only.

As LMCache's own connectors do: ``slot_mapping`` covers the whole token sequence, ``start``/``end`` select the
tokens of one chunk, and on a load the blocks vLLM already holds (``vllm_cached_tokens``) are not overwritten.
Anything that is not whole blocks (a chunk size that is not a multiple of the block size, a chunk whose slots are
not consecutive rows of whole blocks, a block vLLM holds only in part) raises ``ValueError``: LMCache then counts
the chunk as not loaded, and vLLM recomputes it.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_bsr.events import emit


class VLLMPagedMemCPUConnector(lm.PerChunkBatches, lm.GPUConnectorInterface):  # type: ignore[misc]
    """LMCache <-> vLLM CPU paged KV, block by block. kwargs of store/retrieve: ``kvcaches`` (the per-layer
    tensors, in layer order), ``slot_mapping`` (a LongTensor, one slot per token) and, on loads,
    ``vllm_cached_tokens``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.kvcaches: list[torch.Tensor] | None = None
        self.loaded_tokens = 0  # tokens written into vLLM's KV by to_gpu (observability and tests)
        self.stored_tokens = 0  # tokens read out of vLLM's KV by from_gpu

    @classmethod
    def from_metadata(cls, metadata: Any) -> VLLMPagedMemCPUConnector:
        """From LMCache's metadata; ``kv_shape`` is ``(num_layers, 2, chunk_size, num_kv_heads, head_size)``."""
        if getattr(metadata, "use_mla", False):
            raise ValueError("the LMCache CPU connector does not support MLA models")
        layers, _two, _chunk, heads, head_size = (int(x) for x in metadata.kv_shape)
        return cls(layers, heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_kv_heads * self.head_size])

    # -- vLLM's layout ---------------------------------------------------------------------------------------
    def _layers(self, kwargs: dict[str, Any]) -> list[torch.Tensor]:
        if "kvcaches" in kwargs:
            kv = kwargs["kvcaches"]
            self.kvcaches = list(kv.values()) if isinstance(kv, dict) else list(kv)
        if self.kvcaches is None:
            raise ValueError("'kvcaches' must be passed to the LMCache CPU connector")
        if len(self.kvcaches) != self.num_layers:
            raise ValueError(f"{len(self.kvcaches)} KV tensors for a {self.num_layers}-layer model")
        for kv in self.kvcaches:
            if kv.dim() != 4 or kv.shape[1] != self.num_kv_heads or kv.shape[3] != 2 * self.head_size:
                raise ValueError(
                    f"KV tensor of shape {tuple(kv.shape)} is not vLLM's CPU_ATTN layout "
                    f"[num_blocks, {self.num_kv_heads}, block_size, {2 * self.head_size}]"
                )
            if not kv[0].is_contiguous():
                raise ValueError("vLLM's CPU KV blocks are not contiguous: unsupported KV cache layout")
        return self.kvcaches

    @staticmethod
    def _blocks(kwargs: dict[str, Any], start: int, end: int, block_size: int) -> torch.Tensor:
        """The block ids holding tokens [start, end), one per ``block_size`` tokens; ValueError unless the
        tokens fill whole blocks, in order."""
        if "slot_mapping" not in kwargs:
            raise ValueError("'slot_mapping' must be passed to the LMCache CPU connector")
        n = end - start
        if start % block_size or n % block_size:
            raise ValueError(
                f"tokens [{start}, {end}) are not whole vLLM blocks of {block_size}: LMCache's chunk_size must be "
                "a multiple of vLLM's block_size on CPU"
            )
        slots = kwargs["slot_mapping"][start:end].to(device="cpu", dtype=torch.long)
        if len(slots) != n:
            raise ValueError(f"slot_mapping has {len(slots)} slots for tokens [{start}, {end})")
        rows = slots.view(-1, block_size)
        first = rows[:, :1]
        expected = first + torch.arange(block_size, dtype=torch.long)
        if bool((first < 0).any()) or bool((first % block_size).any()) or not torch.equal(rows, expected):
            raise ValueError(f"the slots of tokens [{start}, {end}) are not whole vLLM blocks")
        return (first.flatten() // block_size).contiguous()

    # -- LMCache's interface ---------------------------------------------------------------------------------
    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """vLLM's blocks of tokens [start, end) -> the memory object (store)."""
        layers = self._layers(kwargs)
        bs = int(layers[0].shape[2])
        blocks = self._blocks(kwargs, start, end, bs)
        out = memory_obj.tensor
        n = end - start
        for layer, kv in enumerate(layers):
            # [blocks, H, bs, 2D] -> flat per block -> [2, n, H*D] in block order (a bijection; to_gpu inverts it)
            src = kv.index_select(0, blocks).reshape(len(blocks), 2, bs, -1)
            out[:, layer, :n].copy_(src.permute(1, 0, 2, 3).reshape(2, n, -1))
        self.stored_tokens += n
        emit("lmcache_cpu_store", start=start, end=end, tokens=n)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """The memory object -> vLLM's blocks of tokens [start, end) (load), leaving the blocks vLLM holds."""
        layers = self._layers(kwargs)
        bs = int(layers[0].shape[2])
        blocks = self._blocks(kwargs, start, end, bs)
        n = end - start
        cached = min(n, max(0, int(kwargs.get("vllm_cached_tokens", 0) or 0) - start))
        if cached % bs:
            raise ValueError(f"vLLM holds {cached} tokens of block-aligned chunk [{start}, {end}): not whole blocks")
        skip = cached // bs
        if skip == len(blocks):
            return
        src = memory_obj.tensor
        dst_blocks = blocks[skip:]
        for layer, kv in enumerate(layers):
            data = src[:, layer, skip * bs : n].reshape(2, len(dst_blocks), bs, -1).permute(1, 0, 2, 3)
            kv.index_copy_(0, dst_blocks, data.reshape(len(dst_blocks), *kv.shape[1:]).to(kv.dtype))
        self.loaded_tokens += n - skip * bs
        emit("lmcache_cpu_load", start=start, end=end, tokens=n - skip * bs)


__all__ = ["VLLMPagedMemCPUConnector"]
