"""In-memory fakes for the runtime's fast unit lane: a tier, a pool buffer, a destination and an in-process rank.

These are fakes, on purpose: the runtime's behaviour tests (tests/engine) run it against a real Mooncake master,
a real filesystem tier and one OS process per rank with torch KV, which takes tens of seconds per engine. The
fast lane checks the runtime's own rules (the window loop, the budget, faults, the commit rule, the failure
taxonomy, the event log, the admin API's request handling) in-process, in milliseconds, and lets a test break a
tier or a rank in ways a real one cannot be broken on demand. Nothing here is used outside tests.
"""

from __future__ import annotations

import ctypes
import hashlib
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    RankRequest,
    ResetPeakRequest,
    ResetPeakResult,
    RestoreRequest,
    RestoreResult,
    SetBudgetRequest,
    SetBudgetResult,
    StatsRequest,
    StatsResult,
    StoreRequest,
    StoreResult,
    TierStatus,
    UnsupportedOps,
    dispatch,
)
from bsr_cli.core.events import Event
from bsr_cli.core.keys import object_key
from bsr_cli.core.registration import Registration
from bsr_cli.errors import RankDied, ServerError
from bsr_cli.runtime.checksum import object_checksum
from bsr_cli.runtime.kv_ops import KVOps
from bsr_cli.runtime.pool import RestorePool
from bsr_cli.runtime.rank_host import AbortSignals, RankHost
from bsr_cli.runtime.restore import RankRestorer, RestoreJob
from bsr_cli.runtime.tiers import MISSING, UNAVAILABLE, StagingSlice, TierHealth, TierUnavailable, probe_tiers

R = TypeVar("R")
CHUNK = 16  # tokens per chunk: small, so a prompt of a few hundred tokens spans many windows


def small_registration(tp: int = 2) -> Registration:
    """Two KV groups with different block sizes (like the demo registration), a few bytes per token."""
    return Registration.from_dict(
        {
            "model": "unit/fake",
            "tp_size": tp,
            "chunk_size": CHUNK,
            "groups": [{"name": "full", "block_size": 4}, {"name": "swa", "block_size": 8}],
            "tensors": [
                {"name": "k", "dtype": "uint8", "bytes_per_token": 4, "group": "full"},
                {"name": "v", "dtype": "uint8", "bytes_per_token": 4, "group": "full"},
                {"name": "s", "dtype": "uint8", "bytes_per_token": 4, "group": "swa"},
            ],
        }
    )


def synthetic(chunk_hash: str, rank: int, group: str, nbytes: int) -> bytes:
    """The KV a chunk's prefill produces on one rank and group: a pure function of its prefix-chained hash."""
    return hashlib.shake_128(f"{chunk_hash}:{rank}:{group}".encode()).digest(nbytes)


