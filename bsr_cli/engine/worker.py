"""One TP rank of the embedded engine, as its own process.

It owns the rank's destination KV (torch tensors), its preallocated restore pool, its tier clients (a Mooncake
store client and the filesystem tier) and a RankRestorer, and serves the rank-ops contract (bsr_cli.api.ranks).
The coordinator talks to it over a pipe: a ``Call`` carries a typed request, answered by a ``Reply`` with its typed
result (or an error); ``Abort`` and ``Shutdown`` are signals; progress arrives as ``{"event": ...}`` and liveness as
``{"beat": ...}``. Each call runs in its own thread, so a stats call or an abort is answered while a restore runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bsr_cli.api.pipe import Abort, Call, Reply, Shutdown
from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    RemoveAllRequest,
    RemoveAllResult,
    ResetPeakRequest,
    ResetPeakResult,
    RestoreJob,
    RestoreRequest,
    RestoreResult,
    ScrubRequest,
    ScrubResult,
    SetBudgetRequest,
    SetBudgetResult,
    SetFsConcurrencyRequest,
    SetFsConcurrencyResult,
    StatsRequest,
    StatsResult,
    StoreRequest,
    StoreResult,
    TierStatus,
    UnsupportedOp,
    dispatch,
)
from bsr_cli.core.events import Event, ObjectQuarantined
from bsr_cli.core.evidence import Stage
from bsr_cli.engine.config import RankConfig, RankInfo, RankLink
from bsr_cli.runtime import failure_log
from bsr_cli.runtime.kv_ops import KVOps
from bsr_cli.runtime.rank_host import AbortSignals, RankHost

STORE_BATCH = 16  # objects per put call
QUARANTINE_SHOWN = 5  # quarantined objects a tier's status names (the newest; the total is counted)
HEARTBEAT_S = 0.25  # how often a rank tells the coordinator it is alive
_PR_SET_NAME = 15  # prctl(2)


def name_process(name: str) -> None:
    """Name this process as ``top``, ``ps -e`` and ``pgrep`` show it (Linux: the kernel's command name, 15 bytes at
    most), so that an operator can tell the ranks apart: a rank forked from the fork server otherwise shows as
    ``python``. Elsewhere nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def worker_main(conn: Connection, cfg: RankConfig) -> None:
    name_process(f"bsr-rank{cfg.rank}")
    if cfg.netns:
        # A multi-host engine: this rank is a host of its own. Entered first, before any thread starts (every
        # thread started later, Mooncake's included, inherits it); the pipe to the coordinator is unaffected.
        from bsr_cli.engine import netns

        netns.enter(cfg.netns)
        os.environ["MC_TCP_BIND_ADDRESS"] = str(cfg.address)
    # Each rank gets one intra-op thread: ranks are separate processes sharing the machine's cores.
    import torch

    torch.set_num_threads(1)
    send_lock = threading.Lock()
    # This rank's own failures as JSON lines in the state directory's logs/bsr-rank<N>.log (rotated).
    log = None
    if cfg.log_dir:
        log = failure_log.open_log(Path(cfg.log_dir) / f"bsr-rank{cfg.rank}.log", f"rank{cfg.rank}")

    def send(msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    def emit(ev: Event) -> None:
        if log is not None:
            failure_log.log_failure_event(log, ev)
        send({"event": ev})

    try:
        rank = Rank(cfg, emit)
    except Exception as e:  # noqa: BLE001 - reported to the coordinator, which fails start-up with it
        if log is not None:
            failure_log.log_failure(log, f"rank did not start: {type(e).__name__}: {e}", rank=cfg.rank)
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True, "info": rank.info()})
    stop_beat = threading.Event()

    def beat() -> None:
        # The heartbeat: the coordinator judges this rank's health by it (a stopped or wedged process stops
        # beating though it still exists).
        while not stop_beat.wait(HEARTBEAT_S):
            try:
                send({"beat": time.monotonic()})
            except (OSError, ValueError):
                return

    threading.Thread(target=beat, name=f"rank{rank.rank}-heartbeat", daemon=True).start()
    pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix=f"rank{rank.rank}")

    def handle(call: Call) -> None:
        try:
            send(Reply(call.id, result=dispatch(rank, call.request)))
        except UnsupportedOp as e:
            send(Reply(call.id, error=str(e), refused=e))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller as data
            if log is not None:
                op = type(call.request).__name__.removesuffix("Request").lower()
                failure_log.log_failure(log, f"{op} failed: {type(e).__name__}: {e}", rank=rank.rank, op=op)
            send(Reply(call.id, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()))

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break  # the coordinator is gone: so are we
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, Abort):
                rank.abort(msg.request_id)
                continue
            if isinstance(msg, Call):
                pool.submit(handle, msg)
    finally:
        stop_beat.set()
        rank.close()
        pool.shutdown(wait=False, cancel_futures=True)
        if log is not None:
            failure_log.close_log(log)


