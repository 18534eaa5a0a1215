"""The paper's figures, reproduced exactly by the core."""

from __future__ import annotations

import pytest

from bsr_cli.core import accounting
from bsr_cli.core.units import GiB, MiB, format_bytes
from bsr_cli.errors import InvalidInput
from bsr_cli.loaders import builtin_registration


@pytest.fixture(scope="module")
def paper():
    return builtin_registration("paper-mtp-off")


def test_paper_registration_shape(paper) -> None:
    assert len(paper.tensors) == 167
    assert paper.bytes_per_chunk == 16_408_576
    assert len(builtin_registration("paper-mtp-on").tensors) == 170


def test_rws_at_w32_is_500_75_mib(paper) -> None:
    rws = accounting.rws_bytes(paper, 32)
    assert rws == 525_074_432
    assert rws / MiB == 500.75
    assert format_bytes(rws) == "500.75 MiB"


@pytest.mark.parametrize(
    ("tokens", "need", "rung_gib"),
    [(262_144, 16_802_381_824, 16), (131_072, 8_401_190_912, 8), (32_768, 2_100_297_728, 2)],
)
def test_whole_plan_ladder(paper, tokens: int, need: int, rung_gib: int) -> None:
    chunks = accounting.chunks_for_tokens(tokens, paper.chunk_size)
    assert accounting.whole_plan_bytes(paper, chunks) == need
    assert accounting.ladder_rung(need) == rung_gib * GiB


def test_largest_prompt_windows(paper) -> None:
    chunks = accounting.chunks_for_tokens(524_032, 256)
    assert chunks == 2_047
    assert accounting.num_windows(chunks, 32) == 64
    assert accounting.num_windows(chunks, 0) == 1


def test_rws_does_not_depend_on_n(paper) -> None:
    peaks = {accounting.peak_bytes(paper, 32, accounting.chunks_for_tokens(n, 256)) for n in (32_768, 262_144, 524_032)}
    assert peaks == {525_074_432}


def test_max_window_for_capacity(paper) -> None:
    assert accounting.max_window_for_capacity(paper, 525_074_432) == 32
    assert accounting.max_window_for_capacity(paper, 525_074_431) == 31
    assert accounting.max_window_for_capacity(paper, 1) == 0


def test_aux_is_added_once(paper) -> None:
    reg = type(paper)(**{**paper.__dict__, "aux_bytes": 4096})
    assert accounting.rws_bytes(reg, 32) == 525_074_432 + 4096
    assert accounting.max_window_for_capacity(reg, 525_074_432 + 4096) == 32


def test_ladder_tops_out() -> None:
    assert accounting.ladder_rung(65 * GiB) is None


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_window(paper, bad) -> None:
    with pytest.raises(InvalidInput):
        accounting.rws_bytes(paper, bad)


def test_rws_zero_is_rejected(paper) -> None:
    with pytest.raises(InvalidInput, match="whole-plan"):
        accounting.rws_bytes(paper, 0)


def test_absurd_tokens(paper) -> None:
    with pytest.raises(InvalidInput, match="absurd"):
        accounting.chunks_for_tokens(1 << 40, 256)


def test_max_window_counts_aux_at_the_capacity_boundary(paper) -> None:
    """The largest W is the one whose RWS — chunks *and* aux — fits: exactly at the boundary it fits, one byte
    below it the window shrinks by one chunk."""
    reg = type(paper)(**{**paper.__dict__, "aux_bytes": 4096})
    c = reg.bytes_per_chunk
    for w in (1, 7, 32):
        exact = accounting.rws_bytes(reg, w)
        assert exact == w * c + 4096
        assert accounting.max_window_for_capacity(reg, exact) == w
        assert accounting.max_window_for_capacity(reg, exact - 1) == w - 1
    assert accounting.max_window_for_capacity(reg, 4096) == 0  # aux alone leaves room for no chunk
    assert accounting.max_window_for_capacity(reg, c) == 0  # one chunk without room for aux does not fit


def test_an_empty_plan_holds_nothing_not_even_aux(paper) -> None:
    reg = type(paper)(**{**paper.__dict__, "aux_bytes": 4096})
    for w in (0, 1, 32):
        assert accounting.peak_bytes(reg, w, 0) == 0
    assert accounting.peak_bytes(reg, 32, 1) == reg.bytes_per_chunk + 4096
