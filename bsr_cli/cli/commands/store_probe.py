"""`bsr probe --store mooncake://HOST:PORT`: which ranks of a real LMCache deployment hold which chunks of a prompt,
asked of the Mooncake store directly (no engine), whether the processes holding them are still alive, and why
nothing matches when nothing does.

The keys are LMCache 0.5.6's (bsr_cli.core.lmcache_keys): its dtype names, request tags, and the hash chain's start,
which is 0 for LMCache alone and vLLM's PYTHONHASHSEED-derived start for LMCache inside vLLM. By default the start
is detected: the candidates (no vLLM, and vLLM with a few usual seeds) are tried against the store in one probe.

Liveness fails closed: a chunk counts (in the bitmap and the committable prefix) only when the master names a
replica of it on a holder that answers now. A chunk whose holder cannot be told is UNKNOWN and does not count; the
master's own listing stays in `liveness.listed`.

Fast on purpose (a probe is typed during an incident): only the standard library and Mooncake's client are imported,
the store is asked once for every key (`batch_is_exist`) and once for every held key's replicas
(`batch_get_replica_desc`), and holders are checked in parallel with a bound on threads and time."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from bsr_cli.cli import process_exit
from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions
from bsr_cli.cli.context import AppState
from bsr_cli.core.bitmap import Break, HitBitmap
from bsr_cli.core.integrity import SIDECAR_BYTES, sidecar_key
from bsr_cli.core.lmcache_keys import (
    DTYPE_FLAG,
    lmcache_chunk_hashes,
    lmcache_dtype,
    lmcache_key,
    lmcache_tail_hash,
    next_chunk_hash,
    parse_lmcache_key,
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
    KeyFormatValue,
    KeyGroup,
    Liveness,
    NoDiagnosis,
    SegmentHolder,
    StoreProbe,
    Tail,
)
from bsr_cli.errors import EngineUnreachable, InvalidInput
from bsr_cli.loaders import read_tokens_file
from bsr_cli.mooncake import health

# Seeds tried by --vllm-hash-seed auto (besides bsr's own PYTHONHASHSEED): the values deployment guides use.
AUTO_SEEDS = ("0", "1", "42", "123", "1234", "12345")
# Chunks per candidate start tried by auto-detection (all workers, one batch_is_exist for every candidate).
DETECT_CHUNKS = 64
# LMCache's one KV group, named as the engine's probe names it.
GROUP = "attn"
# Keys per batch_is_exist / batch_get_replica_desc call (one call up to this many: 1,048,576 tokens at world size 4).
BATCH_KEYS = 16384
# Holders checked at once (a metadata lookup and a TCP connect each), and the time all of them may take.
LIVENESS_THREADS = 8
LIVENESS_DEADLINE_S = 3.0


T = TypeVar("T")


def run(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> None:
    st.out.result(collect(st, opts, prompt, width), _render)


def _render(console: Any, d: StoreProbe) -> None:
    from bsr_cli.cli.render import ops as render_ops  # rich: only for text output

    render_ops.store_probe(console, d)


@dataclass(frozen=True)
class _KeyFormat:
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
class _StoreRead:
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


def collect(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> StoreProbe:
    """The store probe's result: bitmap (live holders only), key format, liveness and (on a miss) the diagnosis."""
    host, port = _master_address(opts.store)
    if not opts.model:
        raise InvalidInput(
            "--store needs --model (the model name in LMCache's keys)",
            hint="the model name LMCache stored the keys under (vLLM's --model), e.g. --model meta-llama/Llama-3.1-8B",
        )
    if opts.world_size < 1:
        raise InvalidInput(
            "--world-size must be positive",
            hint="give the TP world size the keys were stored with, e.g. --world-size 2",
        )
    fmt = _KeyFormat(opts.model, opts.world_size, lmcache_dtype(opts.dtype), parse_tags(opts.tags))
    starts = hash_starts(opts.vllm_hash_seed)
    meta = opts.metadata or f"http://{host}:8080/metadata"
    admin_url = opts.admin or f"http://{host}:9003"
    if not opts.verbose:
        os.environ.setdefault("GLOG_minloglevel", "3")  # Mooncake's glog: read when its library loads
    # Started first and waited for last: the master's segment listing and a check of every listed holder.
    holders = _background(lambda: _check_listed_holders(admin_url, meta))
    with _native_stderr_silenced(not opts.verbose):
        tokens, read = _read_store(st, opts, prompt, f"{host}:{port}", meta, fmt, starts)
    n_chunks, chunk_size = read.chunks, opts.chunk_size
    listed = {w: read.held_flags[w * n_chunks : (w + 1) * n_chunks] for w in range(fmt.world_size)}
    checked = holders()
    if isinstance(checked, BaseException):
        raise checked
    live = liveness(checked, meta, read.rows, listed, read.replicas, chunk_size)
    tail_stored = read.tail is not None and any(listed[w][-1] for w in range(fmt.world_size))
    storable = n_chunks if (read.tail is None or tail_stored) else len(read.hashes)
    cells = {(w, GROUP): "".join("1" if c == LIVE else "0" for c in live.cells[w]) for w in range(fmt.world_size)}
    bitmap = HitBitmap(("mooncake",), fmt.world_size, (GROUP,), len(tokens), chunk_size, cells, model=fmt.model)
    k = bitmap.prefix_chunks()
    return StoreProbe(
        store=opts.store,
        bitmap=bitmap,
        prompt_tokens=len(tokens),
        prompt_chunks=n_chunks,
        storable_chunks=storable,
        committable_chunks=k,
        first_break=_first_break(bitmap, live) if k < storable else None,
        strip_width=width,
        key_format=_key_format(fmt, opts.vllm_hash_seed, starts, read),
        key_example=read.rows[0][0] if n_chunks else None,
        liveness=live,
        integrity=_integrity(read),
        tail=Tail(len(tokens) % chunk_size, tail_stored) if read.tail is not None else None,
        diagnosis=_diagnose_total_miss(admin_url, fmt, starts, read, tokens, chunk_size)
        if n_chunks and not read.held_keys
        else None,
    )


