"""Destination KV for one rank of the embedded engine: real torch tensors in paged block pools.

Every registered tensor is a tensor of its registered dtype, shaped ``[num_blocks * block_size, *per_token_shape]``
(one block pool per KV group, each with its own block size), on the rank's device: CPU here, CUDA when a GPU is
present (installs are then host-to-device copies from the pinned restore pool, synchronized on the stream).

The synthetic model: the KV of every token of a chunk is a fixed pseudo-random function of the chunk's
prefix-chained hash, the rank and the KV group, so any two computations agree bit for bit and the cost grows with
the tokens. An object (what the tiers store) is one chunk of one group on one rank: the group's tensors in
registration order, each as ``[tokens, bytes_per_token]``.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bsr_cli.core.registration import Registration
from bsr_cli.runtime.tiers import StagingSlice

TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
HASH_CHUNKS = 64  # chunks gathered at a time when hashing, to bound temporary memory


def _widest(row_bytes: int) -> torch.dtype:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while the tensor lives)."""
    arr: Any = t.contiguous().numpy()
    return memoryview(arr).cast("B")


def pick_device(rank: int) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def object_seed(chunk_hash: str, rank: int, group: str) -> int:
    digest = hashlib.sha256(f"{chunk_hash}|{rank}|{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PagedKV:
    def __init__(self, reg: Registration, rank: int, blocks_per_group: Mapping[str, int], device: torch.device) -> None:
        self.reg = reg
        self.rank = rank
        self.device = device
        self.blocks = dict(blocks_per_group)
        self.tensors: dict[str, torch.Tensor] = {}
        # Row views of the same storage, one row per token, in the widest integer type that divides the row:
        # torch copies indexed rows element by element, so 8-byte elements copy ~5x faster than bytes.
        self.flat: dict[str, torch.Tensor] = {}
        self.wide_dtype: dict[str, torch.dtype] = {}
        for t in reg.tensors:
            rows = self.blocks[t.group] * reg.group(t.group).block_size
            storage = torch.zeros((rows, *t.shape), dtype=TORCH_DTYPES[t.dtype], device=device)
            self.tensors[t.name] = storage
            wide = _widest(t.bytes_per_token)
            self.wide_dtype[t.name] = wide
            self.flat[t.name] = storage.view(torch.uint8).view(rows, t.bytes_per_token).view(wide)
        self.group_tensors = {g: reg.tensors_of(g) for g in reg.group_names}
        self.group_bpt = {g: sum(t.bytes_per_token for t in ts) for g, ts in self.group_tensors.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # -- addressing --------------------------------------------------------------------------------------------
    def rows(self, group: str, block_ids: Sequence[int], token_count: int) -> torch.Tensor:
        bs = self.reg.group(group).block_size
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        rows = (ids[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).reshape(-1)
        return rows[:token_count].to(self.device)

    # -- Destination protocol ----------------------------------------------------------------------------------
    def install(self, group: str, block_ids: Sequence[int], token_count: int, sources: Sequence[StagingSlice]) -> None:
        if self._install_run(group, block_ids, token_count, sources):
            return
        rows = self.rows(group, block_ids, token_count)
        bpt = self.group_bpt[group]
        pos = 0
        for src in sources:
            n = len(src.view) // bpt
            data = torch.frombuffer(src.view, dtype=torch.uint8)
            self._write(group, rows[pos : pos + n], data, n)
            pos += n
        if pos != token_count:
            raise RuntimeError(f"window carried {pos} tokens for group {group}, expected {token_count}")

    def _install_run(
        self, group: str, block_ids: Sequence[int], token_count: int, sources: Sequence[StagingSlice]
    ) -> bool:
        """The fast path: full chunks staged at a constant stride (a window's slots in one run) go in with one
        indexed copy per tensor for the whole window. Returns False when the window does not qualify."""
        cs = self.reg.chunk_size
        bs = self.reg.group(group).block_size
        size = cs * self.group_bpt[group]
        n = len(sources)
        if n < 2 or token_count != n * cs or any(len(src.view) != size for src in sources):
            return False
        stride = sources[1].ptr - sources[0].ptr
        if stride < size or any(src.ptr != sources[0].ptr + i * stride for i, src in enumerate(sources)):
            return False
        span = (n - 1) * stride + size
        base = torch.frombuffer((ctypes.c_ubyte * span).from_address(sources[0].ptr), dtype=torch.uint8)
        first = block_ids[0]
        # Blocks allocated in one run (the usual case) take a plain strided copy, ~1.6x the indexed one on a CPU
        # (memcpy speed); any other block table the indexed copy.
        run = list(block_ids) == list(range(first, first + len(block_ids)))
        ids = None if run else torch.as_tensor(list(block_ids), dtype=torch.long).view(n, cs // bs).to(self.device)
        off = 0
        for t in self.group_tensors[group]:
            bpt = t.bytes_per_token
            wide = self.wide_dtype[t.name]
            src = base.as_strided((n, cs // bs, bs, bpt), (stride, bs * bpt, bpt, 1), off).view(wide)
            if self.device.type == "cuda":
                src = src.to(self.device, non_blocking=True)
            dest = self.flat[t.name].view(-1, bs, self.flat[t.name].shape[1])
            if ids is None:
                dest[first : first + len(block_ids)].view(n, cs // bs, bs, -1).copy_(src)
            else:
                dest[ids] = src
            off += cs * bpt
        return True

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def invalidate(self, block_tables: Mapping[str, Sequence[int]]) -> None:
        for group, ids in block_tables.items():
            if not ids:
                continue
            rows = self.rows(group, ids, len(ids) * self.reg.group(group).block_size)
            for t in self.group_tensors[group]:
                self.flat[t.name].index_fill_(0, rows, 0)
        self.synchronize()

    # -- the synthetic model -----------------------------------------------------------------------------------
    def synthetic_object(self, chunk_hash: str, group: str, tokens: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(object_seed(chunk_hash, self.rank, group))
        return torch.randint(0, 256, (tokens * self.group_bpt[group],), dtype=torch.uint8, generator=gen)

    def prefill(
        self, chunk_hashes: Sequence[str], n_tokens: int, first_chunk: int, block_tables: Mapping[str, Sequence[int]]
    ) -> int:
        """Compute KV for chunks [first_chunk, end) and install it; returns tokens computed."""
        cs = self.reg.chunk_size
        for group in self.reg.group_names:
            bs = self.reg.group(group).block_size
            for c in range(first_chunk, len(chunk_hashes)):
                t0, t1 = c * cs, min((c + 1) * cs, n_tokens)
                obj = self.synthetic_object(chunk_hashes[c], group, t1 - t0)
                rows = self.rows(group, block_tables[group][t0 // bs : -(-t1 // bs)], t1 - t0)
                self._write(group, rows, obj, t1 - t0)
        self.synchronize()
        return max(0, n_tokens - first_chunk * cs)

    def _write(self, group: str, rows: torch.Tensor, data: torch.Tensor, n: int) -> None:
        off = 0
        for t in self.group_tensors[group]:
            size = n * t.bytes_per_token
            src = data[off : off + size].view(n, t.bytes_per_token).view(self.wide_dtype[t.name])
            if self.device.type == "cuda":
                src = src.to(self.device, non_blocking=True)
            self.flat[t.name].index_copy_(0, rows, src)
            off += size

    def gather_object(self, group: str, block_ids: Sequence[int], token_start: int, tokens: int) -> torch.Tensor:
        """The object payload of tokens [token_start, token_start + tokens) of a group, read back from the blocks."""
        bs = self.reg.group(group).block_size
        b0 = token_start // bs
        rows = self.rows(group, block_ids[b0 : -(-(token_start + tokens) // bs)], tokens + token_start - b0 * bs)
        rows = rows[token_start - b0 * bs :]
        parts = [
            self.flat[t.name].index_select(0, rows).view(torch.uint8).reshape(-1) for t in self.group_tensors[group]
        ]
        return torch.cat(parts).cpu()

    def output_hash(self, block_tables: Mapping[str, Sequence[int]], n_tokens: int) -> dict[str, str]:
        """Hash of the installed KV in token order, per group (the request's canonical output hash on this rank)."""
        out = {}
        step = HASH_CHUNKS * self.reg.chunk_size
        for group in self.reg.group_names:
            h = hashlib.sha256()
            for t0 in range(0, n_tokens, step):
                t1 = min(t0 + step, n_tokens)
                h.update(byte_view(self.gather_object(group, block_tables[group], t0, t1 - t0)))
            out[group] = h.hexdigest()[:32]
        return out

    def canonical_hash(self, chunk_hashes: Sequence[str], n_tokens: int) -> dict[str, str]:
        """What output_hash gives after a correct restore or recompute, computed without touching the blocks."""
        out = {}
        cs = self.reg.chunk_size
        for group in self.reg.group_names:
            h = hashlib.sha256()
            span: list[tuple[int, torch.Tensor]] = []
            for c, ch in enumerate(chunk_hashes):
                n = min((c + 1) * cs, n_tokens) - c * cs
                span.append((n, self.synthetic_object(ch, group, n)))
                if len(span) == HASH_CHUNKS or c == len(chunk_hashes) - 1:
                    h.update(byte_view(self._span_payload(group, span)))
                    span = []
            out[group] = h.hexdigest()[:32]
        return out

    def _span_payload(self, group: str, span: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Per-chunk objects (tensor-major each) re-laid as gather_object lays a span: each tensor's tokens in order."""
        parts = []
        off_per_token = 0
        for t in self.group_tensors[group]:
            bpt = t.bytes_per_token
            parts.append(torch.cat([obj[n * off_per_token : n * (off_per_token + bpt)] for n, obj in span]))
            off_per_token += bpt
        return torch.cat(parts)
