"""Restore-capacity accounting (the paper's Eq. 4 and the whole-plan ladder).

RWS(W)          = W · Σ c_i + aux          live restore working set per rank, bounded by W
whole-plan peak = N · Σ c_i                what stock (W = 0) restore stages for N chunks
K               = ceil(N / W)              windows for N chunks
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bsr_cli.core import wire
from bsr_cli.core.registration import Registration
from bsr_cli.core.units import GiB
from bsr_cli.errors import InvalidInput

# The discrete L1 capacity rungs the paper's whole-plan ladder steps through.
DEFAULT_LADDER: tuple[int, ...] = tuple(n * GiB for n in (1, 2, 4, 8, 16, 32, 64))
DEFAULT_W_SWEEP: tuple[int, ...] = (8, 16, 32, 64)
# No deployment restores more than this in one request; larger inputs are typos.
MAX_TOKENS = 1 << 34


def check_window(w: int) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise InvalidInput(
            f"W must be a non-negative integer (0 = whole-plan path), got {w!r}",
            hint="e.g. --W 32 (0 is the whole-plan path)",
        )
    return w


def check_tokens(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise InvalidInput(f"token count must be a non-negative integer, got {tokens!r}", hint="e.g. --tokens 131072")
    if tokens > MAX_TOKENS:
        raise InvalidInput(
            f"{tokens} tokens is absurd (limit {MAX_TOKENS})",
            hint="give the prompt's length in tokens, e.g. --tokens 131072",
        )
    return tokens


def chunks_for_tokens(tokens: int, chunk_size: int) -> int:
    """Chunks covering ``tokens`` (a trailing partial chunk counts: it is stored and restored too)."""
    check_tokens(tokens)
    return -(-tokens // chunk_size)


def num_windows(n_chunks: int, w: int) -> int:
    check_window(w)
    if n_chunks <= 0:
        return 0
    return 1 if w == 0 else -(-n_chunks // w)


def rws_bytes(reg: Registration, w: int) -> int:
    """Live restore working set per rank for window size W (W > 0)."""
    check_window(w)
    if w == 0:
        raise InvalidInput(
            "RWS(0) is not bounded: W=0 is the whole-plan path, see whole_plan_bytes()",
            hint="give W ≥ 1 for a bound; W=0 stages the whole prefix (see whole-plan figures)",
        )
    return w * reg.bytes_per_chunk + reg.aux_bytes


def whole_plan_bytes(reg: Registration, n_chunks: int) -> int:
    """Staging the whole-plan (W=0) path needs per rank to restore n_chunks."""
    return n_chunks * reg.bytes_per_chunk + reg.aux_bytes


def peak_bytes(reg: Registration, w: int, n_chunks: int) -> int:
    """Peak live staging per rank with one live window: min(W, N) chunks (N for the whole-plan path)."""
    check_window(w)
    live = n_chunks if w == 0 else min(w, n_chunks)
    return live * reg.bytes_per_chunk + (reg.aux_bytes if live else 0)


def max_window_for_capacity(reg: Registration, capacity: int) -> int:
    """Largest W whose RWS fits ``capacity`` bytes per rank (0 when not even one chunk fits)."""
    if capacity < 0:
        raise InvalidInput("capacity must not be negative", hint="give a capacity such as 1GiB")
    return max(0, (capacity - reg.aux_bytes) // reg.bytes_per_chunk)


def ladder_rung(need: int, ladder: Sequence[int] = DEFAULT_LADDER) -> int | None:
    """First capacity rung that holds ``need`` bytes, or None when the ladder tops out below it."""
    for rung in sorted(ladder):
        if rung >= need:
            return rung
    return None


@dataclass(frozen=True)
class WindowCost:
    w: int = field(metadata=wire.meta(name="W"))
    windows: int
    rws_bytes: int

    to_wire = wire.writer()


@dataclass(frozen=True)
class Accounting:
    """Everything `bsr rws` reports for one registration, W and prompt length."""

    bytes_per_chunk: int
    aux_bytes: int
    w: int = field(metadata=wire.meta(name="W"))
    rws_bytes: int | None  # None for W=0
    tokens: int
    chunks: int
    windows: int
    whole_plan_bytes: int
    ladder_rung: int | None = field(metadata=wire.meta(name="whole_plan_ladder_rung"))
    sweep: tuple[WindowCost, ...]
    max_w_for_l1: int | None = field(metadata=wire.meta(name="max_W_for_l1"))
    l1_bytes: int | None

    # As `bsr rws --json` has always written it: the L1 bytes before the largest W they allow.
    to_wire = wire.writer(
        order=(
            "bytes_per_chunk",
            "aux_bytes",
            "w",
            "rws_bytes",
            "tokens",
            "chunks",
            "windows",
            "whole_plan_bytes",
            "ladder_rung",
            "sweep",
            "l1_bytes",
            "max_w_for_l1",
        )
    )


def account(
    reg: Registration,
    w: int,
    tokens: int = 0,
    *,
    sweep: Sequence[int] = DEFAULT_W_SWEEP,
    l1_bytes: int | None = None,
    ladder: Sequence[int] = DEFAULT_LADDER,
) -> Accounting:
    check_window(w)
    chunks = chunks_for_tokens(tokens, reg.chunk_size)
    whole = whole_plan_bytes(reg, chunks)
    return Accounting(
        bytes_per_chunk=reg.bytes_per_chunk,
        aux_bytes=reg.aux_bytes,
        w=w,
        rws_bytes=rws_bytes(reg, w) if w else None,
        tokens=tokens,
        chunks=chunks,
        windows=num_windows(chunks, w),
        whole_plan_bytes=whole,
        ladder_rung=ladder_rung(whole, ladder) if chunks else None,
        sweep=tuple(WindowCost(s, num_windows(chunks, s), rws_bytes(reg, s)) for s in sweep if s > 0),
        max_w_for_l1=None if l1_bytes is None else max_window_for_capacity(reg, l1_bytes),
        l1_bytes=l1_bytes,
    )
