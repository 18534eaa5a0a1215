"""`bsr probe --store`'s result, as types: which ranks of an LMCache deployment's Mooncake store hold which chunks of
a prompt (live holders only), whether the holders are alive, the key format asked for, the chunks' integrity, and
why nothing matched when nothing did. bsr_cli.core.store_match builds it from what bsr_cli.mooncake.store_probe
read; `bsr explain --store` (bsr_cli.core.explain) reads it. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from bsr_cli.core import wire
from bsr_cli.core.bitmap import Break, HitBitmap

if TYPE_CHECKING:  # a store probe has no markers; the engine's status types are not on `bsr probe --store`'s path
    from bsr_cli.core.status import MarkerView

# Each cell's state in `liveness.cells`: not listed, listed on a live holder, listed only on gone holders, listed
# but no live holder is known (the replica listing or the holder check did not answer).
ABSENT, LIVE, STALE, UNKNOWN = "0", "1", "s", "u"

# A key-format field's value as a diagnosis tells the user to ask for it: a world size, a dtype flag, the tags
# (KEY=VALUE each) or a vLLM hash seed.
KeyFormatValue = int | str | list[str]


class HolderState(StrEnum):
    """Whether a segment holder answers now."""

    ALIVE = "alive"
    GONE = "gone"
    UNKNOWN = "unknown"  # it could not be checked in time


@dataclass(frozen=True)
class SegmentHolder:
    """A process holding a Mooncake segment: its name, its data endpoint, whether it answers, its size if listed."""

    name: str
    endpoint: str
    state: HolderState
    size_bytes: int | None = wire.field(name="bytes", default=None, omit_none=True)

    @property
    def alive(self) -> bool:
        return self.state is HolderState.ALIVE

    to_wire = wire.writer(order=("name", "endpoint", "alive", "state", "size_bytes"))


@dataclass(frozen=True)
class Liveness:
    """Whether each listed chunk can really be read. ``cells``: per worker, one state per chunk (ABSENT, LIVE,
    STALE, UNKNOWN); ``listed_committable_chunks``: the prefix the master's listing alone gives."""

    segments: tuple[SegmentHolder, ...]
    cells: tuple[str, ...]
    chunk_size: int
    listed_committable_chunks: int
    live_committable_chunks: int
    segment_listing_error: str | None = None

    def count(self, state: str) -> int:
        return sum(row.count(state) for row in self.cells)

    @property
    def stale_chunks(self) -> int:
        return self.count(STALE)

    @property
    def unknown_chunks(self) -> int:
        return self.count(UNKNOWN)

    @property
    def segments_alive(self) -> int:
        return sum(1 for s in self.segments if s.alive)

    @property
    def segments_gone(self) -> int:
        return sum(1 for s in self.segments if s.state is HolderState.GONE)

    def to_wire(self) -> dict[str, Any]:
        rows = {str(w): row for w, row in enumerate(self.cells)}
        listing = {"segment_listing_error": self.segment_listing_error} if self.segment_listing_error else {}
        return listing | {
            "available": True,
            "segments": [s.to_wire() for s in self.segments],
            "segments_alive": self.segments_alive,
            "segments_unknown": sum(1 for s in self.segments if s.state is HolderState.UNKNOWN),
            "held_chunks": self.count(LIVE) + self.stale_chunks + self.unknown_chunks,
            "live_chunks": self.count(LIVE),
            "stale_chunks": self.stale_chunks,
            "unknown_chunks": self.unknown_chunks,
            "cells": rows,
            "cells_legend": {ABSENT: "not listed", LIVE: "live", STALE: "holder gone", UNKNOWN: "liveness unknown"},
            "live_rows": {w: "".join("1" if c == LIVE else "0" for c in row) for w, row in rows.items()},
            "live_committable_chunks": self.live_committable_chunks,
            "live_committable_tokens": self.live_committable_chunks * self.chunk_size,
            # The master's own listing (what a probe without liveness would have said).
            "listed": {
                "rows": {w: "".join("0" if c == ABSENT else "1" for c in row) for w, row in rows.items()},
                "committable_chunks": self.listed_committable_chunks,
            },
        }


