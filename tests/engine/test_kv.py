"""PagedKV installs: every path (one strided copy for a block run, one indexed copy for any other block table, per
chunk when the staged objects are not at one stride) lands the staged bytes in the right blocks."""

from __future__ import annotations

import ctypes
import random

import pytest

torch = pytest.importorskip("torch")

from bsr_cli.loaders import builtin_registration  # noqa: E402
from bsr_cli.runtime.paged_kv import PagedKV  # noqa: E402
from bsr_cli.runtime.tiers import StagingSlice  # noqa: E402

REG = builtin_registration("demo")
CHUNKS = 4


def _kv() -> PagedKV:
    blocks = {g: 4 * CHUNKS * REG.chunk_size // REG.group(g).block_size for g in REG.group_names}
    return PagedKV(REG, 0, blocks, torch.device("cpu"))


def _staged(slot_order: list[int]) -> tuple[torch.Tensor, dict[str, list[StagingSlice]]]:
    """A pool of CHUNKS + 1 slots of random bytes; chunk i is staged in slot slot_order[i]."""
    pool = torch.randint(0, 256, ((CHUNKS + 1) * REG.bytes_per_chunk,), dtype=torch.uint8)
    view = memoryview((ctypes.c_ubyte * pool.numel()).from_address(pool.data_ptr())).cast("B")
    out: dict[str, list[StagingSlice]] = {}
    off = 0
    for g in REG.group_names:
        size = REG.group_bytes_per_chunk(g)
        out[g] = [
            StagingSlice(pool.data_ptr() + s * REG.bytes_per_chunk + off, view[s * REG.bytes_per_chunk + off :][:size])
            for s in slot_order
        ]
        off += size
    return pool, out


def _tables(kind: str) -> dict[str, list[int]]:
    tables = {}
    for g in REG.group_names:
        n = CHUNKS * REG.chunk_size // REG.group(g).block_size
        ids = list(range(3, 3 + n))  # one run, not starting at block 0
        if kind == "shuffled":
            random.Random(7).shuffle(ids)
        tables[g] = ids
    return tables


@pytest.mark.timeout(60)
@pytest.mark.parametrize("blocks", ["run", "shuffled"])
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [4, 0, 2, 1]])
def test_install_lands_every_staged_byte_in_its_blocks(blocks: str, slots: list[int]) -> None:
    kv = _kv()
    pool, staged = _staged(slots)
    tables = _tables(blocks)
    tokens = CHUNKS * REG.chunk_size
    for g in REG.group_names:
        kv.install(g, tables[g], tokens, staged[g])
    for g in REG.group_names:
        for c, src in enumerate(staged[g]):
            got = kv.gather_object(g, tables[g], c * REG.chunk_size, REG.chunk_size)
            assert bytes(got.numpy()) == bytes(src.view), (g, c)
    # Nothing outside the request's blocks was written.
    untouched = {g: [b for b in range(kv.blocks[g]) if b not in set(tables[g])] for g in REG.group_names}
    for g, ids in untouched.items():
        assert not kv.gather_object(g, ids, 0, len(ids) * REG.group(g).block_size).any()
    del pool