LINK_PROBE_S = 0.5  # per link: a link that is up answers a TCP connect in well under a millisecond


def _unreachable_links(links: Sequence[RankLink]) -> str:
    """Which of this rank's links to the store's hosts do not carry a TCP connect now, e.g. ``link rank0↔holder
    down: 10.213.0.2:15432 unreachable`` (empty when all answer): said with a failed fetch, so that the failure
    names the link and not just the tier."""
    from bsr_cli.mooncake.health import tcp_reachable

    return "; ".join(
        f"link {lk.link} down: {lk.address} unreachable" for lk in links if not tcp_reachable(lk.address, LINK_PROBE_S)
    )


class Rank(RankHost):
    """One rank of the embedded engine, in its own process: its KV, restore pool and tiers, and the rank ops over
    them (the ones every host serves alike from ``RankHost``)."""

    def __init__(self, cfg: RankConfig, emit: Callable[[Event], None]) -> None:
        import torch

        from bsr_cli.runtime.paged_kv import PagedKV, pick_device
        from bsr_cli.runtime.pool import RestorePool
        from bsr_cli.runtime.restore import RankRestorer
        from bsr_cli.runtime.scrub import Scrubber
        from bsr_cli.runtime.tiers import Tier
        from bsr_cli.tiers.fs import FilesystemTier
        from bsr_cli.tiers.mooncake import TRAILER_BYTES

        self.rank = cfg.rank
        self.reg = cfg.registration
        self.device = pick_device(self.rank)
        self.kv = PagedKV(self.reg, self.rank, cfg.blocks, self.device)
        self.kv_ops = KVOps(self.kv)
        self.emit = emit
        # The restore pool: allocated once, pinned when installs go to a GPU, never grown. Each staged object has
        # room for the Mooncake tier's trailer after it, so the whole object arrives in one transfer; that room
        # (16 bytes per object) is not staging and is counted in no bound.
        pin = self.device.type == "cuda"
        groups = self.reg.group_names
        stride = self.reg.bytes_per_chunk + len(groups) * TRAILER_BYTES
        slots = cfg.pool_bytes // self.reg.bytes_per_chunk
        self.pool_tensor = torch.zeros(slots * stride, dtype=torch.uint8, pin_memory=pin)
        ptr = self.pool_tensor.data_ptr()
        view = memoryview((ctypes.c_ubyte * self.pool_tensor.numel()).from_address(ptr)).cast("B")
        self.pool = RestorePool(
            ptr, view, self.reg.bytes_per_chunk, cfg.budget_bytes, slot_stride=stride, tail=TRAILER_BYTES
        )
        self.tiers: dict[str, Tier] = {}
        mc = cfg.mooncake
        if mc is not None:
            from bsr_cli.tiers.mooncake import MooncakeTier

            tier = MooncakeTier(
                mc.master_address,
                mc.metadata_url,
                health_url=mc.health_url,
                admin_url=mc.admin_url,
                deadline_s=30.0,
                local_hostname=cfg.address or "127.0.0.1",
            )
            tier.register(ptr, self.pool_tensor.numel())
            self.tiers["mooncake"] = tier
        self.tiers["fs"] = FilesystemTier(cfg.fs_dir, load_concurrency=cfg.fs_concurrency)
        offsets, off = {}, 0
        for g in groups:
            offsets[g] = off
            off += self.reg.group_bytes_per_chunk(g) + TRAILER_BYTES
        self.restorer = RankRestorer(self.rank, self.reg.group_names, offsets, self.pool, self.tiers, self.kv, emit)
        links = cfg.links
        if links:
            self.restorer.diagnose = lambda tier: _unreachable_links(links) if tier == "mooncake" else ""
        self.aborts = AbortSignals()
        self.scrub_after_failure = cfg.scrub_after_failure
        self.scrubber = Scrubber(self.rank, self.tiers, self._emit_scrub)
        self._health_cache: tuple[float, dict[str, TierStatus]] = (0.0, {})
        # Bumped when a tier's state is known to have changed (a store refused, an object quarantined): an answer
        # computed before that is not cached, so the next health call says it.
        self._tier_epoch = 0

    def info(self) -> RankInfo:
        import torch

        return RankInfo(
            rank=self.rank,
            pid=os.getpid(),
            device=str(self.device),
            torch=str(torch.__version__),
            kv_bytes=self.kv.nbytes,
            pool=self.pool.stats(),
            tiers=tuple(self.tiers),
        )

    def _emit_scrub(self, ev: Event) -> None:
        if isinstance(ev, ObjectQuarantined):
            self._tier_changed()  # the next health answer counts it
        self.emit(ev)

    def close(self) -> None:
        self.scrubber.stop()
        self.restorer.close()
        for t in self.tiers.values():
            with contextlib.suppress(Exception):  # closing on the way out; nothing left to tell
                t.close()

    # -- ops (bsr_cli.api.ranks.RankOps) ---------------------------------------------------------------------------
    def _keys(self, hashes: list[str]) -> dict[str, list[str]]:
        from bsr_cli.core.keys import object_key

        return {g: [object_key(self.reg, self.rank, g, h) for h in hashes] for g in self.reg.group_names}

    def probe(self, req: ProbeRequest) -> ProbeResult:
        """Per group, one hex digit per chunk: bit i set when tiers[i] holds the object. Moves no bytes."""
        from bsr_cli.runtime.tiers import probe_tiers

        return probe_tiers(self.tiers, self._keys(req.hashes), req.tiers, len(req.hashes), req.timeout_s)

    def store(self, req: StoreRequest) -> StoreResult:
        """Write objects read back from the blocks to each tier: chunks[tier] = chunk indices it lacks.
        Tiers are independent: one that refuses writes (full, down) does not keep the others from storing."""
        from bsr_cli.runtime.checksum import object_checksum
        from bsr_cli.runtime.paged_kv import byte_view

        keys = self._keys(req.hashes)
        cs = self.reg.chunk_size
        stored: dict[str, int] = {}
        errors: dict[str, str] = {}
        for tier_name, idx in req.chunks.items():
            tier = self.tiers.get(tier_name)
            if tier is None:
                continue
            batch: list[tuple[str, memoryview, int]] = []
            done = 0
            try:
                for c in idx:
                    t0, t1 = c * cs, min((c + 1) * cs, req.n_tokens)
                    for g in self.reg.group_names:
                        payload = byte_view(self.kv.gather_object(g, req.block_tables[g], t0, t1 - t0))
                        batch.append((keys[g][c], payload, object_checksum(keys[g][c], payload)))
                    if len(batch) >= STORE_BATCH or c == idx[-1]:
                        tier.put([b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch])
                        done += len(batch)
                        batch = []
            except Exception as e:  # noqa: BLE001 - reported per tier; the request itself is unaffected
                errors[tier_name] = f"{type(e).__name__}: {e}"
                self._tier_changed()
            stored[tier_name] = done
        return StoreResult(stored, errors)

    def restore(self, req: RestoreRequest) -> RestoreResult:
        job = req.job
        job.validate(self.reg.group_names)
        with self.aborts.held(job.request_id) as abort:
            out = self.restorer.restore(job, abort)
        # A tier that did not answer the fetch (a cut link, the master down) sent nothing to check: re-reading its
        # objects now would only be another call across the same fault, with the rank's answer waiting on it.
        if not out.ok and out.tier and out.stage in (Stage.FETCH, Stage.VERIFY) and not out.unanswered:
            checked = self._quarantine_window(job, out)
            if self.scrub_after_failure:
                self._scrub_rest(job, out.tier, checked)
        return out

    def _quarantine_window(self, job: RestoreJob, out: RestoreResult) -> set[str]:
        """After a tier failed a restore: re-read the failed window's objects on that tier and move the damaged
        ones aside, so the chunk counts as absent and the next store rewrites it (instead of the same chunk
        failing every restore). Only a tier that can check its own objects does this (fs and Mooncake). Answers the
        keys it re-read."""
        from bsr_cli.runtime.scrub import quarantine_damaged
        from bsr_cli.runtime.tiers import RepairableTier

        tier = self.tiers.get(out.tier or "")
        win = next((w for w in job.windows if w.index == out.failed_window), None)
        if not isinstance(tier, RepairableTier) or win is None:
            return set()
        where = {
            job.objects[g][c].key: (c, g)
            for c in range(win.chunk_start, win.chunk_end)
            for g in self.reg.group_names
            if job.objects[g][c].tier == out.tier
        }
        try:
            moved = quarantine_damaged(
                tier,
                {
                    key: f"chunk {c} group {g} on rank {self.rank}; restore of {job.request_id} failed: {out.reason}"
                    for key, (c, g) in where.items()
                },
            )
        except Exception:
            logging.getLogger(__name__).exception("rank %d: quarantine on tier %s failed", self.rank, out.tier)
            return set(where)
        if moved:
            self._tier_changed()
        for q in moved:
            chunk, group = where[q.key]
            self.emit(
                ObjectQuarantined(
                    rank=self.rank,
                    tier=out.tier or "",
                    chunk=chunk,
                    group=group,
                    key=q.key,
                    file=q.file,
                    reason=q.reason,
                    request=job.request_id,
                )
            )
        return set(where)

    def _scrub_rest(self, job: RestoreJob, tier: str, checked: set[str]) -> None:
        """The failed window was only the first damage the restore met: scrub the rest of the prompt's objects on
        that tier in the background (every chunk of the prompt, not only the restored prefix), so that one failed
        restore sets every damaged object apart and the next store rewrites them all."""
        from bsr_cli.core.scrub import ScrubLimits
        from bsr_cli.runtime.scrub import ScrubTarget
        from bsr_cli.runtime.tiers import RepairableTier

        if not isinstance(self.tiers.get(tier), RepairableTier) or not job.chunk_hashes:
            return
        keys = self._keys(list(job.chunk_hashes))
        targets = [
            ScrubTarget(keys[g][c], c, g)
            for c in range(len(job.chunk_hashes))
            for g in self.reg.group_names
            if keys[g][c] not in checked
        ]
        self.scrubber.scrub_prompt(
            tier, targets, prompt=job.prompt, limits=ScrubLimits(), request=job.request_id, background=True
        )

    def scrub(self, req: ScrubRequest) -> ScrubResult:
        """An operator's scrub of this rank's objects on a tier: a prompt's, or its share of every object."""
        from bsr_cli.core.evidence import ScrubScope
        from bsr_cli.core.scrub import ScrubLimits
        from bsr_cli.runtime.scrub import ScrubTarget

        limits = ScrubLimits(req.max_objects, req.max_bytes)
        if req.scope is ScrubScope.ALL:
            out = self.scrubber.scrub_all(req.tier, shards=req.shards, limits=limits, scrub=req.scrub)
        else:
            keys = self._keys(req.hashes)
            targets = [ScrubTarget(keys[g][c], c, g) for c in range(len(req.hashes)) for g in self.reg.group_names]
            result = self.scrubber.scrub_prompt(req.tier, targets, prompt=req.prompt, limits=limits, scrub=req.scrub)
            assert result is not None  # run now, not in the background
            out = result
        if out.quarantined:
            self._tier_changed()
        return out

    def _tier_changed(self) -> None:
        self._tier_epoch += 1
        self._health_cache = (0.0, {})

    def stats(self, req: StatsRequest) -> StatsResult:
        from bsr_cli.runtime.tiers import RepairableTier

        tiers: dict[str, TierStatus] | None = None
        if req.health:
            at, cached = self._health_cache
            if time.monotonic() - at > 1.0:
                epoch = self._tier_epoch
                cached = {}
                for name, tier in self.tiers.items():
                    h = tier.health()
                    shown, total = tier.quarantined(QUARANTINE_SHOWN) if isinstance(tier, RepairableTier) else ([], 0)
                    cached[name] = TierStatus(h.ok, h.detail, h.condition.value, shown, total)
                if epoch == self._tier_epoch:
                    self._health_cache = (time.monotonic(), cached)
            # A scrub's progress moves on every object: never from the cache.
            tiers = {name: replace(t, scrubs=self.scrubber.progress(name)) for name, t in cached.items()}
        return StatsResult(self.rank, self.pool.stats().to_dict(), tiers)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        self.pool.reset_peak()
        return ResetPeakResult()

    def set_budget(self, req: SetBudgetRequest) -> SetBudgetResult:
        self.pool.set_budget(req.budget_bytes)
        return SetBudgetResult(self.pool.stats().to_dict())

    def set_fs_concurrency(self, req: SetFsConcurrencyRequest) -> SetFsConcurrencyResult:
        tier = self.tiers["fs"]
        tier.load_concurrency = req.value  # type: ignore[attr-defined]
        return SetFsConcurrencyResult(req.value)

    def remove_all(self, req: RemoveAllRequest) -> RemoveAllResult:
        t = self.tiers[req.tier]
        return RemoveAllResult(int(t.remove_all()))  # type: ignore[attr-defined]
