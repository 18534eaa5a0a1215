"""Request traces in the Mooncake trace format, and each request's external prefix hit.

One record per request, in arrival order::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds from the start, ``hash_ids`` one id per 512-token block of the input,
remapped so that equal ids mean an equal prefix up to and including that block (the id of block i stands for the
whole prefix of blocks 0..i). ``bsr events export --trace`` writes the engine's own past requests the same way.

The hit model (what a store of previously seen blocks can restore for a request):

* A request's hit is the longest prefix of its block ids that are all in the store when it arrives.
* After its lookup, every block of the request enters the store (its prefill and the store's write latency are
  ignored: a request arriving one millisecond later already finds them).
* Without a capacity the store keeps everything. With one (in blocks) it evicts the least recently used block;
  the blocks of a request are touched tail first (as vLLM's prefix cache frees a request's blocks), so that among
  one request's blocks the tail is evicted before the head and a stored prefix shrinks from its end.
* Converted to the registration's chunks: the hit covers ``min(blocks · 512, input_length)`` tokens, and a chunk
  is restored only when all its tokens lie in the hit. A trailing partial chunk therefore counts only when the
  whole input hits (every block id, the partial last block included, was seen: the identical prompt, whose partial
  chunk was stored too); otherwise it is recomputed.

Pure: parses plain data, does no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bsr_cli.core import wire
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.core.events import Event

_TRACE_HINT = "a trace is JSON Lines in the Mooncake format (timestamp, input_length, hash_ids): examples/trace.jsonl"

# Tokens per hashed block in the Mooncake trace format.
TRACE_BLOCK_TOKENS = 512
# No real request is longer; larger inputs are typos or a different unit.
MAX_INPUT_TOKENS = 1 << 24


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its arrival (ms from the start), lengths in tokens and prefix-block ids. Its wire
    form is the trace format's record (``to_wire``)."""

    arrival_ms: int = field(metadata=wire.meta(name="timestamp"))
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    to_wire = wire.writer()


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    source: str = ""
    # Tokens per hashed block: 512 in the format; fewer in a token-scaled copy (see ``scale_tokens``).
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_ms(self) -> int:
        return self.requests[-1].arrival_ms - self.requests[0].arrival_ms if self.requests else 0

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def head(self, n: int, skip: int = 0) -> Trace:
        """``n`` requests from the ``skip``-th on (a slice keeps arrival order)."""
        return Trace(self.requests[skip : skip + n], self.source, self.block_tokens)

    def scale_tokens(self, block_tokens: int) -> Trace:
        """The same requests with ``block_tokens`` tokens per block instead of 512, to replay a trace on a machine
        too small for its prompts: every length is scaled by ``block_tokens / 512`` and rounded up, so each
        request keeps its number of blocks and its last block stays partial (or full) as it was."""
        if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
            raise InvalidInput(
                f"tokens per block must be in [1, {TRACE_BLOCK_TOKENS}], got {block_tokens}",
                hint=f"give a value in [1, {TRACE_BLOCK_TOKENS}]",
            )
        scaled = tuple(
            TraceRequest(
                r.arrival_ms,
                -(-r.input_length * block_tokens // self.block_tokens),
                -(-r.output_length * block_tokens // self.block_tokens),
                r.hash_ids,
            )
            for r in self.requests
        )
        return Trace(scaled, self.source, block_tokens)


def _int_field(record: Mapping[str, Any], name: str, where: str, *, low: int = 0, high: int | None = None) -> int:
    if name not in record:
        raise InvalidInput(f"{where}: missing field {name!r}", hint=_TRACE_HINT)
    value = record[name]
    # Exactly an integer: 1.5 ms or "12" would be read as something the trace did not say.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{where}: {name} must be an integer, got {value!r}"[:200], hint=_TRACE_HINT)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidInput(f"{where}: {name} must be {bound}, got {value}", hint=_TRACE_HINT)
    return value


def parse_request(record: Any, where: str) -> TraceRequest:
    """One trace record (a decoded JSON object); ``where`` names it in errors (``FILE:LINE``)."""
    if not isinstance(record, Mapping):
        raise InvalidInput(f"{where}: expected a JSON object, got {type(record).__name__}", hint=_TRACE_HINT)
    arrival = _int_field(record, "timestamp", where)
    input_length = _int_field(record, "input_length", where, high=MAX_INPUT_TOKENS)
    output_length = _int_field(record, "output_length", where)
    ids = record.get("hash_ids")
    if not isinstance(ids, list):
        raise InvalidInput(f"{where}: hash_ids must be a list of integers", hint=_TRACE_HINT)
    if any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise InvalidInput(f"{where}: hash_ids must be integers", hint=_TRACE_HINT)
    blocks = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(ids) > blocks:
        # Fewer ids than blocks is allowed (a trace may hash only a prefix); more cannot describe this input.
        raise InvalidInput(
            f"{where}: {len(ids)} hash_ids for {input_length} input tokens "
            f"(at most {blocks} blocks of {TRACE_BLOCK_TOKENS})",
            hint=_TRACE_HINT,
        )
    return TraceRequest(arrival, input_length, output_length, tuple(ids))


def build_trace(requests: Iterable[tuple[str, TraceRequest]], source: str = "") -> Trace:
    """A trace from parsed requests, each with where it came from; refuses arrivals out of order and an empty
    trace (a planner fed nothing would print a confident table of zeros)."""
    out: list[TraceRequest] = []
    for where, req in requests:
        if out and req.arrival_ms < out[-1].arrival_ms:
            raise InvalidInput(
                f"{where}: arrival {req.arrival_ms} ms is before the previous request's {out[-1].arrival_ms} ms",
                hint="a trace lists requests in arrival order (sort it by timestamp)",
            )
        out.append(req)
    if not out:
        raise InvalidInput(f"{source or 'the trace'}: no requests", hint=_TRACE_HINT)
    return Trace(tuple(out), source)


class _LruBlocks:
    """The store's block ids with least-recently-used eviction at ``capacity`` blocks (None: unbounded)."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._order: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def __contains__(self, block: int) -> bool:
        return block in self._order

    def touch(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):  # tail first: the head of the request ends up the most recently used
            if b in self._order:
                self._order.move_to_end(b)
            else:
                self._order[b] = None
        if self.capacity is not None:
            while len(self._order) > self.capacity:
                self._order.popitem(last=False)
                self.evicted += 1


@dataclass(frozen=True)
class PrefixHits:
    blocks: tuple[int, ...]  # per request, its leading block ids found in the store at its arrival
    evicted: int  # blocks the LRU evicted over the trace (0 without a capacity)


def prefix_hits(trace: Trace, store_capacity: int | None = None) -> PrefixHits:
    """Per request, the number of leading block ids found in the store at its arrival (see the module's model)."""
    if store_capacity is not None and store_capacity < 1:
        raise InvalidInput(
            f"the store capacity must be at least one block, got {store_capacity}",
            hint="e.g. --store-capacity 50000 (blocks of 512 tokens)",
        )
    store = _LruBlocks(store_capacity)
    hits = []
    for req in trace.requests:
        k = 0
        for b in req.hash_ids:
            if b not in store:
                break
            k += 1
        hits.append(k)
        store.touch(req.hash_ids)
    return PrefixHits(tuple(hits), store.evicted)


def hit_tokens(req: TraceRequest, blocks: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
    """Tokens of ``req`` covered by a hit of ``blocks`` leading blocks."""
    return min(blocks * block_tokens, req.input_length)


def hit_chunks(req: TraceRequest, blocks: int, chunk_size: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> int:
    """Chunks of ``chunk_size`` tokens restorable from a hit of ``blocks`` leading blocks: whole chunks inside the
    hit, plus the trailing partial chunk when the whole input hits."""
    tokens = hit_tokens(req, blocks, block_tokens)
    if tokens == req.input_length and blocks > 0:
        return -(-tokens // chunk_size)
    return tokens // chunk_size


def restored_tokens(req: TraceRequest, chunks: int, chunk_size: int) -> int:
    """Tokens those chunks carry (the last one may be partial)."""
    return min(chunks * chunk_size, req.input_length)


def prompt_tokens(req: TraceRequest, block_tokens: int, salt: int, request_index: int) -> list[int]:
    """Token ids for ``req`` that keep the trace's prefix structure: block i of every request with the same id at
    i carries the same ``block_tokens`` ids (a function of the id and ``salt`` only), so equal leading ids give an
    equal token prefix and chunk hashes match exactly where the trace says the prefix is shared. Tokens past the
    listed ids are unique to the request."""
    out: list[int] = []
    for i in range(-(-req.input_length // block_tokens)):
        key = req.hash_ids[i] if i < len(req.hash_ids) else -(request_index + 1) * (1 << 20) - i
        out.extend(synthetic_token(salt, key, j) for j in range(block_tokens))
    return out[: req.input_length]


def synthetic_token(salt: int, key: int, j: int) -> int:
    """Token ``j`` of the block keyed ``key``: a cheap integer mix (splitmix-like) in [1, 2^31), so no two
    different keys give a block of the same tokens."""
    x = (salt * 0x9E3779B97F4A7C15 + key * 0xBF58476D1CE4E5B9 + j * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return 1 + x % ((1 << 31) - 1)


# -- bsr's own traffic as a trace (`bsr events export --trace`) ----------------------------------------------------
BLOCK_ID_HEX = 12  # digits of a block id in a request_admitted event: 48 bits, a few bytes per 512 tokens


def block_ids(chunk_hashes: Sequence[str], n_tokens: int, chunk_size: int) -> tuple[str, ...]:
    """One id per 512-token block of a prompt, from its prefix-chained chunk hashes: the hash of the chunk holding
    the block's last token, mixed with the block's index (so that with chunks longer than a block, two blocks
    never share an id). Chained, like the chunk hashes: equal ids at block i mean an equal prefix up to the chunk
    boundary that covers block i, which is what a store of chunks can restore."""
    out = []
    for i in range(-(-n_tokens // TRACE_BLOCK_TOKENS)):
        last = min((i + 1) * TRACE_BLOCK_TOKENS, n_tokens) - 1
        h = chunk_hashes[last // chunk_size]
        out.append(hashlib.sha256(f"{h}:{i}".encode()).hexdigest()[:BLOCK_ID_HEX])
    return tuple(out)


@dataclass(frozen=True)
class SeenRequest:
    """One past request as the engine's events recorded it."""

    arrival_s: float  # Unix time it arrived (before any wait for destination blocks)
    input_length: int
    block_ids: tuple[str, ...]
    output_length: int = 0  # the embedded engine generates nothing: 0


def seen_requests(held: Iterable[Event]) -> tuple[list[SeenRequest], int]:
    """(the requests the engine's `request_admitted` events record, how many of ``held`` were left out): an event
    of another kind, or one from an engine too old to record block ids (its prefix is unknown), is counted, not
    used. A request arrived when it began to wait for destination blocks, ``queued_s`` before it was admitted."""
    from bsr_cli.core.events import RequestAdmitted  # `bsr plan --trace` reads traces without the event types

    seen, skipped = [], 0
    for admitted in held:
        if not isinstance(admitted, RequestAdmitted) or not admitted.block_ids:
            skipped += 1
            continue
        seen.append(SeenRequest(admitted.time - admitted.queued_s, admitted.tokens, admitted.block_ids))
    return seen, skipped


def trace_records(requests: Iterable[SeenRequest]) -> list[TraceRequest]:
    """The requests as a trace's records, in arrival order: timestamps in ms from the first arrival, block ids
    remapped to small integers in order of first appearance (as the published traces remap theirs)."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if not ordered:
        return []
    t0 = ordered[0].arrival_s
    ids: dict[str, int] = {}
    out = []
    for r in ordered:
        out.append(
            TraceRequest(
                arrival_ms=round((r.arrival_s - t0) * 1000),
                input_length=r.input_length,
                output_length=r.output_length,
                hash_ids=tuple(ids.setdefault(b, len(ids)) for b in r.block_ids),
            )
        )
    return out
