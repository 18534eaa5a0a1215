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
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from bsr_cli.core.markers import Marker
from bsr_cli.core.plan import chunk_spans

MAX_MARKERS = 4096


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
        hit = next((k for k in keys if k in self.markers), None)
        if hit is not None:
            n = 0
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
            return True
        return False

    def on_load_errors(self, invalid_block_ids: Iterable[int], reason: str = "load error") -> list[str]:
        """Workers reported failed blocks: mark the probed prefix of every tracked request that owns one of them
        (the next admission of a prompt starting with it computes locally). Returns the requests hit."""
        bad = set(invalid_block_ids)
        hit = []
        for req, groups in self.blocks.items():
            if any(b in bad for g in groups for b in g):
                key = self.prefix_key(req) or req
                if key not in self.markers:
                    self.markers[key] = Marker(prompt=key, excluded=set(), reason=reason, request=req)
                    while len(self.markers) > self.max_markers:
                        del self.markers[next(iter(self.markers))]
                hit.append(req)
        return hit

    def on_finished(self, request: str) -> None:
        """Teardown (finished, aborted, preempted out): the request's state goes; a marker for its prefix stays
        for the next admission of a prompt that starts with it."""
        self.blocks.pop(request, None)
        self.external.pop(request, None)
        self.prefixes.pop(request, None)
        self.forced.pop(request, None)


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
            return LoadResult(False, 0, i, f"loaded {got} of {e - s} tokens in window {i}")
        done += got
    return LoadResult(True, done)


def failed_block_ids(block_ids_per_group: Sequence[Sequence[int]] | Mapping[int, Sequence[int]]) -> set[int]:
    """Every destination block of a failed request, in every KV group: reported as load errors so the external
    prefix collapses to zero (vLLM recomputes from the first invalid block)."""
    groups = block_ids_per_group.values() if isinstance(block_ids_per_group, Mapping) else block_ids_per_group
    return {int(b) for g in groups for b in g}