def _master_address(store: str) -> tuple[str, int]:
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


def _read_store(
    st: AppState,
    opts: StoreProbeOptions,
    prompt: PromptFlags,
    rpc_address: str,
    meta: str,
    fmt: _KeyFormat,
    starts: list[tuple[str, int]],
) -> tuple[list[int], _StoreRead]:
    """The prompt's tokens, and what the store holds of them: one session, every key asked in one batch."""
    # The client's set-up (~20 ms) runs while the prompt is read and hashed.
    connecting = _background(lambda: _StoreSession(rpc_address, meta, st.settings.timeout_s, opts.store))
    try:
        tokens = _tokens(prompt)
        detect = (
            {label: lmcache_chunk_hashes(tokens, opts.chunk_size, s, limit=DETECT_CHUNKS) for label, s in starts}
            if len(starts) > 1
            else {}
        )
    except BaseException:
        session = connecting()
        if isinstance(session, _StoreSession):
            session.close()
        raise
    session = connecting()
    if isinstance(session, BaseException):
        raise session
    try:
        chosen, matched = _detect_start(session, fmt, starts, detect)
        start = dict(starts)[chosen]
        hashes = lmcache_chunk_hashes(tokens, opts.chunk_size, start)
        tail = lmcache_tail_hash(tokens, opts.chunk_size, hashes[-1] if hashes else start)
        rows = fmt.keys_of(hashes + ([tail] if tail is not None else []))
        flat = [k for row in rows for k in row]
        held_flags = session.exists(flat)
        held_keys = [k for k, h in zip(flat, held_flags, strict=True) if h]
        replicas = session.replicas(held_keys) if held_keys else {}
        # bsr's plugins store each object's checksum beside it; stock LMCache stores none, an older bsr one of the
        # bytes alone (of another size): both are unverified (docs/mixed-deployments.md).
        sidecars = session.sizes([sidecar_key(k) for k in held_keys]) if held_keys else {}
        sums = [sidecars.get(sidecar_key(k)) == SIDECAR_BYTES for k in held_keys]
    finally:
        session.close()
    return tokens, _StoreRead(chosen, matched, hashes, tail, rows, held_flags, held_keys, replicas, sums)


