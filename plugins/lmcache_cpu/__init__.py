"""LMCache KV offload for vLLM's CPU build.

``install()`` makes LMCache's ``CreateGPUConnector`` return :class:`~lmcache_cpu.connector.VLLMPagedMemCPUConnector`
for vLLM when LMCache's device is the CPU (every other engine and device keeps LMCache's own choice). It must run
in each vLLM worker process before LMCache's adapter builds its engine. Two ways:

* vLLM's general-plugin entry point (``vllm.general_plugins``: ``lmcache_cpu = "lmcache_cpu:register"``, declared
  in bsr's pyproject.toml), which vLLM runs in every process it starts; then the stock ``LMCacheConnectorV1`` works
  on CPU unchanged;
* importing ``vllm_bsr.connector`` (``BSRConnector``) installs it too.

Importing this package imports nothing heavy; ``install()`` imports LMCache.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from typing import Any

log = logging.getLogger("lmcache_cpu")


def _wrap(mod: Any) -> None:
    """Wrap ``mod.CreateGPUConnector`` (LMCache's ``lmcache.v1.gpu_connector``). Imports nothing until called."""
    original = mod.CreateGPUConnector
    if getattr(original, "_bsr_cpu", False):
        return

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        from lmcache_bsr import _lmcache as lm

        _, engine_type, device = lm.gpu_connector_factory()
        if device != "cpu" or engine != engine_type.VLLM:
            return original(config, metadata, engine, layout_hints=layout_hints)
        if getattr(config, "use_layerwise", False) or getattr(config, "enable_blending", False):
            raise ValueError("LMCache on CPU: use_layerwise and enable_blending are not supported by the CPU connector")
        from .connector import VLLMPagedMemCPUConnector

        conn = VLLMPagedMemCPUConnector.from_metadata(metadata)
        log.info(
            "LMCache CPU connector for vLLM: %d layers, %d KV heads, head size %d",
            conn.num_layers,
            conn.num_kv_heads,
            conn.head_size,
        )
        return conn

    create._bsr_cpu = True  # type: ignore[attr-defined]
    mod.CreateGPUConnector = create


def install() -> bool:
    """Route LMCache's vLLM connector choice to the CPU connector on CPU. Idempotent. True when LMCache's device
    is the CPU (so the CPU connector is what vLLM gets), False otherwise (nothing changed)."""
    from lmcache_bsr import _lmcache as lm

    mod, _engine_type, device_type = lm.gpu_connector_factory()
    if device_type != "cpu":
        return False
    _wrap(mod)
    return True


_HOOK_MODULE = "lmcache.v1.gpu_connector"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``install()`` right after LMCache's connector-factory module is imported (and not before: importing
    LMCache early pulls numba/llvmlite into the process, and vLLM's CPU worker scans every loaded module when it
    registers its kernel overrides, which fails on llvmlite's objects)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _HOOK_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                exec_module = spec.loader.exec_module

                def exec_then_install(module: Any, _exec: Any = exec_module) -> None:
                    _exec(module)
                    _wrap(module)  # decides per call (device, engine type): nothing else imported here

                spec.loader.exec_module = exec_then_install  # type: ignore[method-assign]
                return spec
        return None


def register() -> None:
    """vLLM's general-plugin hook (runs in every vLLM process). Imports nothing: when LMCache is already imported,
    installs at once; otherwise right after LMCache's connector factory is imported. Never raises: a missing or
    unsupported LMCache leaves vLLM as it is, with one warning."""
    if _HOOK_MODULE in sys.modules:
        try:
            install()
        except ImportError as e:
            log.warning("lmcache_cpu: LMCache CPU connector not installed: %s", e)
        return
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


__all__ = ["install", "register"]
