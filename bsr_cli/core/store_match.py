"""Matching a prompt against what an LMCache deployment stored in Mooncake, as `bsr probe --store` does: the keys
LMCache 0.5.6 writes for the prompt's chunks (bsr_cli.core.lmcache_keys), the hash chain start they were written
under, which holders can really serve each chunk, and the hit bitmap built from the live ones.

Pure: what the store answered comes in as values (`StoreRead`, `Holders`); asking it is
bsr_cli.mooncake.store_probe's. Liveness fails closed: a chunk counts (in the bitmap and the committable prefix) only
when the master names a replica of it on a holder that answered; a chunk whose holder could not be told is UNKNOWN
and does not count."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from bsr_cli.core.bitmap import Break, HitBitmap
from bsr_cli.core.integrity import SIDECAR_BYTES, sidecar_key
from bsr_cli.core.lmcache_keys import (
    lmcache_chunk_hashes,
    lmcache_dtype,
    lmcache_key,
    lmcache_tail_hash,
    parse_tags,
    vllm_seeded_start,
)
from bsr_cli.core.store_probe import (
    ABSENT,
    LIVE,
    STALE,
    UNKNOWN,
    ChunkRef,
    Diagnosis,
    HashStart,
    HolderState,
    Integrity,
    KeyFormatReport,
    Liveness,
    NoDiagnosis,
    SegmentHolder,
    StoreProbe,
    Tail,
)
from bsr_cli.errors import InvalidInput

# Seeds tried by --vllm-hash-seed auto (besides bsr's own PYTHONHASHSEED): the values deployment guides use.
AUTO_SEEDS = ("0", "1", "42", "123", "1234", "12345")
# Chunks per candidate start tried by auto-detection (all workers, one batch_is_exist for every candidate).
DETECT_CHUNKS = 64
# LMCache's one KV group, named as the engine's probe names it.
GROUP = "attn"

# (label, start) of a hash chain start: "none" (LMCache without vLLM, start 0) or a vLLM hash seed.
HashStartCandidate = tuple[str, int]


@dataclass(frozen=True)
class KeyFormat:
    """How LMCache names the prompt's chunks in the store: one key per worker and chunk hash."""

    model: str
    world_size: int
    dtype: str
    tags: tuple[tuple[str, str], ...]

    def keys_of(self, hashes: Sequence[int]) -> list[list[str]]:
        """The keys of ``hashes``, one row per worker."""
        return [
            [lmcache_key(self.model, self.world_size, w, h, self.dtype, self.tags) for h in hashes]
            for w in range(self.world_size)
        ]


@dataclass(frozen=True)
class StoreQuery:
    """What a store probe asks and where: the master's addresses, the key format and the chain starts to try."""

    store: str  # mooncake://HOST:PORT, as given
    rpc_address: str  # HOST:PORT
    metadata_url: str
    admin_url: str
    key_format: KeyFormat
    requested_seed: str  # --vllm-hash-seed as given
    starts: tuple[HashStartCandidate, ...]  # the candidates; more than one: auto-detect among them
    auto_starts: tuple[HashStartCandidate, ...]  # every start bsr knows (a diagnosis tries them all)
    chunk_size: int

    @property
    def auto(self) -> bool:
        return len(self.starts) > 1


def store_query(
    store: str,
    *,
    model: str | None,
    world_size: int,
    metadata: str | None,
    admin: str | None,
    dtype: str,
    tags: Sequence[str],
    vllm_hash_seed: str,
    chunk_size: int,
    own_seed: str,
) -> StoreQuery:
    """The probe's query from its flags (``own_seed``: this process's PYTHONHASHSEED, tried first under auto), or
    InvalidInput naming the first flag that is wrong."""
    host, port = master_address(store)
    if not model:
        raise InvalidInput(
            "--store needs --model (the model name in LMCache's keys)",
            hint="the model name LMCache stored the keys under (vLLM's --model), e.g. --model meta-llama/Llama-3.1-8B",
        )
    if world_size < 1:
        raise InvalidInput(
            "--world-size must be positive",
            hint="give the TP world size the keys were stored with, e.g. --world-size 2",
        )
    fmt = KeyFormat(model, world_size, lmcache_dtype(dtype), parse_tags(tags))
    return StoreQuery(
        store=store,
        rpc_address=f"{host}:{port}",
        metadata_url=metadata or f"http://{host}:8080/metadata",
        admin_url=admin or f"http://{host}:9003",
        key_format=fmt,
        requested_seed=vllm_hash_seed,
        starts=tuple(hash_starts(vllm_hash_seed, own_seed=own_seed)),
        auto_starts=tuple(hash_starts("auto", own_seed=own_seed)),
        chunk_size=chunk_size,
    )