def _detect_start(
    session: _StoreSession, fmt: _KeyFormat, starts: list[tuple[str, int]], detect: dict[str, list[int]]
) -> tuple[str, dict[str, int]]:
    """(the chain start's label, chunks held per candidate that held any). Under auto (``detect`` holds each
    candidate's first chunks), one probe of every candidate's keys; the most hits wins."""
    if not detect:
        return starts[0][0], {}
    batch = {label: fmt.keys_of(hs) for label, hs in detect.items()}
    held = session.exists([k for rows in batch.values() for row in rows for k in row])
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


def _first_break(bitmap: HitBitmap, live: Liveness) -> Break | None:
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


def _key_format(fmt: _KeyFormat, requested: str, starts: list[tuple[str, int]], read: _StoreRead) -> KeyFormatReport:
    return KeyFormatReport(
        dtype=fmt.dtype,
        tags=[f"{k}%{v}" for k, v in fmt.tags],
        hash_start=HashStart(
            requested=requested,
            vllm_hash_seed=None if read.chosen == "none" else read.chosen,
            start=dict(starts)[read.chosen],
            detected=bool(read.matched) if len(starts) > 1 else None,
            candidates_held=read.matched,
            # More than one chain start matched (the same prompt stored by deployments with other seeds).
            chains_matched=[_seed_label(label) for label in read.matched],
        ),
    )


def _integrity(read: _StoreRead) -> Integrity:
    checksummed = dict(zip(read.held_keys, read.sums, strict=True))
    unverified = [  # the first few, by rank and chunk
        ChunkRef(w, i)
        for w, row in enumerate(read.rows)
        for i, key in enumerate(row)
        if key in checksummed and not checksummed[key]
    ][:64]
    return Integrity(sum(read.sums), len(read.sums) - sum(read.sums), unverified)


def _diagnose_total_miss(
    admin_url: str,
    fmt: _KeyFormat,
    starts: list[tuple[str, int]],
    read: _StoreRead,
    tokens: list[int],
    chunk_size: int,
) -> Diagnosis | NoDiagnosis:
    """`diagnose` with this prompt's chunk hashes under every chain start bsr knows (the chosen one's reused)."""
    every = dict(starts) | dict(hash_starts("auto"))
    hex_chains = {
        label: {
            f"{h:x}" for h in (read.hashes if label == read.chosen else lmcache_chunk_hashes(tokens, chunk_size, s))
        }
        for label, s in every.items()
    }
    return diagnose(
        admin_url,
        fmt.model,
        fmt.world_size,
        fmt.dtype,
        fmt.tags,
        read.chosen,
        hex_chains,
        auto=len(starts) > 1,
        tokens=tokens,
        chunk_size=chunk_size,
    )


def _seed_label(label: str) -> str:
    return "no vLLM (start 0)" if label == "none" else f"vLLM hash seed {label}"


def hash_starts(option: str) -> list[tuple[str, int]]:
    """(label, start) candidates for --vllm-hash-seed: 'none' is LMCache without vLLM (start 0)."""
    opt = str(option).strip().lower()
    if opt == "none":
        return [("none", 0)]
    if opt != "auto":
        return [(opt, vllm_seeded_start(opt))]
    seeds = [s for s in (os.environ.get("PYTHONHASHSEED", ""), *AUTO_SEEDS) if s.isdigit()]
    return [("none", 0)] + [(s, vllm_seeded_start(s)) for s in dict.fromkeys(seeds)]


