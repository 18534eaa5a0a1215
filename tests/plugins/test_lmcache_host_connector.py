"""The LMCache host's CPU paged connector (lmcache_bsr._lmcache.CPUPagedConnector): its install copy puts every
token's K and V in the row the slot mapping names, whether the rows form one run (the strided copy) or not (the
indexed copy), and writes no other row. Run through scripts/test-plugins; skipped when LMCache is absent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache_bsr import _lmcache as lm

LAYERS, HEADS, D, ROWS, N = 3, 2, 8, 64, 16


def expected(obj: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
    """The destination as the layout defines it, written token by token."""
    out = [torch.zeros(ROWS, 2, HEADS, D) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        for i, r in enumerate(rows.tolist()):
            for kv in range(2):
                out[layer][r, kv] = obj[kv, layer, i].view(HEADS, D)
    return out


@pytest.mark.parametrize("rows", [list(range(20, 20 + N)), [5, 6, 7, 8, 40, 41, 42, 43, 0, 1, 2, 3, 60, 61, 62, 63]])
def test_install_copy_puts_each_token_in_its_row_and_nowhere_else(rows: list[int]) -> None:
    g = torch.Generator().manual_seed(3)
    obj = torch.randn(2, LAYERS, N, HEADS * D, generator=g)
    slots = torch.tensor([0] * N + rows, dtype=torch.long)  # the window starts at token N of the request
    dst = [torch.zeros(ROWS, 2, HEADS, D) for _ in range(LAYERS)]
    conn = lm.CPUPagedConnector(LAYERS, HEADS, D)
    conn.to_gpu(SimpleNamespace(tensor=obj), N, 2 * N, kvcaches=dst, slot_mapping=slots)
    want = expected(obj, torch.tensor(rows))
    for layer in range(LAYERS):
        assert torch.equal(dst[layer], want[layer]), layer
    assert conn.installs == [(N, 2 * N)]
