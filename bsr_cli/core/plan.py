"""Window planning: split the committable prefix into windows G1..GK of at most W chunks.

Each window carries its chunk and token range, the slice of the request's block table it installs into for every
KV group (groups may page in different block sizes), and its bytes per rank. W = 0 is the legacy whole-plan path:
one window of every committable chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from bsr_cli.core import accounting, wire
from bsr_cli.core.bitmap import Break, HitBitmap, full_hit_bitmap
from bsr_cli.core.registration import Registration
from bsr_cli.errors import InvalidInput


@dataclass(frozen=True)
class BlockSlice:
    """Indices [start, end) into one group's block table for the request."""

    group: str
    start: int
    end: int


@dataclass(frozen=True)
class Window:
    index: int
    chunk_start: int
    chunk_end: int
    token_start: int
    token_end: int
    bytes_per_rank: int
    blocks: tuple[BlockSlice, ...]

    @property
    def chunks(self) -> int:
        return self.chunk_end - self.chunk_start

    def to_wire(self) -> dict[str, int | list[int] | dict[str, list[int]]]:
        """Its chunk and token ranges and each group's block slice as [start, end) pairs (``chunks`` on the wire
        is the range, not the count this type calls ``chunks``)."""
        return {
            "index": self.index,
            "chunks": [self.chunk_start, self.chunk_end],
            "tokens": [self.token_start, self.token_end],
            "bytes_per_rank": self.bytes_per_rank,
            "blocks": {b.group: [b.start, b.end] for b in self.blocks},
        }


@dataclass(frozen=True)
class RestorePlan:
    registration: str
    w: int = field(metadata=wire.meta(name="W"))
    prompt_tokens: int
    prompt_chunks: int
    committable_chunks: int
    committable_tokens: int
    windows: tuple[Window, ...]
    peak_bytes_per_rank: int
    rws_bytes: int | None
    whole_plan_bytes: int
    whole_plan_rung: int | None
    first_break: Break | None
    excluded_tiers: tuple[str, ...]
    objects_by_tier: dict[str, int]

    @property
    def kind(self) -> str:
        return "bsr.plan"

    @property
    def windows_count(self) -> int:
        return len(self.windows)

    # The summary first, the windows last.
    to_wire = wire.writer(
        order=(
            "kind",
            "registration",
            "w",
            "prompt_tokens",
            "prompt_chunks",
            "committable_chunks",
            "committable_tokens",
            "windows_count",
            "peak_bytes_per_rank",
            "rws_bytes",
            "whole_plan_bytes",
            "whole_plan_rung",
            "first_break",
            "excluded_tiers",
            "objects_by_tier",
            "windows",
        )
    )


def check_bitmap_matches(reg: Registration, bitmap: HitBitmap) -> None:
    if bitmap.ranks != reg.tp_size:
        raise InvalidInput(
            f"probe has {bitmap.ranks} ranks but the registration has tp_size {reg.tp_size}",
            hint="plan with the registration the probe was saved with (`bsr status` shows the engine's)",
        )
    if tuple(bitmap.groups) != reg.group_names:
        raise InvalidInput(
            f"probe groups {list(bitmap.groups)} differ from the registration's {list(reg.group_names)}",
            hint="plan with the registration the probe was saved with (`bsr status` shows the engine's)",
        )
    if bitmap.chunk_size != reg.chunk_size:
        raise InvalidInput(
            f"probe chunk_size {bitmap.chunk_size} differs from the registration's {reg.chunk_size}",
            hint="plan with the registration the probe was saved with (`bsr status` shows the engine's)",
        )
    if bitmap.registration and bitmap.registration != reg.identity:
        raise InvalidInput(
            f"probe was made against registration {bitmap.registration}, not {reg.identity}",
            hint="plan with the registration the engine serves (`bsr status` shows its identity)",
        )


def chunk_spans(first_chunk: int, end_chunk: int, w: int) -> list[tuple[int, int]]:
    """The windows over chunks [first_chunk, end_chunk): [c0, c1) spans of at most ``w`` chunks; ``w`` <= 0 is
    one window over all of them (the whole-plan path). The one windowing rule every host uses."""
    if end_chunk <= first_chunk:
        return []
    step = end_chunk - first_chunk if w <= 0 else w
    return [(c0, min(c0 + step, end_chunk)) for c0 in range(first_chunk, end_chunk, step)]


