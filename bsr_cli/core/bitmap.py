"""Hit bitmaps: for every TP rank × KV group × chunk, which tiers hold the chunk.

A probe-only lookup produces one of these without moving object bytes. Each cell is a bit mask over the bitmap's
tiers (bit i = ``tiers[i]``, listed in restore preference order, e.g. ``("mooncake", "fs")``). On the wire a
(rank, group) row is a string with one hex digit per chunk: ``"3331100"`` = both tiers, then only the first, then
a miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

_PROBE_HINT = "give a probe result saved with `bsr probe --json > probe.json` (examples/probe.json is one)"

MAX_TIERS = 4  # one hex digit per cell
PROBE_KIND = "bsr.probe"  # what a bitmap's JSON (and a probe's) says it is


@dataclass(frozen=True)
class Break:
    """Where the committable prefix ends: the first (chunk, rank, group) no allowed tier holds."""

    chunk: int
    rank: int
    group: str
    held_by: tuple[str, ...]  # tiers that do hold it but are excluded (e.g. by a force-local marker)
    reason: str

    to_wire = wire.writer()

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue] | None) -> Break | None:
        """A break as a probe's JSON carries it (``first_break``: an object, or null when nothing breaks)."""
        return wire.read(cls, d) if d else None


@dataclass(frozen=True)
class BitmapRow:
    """One (rank, KV group) row of a hit bitmap: one hex digit per chunk, the mask of the tiers that hold it."""

    rank: int
    group: str
    cells: str

    to_wire = wire.writer()