def master_address(store: str) -> tuple[str, int]:
    """(host, port) of --store mooncake://HOST:PORT, the master's RPC address; InvalidInput when it is not one."""
    url = urlsplit(store)
    try:
        port = url.port
    except ValueError:
        port = None  # not a number, or out of range
    if url.scheme != "mooncake" or not url.hostname or not port:
        raise InvalidInput(
            f"--store must look like mooncake://HOST:PORT (the master's RPC address), got {store!r}",
            hint="e.g. --store mooncake://10.0.0.5:50051",
        )
    return url.hostname, port


def hash_starts(option: str, *, own_seed: str) -> list[HashStartCandidate]:
    """(label, start) candidates for --vllm-hash-seed: 'none' is LMCache without vLLM (start 0); 'auto' tries that,
    ``own_seed`` (this process's PYTHONHASHSEED, when a number) and AUTO_SEEDS, in that order."""
    opt = str(option).strip().lower()
    if opt == "none":
        return [("none", 0)]
    if opt != "auto":
        return [(opt, vllm_seeded_start(opt))]
    seeds = [s for s in (own_seed, *AUTO_SEEDS) if s.isdigit()]
    return [("none", 0)] + [(s, vllm_seeded_start(s)) for s in dict.fromkeys(seeds)]


def detection_hashes(query: StoreQuery, tokens: Sequence[int]) -> dict[str, list[int]]:
    """Under auto, each candidate start's first DETECT_CHUNKS chunk hashes (asked of the store in one batch); else
    nothing to detect."""
    if not query.auto:
        return {}
    return {label: lmcache_chunk_hashes(tokens, query.chunk_size, s, limit=DETECT_CHUNKS) for label, s in query.starts}


def choose_start(
    starts: Sequence[HashStartCandidate], batch: Mapping[str, list[list[str]]], held: Sequence[bool]
) -> tuple[str, dict[str, int]]:
    """(the chain start's label, chunks held per candidate that held any), from ``held``: the store's answer for
    every key of ``batch`` (each candidate's keys, per worker), in order. The most hits wins; none: the first."""
    counts, i = {}, 0
    for label, rows in batch.items():
        n = sum(len(r) for r in rows)
        counts[label] = sum(held[i : i + n])
        i += n
    matched = {label: c for label, c in counts.items() if c}
    if not matched:
        return starts[0][0], matched
    # Ties: the candidates' order (none, this process's seed, the usual seeds).
    return max(matched, key=lambda label: (matched[label], -list(counts).index(label))), matched


def prompt_keys(
    fmt: KeyFormat, tokens: Sequence[int], chunk_size: int, start: int
) -> tuple[list[int], int | None, list[list[str]]]:
    """(the full chunks' hashes, the partial tail's hash or None, the keys per worker: full chunks, then the tail)."""
    hashes = lmcache_chunk_hashes(tokens, chunk_size, start)
    tail = lmcache_tail_hash(tokens, chunk_size, hashes[-1] if hashes else start)
    return hashes, tail, fmt.keys_of(hashes + ([tail] if tail is not None else []))


def checksummed(held_keys: Sequence[str], sizes: Mapping[str, int]) -> list[bool]:
    """Per held key: a checksum of this format is stored beside it (``sizes``: the sidecars' sizes by key). bsr's
    plugins store one; stock LMCache stores none, an older bsr one of the bytes alone (of another size): both are
    unverified (docs/mixed-deployments.md)."""
    return [sizes.get(sidecar_key(k)) == SIDECAR_BYTES for k in held_keys]