def windows_for(reg: Registration, w: int, n_chunks: int, tokens: int) -> tuple[Window, ...]:
    """The schedule for the first ``n_chunks`` chunks of a ``tokens``-long prompt."""
    accounting.check_window(w)
    out = []
    per_chunk = reg.bytes_per_chunk
    for j, (c0, c1) in enumerate(chunk_spans(0, n_chunks, w)):
        t0, t1 = c0 * reg.chunk_size, min(c1 * reg.chunk_size, tokens)
        blocks = tuple(BlockSlice(g.name, t0 // g.block_size, -(-t1 // g.block_size)) for g in reg.groups)
        out.append(Window(j, c0, c1, t0, t1, (c1 - c0) * per_chunk, blocks))
    return tuple(out)


def plan_restore(
    reg: Registration,
    w: int,
    *,
    bitmap: HitBitmap | None = None,
    tokens: int | None = None,
    exclude_tiers: Iterable[str] = (),
    tiers: tuple[str, ...] = ("mooncake", "fs"),
) -> RestorePlan:
    """Plan a restore from a probe bitmap, or from ``tokens`` assuming every chunk hits the first tier."""
    accounting.check_window(w)
    if bitmap is None:
        if tokens is None:
            raise InvalidInput("plan needs a token count or a probe result", hint="give --tokens N or --probe FILE")
        accounting.check_tokens(tokens)
        bitmap = full_hit_bitmap(tiers, reg.tp_size, reg.group_names, tokens, reg.chunk_size)
    check_bitmap_matches(reg, bitmap)
    excluded = tuple(exclude_tiers)
    k = bitmap.prefix_chunks(excluded)
    committable_tokens = bitmap.prefix_tokens(excluded)
    by_tier: dict[str, int] = {}
    for r in range(bitmap.ranks):
        for g in bitmap.groups:
            for c in range(k):
                t = bitmap.choose_tier(r, g, c, excluded)
                if t:
                    by_tier[t] = by_tier.get(t, 0) + 1
    windows = windows_for(reg, w, k, committable_tokens)
    return RestorePlan(
        registration=reg.identity,
        w=w,
        prompt_tokens=bitmap.tokens,
        prompt_chunks=bitmap.chunks,
        committable_chunks=k,
        committable_tokens=committable_tokens,
        windows=windows,
        peak_bytes_per_rank=accounting.peak_bytes(reg, w, k),
        rws_bytes=accounting.rws_bytes(reg, w) if w else None,
        whole_plan_bytes=accounting.whole_plan_bytes(reg, k),
        whole_plan_rung=accounting.ladder_rung(accounting.whole_plan_bytes(reg, k)) if k else None,
        first_break=bitmap.first_break(excluded),
        excluded_tiers=excluded,
        objects_by_tier=by_tier,
    )


# The prompt lengths `bsr plan --W N` plans when given no prompt: from a short chat turn to a million-token context.
DEFAULT_PROMPT_LADDER: tuple[int, ...] = (8_192, 32_768, 131_072, 262_144, 524_288, 1_048_576)


@dataclass(frozen=True)
class LadderRow:
    """One prompt length of a ladder plan: its windows, and what BSR and the whole-plan path stage per rank."""

    tokens: int
    chunks: int
    windows: int
    peak_bytes_per_rank: int
    whole_plan_bytes: int
    whole_plan_rung: int | None

    to_wire = wire.writer()


@dataclass(frozen=True)
class LadderPlan:
    """`bsr plan --W N` with no prompt: every chunk a hit, over a ladder of prompt lengths, so the bound shows (the
    BSR peak stays RWS(W) while the whole-plan staging grows with the prompt)."""

    registration: str
    w: int = field(metadata=wire.meta(name="W"))
    rws_bytes: int | None
    rows: tuple[LadderRow, ...]

    @property
    def kind(self) -> str:
        return "bsr.plan.ladder"

    to_wire = wire.writer(order=("kind", "registration", "w", "rws_bytes", "rows"))


def plan_ladder(reg: Registration, w: int, lengths: Iterable[int] = DEFAULT_PROMPT_LADDER) -> LadderPlan:
    """The plan of a fully held prompt at each of ``lengths`` tokens, in one table."""
    accounting.check_window(w)
    rows = []
    for tokens in lengths:
        k = accounting.chunks_for_tokens(tokens, reg.chunk_size)
        whole = accounting.whole_plan_bytes(reg, k)
        rows.append(
            LadderRow(
                tokens=tokens,
                chunks=k,
                windows=accounting.num_windows(k, w),
                peak_bytes_per_rank=accounting.peak_bytes(reg, w, k),
                whole_plan_bytes=whole,
                whole_plan_rung=accounting.ladder_rung(whole),
            )
        )
    return LadderPlan(reg.identity, w, accounting.rws_bytes(reg, w) if w else None, tuple(rows))
