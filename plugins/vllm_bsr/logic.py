"""The vLLM connector's decisions, as plain Python (no vLLM, no LMCache, no torch): unit-tested anywhere.

Scheduler side: how many external tokens to report for a request (the probe-only prefix, or 0 while a
force-local marker stands for its prefix), and the marker's lifecycle. vLLM reschedules a request whose load
failed in place (recompute) and never asks the connector about it again, so a marker keyed by the request would be
set and dropped without ever being read. The marker is keyed by the *prefix* whose load failed instead (a running
digest of its token ids at the chunk boundary where the load ended): it outlives the failed request and steers the
next admission of any prompt that starts with that prefix (the same prompt, or a longer one sharing it) to local
compute (0 external tokens; vLLM recomputes and LMCache stores the chunks afresh), and that admission clears it.
Markers are bounded (oldest dropped first). Worker side: the windows of a load and, when any window
fails, the block ids to report as load errors (every block of the request in every KV group, so vLLM drops the
whole external prefix and recomputes it instead of trusting a partial one).

Windows are numbered as everywhere in bsr: a 0-based index in machine fields (events, JSON: ``failed_window: 1``)
and ``G1..GK`` in text a person reads (``window G2`` is index 1), see ``window_label``.

What the scheduler holds is published for the workers' admin API (``SchedulerState.published``): the markers (the
scheduler runs in another process than the workers' admin servers), each with the bsr prompt hash of the prefix it
stands for and that prefix's length in tokens, so a client holding a prompt's tokens can tell whether a marker
covers it.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from bsr_cli.core.evidence import EventKind, FailureKind, Outcome, Stage, window_label
from bsr_cli.core.keys import prompt_hash
from bsr_cli.core.markers import Marker
from bsr_cli.core.plan import chunk_spans

MAX_MARKERS = 4096
MAX_FORCED = 16  # forced-local admissions kept for the admin API (the newest)
MARKER_REASON = "a worker reported load errors on its blocks: vLLM recomputed the request"


def prefix_keys(tokens: Sequence[int], chunk_size: int, n_chunks: int) -> list[str]:
    """The key of each chunk-aligned prefix ``tokens[:k * chunk_size]``, k = 1..n_chunks. One running digest, so
    all the boundaries together cost one pass over the tokens."""
    h = hashlib.blake2b(digest_size=12)
    out = []
    for k in range(n_chunks):
        h.update(array("q", tokens[k * chunk_size : (k + 1) * chunk_size]).tobytes())
        out.append(h.copy().hexdigest())
    return out


class SchedulerState:
    """Per-request bookkeeping of the scheduler-side connector; force-local markers per failed prefix."""

    def __init__(self, chunk_size: int, max_markers: int = MAX_MARKERS) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.chunk_size = chunk_size
        self.max_markers = max_markers
        self.markers: dict[str, Marker] = {}  # prefix key -> marker (insertion order = age)
        self.blocks: dict[str, tuple[list[int], ...]] = {}  # request -> block ids per KV group
        self.external: dict[str, int] = {}
        self.prefixes: dict[str, list[str]] = {}  # request -> its probed prefix's keys, one per chunk boundary
        self.forced: dict[str, str] = {}  # request -> the marker's key that forced it local
        self.tokens: dict[str, Sequence[int]] = {}  # request -> its prompt's token ids (vLLM's list, not copied)
        self.prefix_tokens: dict[str, int] = {}  # marker key -> tokens in the prefix it stands for
        self.forced_log: list[dict[str, object]] = []  # the newest admissions a marker sent to local compute
        self.failed_log: list[dict[str, object]] = []  # the newest requests whose load a worker reported failed

    def external_tokens(
        self,
        request: str,
        probed_prefix_tokens: int,
        num_computed_tokens: int,
        tokens: Sequence[int] | None = None,
    ) -> int:
        """External tokens to report: 0 when a marker stands for any chunk-aligned prefix of the request's
        probed prefix (``tokens``: its prompt's token ids; without them the request id is the only key); else the
        chunk-aligned probe prefix past what vLLM has."""
        aligned = probed_prefix_tokens // self.chunk_size * self.chunk_size
        if tokens is None:
            keys = [request]
        else:
            keys = prefix_keys(tokens, self.chunk_size, min(aligned, len(tokens)) // self.chunk_size)
        self.prefixes[request] = keys
        if tokens is not None:
            self.tokens[request] = tokens
        hit = next((k for k in keys if k in self.markers), None)
        if hit is not None:
            n = 0
            if self.forced.get(request) != hit:
                m = self.markers[hit]
                seen = {"request": request, "marker": m.prompt, "prefix_tokens": self.prefix_tokens.get(hit)}
                self.forced_log = [*self.forced_log[-(MAX_FORCED - 1) :], seen | {"at": time.time()}]
            self.forced[request] = hit
        else:
            n = max(0, aligned - num_computed_tokens)
        self.external[request] = n
        return n

    def prefix_key(self, request: str) -> str | None:
        """The key of the longest prefix the request was probed for (what a failed load of it marks)."""
        keys = self.prefixes.get(request)
        return keys[-1] if keys else None

    def on_alloc(self, request: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> bool:
        """The scheduler allocated the request's blocks. Returns True when this admission cleared a marker
        (the request runs without the external prefix, recomputing it: the marker has served its purpose)."""
        self.blocks[request] = tuple(list(g) for g in block_ids)
        key = self.forced.pop(request, None)
        if key is not None and key in self.markers and num_external_tokens == 0:
            del self.markers[key]
            self.prefix_tokens.pop(key, None)
            return True
        return False

    def on_load_errors(self, invalid_block_ids: Iterable[int], reason: str = MARKER_REASON) -> list[str]:
        """Workers reported failed blocks: mark the probed prefix of every tracked request that owns one of them
        (the next admission of a prompt starting with it computes locally). Returns the requests hit."""
        bad = set(invalid_block_ids)
        hit = []
        for req, groups in self.blocks.items():
            if any(b in bad for g in groups for b in g):
                key = self.prefix_key(req) or req
                if key not in self.markers:
                    n = len(self.prefixes.get(req) or ()) * self.chunk_size
                    toks = self.tokens.get(req)
                    # Shown under bsr's prompt hash of the prefix (what `bsr probe`/`explain` compute from tokens).
                    shown = prompt_hash(toks[:n]) if toks is not None and n else key
                    self.markers[key] = Marker(prompt=shown, excluded=set(), reason=reason, request=req)
                    if toks is not None and n:
                        self.prefix_tokens[key] = n
                    while len(self.markers) > self.max_markers:
                        oldest = next(iter(self.markers))
                        del self.markers[oldest]
                        self.prefix_tokens.pop(oldest, None)
                # Request-level truth for every TP rank: a rank whose own windows completed still had its load
                # thrown away (vLLM recomputes the whole request when any rank reports a failed block).
                failed = {"request": req, "prefix_tokens": len(self.prefixes.get(req) or ()) * self.chunk_size}
                self.failed_log = [*self.failed_log[-(MAX_FORCED - 1) :], failed | {"at": time.time()}]
                hit.append(req)
        return hit

    def on_finished(self, request: str) -> None:
        """Teardown (finished, aborted, preempted out): the request's state goes; a marker for its prefix stays
        for the next admission of a prompt that starts with it."""
        self.blocks.pop(request, None)
        self.external.pop(request, None)
        self.prefixes.pop(request, None)
        self.forced.pop(request, None)
        self.tokens.pop(request, None)

    def published(self) -> dict[str, object]:
        """What the workers' admin API serves of the scheduler (plain data, for a file the admin reads): every
        standing marker, with the prefix it stands for (``prefix_tokens``: a prompt is covered when its first
        ``prefix_tokens`` tokens hash to ``prompt``), the newest admissions a marker sent to local compute, and the
        newest requests whose load a worker reported failed (whichever TP rank it was)."""
        markers = [
            m.to_dict() | {"prefix_tokens": self.prefix_tokens.get(k), "force_local": True}
            for k, m in self.markers.items()
        ]
        return {
            "chunk_size": self.chunk_size,
            "markers": markers,
            "forced": list(self.forced_log),
            "load_failed": list(self.failed_log),
        }


def windows(start_token: int, end_token: int, chunk_size: int, w_chunks: int) -> list[tuple[int, int]]:
    """[s, e) windows of at most ``w_chunks`` chunks covering [start, end); start is floored to a chunk (what
    LMCache's mask needs), end must be chunk-aligned. ``w_chunks`` 0 = one window (the stock whole-plan path)."""
    if end_token % chunk_size:
        raise ValueError(f"end {end_token} is not a multiple of the chunk size {chunk_size}")
    spans = chunk_spans(start_token // chunk_size, end_token // chunk_size, w_chunks)
    return [(c0 * chunk_size, c1 * chunk_size) for c0, c1 in spans]


@dataclass
class LoadResult:
    ok: bool
    loaded_tokens: int
    failed_window: int | None = None
    reason: str = ""


def load_in_windows(retrieve: Callable[[int, int], int], wins: Sequence[tuple[int, int]]) -> LoadResult:
    """Run ``retrieve(s, e)`` (returns tokens loaded in [s, e)) per window; stop at the first short window or
    exception. Nothing loaded counts unless every window completes (fail closed)."""
    done = 0
    for i, (s, e) in enumerate(wins):
        try:
            got = retrieve(s, e)
        except Exception as exc:  # noqa: BLE001 - any exception fails the load, closed
            return LoadResult(False, 0, i, f"{type(exc).__name__}: {exc}")
        if got != e - s:
            return LoadResult(False, 0, i, f"loaded {got} of {e - s} tokens in window {window_label(i)}")
        done += got
    return LoadResult(True, done)


def failed_block_ids(block_ids_per_group: Sequence[Sequence[int]] | Mapping[int, Sequence[int]]) -> set[int]:
    """Every destination block of a failed request, in every KV group: reported as load errors so the external
    prefix collapses to zero (vLLM recomputes from the first invalid block)."""
    groups = block_ids_per_group.values() if isinstance(block_ids_per_group, Mapping) else block_ids_per_group
    return {int(b) for g in groups for b in g}


# -- what the worker's admin API records of a load ------------------------------------------------------------
# An injected fault of this kind fails the window's install (the copy into vLLM's paged KV): the rank is blamed,
# as bsr's taxonomy says (core/evidence.py); every other failure of LMCache's retrieve is the tier's (fetch).
INSTALL_FAULTS = frozenset({"restore-fault"})


class IntegrityFailure(TypedDict):
    """The chunk of a load that failed its checksum (or had none), as the connector found it."""

    chunk: int | None  # its index among the request's chunks (None: not among them)
    tier: str
    key: str  # its LMCache key
    verdict: str
    detail: str
    removed: bool  # removed from the store: the next store rewrites it


class _FailedSpan(TypedDict, total=False):
    chunks: list[int]  # the failed window's [start, end) in chunks


class _FailedChunk(TypedDict, total=False):
    chunk: int | None
    key: str
    verdict: str


class LoadFailure(TypedDict):
    """One failure of a load, as a restore's failure reads (rank, window, stage, kind, tier, why)."""

    rank: int
    window: int | None
    chunks: NotRequired[list[int]]
    chunk: NotRequired[int | None]
    key: NotRequired[str]
    verdict: NotRequired[str]
    stage: str
    kind: str
    tier: str | None
    reason: str


class LoadReport(TypedDict):
    """One load as the connector saw it (``load_report``), in bsr's restore vocabulary."""

    request: str
    prompt: str
    prefix_tokens: int
    W: int
    outcome: str
    windows: int
    windows_run: int
    window_spans: list[list[int]]
    chunks: int
    advertised_tokens: int
    committed_tokens: int
    loaded_tokens: int
    recomputed_tokens: int
    failed_window: int | None
    failures: list[LoadFailure]
    failure_kind: str | None
    tiers: list[str]
    reason: str
    unverified_chunks: int
    seconds: float
    bytes: int
    bytes_per_chunk: int
    chunk_size: int


def load_report(
    *,
    request: str,
    prompt: str,
    vllm_cached_tokens: int,
    end_token: int,
    wins: Sequence[tuple[int, int]],
    windows_run: int,
    result: LoadResult,
    w: int,
    chunk_size: int,
    bytes_per_chunk: int,
    tiers: Sequence[str],
    fault_kind: str | None = None,
    seconds: float = 0.0,
    integrity: IntegrityFailure | None = None,
    unverified_chunks: int = 0,
) -> LoadReport:
    """One load as the connector saw it, in bsr's restore vocabulary (what `bsr status` and `explain` read).

    ``advertised_tokens``: what the scheduler told vLLM would come from the store; ``loaded_tokens``: what vLLM
    really took (all or nothing: a failed window fails the whole load); ``recomputed_tokens``: what vLLM computes
    again because the load failed (every block of the request is reported, so vLLM recomputes from token 0 up to
    the end of the external prefix; vLLM's own ``num_cached_tokens`` may still count them as cached).

    ``integrity``: the chunk that failed its checksum (or had none), when that failed the load: the tier is blamed
    at the verify stage, and the failure names the chunk. ``unverified_chunks``: chunks loaded without a
    checksum (only when the connector is told to load them)."""
    advertised = max(0, end_token - vllm_cached_tokens)
    done = len(wins) if result.ok else int(result.failed_window or 0)
    fails = [] if result.ok else [_load_failure(result, wins, chunk_size, tiers, fault_kind, integrity)]
    return {
        "request": request,
        "prompt": prompt,
        "prefix_tokens": end_token,
        "W": w,
        "outcome": (Outcome.COMMITTED if result.ok else Outcome.FAILED_CLOSED).value,
        "windows": len(wins),
        "windows_run": windows_run,
        "window_spans": [list(x) for x in wins],
        "chunks": len(range(vllm_cached_tokens // chunk_size, end_token // chunk_size)),
        "advertised_tokens": advertised,
        "committed_tokens": advertised if result.ok else 0,
        "loaded_tokens": advertised if result.ok else 0,
        "recomputed_tokens": 0 if result.ok else end_token,
        "failed_window": result.failed_window,
        "failures": fails,
        "failure_kind": fails[0]["kind"] if fails else None,
        "tiers": list(tiers),
        "reason": result.reason,
        "unverified_chunks": unverified_chunks,
        "seconds": seconds,
        # Bytes moved into vLLM's KV by the windows that completed (a failed load's are then recomputed over).
        "bytes": sum((e - s) // chunk_size for s, e in wins[:done]) * bytes_per_chunk,
        "bytes_per_chunk": bytes_per_chunk,
        "chunk_size": chunk_size,
    }


def _load_failure(
    result: LoadResult,
    wins: Sequence[tuple[int, int]],
    chunk_size: int,
    tiers: Sequence[str],
    fault_kind: str | None,
    integrity: IntegrityFailure | None,
) -> LoadFailure:
    """The failure of a load that failed: an injected install fault is the rank's, a chunk that failed its checksum
    the verifying tier's at the verify stage, anything else the tier's fetch."""
    install = fault_kind in INSTALL_FAULTS
    stage = Stage.INSTALL if install else Stage.FETCH
    kind = FailureKind.RANK if install else FailureKind.TIER
    # LMCache's retrieve does not say which backend came back short; with one tier it can only be that one.
    tier = None if install else (tiers[0] if len(tiers) == 1 else "lmcache")
    span: _FailedSpan = {}
    if result.failed_window is not None and 0 <= result.failed_window < len(wins):
        s, e = wins[result.failed_window]
        span = {"chunks": [s // chunk_size, e // chunk_size]}  # the failed window's [start, end)
    found: _FailedChunk = {}
    if integrity is not None and not install:
        # The bytes arrived but were wrong (or unprovable): the verifying tier's, at the verify stage.
        stage, tier = Stage.VERIFY, str(integrity["tier"])
        found = {"chunk": integrity["chunk"], "key": integrity["key"], "verdict": integrity["verdict"]}
    return {
        "rank": 0,
        "window": result.failed_window,
        **span,
        **found,
        "stage": stage.value,
        "kind": kind.value,
        "tier": tier,
        "reason": result.reason,
    }


def load_events(report: LoadReport) -> list[dict[str, object]]:
    """The events of one load, as bsr's embedded engine writes them for a restore (so `bsr explain`, `describe` and
    `bsr events` read a worker's loads as they read its restores): started, each window released, the failure (the
    window, its chunks, the tier and stage, why), then committed or failed closed. Windows: 0-based ``window``
    fields."""
    req = report["request"]
    spans = report["window_spans"]
    ok = report["outcome"] == Outcome.COMMITTED
    released = len(spans) if ok else int(report["failed_window"] or 0)
    out: list[dict[str, object]] = [
        {
            "type": EventKind.RESTORE_STARTED.value,
            "request": req,
            "prompt": report["prompt"],
            "prefix_tokens": report["prefix_tokens"],
            "tokens": report["advertised_tokens"],
            "windows": report["windows"],
            "W": report["W"],
            "tiers": report["tiers"],
        }
    ]
    for i, (s, e) in enumerate(spans[:released]):
        out.append(
            {
                "type": EventKind.WINDOW_RELEASED.value,
                "request": req,
                "rank": 0,
                "window": i,
                "windows": len(spans),
                "bytes": (e - s) // report["chunk_size"] * report["bytes_per_chunk"],
            }
        )
    # Each failure also as the rank's own event, as the embedded engine's ranks write it (`bsr describe` reads it).
    out += [{"type": EventKind.RESTORE_FAILED.value, "request": req} | f for f in report["failures"]]
    end = {
        "type": (EventKind.RESTORE_COMMITTED if ok else EventKind.RESTORE_FAILED_CLOSED).value,
        "request": req,
        "committed_tokens": report["committed_tokens"],
        "advertised_tokens": report["advertised_tokens"],
        "loaded_tokens": report["loaded_tokens"],
        "recomputed_tokens": report["recomputed_tokens"],
        "failures": report["failures"],
        "failure_kind": report["failure_kind"],
        "seconds": report["seconds"],
    }
    return [*out, end]
