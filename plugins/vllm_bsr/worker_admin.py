"""bsr's admin API served from inside one vLLM worker, over that worker's own LMCache engine.

LMCache serves its internal API server per worker but cannot host third-party routes, so each worker runs bsr's
``AdminServer`` (``/bsr/v1``) in a daemon thread next to it: a one-rank Coordinator whose only RankClient wraps
the worker's engine (the engine is LMCache's, built by its vLLM adapter: bsr never builds or destroys it, so
``LMCacheRank``, which owns its engine and a CPU paged KV, does not fit; this is the thin adapter instead,
driven through ``ThreadRank``).

What it serves (``WorkerRankOps``, the rank-ops contract's ``probe``/``stats``/``reset_peak``; every other op answers
``UnsupportedOp``): ``probe`` (the per-tier, per-chunk bitmap of THIS rank, probe-only: no pins, no bytes moved),
``status``/``info``/``registration``, and faults when the connector's ``bsr_admin_faults`` is set (they fire inside
the worker's load windows, ``take_fault``). What it refuses: ``submit``/``restore``/stores and the bench
(``info.serves_restores`` is false), since in a vLLM deployment KV moves only through vLLM's scheduler and the BSR
connector; and clearing markers, which live in the scheduler.
The coordinator is one-rank, so the bitmap calls this worker "rank 0"; ``info.engine`` names the real TP rank.

Bound to loopback; port ``bsr_admin_port + rank``; bearer token ``bsr_admin_token`` or ``$BSR_TOKEN``.
Verified with real LMCache engines (tests/plugins/test_vllm_lookup.py) and inside real vLLM workers (tests/vllm).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_bsr.host import LMCacheCoordinator
from lmcache_bsr.rank import ThreadRank
from lmcache_bsr.tokens import TokenRegistry

from bsr_cli.api.ranks import (
    ProbeRequest,
    ProbeResult,
    ResetPeakRequest,
    ResetPeakResult,
    StatsRequest,
    StatsResult,
    TierStatus,
    UnsupportedOp,
    UnsupportedOps,
)
from bsr_cli.core.bitmap import encode_row
from bsr_cli.core.registration import KVGroup, Registration, TensorSpec
from bsr_cli.errors import BadRequest
from bsr_cli.runtime.coordinator import EngineSettings
from bsr_cli.runtime.events import EventLog
from bsr_cli.server.admin import AdminServer

from .probe_lookup import EngineFn, RankProber

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def registration_of(eng: Any, block_size: int = 16) -> Registration:
    """bsr's registration for an LMCache engine's layout (one group, one tensor per layer), as a one-rank view."""
    md = eng.metadata
    layers, _two, chunk, heads, head_size = (int(x) for x in md.kv_shape)
    dtype = DTYPES.get(md.kv_dtype, "bf16")
    tensors = tuple(TensorSpec(f"layers.{i}.kv", dtype, (2, heads, head_size), "attn") for i in range(layers))
    return Registration(
        model=str(md.model_name),
        tp_size=1,
        groups=(KVGroup("attn", block_size),),
        tensors=tensors,
        chunk_size=chunk,
        source=f"vllm-lmcache-worker{md.worker_id}",
    )


class WorkerRankOps(UnsupportedOps):
    """The ops a per-worker coordinator drives (bsr_cli.api.ranks.RankOps), over an existing engine: probe, stats
    and reset_peak; every op that would move or write KV is refused (``UnsupportedOp``)."""

    rank = 0  # the coordinator's index: one rank per admin server
    host_name = "a vLLM worker"

    def __init__(self, engine_fn: EngineFn, tp_rank: int, registry: TokenRegistry, group: str = "attn") -> None:
        self.tp_rank = tp_rank
        self.prober = RankProber(engine_fn)
        self.registry = registry
        self.group = group

    def unsupported(self, op: str) -> UnsupportedOp:
        return UnsupportedOp(
            op,
            f"op {op!r} is not served from a vLLM worker: KV moves only through vLLM's scheduler and the BSR "
            "connector there",
            hint="use `bsr probe` / `bsr status` against a worker; submit and restore through vLLM",
        )

    def probe(self, req: ProbeRequest) -> ProbeResult:
        eng = self.prober.engine_fn()
        if eng is None:
            return ProbeResult({self.group: "0" * len(req.hashes)}, {"engine": "no LMCache engine"})
        tokens = self.registry.tokens_for(req.hashes)
        keys = [k for _, _, k in lm.chunk_keys(eng, tokens)]
        held, errors = self.prober.presence(keys)
        return ProbeResult({self.group: encode_row(held, req.tiers, len(req.hashes))}, errors)

    def stats(self, req: StatsRequest) -> StatsResult:
        pool = dict.fromkeys(
            ("capacity_bytes", "budget_bytes", "slot_bytes", "live_bytes", "peak_bytes", "windows_live", "waiters"), 0
        )
        tiers: dict[str, TierStatus] | None = None
        if req.health:
            eng = self.prober.engine_fn()
            tiers = {}
            names = self.prober.tiers()
            if "mooncake" in names:
                from .probe_lookup import mooncake_health_url

                url = mooncake_health_url(eng)
                ok = url is None or self.prober.master_ok(url)
                tiers["mooncake"] = TierStatus(ok, f"LMCache RemoteBackend; master {url} {'up' if ok else 'DOWN'}")
            if "fs" in names:
                tiers["fs"] = TierStatus(True, f"LMCache LocalDiskBackend at {eng.config.local_disk}")
        return StatsResult(self.rank, pool, tiers, tp_rank=self.tp_rank)

    def reset_peak(self, req: ResetPeakRequest) -> ResetPeakResult:
        return ResetPeakResult()

    def close(self) -> None:
        return None  # the engine belongs to LMCache's vLLM adapter: never destroyed here


class WorkerCoordinator(LMCacheCoordinator):
    """A one-rank coordinator that refuses to move KV: in a vLLM deployment only vLLM's scheduler does."""

    def _refuse(self, what: str) -> Any:
        raise BadRequest(
            f"{what} is not served from a vLLM worker: KV moves only through vLLM's scheduler and the BSR connector",
            hint="send the prompt to vLLM; use `bsr probe` / `bsr status` against the workers",
        )

    def submit(self, tokens: Any, **kw: Any) -> dict[str, Any]:
        return self._refuse("submit")  # type: ignore[no-any-return]

    def restore(self, tokens: Any, **kw: Any) -> dict[str, Any]:
        return self._refuse("restore")  # type: ignore[no-any-return]

    def info(self) -> dict[str, Any]:
        return {**super().info(), "serves_restores": False}

    def update_settings(self, **changes: Any) -> None:
        # B, W and the filesystem concurrency govern restores, which a worker does not run.
        self._refuse("changing restore settings")

    def clear_markers(self, scope: Any = None) -> int:
        raise BadRequest(
            "force-local markers are not served from a vLLM worker: they live in vLLM's scheduler (the BSR "
            "connector), keyed by the failed prefix, and clear on the next admission of a prompt that starts with it",
            hint="watch `bsr_marker_set` / `bsr_marker_cleared` in $BSR_VLLM_EVENTS or the scheduler's log",
        )


