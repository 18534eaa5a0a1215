"""The rank ops every rank host serves the same way, declared once.

Every rank host (the embedded engine's rank process, ``engine/worker.py``; the LMCache plugin's rank; the unit
lane's fake) serves the rank ops (``bsr_cli.api.ranks.RankOps``) through the one dispatcher,
``api.ranks.dispatch``. Most ops are the host's own: how it probes and stores, restores, reports its tiers. These
are not, and a host takes them from ``RankHost`` instead of writing them again:

- the destination-KV ops (prefill, output_hash, canonical_hash, invalidate), served by the host's ``kv_ops``
  (``runtime/kv_ops.KVOps``, over the host's KV);
- ``abort``: the request's abort signal is set now, or kept for its job when the abort comes first, so a restore
  that has not reached this rank yet ends at once when it does (``AbortSignals``, which a host's restore holds
  its signal through).

A host that serves only some ops still takes the rest from ``api.ranks.UnsupportedOps`` (listed after this base:
``class Host(RankHost, UnsupportedOps)``). Kept free of torch, as ``kv_ops`` is."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from bsr_cli.api import ranks
from bsr_cli.runtime.kv_ops import KVOps


class AbortSignals:
    """A rank host's abort signal per request: set by an abort, held by the request's restore while it runs. An
    abort that arrives before its job is kept, and the restore ends as soon as its job comes."""

    def __init__(self) -> None:
        self._by_request: dict[str, threading.Event] = {}

    def signal(self, request_id: str) -> None:
        self._by_request.setdefault(request_id, threading.Event()).set()

    @contextmanager
    def held(self, request_id: str) -> Iterator[threading.Event]:
        """The request's signal for its restore's run (already set when its abort came first), dropped after."""
        abort = self._by_request.setdefault(request_id, threading.Event())
        try:
            yield abort
        finally:
            self._by_request.pop(request_id, None)


class RankHost:
    """The ops every rank host serves the same way (see the module's docstring). A host sets ``kv_ops`` and
    ``aborts`` when it is built."""

    kv_ops: KVOps
    aborts: AbortSignals

    # -- destination-KV ops: served by the KVOps over this rank's KV ------------------------------------------------
    def prefill(self, req: ranks.PrefillRequest) -> ranks.PrefillResult:
        return self.kv_ops.prefill(req)

    def output_hash(self, req: ranks.OutputHashRequest) -> ranks.OutputHashResult:
        return self.kv_ops.output_hash(req)

    def canonical_hash(self, req: ranks.CanonicalHashRequest) -> ranks.CanonicalHashResult:
        return self.kv_ops.canonical_hash(req)

    def invalidate(self, req: ranks.InvalidateRequest) -> ranks.InvalidateResult:
        return self.kv_ops.invalidate(req)

    def abort(self, request_id: str) -> None:
        """End request ``request_id``'s restore fail-closed (now, or as soon as its job arrives)."""
        self.aborts.signal(request_id)


__all__ = ["AbortSignals", "RankHost"]
