"""A vLLM KV connector with BSR's restore semantics, built on LMCache's vLLM connector (LMCache 0.5.6).

Load it with::

    --kv-transfer-config '{"kv_connector": "BSRConnector", "kv_connector_module_path": "vllm_bsr.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"bsr_window_chunks": 32}}'

What it changes over LMCache's connector (everything else is LMCache's):

* scheduler: the external-token count passes through ``SchedulerState`` (vllm_bsr/logic.py): 0 while the
  request's force-local marker stands; the marker is set when workers report load errors on the request's
  blocks and cleared on the next successful admission or on teardown. The count itself is LMCache's lookup
  (its lookup client asks the workers; see docs/deployment.md for why this is not bsr's probe-only bitmap here);
* worker: loads in windows of at most W chunks (LMCache's masked retrieve, one window at a time, so L1 staging is
  bounded by the window); on any short window or exception every block of the request in every KV group is
  reported by ``get_block_ids_with_load_errors``, so vLLM drops the whole external prefix and recomputes.

Verified here: this module imports against vLLM 0.33.0's real ``KVConnectorBase_V1`` and LMCache 0.5.6's
``LMCacheConnectorV1Dynamic`` (vLLM installed --no-deps on CPU; tests/plugins/test_vllm_logic.py). NOT verified
here: running inside vLLM (no GPU on this machine) — plugins/vllm_bsr/gpu_smoke.sh does that on a GPU host.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache_bsr._lmcache import vllm_connector_base

from .logic import SchedulerState, failed_block_ids, load_in_windows, windows

_LMCacheConnector: Any = vllm_connector_base()
DEFAULT_WINDOW_CHUNKS = 32


class BSRConnector(_LMCacheConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        self.bsr_w = int(extra.get("bsr_window_chunks", DEFAULT_WINDOW_CHUNKS))
        self.bsr_chunk = int(getattr(self._lmcache_engine, "_lmcache_chunk_size", 256))
        self.bsr = SchedulerState(self.bsr_chunk)

    # -- scheduler side ----------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n is None:  # LMCache has not answered yet: ask again later, as LMCache would
            return n, load_async
        ext = self.bsr.external_tokens(request.request_id, int(n) + num_computed_tokens, num_computed_tokens)
        return min(int(n), ext), load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.bsr.on_alloc(request.request_id, blocks.get_block_ids(), num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # The worker needs every KV group's block ids to collapse a failed request; LMCache's metadata carries one.
        meta.bsr_block_ids = {r: self.bsr.blocks[r] for r in self.bsr.blocks}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self.bsr.on_load_errors(getattr(connector_output, "invalid_block_ids", None) or ())
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.bsr.on_finished(request.request_id)
        return super().request_finished(request, block_ids)  # type: ignore[no-any-return]

    # -- worker side -------------------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
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
        for req in meta.requests:
            spec = req.load_spec
            if spec is None or not spec.can_load:
                continue
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

            result = load_in_windows(retrieve, windows(spec.vllm_cached_tokens, end, cs, self.bsr_w))
            engine.lookup_unpin(req.req_id)  # LMCache's lookup pinned the prefix; a blocking load releases it
            if not result.ok:
                groups = groups_of.get(req.req_id)
                if not groups:  # fall back to the one group LMCache's metadata knows
                    groups = [torch.unique(req.slot_mapping.cpu() // impl._block_size).tolist()]
                impl._invalid_block_ids.update(failed_block_ids(groups))