class WorkerAdmin:
    """The admin server of one vLLM worker. ``stop()`` it (the connector does on shutdown)."""

    def __init__(
        self, engine_fn: EngineFn, tp_rank: int, *, token: str, port: int, host: str = "127.0.0.1", faults: bool = False
    ) -> None:
        eng = engine_fn()
        if eng is None:
            raise RuntimeError("LMCache has no engine in this worker: bsr's admin API cannot start")
        reg = registration_of(eng)
        self.registry = TokenRegistry(reg.chunk_size)
        self.ops = WorkerRankOps(engine_fn, tp_rank, self.registry)
        tiers = tuple(self.ops.prober.tiers()) or ("fs",)
        settings = EngineSettings(
            name=f"vllm-lmcache tp-rank {tp_rank}", tiers=tiers, kv_tokens=reg.chunk_size, w=0, faults_enabled=faults
        )
        self.rank = ThreadRank(self.ops, max_workers=4)
        self.coordinator = WorkerCoordinator(reg, [self.rank], settings, EventLog(), registry=self.registry)
        self.server = AdminServer(self.coordinator, token=token, host=host, port=port)
        self.server.start()

    def take_fault(self, window: int) -> Any:
        """The armed fault that fires in load window ``window`` (0-based) of this worker, if any; counts it as
        fired (and drops it once its count is spent). Called by the BSR connector inside every window."""
        c = self.coordinator
        with c._lock:
            for i, f in enumerate(c.faults):
                if f.applies_to_rank(0) and f.hits(window, 0):
                    fired = f.after_firing()
                    if fired.exhausted():
                        del c.faults[i]
                    else:
                        c.faults[i] = fired
                    break
            else:
                return None
        c.events.append({"type": "fault_fired", "window": window, **fired.to_dict()})
        return fired

    @property
    def url(self) -> str:
        return str(self.server.url)

    def stop(self) -> None:
        self.server.stop()
        self.rank.close()


__all__ = ["WorkerAdmin", "WorkerRankOps", "registration_of"]