@dataclass(frozen=True)
class StoreRead:
    """What one probe read from the store: the chain start it chose, the prompt's keys per worker (its full chunks,
    then the partial tail's), which of them the master lists, their replicas and their checksum sidecars."""

    chosen: str  # the chain start's label: "none" (no vLLM) or a vLLM hash seed
    matched: dict[str, int]  # auto-detection: chunks held under each candidate start that held any
    hashes: list[int]  # the full chunks' hashes
    tail: int | None  # the partial last chunk's hash, when the prompt has one
    rows: list[list[str]]  # the keys, per worker
    held_flags: list[bool]  # per key of ``rows`` flattened: listed by the master
    held_keys: list[str]
    replicas: dict[str, list[str]]
    sums: list[bool]  # per held key: a checksum of this format is stored beside it

    @property
    def chunks(self) -> int:
        return len(self.rows[0]) if self.rows else 0

    @property
    def listed(self) -> dict[int, list[bool]]:
        """Per worker, per chunk: listed by the master."""
        n = self.chunks
        return {w: self.held_flags[w * n : (w + 1) * n] for w in range(len(self.rows))}


@dataclass(frozen=True)
class ListedSegment:
    """A segment as the master's listing names it: its name, its transfer engine endpoint, its size (if given)."""

    name: str
    te_endpoint: str
    size_bytes: int | None = None


class Holders:
    """Segment holders and what their checks found: from the master's segment listing (``listing_error`` when it
    could not be read), plus any holder a replica names that the listing lacked. ``alive`` is filled by whoever
    checks them (None: could not be checked, unknown); a holder absent from it was not checked in time."""

    def __init__(self, segments: Sequence[ListedSegment], listing_error: str | None) -> None:
        self.segments = list(segments)
        self.listing_error = listing_error
        self.te: dict[str, str] = {}  # segment name -> te_endpoint
        for seg in self.segments:
            name = seg.name or seg.te_endpoint
            if name:
                self.te[name] = seg.te_endpoint or name
        self.alive: dict[str, bool | None] = {}  # None: could not be checked (unknown)
        self.endpoint: dict[str, str] = {}

    def unchecked(self, names: Sequence[str]) -> list[str]:
        """The holders of ``names`` not checked yet, each now known by its name (a replica's endpoint)."""
        todo = [n for n in dict.fromkeys(names) if n not in self.alive]
        for n in todo:
            self.te.setdefault(n, n)
        return todo


def replica_holders(replicas: Mapping[str, list[str]]) -> list[str]:
    """Every holder a replica names, in the order the replicas name them (repeats kept)."""
    return [ep for eps in replicas.values() for ep in eps]


def liveness(
    holders: Holders,
    rows: list[list[str]],
    listed: Mapping[int, list[bool]],
    replicas: Mapping[str, list[str]],
    chunk_size: int,
) -> Liveness:
    """Whether each listed chunk can really be read, from the holders' checks: a chunk is live only when a live
    holder is known to hold it; a chunk whose replicas the master did not name, or whose holders could not be
    checked, is unknown."""
    te = dict(holders.te)
    for ep in replica_holders(replicas):  # every holder a replica names is reported, checked or not
        te.setdefault(ep, ep)
    alive = holders.alive
    by_size = {seg.name: seg.size_bytes for seg in holders.segments}
    segments = tuple(
        SegmentHolder(
            name,
            holders.endpoint.get(name, te_endpoint),
            HolderState.ALIVE
            if alive.get(name)
            else (HolderState.GONE if alive.get(name) is False else HolderState.UNKNOWN),
            by_size.get(name),
        )
        for name, te_endpoint in te.items()
    )
    cells = tuple(
        "".join(_cell(listed[w][i], replicas.get(key), alive) for i, key in enumerate(row))
        for w, row in enumerate(rows)
    )
    n = len(rows[0]) if rows else 0

    def prefix(ok: Callable[[str], bool]) -> int:
        k = 0
        while k < n and all(ok(c[k]) for c in cells):
            k += 1
        return k

    return Liveness(
        segments=segments,
        cells=cells,
        chunk_size=chunk_size,
        listed_committable_chunks=prefix(lambda c: c != ABSENT),
        live_committable_chunks=prefix(lambda c: c == LIVE),
        segment_listing_error=holders.listing_error,
    )


