"""The tier interface the BSR runtime restores from.

A tier is an external store of chunk objects (the Mooncake store, a filesystem "SSD" tier, an LMCache backend).
The runtime never imports a concrete tier: hosts (the embedded engine, the LMCache plugin) construct tiers and
hand them in. Every call takes a deadline; a tier never blocks past it.

Objects are immutable byte strings addressed by LMCache-style keys
(``model@world_size@worker_id@<chunk hash hex>@<dtype>``). Each object is stored with its object checksum, a CRC32C
over its key, its length and its payload (`bsr_cli.runtime.checksum.object_checksum`), so the runtime can detect
corruption and an object stored under another chunk's key; the tier returns the stored checksum next to the bytes,
and the *runtime* verifies it against the key it asked for (so an injected in-transit corruption is caught by the
same check as a real one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from bsr_cli.api.ranks import ProbeResult, QuarantinedObject
from bsr_cli.core.bitmap import encode_row
from bsr_cli.core.evidence import TierCondition

# Per-object result codes of Tier.get_into (>= 0 means the number of bytes written).
MISSING = -1  # the tier does not hold the key
TIMED_OUT = -2  # the deadline passed before the object arrived
IO_ERROR = -3  # the transfer failed (connection, short read, store error)
UNAVAILABLE = -4  # the tier as a whole cannot serve (master down, directory gone)

CODE_NAMES = {MISSING: "missing", TIMED_OUT: "timeout", IO_ERROR: "io-error", UNAVAILABLE: "unavailable"}


class TierUnavailable(Exception):
    """The tier cannot serve at all (e.g. the Mooncake master is down). Raised by put/contains."""


@dataclass(frozen=True)
class StagingSlice:
    """A writable region of the restore pool: its address (for RDMA/TCP engines that take raw pointers) and
    a memoryview over the same bytes (for file reads). ``len(view)`` is the object size. ``tail``: bytes after the
    region, in the same registered buffer, that a tier may write too (room for a stored object's trailer, so the
    whole object lands in one transfer buffer); never part of the object's payload."""

    ptr: int
    view: memoryview
    tail: int = 0


@dataclass(frozen=True)
class TierHealth:
    ok: bool
    detail: str
    condition: TierCondition = TierCondition.OK  # why; an unhealthy tier that names none is UNAVAILABLE

    def __post_init__(self) -> None:
        if not self.ok and self.condition is TierCondition.OK:
            object.__setattr__(self, "condition", TierCondition.UNAVAILABLE)


class Tier(Protocol):
    name: str  # short, stable: "mooncake", "fs"

    def health(self) -> TierHealth: ...

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        """Probe: which keys the tier holds. Moves no object bytes and leaves nothing pinned or locked."""
        ...

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        """Store objects (payload + its object checksum). Raises TierUnavailable or OSError on failure; never
        half-reports."""
        ...

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        """Fetch each object into its staging slice. Returns (codes, stored checksums): per key the number of bytes
        written (== len(dest.view) on success) or a negative code above, and the checksum stored with it (None when
        the object did not arrive). Never raises for per-object failures."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RepairableTier(Protocol):
    """A tier that can check its own stored objects and set a damaged one apart (HDFS-style: the bad replica is
    set apart, the chunk counts as absent, and the next store writes it again from a good source): the fs tier
    moves it under ``quarantine/``, the Mooncake tier removes it."""

    def quarantine_damaged(self, suspects: Mapping[str, str]) -> list[QuarantinedObject]:
        """Re-read each suspect object (key → what it is and why it is suspect) and move aside the ones whose
        stored bytes fail their checksum (an object that reads back intact stays: its damage was in transit, not
        on the tier). Returns what it moved."""
        ...

    def quarantined(self, limit: int) -> tuple[list[QuarantinedObject], int]:
        """The newest ``limit`` objects set apart, and how many there are in all."""
        ...


@runtime_checkable
class AbandoningTier(Protocol):
    """A tier whose ``get_into`` may give up at its deadline while the transfer still runs (a Mooncake call on a
    worker thread cannot be cancelled): the staging slices it was given may still be written after it returned."""

    def pending_writes(self) -> list[Future[Any]]:
        """The transfers abandoned at a deadline that have not returned yet: until each is done, the memory it was
        given must not be reused."""
        ...


def probe_tiers(
    tiers: Mapping[str, Tier], keys: Mapping[str, Sequence[str]], asked: Sequence[str], n_chunks: int, timeout_s: float
) -> ProbeResult:
    """A rank's probe over its own tiers: per KV group (``keys``: the group's object keys), one hex digit per chunk,
    bit i set when ``asked[i]`` holds the object. Moves no bytes; a tier that cannot answer holds nothing there and
    says why."""
    held: dict[str, dict[str, list[bool]]] = {g: {} for g in keys}
    errors: dict[str, str] = {}
    for name in asked:
        tier = tiers.get(name)
        if tier is None:
            continue
        for g, ks in keys.items():
            try:
                held[g][name] = tier.contains(ks, timeout_s)
            except Exception as e:  # noqa: BLE001 - an unreachable tier holds nothing, and says why
                errors[name] = f"{type(e).__name__}: {e}"
                break
    return ProbeResult({g: encode_row(held[g], asked, n_chunks) for g in keys}, errors)