class FakeTier:
    """A fake tier: a dict of key → (payload, CRC32C) behind the runtime's Tier protocol.

    A fake because the fast lane must not start Mooncake or touch a disk, and because a test needs to make a
    tier lose, shorten or refuse objects on demand. It keeps the protocol's contract: ``contains`` moves no bytes
    (counted in ``bytes_read``), ``get_into`` never raises for a per-object failure and returns the stored checksum.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.down = False
        self.short: set[str] = set()  # keys served one byte short
        self.bytes_read = 0
        self.get_calls = 0
        self.contains_calls = 0
        self.gate: threading.Event | None = None  # when set by a test, get_into waits on it (a slow tier)

    def health(self) -> TierHealth:
        return TierHealth(not self.down, "down" if self.down else "ok")

    def contains(self, keys: Sequence[str], timeout_s: float) -> list[bool]:
        self.contains_calls += 1
        if self.down:
            raise TierUnavailable(f"{self.name} is down")
        return [k in self.objects for k in keys]

    def put(self, keys: Sequence[str], payloads: Sequence[memoryview], checksums: Sequence[int]) -> None:
        if self.down:
            raise TierUnavailable(f"{self.name} is down")
        for k, p, c in zip(keys, payloads, checksums, strict=True):
            self.objects[k] = (bytes(p), c)

    def get_into(
        self, keys: Sequence[str], dests: Sequence[StagingSlice], timeout_s: float
    ) -> tuple[list[int], list[int | None]]:
        self.get_calls += 1
        if self.gate is not None:
            self.gate.wait(timeout_s)
        codes: list[int] = []
        sums: list[int | None] = []
        for k, d in zip(keys, dests, strict=True):
            if self.down:
                codes.append(UNAVAILABLE)
                sums.append(None)
                continue
            held = self.objects.get(k)
            if held is None:
                codes.append(MISSING)
                sums.append(None)
                continue
            payload, stored = held
            n = min(len(payload), len(d.view)) - (1 if k in self.short else 0)
            d.view[:n] = payload[:n]
            self.bytes_read += n
            codes.append(n)
            sums.append(stored)
        return codes, sums

    def close(self) -> None:
        pass


def make_pool(slots: int, slot_bytes: int, budget_bytes: int | None = None) -> RestorePool:
    """A RestorePool over a ctypes buffer: the fake of the host's preallocated (pinned) torch tensor. A real
    address is needed because the runtime checksums staged objects by pointer. The pool's ``view`` references the
    buffer (a memoryview holds its exporter), so the memory lives as long as the pool."""
    buf = (ctypes.c_ubyte * (slots * slot_bytes))()
    return RestorePool(ctypes.addressof(buf), memoryview(buf).cast("B"), slot_bytes, budget_bytes)


class FakeDestination:
    """A fake of the host's paged KV cache (the Destination protocol): per group, one bytearray per block.

    A fake because the real one is torch tensors (seconds to import, and the fast lane stays torch-free). It keeps
    what a test must see: the bytes installed per block, every install and sync, and every scrubbed block.
    """

    def __init__(self, reg: Registration, rank: int) -> None:
        self.reg = reg
        self.rank = rank
        self.bpt = {g: sum(t.bytes_per_token for t in reg.tensors_of(g)) for g in reg.group_names}
        self.blocks: dict[str, dict[int, bytearray]] = {g: {} for g in reg.group_names}
        self.installs: list[tuple[str, tuple[int, ...], int]] = []
        self.syncs = 0
        self.invalidated: list[dict[str, list[int]]] = []
        self.lock = threading.Lock()

    def _block(self, group: str, b: int) -> bytearray:
        size = self.reg.group(group).block_size * self.bpt[group]
        return self.blocks[group].setdefault(b, bytearray(size))

    def write(self, group: str, block_ids: Sequence[int], token_start: int, data: bytes) -> None:
        """Write ``data`` (whole tokens) at token offset ``token_start`` of the block table ``block_ids``."""
        bs, bpt = self.reg.group(group).block_size, self.bpt[group]
        for i in range(len(data) // bpt):
            t = token_start + i
            blk = self._block(group, block_ids[t // bs])
            off = (t % bs) * bpt
            blk[off : off + bpt] = data[i * bpt : (i + 1) * bpt]

    def read(self, group: str, block_ids: Sequence[int], token_start: int, tokens: int) -> bytes:
        bs, bpt = self.reg.group(group).block_size, self.bpt[group]
        out = bytearray()
        for t in range(token_start, token_start + tokens):
            blk = self._block(group, block_ids[t // bs])
            out += blk[(t % bs) * bpt : (t % bs + 1) * bpt]
        return bytes(out)

    # -- Destination protocol ----------------------------------------------------------------------------------
    def install(self, group: str, block_ids: Sequence[int], token_count: int, sources: Sequence[StagingSlice]) -> None:
        data = b"".join(bytes(s.view) for s in sources)
        if len(data) != token_count * self.bpt[group]:
            raise RuntimeError(f"window carried {len(data)} bytes for group {group}, expected {token_count} tokens")
        with self.lock:
            self.write(group, block_ids, 0, data)
            self.installs.append((group, tuple(block_ids), token_count))

    def synchronize(self) -> None:
        self.syncs += 1

    def invalidate(self, block_tables: Mapping[str, Sequence[int]]) -> None:
        with self.lock:
            self.invalidated.append({g: list(ids) for g, ids in block_tables.items()})
            for g, ids in block_tables.items():
                for b in ids:
                    self._block(g, b)[:] = bytes(len(self._block(g, b)))

    # -- the synthetic model -----------------------------------------------------------------------------------
    def prefill(self, hashes: Sequence[str], n_tokens: int, first_chunk: int, block_tables: Mapping[str, Any]) -> int:
        cs = self.reg.chunk_size
        for c in range(first_chunk, -(-n_tokens // cs)):
            t0, t1 = c * cs, min((c + 1) * cs, n_tokens)
            for g in self.reg.group_names:
                self.write(g, block_tables[g], t0, synthetic(hashes[c], self.rank, g, (t1 - t0) * self.bpt[g]))
        return n_tokens - first_chunk * cs

    def output_hash(self, block_tables: Mapping[str, Sequence[int]], n_tokens: int) -> dict[str, str]:
        return {
            g: hashlib.sha256(self.read(g, block_tables[g], 0, n_tokens)).hexdigest()[:16] for g in self.reg.group_names
        }

    def canonical_hash(self, hashes: Sequence[str], n_tokens: int) -> dict[str, str]:
        cs = self.reg.chunk_size
        out = {}
        for g in self.reg.group_names:
            data = b"".join(
                synthetic(h, self.rank, g, (min((c + 1) * cs, n_tokens) - c * cs) * self.bpt[g])
                for c, h in enumerate(hashes)
            )
            out[g] = hashlib.sha256(data).hexdigest()[:16]
        return out


class FakeRankOps(RankHost, UnsupportedOps):
    """The ops of one rank (the RankOps contract), in-process: the same runtime pieces as the embedded engine's
    rank process (RestorePool, RankRestorer) over the fakes above. A fake host because the real one is a torch
    process."""

    host_name = "the unit-test fake rank"

    def __init__(
        self,
        reg: Registration,
        rank: int,
        tiers: Mapping[str, FakeTier],
        pool_slots: int,
        budget_bytes: int | None,
        emit: Callable[[Event], None],
    ) -> None:
        self.reg, self.rank, self.tiers = reg, rank, dict(tiers)
        self.kv = FakeDestination(reg, rank)
        self.kv_ops = KVOps(self.kv)  # the synthetic-model ops, over the fake destination
        self.pool = make_pool(pool_slots, reg.bytes_per_chunk, budget_bytes)
        offsets, off = {}, 0
        for g in reg.group_names:
            offsets[g] = off
            off += reg.group_bytes_per_chunk(g)
        self.restorer = RankRestorer(rank, reg.group_names, offsets, self.pool, self.tiers, self.kv, emit)
        self.aborts = AbortSignals()
        self.jobs: list[RestoreJob] = []

    def _keys(self, hashes: Sequence[str]) -> dict[str, list[str]]:
        return {g: [object_key(self.reg, self.rank, g, h) for h in hashes] for g in self.reg.group_names}

    def probe(self, req: ProbeRequest) -> ProbeResult:
        return probe_tiers(self.tiers, self._keys(req.hashes), req.tiers, len(req.hashes), req.timeout_s)

    def store(self, req: StoreRequest) -> StoreResult:
        keys = self._keys(req.hashes)
        cs = self.reg.chunk_size
        stored, errors = {}, {}
        for name, idx in req.chunks.items():
            tier = self.tiers.get(name)
            if tier is None:
                continue
            try:
                for c in idx:
                    t0, t1 = c * cs, min((c + 1) * cs, req.n_tokens)
                    for g in self.reg.group_names:
                        payload = memoryview(self.kv.read(g, req.block_tables[g], t0, t1 - t0))
                        tier.put([keys[g][c]], [payload], [object_checksum(keys[g][c], payload)])
                stored[name] = len(idx) * len(self.reg.group_names)
            except TierUnavailable as e:
                errors[name] = str(e)
                stored[name] = 0
        return StoreResult(stored, errors)

    def restore(self, req: RestoreRequest) -> RestoreResult:
        job = req.job
        job.validate(self.reg.group_names)
        with self.aborts.held(job.request_id) as abort:
            self.jobs.append(job)
            return self.restorer.restore(job, abort)

    def stats(self, req: StatsRequest) -> StatsResult:
        tiers = None
        if req.health:
            tiers = {n: TierStatus(t.health().ok, t.health().detail) for n, t in self.tiers.items()}
        return StatsResult(self.rank, self.pool.stats().to_dict(), tiers)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        self.pool.reset_peak()
        return ResetPeakResult()

    def set_budget(self, req: SetBudgetRequest) -> SetBudgetResult:
        self.pool.set_budget(req.budget_bytes)
        return SetBudgetResult(self.pool.stats().to_dict())

    # set_fs_concurrency and remove_all: not served by this fake (it has no filesystem tier): UnsupportedOp.


class InProcessRank:
    """A RankClient whose rank runs in this process (the fake of the embedded engine's rank process and pipe).

    ``hang`` (a set of op names) makes those calls block until ``release`` is set (a rank that stopped making
    progress); ``dead`` makes ``alive()`` false and every call fail (a rank whose process exited); ``dying`` makes
    every call fail as a broken pipe while ``alive()`` is still true (a rank just killed, not yet reported gone).
    Events reach the coordinator through the ops' ``emit``, as they would over the pipe."""

    def __init__(self, ops: FakeRankOps) -> None:
        self.ops = ops
        self.rank = ops.rank
        self.calls: list[str] = []
        self.dead = False
        self.dying = False
        self.hang: set[str] = set()
        self.release = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"fake-rank{ops.rank}")

    def submit(self, request: RankRequest[R]) -> Future[R]:
        if self.dead:  # as the process rank answers once its process is gone
            fut: Future[R] = Future()
            fut.set_exception(ServerError(f"rank {self.rank} is not running: process exited"))
            return fut
        if self.dying:  # as the process rank answers when its pipe breaks under the send
            fut = Future()
            fut.set_exception(RankDied(f"rank {self.rank} is unreachable: [Errno 32] Broken pipe"))
            return fut
        self.calls.append(request.op)
        # What the pipe does to a request and its result: each crosses as a pickled copy.
        sent: RankRequest[R] = pickle.loads(pickle.dumps(request))

        def call() -> R:
            if sent.op in self.hang:
                self.release.wait(120)  # the test releases it; the bound only stops a forgotten hang
            result: R = pickle.loads(pickle.dumps(dispatch(self.ops, sent)))
            return result

        return self._pool.submit(call)

    def abort(self, request: str) -> None:
        self.ops.abort(request)

    def alive(self) -> bool:
        return not self.dead

    def close(self) -> None:
        self.release.set()
        self.ops.restorer.close()
        self._pool.shutdown(wait=True, cancel_futures=True)


class RestartSchedule:
    """The host's restarts of dead ranks as the coordinator asks them (``RankRestarts``): a fake of the embedded
    engine's ``lifecycle.RankRestarter``, whose real restarts start rank processes. Every rank is next tried in
    ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def restart_in(self, rank: int) -> float:
        return self.seconds
