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

from collections.abc import Iterator, Mapping, Sequence
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


@dataclass(frozen=True)
class StoredCheck:
    """One stored object as its tier read it back whole and checked it: its header or trailer, key and length, and
    the object checksum bound to them (``runtime.checksum.object_checksum``)."""

    ref: str  # where the tier holds it (the fs tier: its file; Mooncake: its key): what ``set_aside`` moves
    key: str | None  # the key it is stored under (None: its header could not be read)
    held: bool = True  # False: the tier does not hold it (nothing was read)
    bytes: int = 0  # bytes read back
    damage: str | None = None  # why its stored bytes fail their check; None: intact (or not held)
    # The stored version read (the fs tier: inode, size and mtime): ``set_aside`` leaves a newer one alone, so an
    # object rewritten between the check and the move (the next store's) is never set apart.
    version: str = ""


@runtime_checkable
class RepairableTier(Protocol):
    """A tier that can check its own stored objects and set a damaged one apart (HDFS-style: the bad replica is
    set apart, the chunk counts as absent, and the next store writes it again from a good source): the fs tier
    moves it under ``quarantine/``, the Mooncake tier removes it. The re-read of a failed restore's window and
    every scrub (``runtime/scrub.py``: the rest of a prompt after that failure, or `bsr scrub` of a prompt or of
    every object) go through these four methods; a tier that can verify its objects plugs in by implementing them
    (fs and Mooncake do; a tier that cannot takes no part in either)."""

    name: str

    def check_stored(self, key: str) -> StoredCheck:
        """Read the object stored under ``key`` back whole and check it. An absent one is not held, an unreadable
        one damaged where the tier can tell (a file that cannot be read); raises ``TierUnavailable`` when the tier
        cannot be read at all, or cannot answer for this object (then nothing can be said of it)."""
        ...

    def check_all(self, shard: int, shards: int) -> Iterator[StoredCheck]:
        """Every object the tier holds in ``shard`` of ``shards`` (ranks sharing one store split it), each read back
        and checked as it is reached (so a caller that stops early reads no more). Raises ``TierUnavailable`` when
        the tier cannot be walked."""
        ...

    def set_aside(self, found: StoredCheck, reason: str) -> QuarantinedObject | None:
        """Move a damaged object out of the tier's reach (never served again), with ``reason``: kept for the
        incident where the tier has a place for it, removed otherwise; None when it could not be (gone already,
        rewritten since ``found`` was read, a read-only store)."""
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


@runtime_checkable
class ExplainingTier(Protocol):
    """A tier that knows a fault behind a fetch's failure besides its error codes (an injected fault): evidence of
    the tier's fault, which outranks a rank's starvation when its deadline runs out."""

    def known_fault(self, keys: Sequence[str]) -> str:
        """Why a fetch of ``keys`` fails, as the tier knows it ("" when it knows of nothing)."""
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