def _cell(listed: bool, holders: list[str] | None, alive: Mapping[str, bool | None]) -> str:
    """One chunk's state: ABSENT, LIVE, STALE or UNKNOWN."""
    if not listed:
        return ABSENT
    if not holders:
        return UNKNOWN
    if any(alive.get(ep) for ep in holders):
        return LIVE
    if all(alive.get(ep) is False for ep in holders):
        return STALE
    return UNKNOWN


def first_break(bitmap: HitBitmap, live: Liveness) -> Break | None:
    """The first chunk that breaks the committable prefix, saying why when the master does list it."""
    brk = bitmap.first_break()
    if brk is None:
        return None
    state = live.cells[brk.rank][brk.chunk]
    if state == STALE:
        return replace(brk, reason="listed by the master, but its holder is gone")
    if state == UNKNOWN:
        return replace(brk, reason="listed by the master, but no live holder is known (liveness unknown)")
    return brk


def seed_label(label: str) -> str:
    return "no vLLM (start 0)" if label == "none" else f"vLLM hash seed {label}"


def key_format_report(query: StoreQuery, read: StoreRead) -> KeyFormatReport:
    fmt = query.key_format
    return KeyFormatReport(
        dtype=fmt.dtype,
        tags=[f"{k}%{v}" for k, v in fmt.tags],
        hash_start=HashStart(
            requested=query.requested_seed,
            vllm_hash_seed=None if read.chosen == "none" else read.chosen,
            start=dict(query.starts)[read.chosen],
            detected=bool(read.matched) if query.auto else None,
            candidates_held=read.matched,
            # More than one chain start matched (the same prompt stored by deployments with other seeds).
            chains_matched=[seed_label(label) for label in read.matched],
        ),
    )


def integrity(read: StoreRead) -> Integrity:
    checksums = dict(zip(read.held_keys, read.sums, strict=True))
    unverified = [  # the first few, by rank and chunk
        ChunkRef(w, i)
        for w, row in enumerate(read.rows)
        for i, key in enumerate(row)
        if key in checksums and not checksums[key]
    ][:64]
    return Integrity(sum(read.sums), len(read.sums) - sum(read.sums), unverified)


def prompt_chains(query: StoreQuery, read: StoreRead, tokens: Sequence[int]) -> dict[str, set[str]]:
    """The prompt's chunk hashes (hex, as keys spell them) under every chain start bsr knows (the chosen one's
    reused): what a diagnosis of a total miss looks for in the store's keys."""
    every = dict(query.starts) | dict(query.auto_starts)
    return {
        label: {
            f"{h:x}"
            for h in (read.hashes if label == read.chosen else lmcache_chunk_hashes(tokens, query.chunk_size, s))
        }
        for label, s in every.items()
    }


def store_probe_result(
    query: StoreQuery,
    tokens: Sequence[int],
    read: StoreRead,
    live: Liveness,
    diagnosis: Diagnosis | NoDiagnosis | None,
    width: int | None,
) -> StoreProbe:
    """The store probe's result: the bitmap of live holders only, the prefix it commits and where it breaks, the
    key format, liveness, integrity, the partial tail and (on a total miss) the diagnosis."""
    fmt, chunk_size, n_chunks = query.key_format, query.chunk_size, read.chunks
    listed = read.listed
    tail_stored = read.tail is not None and any(listed[w][-1] for w in range(fmt.world_size))
    storable = n_chunks if (read.tail is None or tail_stored) else len(read.hashes)
    cells = {(w, GROUP): "".join("1" if c == LIVE else "0" for c in live.cells[w]) for w in range(fmt.world_size)}
    bitmap = HitBitmap(("mooncake",), fmt.world_size, (GROUP,), len(tokens), chunk_size, cells, model=fmt.model)
    k = bitmap.prefix_chunks()
    return StoreProbe(
        store=query.store,
        bitmap=bitmap,
        prompt_tokens=len(tokens),
        prompt_chunks=n_chunks,
        storable_chunks=storable,
        committable_chunks=k,
        first_break=first_break(bitmap, live) if k < storable else None,
        strip_width=width,
        key_format=key_format_report(query, read),
        key_example=read.rows[0][0] if n_chunks else None,
        liveness=live,
        integrity=integrity(read),
        tail=Tail(len(tokens) % chunk_size, tail_stored) if read.tail is not None else None,
        diagnosis=diagnosis,
    )