@dataclass(frozen=True)
class HitBitmap:
    tiers: tuple[str, ...]
    ranks: int
    groups: tuple[str, ...]
    tokens: int
    chunk_size: int
    rows: Mapping[tuple[int, str], str]
    registration: str = ""  # identity of the registration the probe was made against
    model: str = ""

    def __post_init__(self) -> None:
        if not self.tiers or len(self.tiers) > MAX_TIERS:
            raise InvalidInput(f"a bitmap needs 1..{MAX_TIERS} tiers", hint=_PROBE_HINT)
        if self.ranks <= 0 or not self.groups:
            raise InvalidInput("a bitmap needs at least one rank and one group", hint=_PROBE_HINT)
        if self.chunk_size <= 0:
            raise InvalidInput("bitmap chunk_size must be positive", hint=_PROBE_HINT)
        if self.tokens < 0:
            raise InvalidInput("bitmap token count must not be negative", hint=_PROBE_HINT)
        n = self.chunks
        limit = (1 << len(self.tiers)) - 1
        for r in range(self.ranks):
            for g in self.groups:
                row = self.rows.get((r, g))
                if row is None:
                    raise InvalidInput(f"bitmap has no row for rank {r} group {g!r}", hint=_PROBE_HINT)
                if len(row) != n:
                    raise InvalidInput(
                        f"ragged bitmap: rank {r} group {g!r} has {len(row)} chunks, expected {n}", hint=_PROBE_HINT
                    )
                try:
                    bad = any(int(c, 16) > limit for c in set(row))
                except ValueError:
                    bad = True
                if bad:
                    raise InvalidInput(
                        f"bitmap rank {r} group {g!r} has cells outside its {len(self.tiers)} tiers", hint=_PROBE_HINT
                    )
        extra = set(self.rows) - {(r, g) for r in range(self.ranks) for g in self.groups}
        if extra:
            raise InvalidInput(f"bitmap has rows for unknown rank/group: {sorted(extra)[:3]}", hint=_PROBE_HINT)

    @property
    def chunks(self) -> int:
        return -(-self.tokens // self.chunk_size)

    def mask(self, rank: int, group: str, chunk: int) -> int:
        return int(self.rows[(rank, group)][chunk], 16)

    def _allowed_mask(self, exclude: Iterable[str]) -> int:
        ex = set(exclude)
        unknown = ex - set(self.tiers)
        if unknown:
            raise InvalidInput(
                f"unknown tier(s) {sorted(unknown)}; bitmap tiers are {list(self.tiers)}",
                hint=f"name one of {', '.join(self.tiers)}",
            )
        return sum(1 << i for i, t in enumerate(self.tiers) if t not in ex)

    def prefix_chunks(self, exclude: Iterable[str] = ()) -> int:
        """Chunks held, by some allowed tier, for every rank and every group (Eq. 6 applied to discovery)."""
        allowed = self._allowed_mask(exclude)
        end = self.chunks
        for row in self.rows.values():
            for i, c in enumerate(row[:end]):
                if not int(c, 16) & allowed:
                    end = i
                    break
        return end

    def prefix_tokens(self, exclude: Iterable[str] = ()) -> int:
        return min(self.prefix_chunks(exclude) * self.chunk_size, self.tokens)

    def first_break(self, exclude: Iterable[str] = ()) -> Break | None:
        exclude = tuple(exclude)
        allowed = self._allowed_mask(exclude)
        k = self.prefix_chunks(exclude)
        if k >= self.chunks:
            return None
        for r in range(self.ranks):
            for g in self.groups:
                m = self.mask(r, g, k)
                if not m & allowed:
                    held = tuple(t for i, t in enumerate(self.tiers) if m >> i & 1)
                    reason = "excluded tier only" if held else "missing in every tier"
                    return Break(chunk=k, rank=r, group=g, held_by=held, reason=reason)
        raise AssertionError("prefix ended without a breaking cell")  # pragma: no cover

    def choose_tier(self, rank: int, group: str, chunk: int, exclude: Iterable[str] = ()) -> str | None:
        """The preferred allowed tier holding a cell (restore reads it from there)."""
        m = self.mask(rank, group, chunk) & self._allowed_mask(exclude)
        for i, t in enumerate(self.tiers):
            if m >> i & 1:
                return t
        return None

    def tier_prefix_chunks(self, tier: str) -> int:
        """How far one tier alone holds the prompt for every rank and group (a fallback tier must hold it all)."""
        return self.prefix_chunks(exclude=[t for t in self.tiers if t != tier])

    def to_dict(self) -> wire.JsonObject:
        return {
            "kind": PROBE_KIND,
            "model": self.model,
            "registration": self.registration,
            "tokens": self.tokens,
            "chunk_size": self.chunk_size,
            "chunks": self.chunks,
            "tiers": list(self.tiers),
            "ranks": self.ranks,
            "groups": list(self.groups),
            "rows": [BitmapRow(r, g, self.rows[(r, g)]).to_wire() for r in range(self.ranks) for g in self.groups],
        }

    @classmethod
    def wire_schema(cls, s: wire.Schemas) -> wire.JsonSchema:
        """``to_dict``'s object: the bitmap's own keys, its ``chunks``, and its rows as a list (ranks first)."""
        text, count, names = s.of(str), s.of(int), s.of(tuple[str, ...])
        keys = {
            "kind": {"const": PROBE_KIND},
            "model": text,
            "registration": text,
            "tokens": count,
            "chunk_size": count,
            "chunks": count,
            "tiers": names,
            "ranks": count,
            "groups": names,
            "rows": s.of(tuple[BitmapRow, ...]),
        }
        return wire.object_schema(keys, tuple(keys))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "probe") -> HitBitmap:
        if not isinstance(data, Mapping):
            raise InvalidInput(f"{source}: expected a probe result object", hint=_PROBE_HINT)
        if isinstance(data.get("bitmap"), Mapping):  # a whole `bsr probe --json` document
            data = data["bitmap"]
        try:
            rows_raw = data["rows"]
            rows = {(int(x["rank"]), str(x["group"])): str(x["cells"]) for x in rows_raw}
            if len(rows) != len(rows_raw):
                raise InvalidInput(f"{source}: duplicate bitmap rows", hint=_PROBE_HINT)
            return cls(
                tiers=tuple(str(t) for t in data["tiers"]),
                ranks=int(data["ranks"]),
                groups=tuple(str(g) for g in data["groups"]),
                tokens=int(data["tokens"]),
                chunk_size=int(data["chunk_size"]),
                rows=rows,
                registration=str(data.get("registration", "")),
                model=str(data.get("model", "")),
            )
        except KeyError as e:
            raise InvalidInput(f"{source}: probe result lacks {e.args[0]!r}", hint=_PROBE_HINT) from None
        except (TypeError, ValueError):
            raise InvalidInput(f"{source}: malformed probe result", hint=_PROBE_HINT) from None


def encode_row(held: Mapping[str, Sequence[bool]], tiers: Sequence[str], chunks: int) -> str:
    """One (rank, group) row of a bitmap from each tier's per-chunk presence (a tier missing from ``held`` holds
    nothing): bit i of a chunk's hex digit is set when ``tiers[i]`` holds it."""
    masks = [0] * chunks
    for i, name in enumerate(tiers):
        for c, present in enumerate(held.get(name, ())):
            if present:
                masks[c] |= 1 << i
    return "".join(f"{m:x}" for m in masks)


def full_hit_bitmap(
    tiers: Sequence[str], ranks: int, groups: Sequence[str], tokens: int, chunk_size: int, **meta: str
) -> HitBitmap:
    """Every chunk held by the first tier: what `bsr plan --tokens N` assumes."""
    n = -(-tokens // chunk_size)
    rows = {(r, g): "1" * n for r in range(ranks) for g in groups}
    return HitBitmap(tuple(tiers), ranks, tuple(groups), tokens, chunk_size, rows, **meta)