# The parts of the result below are written as they are: their fields are the wire's.
@dataclass(frozen=True)
class HashStart:
    """The hash chain start the probe used, and what auto-detection found."""

    requested: str
    vllm_hash_seed: str | None
    start: int
    detected: bool | None  # None: not auto-detected
    candidates_held: dict[str, int]  # chunks held under each candidate start that held any
    chains_matched: list[str]


@dataclass(frozen=True)
class KeyFormatReport:
    dtype: str
    tags: list[str]  # KEY%VALUE, as LMCache's keys spell them
    hash_start: HashStart


@dataclass(frozen=True)
class ChunkRef:
    rank: int
    chunk: int


@dataclass(frozen=True)
class Integrity:
    """Which held chunks carry bsr's checksum sidecar (bound to the chunk: ``core.integrity``), and the first few
    that do not (no sidecar: stock LMCache; an older bsr's bytes-only one)."""

    checksummed_chunks: int
    unverified_chunks: int
    unverified: list[ChunkRef]


@dataclass(frozen=True)
class Tail:
    """The prompt's partial last chunk: its tokens, and whether it is stored (LMCache's save_unfull_chunk)."""

    tokens: int
    stored: bool


@dataclass(frozen=True)
class KeyGroup:
    """A group of the store's keys for the model (world size, dtype, tags), as a diagnosis reports it."""

    world_size: int
    dtype: str
    tags: list[str]
    keys: int
    workers: list[int]
    prompt_chunks_held: int
    vllm_hash_seed: str | None
    unknown_start_chunks: int
    differs_in: list[str]
    changes: dict[str, KeyFormatValue]  # key-format field -> the value that would ask for this group's keys
    flags: list[str]


@dataclass(frozen=True)
class Diagnosis:
    """Why nothing matched: the model's key groups, closest first, and the likely causes."""

    keys_listed: int
    keys_for_model: int
    groups: list[KeyGroup]
    closest: int | None
    causes: list[str]
    available: bool = True


@dataclass(frozen=True)
class NoDiagnosis:
    """The store's keys could not be listed: why, and what to pass."""

    why: str
    hint: str
    available: bool = False


@dataclass(frozen=True)
class StoreProbe:
    """`bsr probe --store`'s result: the bitmap (live holders only), key format, liveness, integrity and (on a total
    miss) the diagnosis."""

    store: str
    bitmap: HitBitmap
    prompt_tokens: int
    prompt_chunks: int
    storable_chunks: int
    committable_chunks: int
    first_break: Break | None
    strip_width: int | None
    key_format: KeyFormatReport
    key_example: str | None
    liveness: Liveness
    integrity: Integrity
    tail: Tail | None = wire.field(default=None, omit_none=True)
    diagnosis: Diagnosis | NoDiagnosis | None = wire.field(default=None, omit_none=True)

    @property
    def storable_tokens(self) -> int:
        return min(self.storable_chunks * self.bitmap.chunk_size, self.prompt_tokens)

    @property
    def committable_tokens(self) -> int:
        return self.bitmap.prefix_tokens()

    # A store probe's JSON has the keys of an engine's probe (`bsr probe --json`): its kind, and no tier errors or
    # markers (a store has neither).
    @property
    def kind(self) -> str:
        return "bsr.store-probe"

    @property
    def tier_errors(self) -> dict[str, dict[str, str]]:
        return {}

    @property
    def markers(self) -> tuple[MarkerView, ...]:
        return ()

    to_wire = wire.writer(
        order=(
            "kind",
            "store",
            "bitmap",
            "prompt_tokens",
            "prompt_chunks",
            "storable_chunks",
            "storable_tokens",
            "committable_chunks",
            "committable_tokens",
            "first_break",
            "tier_errors",
            "markers",
            "strip_width",
            "key_format",
            "key_example",
            "liveness",
            "integrity",
            "tail",
            "diagnosis",
        )
    )