def _tokens(prompt: PromptFlags) -> list[int]:
    if prompt.given() != 1:
        raise InvalidInput(
            "give exactly one of --tokens-file, --prompt-file or --synthetic N", hint="e.g. --tokens-file prompt.json"
        )
    if prompt.prompt_file is not None:
        raise InvalidInput(
            "--store needs token ids (--tokens-file): bsr cannot reproduce your model's tokenizer",
            hint="write the prompt's token ids (from your tokenizer) to a file and pass --tokens-file",
        )
    if prompt.synthetic is not None:
        from bsr_cli.core.keys import synthetic_tokens

        return synthetic_tokens(prompt.synthetic, prompt.seed)
    assert prompt.tokens_file is not None
    return read_tokens_file(prompt.tokens_file)


def _background(fn: Callable[[], T]) -> Callable[[], T | Exception]:
    """Run `fn` on a daemon thread now; the returned function waits for its value (or the exception it raised)."""
    box: list[T | Exception] = []

    def work() -> None:
        try:
            box.append(fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller as a value
            box.append(e)

    t = threading.Thread(target=work, name="bsr-store-probe", daemon=True)
    t.start()

    def wait() -> T | Exception:
        t.join()
        return box[0]

    return wait


class _CallTimedOut(Exception):
    pass


class _StoreSession:
    """A read-only Mooncake client for one probe: no segment, no buffer, every call under a deadline (on a daemon
    thread, abandoned at the deadline). The master is probed over HTTP and TCP first: Mooncake's setup() against a
    dead master blocks ~90 s and leaves a client that crashes on use."""

    def __init__(self, rpc_address: str, metadata_url: str, deadline_s: float, store_url: str) -> None:
        self.store_url = store_url
        self.deadline_s = max(deadline_s, 0.1)
        probe_s = min(2.0, self.deadline_s)
        down = None
        if metadata_url.startswith("http") and not health.master_healthy(health.health_url_for(metadata_url), probe_s):
            down = f"health probe {health.health_url_for(metadata_url)} failed"
        elif not health.tcp_reachable(rpc_address, timeout=probe_s):
            down = f"RPC port {rpc_address} refuses connections"
        if down:
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: mooncake master unavailable, not connecting: {down}",
                hint="check --store (RPC port) and --metadata",
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            hint = "apt-get install -y libibverbs1" if "libibverbs" in str(exc) else "pip install the Mooncake wheel"
            raise EngineUnreachable(f"cannot load the Mooncake client: {exc}", hint=hint) from None
        # Advertise this client's transfer endpoint on loopback (Mooncake otherwise picks the first NIC).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self._store = MooncakeDistributedStore()
        self._abandoned = False
        try:
            rc = self._call(lambda: self._store.setup("127.0.0.1", metadata_url, 0, 0, "tcp", "", rpc_address))
        except _CallTimedOut:
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: setup did not finish within {self.deadline_s:g} s",
                hint="check --store (RPC port) and --metadata",
            ) from None
        if rc != 0:
            self._abandoned = True  # a failed setup leaves nothing to close
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: setup failed with code {rc}",
                hint="check --store (RPC port) and --metadata",
            )

    def _call(self, fn: Callable[[], T]) -> T:
        box: list[T | BaseException] = []
        done = threading.Event()

        def work() -> None:
            try:
                box.append(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            done.set()

        threading.Thread(target=work, name="bsr-store-call", daemon=True).start()
        if not done.wait(self.deadline_s):
            self._abandoned = True  # closing under a running call can crash the process
            raise _CallTimedOut
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def exists(self, keys: list[str]) -> list[bool]:
        """One ``batch_is_exist`` (per BATCH_KEYS keys): 1 is held; 0 and errors are not."""
        out: list[bool] = []
        for i in range(0, len(keys), BATCH_KEYS):
            part = keys[i : i + BATCH_KEYS]
            try:
                rcs = self._call(lambda part=part: self._store.batch_is_exist(part))  # type: ignore[misc]
            except _CallTimedOut:
                raise EngineUnreachable(
                    f"the Mooncake store at {self.store_url} did not answer batch_is_exist in {self.deadline_s:g} s",
                    hint="is the master up? raise --timeout if the store is large or busy",
                ) from None
            if len(rcs) != len(part) or (part and all(rc < 0 for rc in rcs)):
                raise EngineUnreachable(
                    f"the Mooncake store at {self.store_url} failed batch_is_exist (codes {sorted(set(rcs))[:3]})",
                    hint="is the master up, and is this its RPC port? --verbose shows the Mooncake client's log",
                )
            out += [rc == 1 for rc in rcs]
        return out

    def _complete_replicas(self, keys: list[str]) -> dict[str, list[Any]]:
        """Each key's complete memory replicas' buffer descriptors, per the master. A key the master did not answer
        for is absent: what it holds is unknown."""
        out: dict[str, list[Any]] = {}
        for i in range(0, len(keys), BATCH_KEYS):
            part = keys[i : i + BATCH_KEYS]
            try:
                got = self._call(lambda part=part: self._store.batch_get_replica_desc(part))  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - not answered (timed out, refused, an older client): unknown, never live
                continue
            for key, descs in got.items():
                complete = [
                    d.get_memory_descriptor().buffer_descriptor
                    for d in descs
                    if d.is_memory_replica() and str(d.status).endswith("COMPLETE")
                ]
                if complete:
                    out[key] = complete
        return out

    def replicas(self, keys: list[str]) -> dict[str, list[str]]:
        """The holders (transport endpoints) of each key's complete memory replicas; absent: liveness unknown."""
        return {k: [str(b.transport_endpoint) for b in bufs] for k, bufs in self._complete_replicas(keys).items()}

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """Each held key's size in bytes (its first complete replica's); absent: not held, or unknown."""
        return {k: int(bufs[0].size) for k, bufs in self._complete_replicas(keys).items()}

    def close(self) -> None:
        """Close the client, or leave it to the process's exit where `bsr` ends without interpreter teardown
        (closing joins Mooncake's threads: about 1 s)."""
        if self._abandoned or process_exit.leave_open(self._store):
            return
        self._store.close()


@contextlib.contextmanager
def _native_stderr_silenced(enabled: bool) -> Iterator[None]:
    """Mooncake's C++ client logs (glog) straight to file descriptor 2; keep that off the terminal (--verbose
    shows it). Python's own error reporting happens after the block, on the restored descriptor."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(sink, 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(sink)
    finally:
        os.close(saved)


@dataclass(frozen=True)
class ListedSegment:
    """A segment as the master's listing names it: its name, its transfer engine endpoint, its size (if given)."""

    name: str
    te_endpoint: str
    size_bytes: int | None = None


class _Holders:
    """Segment holders and whether each answers now: from the master's segment listing, plus any holder a replica
    names that the listing lacked. Holders are checked in parallel (at most LIVENESS_THREADS at once, all within
    LIVENESS_DEADLINE_S); one that could not be checked in time is unknown."""

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

    def check(self, metadata_url: str, names: Sequence[str]) -> None:
        todo = [n for n in dict.fromkeys(names) if n not in self.alive]
        if not todo:
            return
        pool = ThreadPoolExecutor(max_workers=min(LIVENESS_THREADS, len(todo)), thread_name_prefix="bsr-holder")
        futs = {n: pool.submit(health.check_holder, metadata_url, n, self.te.setdefault(n, n)) for n in todo}
        pool.shutdown(wait=False, cancel_futures=False)
        deadline = time.monotonic() + LIVENESS_DEADLINE_S
        for name, fut in futs.items():
            try:
                self.endpoint[name], self.alive[name] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - a holder that could not be checked is unknown, not dead or alive
                fut.cancel()


def _check_listed_holders(admin_url: str, metadata_url: str) -> _Holders:
    from bsr_cli.errors import ServiceError

    try:
        listing = health.segments(admin_url, timeout=LIVENESS_DEADLINE_S)
    except ServiceError as e:
        return _Holders((), e.message)
    found = _Holders(
        [ListedSegment(seg.segment_name, seg.te_endpoint, seg.size_bytes) for seg in listing],
        None,
    )
    found.check(metadata_url, list(found.te))
    return found


def liveness(
    holders: _Holders,
    metadata_url: str,
    rows: list[list[str]],
    listed: dict[int, list[bool]],
    replicas: dict[str, list[str]],
    chunk_size: int,
) -> Liveness:
    """Whether each listed chunk can really be read: the master names its replicas' holders (one batched replica
    query), and each holder is asked directly (a TCP connect to its data endpoint; the master's listings keep a dead
    holder's entries until its client TTL runs out, ~10 s). A chunk is live only when a live holder is known to hold
    it; a chunk whose replicas the master did not name, or whose holders could not be checked, is unknown."""
    holders.check(metadata_url, [ep for eps in replicas.values() for ep in eps])
    alive = holders.alive
    by_size = {seg.name: seg.size_bytes for seg in holders.segments}
    segments = tuple(
        SegmentHolder(
            name,
            holders.endpoint.get(name, te),
            HolderState.ALIVE
            if alive.get(name)
            else (HolderState.GONE if alive.get(name) is False else HolderState.UNKNOWN),
            by_size.get(name),
        )
        for name, te in holders.te.items()
    )
    cells: list[str] = []
    for w, row in enumerate(rows):
        out = []
        for i, key in enumerate(row):
            if not listed[w][i]:
                out.append(ABSENT)
                continue
            eps = replicas.get(key)
            if not eps:
                out.append(UNKNOWN)
            elif any(alive.get(ep) for ep in eps):
                out.append(LIVE)
            elif all(alive.get(ep) is False for ep in eps):
                out.append(STALE)
            else:
                out.append(UNKNOWN)
        cells.append("".join(out))
    n = len(rows[0]) if rows else 0

    def prefix(ok: Callable[[str], bool]) -> int:
        k = 0
        while k < n and all(ok(c[k]) for c in cells):
            k += 1
        return k

    return Liveness(
        segments=segments,
        cells=tuple(cells),
        chunk_size=chunk_size,
        listed_committable_chunks=prefix(lambda c: c != ABSENT),
        live_committable_chunks=prefix(lambda c: c == LIVE),
        segment_listing_error=holders.listing_error,
    )


def _list_keys(admin_url: str) -> list[str]:
    return health.all_keys(admin_url, timeout=10)


def _changes_as_flags(changes: dict[str, KeyFormatValue]) -> list[str]:
    """The flags a diagnosis tells the user to pass (for its text; `explain` builds whole commands from them)."""
    out = []
    for field, value in changes.items():
        if field == "world_size":
            out.append(f"--world-size {value}")
        elif field == "dtype":
            out.append(f"--dtype {value}")
        elif field == "tags" and isinstance(value, list):
            out.append(" ".join(f"--tag {shlex.quote(t)}" for t in value) if value else "drop --tag")
        else:
            out.append(f"--vllm-hash-seed {value}")
    return out


def _describe(ws: int, dt: str, tags: tuple[tuple[str, str], ...]) -> str:
    t = ", tags " + "@".join(f"{k}%{v}" for k, v in tags) if tags else ", no tags"
    return f"world size {ws}, dtype {dt}{t}"


def _unknown_start_chunks(members: list[Any], tokens: Sequence[int], chunk_size: int) -> int:
    """How many leading chunks of this prompt a group holds under a chain start none of the candidates gives: a
    key whose next link (the prompt's second chunk hashed after it) is also in the group is the prompt's first
    chunk under that start. 0 when none is (or the prompt has fewer than two full chunks: nothing to confirm)."""
    if len(tokens) < 2 * chunk_size:
        return 0
    hexes = {p.chunk_hash for p in members}
    second = tuple(tokens[chunk_size : 2 * chunk_size])
    for p in members:
        try:
            h = int(p.chunk_hash, 16)
        except ValueError:
            continue
        if f"{next_chunk_hash(h, second):x}" not in hexes:
            continue
        held, prefix = 1, h
        for i in range(chunk_size, len(tokens) - chunk_size + 1, chunk_size):
            prefix = next_chunk_hash(prefix, tokens[i : i + chunk_size])
            if f"{prefix:x}" not in hexes:
                break
            held += 1
        return held
    return 0


# A group of the store's keys for the model: the fields LMCache puts in a key besides the chunk hash.
_GroupKey = tuple[int, str, tuple[tuple[str, str], ...]]  # (world size, dtype, tags)


def diagnose(
    admin_url: str,
    model: str,
    world_size: int,
    dtype: str,
    tags: tuple[tuple[str, str], ...],
    start_label: str,
    chains: dict[str, set[str]],
    *,
    auto: bool = False,
    tokens: Sequence[int] = (),
    chunk_size: int = 256,
) -> Diagnosis | NoDiagnosis:
    """Explain a total miss from what the store does hold (the master's key listing): group the model's keys by
    (world size, dtype, tag set), count in each how many of this prompt's chunk hashes it holds under each candidate
    chain start (and whether it holds the prompt under a start no candidate gives), and rank the groups: the
    closest is the first (holds the prompt, then fewest differing fields, then most chunks, then most keys)."""
    try:
        keys = _list_keys(admin_url)
    except OSError as e:
        return NoDiagnosis(
            why=f"could not list the store's keys at {admin_url}: {e}",
            hint="pass --master-admin http://HOST:PORT (the master's metrics/admin port)",
        )
    parsed = [p for p in (parse_lmcache_key(k) for k in keys) if p is not None and p.layer_id is None]
    mine = [p for p in parsed if p.model == model]
    models = Counter(p.model for p in parsed)
    causes: list[str] = []
    ranked: list[KeyGroup] = []
    if not parsed:
        causes.append(
            "the store holds no LMCache-format keys at all (nothing was stored, or the master restarted: "
            "Mooncake keeps its metadata in memory)"
        )
    elif not mine:
        causes.append(
            f"the store holds no keys for model {model!r}; it holds: "
            + ", ".join(f"{m} ({n})" for m, n in models.most_common(5))
        )
    else:
        groups: dict[_GroupKey, list[Any]] = defaultdict(list)
        for p in mine:
            groups[(p.world_size, p.dtype, p.tags)].append(p)
        want: _GroupKey = (world_size, dtype, tags)
        scored = [
            _score_group(group, members, want, chains, start_label, auto, tokens, chunk_size)
            for group, members in groups.items()
        ]
        # The diagnosis's ranking (ties broken by the description, never by the master's listing order).
        scored.sort(key=lambda s: (not s[0][0], -s[0][1], -s[0][2], -s[0][3], s[0][4]))
        ranked = [g for _, _, g in scored]
        causes.append(_closest_cause(scored[0][1], scored[0][2], model, chains))
        if len(groups) > 1:
            causes.append(
                f"keys of {model!r} are mixed: {len(groups)} groups ("
                + "; ".join(f"{d}: {g.keys} key(s)" for _, d, g in scored)
                + ")"
            )
    return Diagnosis(
        keys_listed=len(keys),
        keys_for_model=len(mine),
        groups=ranked,
        closest=0 if ranked else None,
        causes=causes,
    )


def _score_group(
    group: _GroupKey,
    members: list[Any],
    want: _GroupKey,
    chains: dict[str, set[str]],
    start_label: str,
    auto: bool,
    tokens: Sequence[int],
    chunk_size: int,
) -> tuple[tuple[Any, ...], str, KeyGroup]:
    """(its rank, its description, the group as the diagnosis reports it): how many of the prompt's chunks the group
    holds under its best chain start, and which flags would make the probe ask for its keys."""
    ws, dt, tg = group
    hexes = {p.chunk_hash for p in members}
    hits = {label: len(hexes & chain) for label, chain in chains.items()}
    best_label = max(hits, key=lambda lbl: (hits[lbl], lbl == start_label))
    diff = [f for f, mine, theirs in zip(("world_size", "dtype", "tags"), want, group, strict=True) if mine != theirs]
    if hits[best_label] and best_label != start_label and not auto:
        diff.append("hash_start")  # under auto, the start is found once the other fields fit
    unknown_start = 0 if hits[best_label] else _unknown_start_chunks(members, tokens, chunk_size)
    changes: dict[str, KeyFormatValue] = {}
    for f in diff:
        if f == "world_size":
            changes[f] = ws
        elif f == "dtype":
            changes[f] = DTYPE_FLAG.get(dt, dt)
        elif f == "tags":
            changes[f] = [f"{k}={v}" for k, v in tg]
        else:
            changes["vllm_hash_seed"] = best_label
    g = KeyGroup(
        world_size=ws,
        dtype=dt,
        tags=[f"{k}%{v}" for k, v in tg],
        keys=len(members),
        workers=sorted({p.worker_id for p in members}),
        prompt_chunks_held=hits[best_label],
        vllm_hash_seed=None if best_label == "none" or not hits[best_label] else best_label,
        unknown_start_chunks=unknown_start,
        differs_in=diff,
        changes=changes,
        flags=_changes_as_flags(changes),
    )
    desc = _describe(ws, dt, tg)
    if hits[best_label] and best_label != "none":
        desc += f", vLLM hash seed {best_label}"
    held_any = hits[best_label] or unknown_start
    return (bool(held_any), -len(diff), hits[best_label] or unknown_start, len(members), desc), desc, g


def _closest_cause(desc: str, best: KeyGroup, model: str, chains: dict[str, set[str]]) -> str:
    """Why the closest group (described by ``desc``) did not answer the probe, and the flags that would fix it."""
    if best.prompt_chunks_held:
        if not best.differs_in:
            return f"the keys match ({desc}) but none is held now"
        return (
            f"closest group: {desc} holds {best.prompt_chunks_held} chunk(s) of this prompt "
            f"({best.keys} key(s)); pass {' and '.join(best.flags)}"
        )
    if best.unknown_start_chunks:
        tried = ", ".join(sorted(x for x in chains if x != "none"))
        return (
            f"{desc} holds {best.unknown_start_chunks} chunk(s) of this prompt under a hash chain start that "
            f"none of the vLLM hash seeds tried gives ({tried}; and no vLLM): vLLM ran with another "
            "PYTHONHASHSEED (pass --vllm-hash-seed SEED with the seed it ran with) or with none (random: "
            "unreproducible)" + (f", and {' and '.join(best.flags)}" if best.flags else "")
        )
    tried = ", ".join(sorted(chains))
    return (
        f"{best.keys} chunk(s) of {model!r} are stored ({desc}"
        + (f"; differs in {', '.join(best.differs_in)}: {', '.join(best.flags)}" if best.differs_in else "")
        + "), but none with this prompt's chunk hashes under any chain start tried (vLLM hash seeds: "
        f"{tried}): a different prompt prefix, tokenizer or chunk size, or vLLM ran with another "
        "PYTHONHASHSEED (pass --vllm-hash-seed SEED) or with none (random: unreproducible)"
    )


__all__ = ["collect", "diagnose", "hash_starts", "liveness", "run"]
