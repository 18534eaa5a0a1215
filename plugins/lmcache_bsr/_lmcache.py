"""The one module that imports LMCache.

LMCache moves its modules between releases (``lmcache.v1.gpu_connector`` became a package, the storage manager
was rewritten, the vLLM adapter split in two), so every LMCache name the plugins use is imported here and nowhere
else. Supported: LMCache 0.5.6 (the release the CPU tests run against). Any other version fails at import with a
message naming the supported one; set ``BSR_LMCACHE_ANY_VERSION=1`` to try anyway at your own risk.

Besides the imports, this module holds the few places where the plugin reaches into LMCache internals (each one
says why): the CPU paged connector, the L1 peak tracker, probe-only presence per backend, the windowed retrieve's
pieces, and the crash guards (destroy before exit, wait for remote puts).
"""

from __future__ import annotations

import os

# Before LMCache is imported: no usage-telemetry thread posting to stats.lmcache.ai, and quieter logs.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypedDict

import torch

SUPPORTED_VERSION = "0.5.6"

try:
    import lmcache
    from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"lmcache_bsr needs LMCache {SUPPORTED_VERSION} (import failed: {e}); "
        f"install it with scripts/test-plugins or `pip install --no-deps lmcache=={SUPPORTED_VERSION}` "
        "plus plugins/lmcache_bsr/requirements-cpu.txt"
    ) from e

LMCACHE_VERSION = str(getattr(lmcache, "__version__", "unknown"))
if LMCACHE_VERSION != SUPPORTED_VERSION and os.environ.get("BSR_LMCACHE_ANY_VERSION") != "1":
    raise ImportError(
        f"lmcache_bsr supports LMCache {SUPPORTED_VERSION} only; found {LMCACHE_VERSION}. Its module paths and "
        "storage internals change between releases. Set BSR_LMCACHE_ANY_VERSION=1 to try anyway."
    )

# LMCache's backend names for bsr's tier names.
TIER_BACKENDS = {"fs": "LocalDiskBackend", "mooncake": "RemoteBackend", "cpu": "LocalCPUBackend"}
# A location no backend has: LMCache's own batched_get answers [None] * n for it, which is how an injected
# "tier down" fault travels through LMCache's real failure path (a short retrieve mask).
FAULT_LOCATION = "BsrFaultInjectedDown"

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# -- engines ---------------------------------------------------------------------------------------------------
class MooncakeExtraConfig(TypedDict, total=False):
    """LMCache's ``extra_config`` for its Mooncake backend, and bsr's checksum switches beside them."""

    mooncake_local_hostname: str
    mooncake_metadata_server: str
    mooncake_master_server_addr: str
    mooncake_protocol: str
    mooncake_global_segment_size: int
    mooncake_local_buffer_size: int
    save_chunk_meta: bool
    transfer_timeout: int
    bsr_checksums: bool
    bsr_load_unverified: bool


class LMCacheConfig(TypedDict, total=False):
    """LMCache's configuration of one engine (``LMCacheEngineConfig.from_defaults``): the keys bsr sets or reads;
    a host config may give any other of LMCache's own beside them, passed through as given."""

    chunk_size: int
    local_cpu: bool
    max_local_cpu_size: float  # GiB
    local_disk: str
    max_local_disk_size: float  # GiB
    remote_url: str
    remote_serde: str
    blocking_timeout_secs: float
    extra_config: MooncakeExtraConfig


def build_engine(
    instance_id: str,
    config: LMCacheConfig,
    *,
    model: str,
    world_size: int,
    worker_id: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    dtype: str,
    connector: GPUConnectorInterface,
) -> LMCacheEngine:
    """A CPU-only LMCache engine for one TP rank (``post_init`` done: storage manager and backends exist)."""
    cfg = LMCacheEngineConfig.from_defaults(**config)
    chunk = int(config.get("chunk_size", 256))
    md = LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=TORCH_DTYPES[dtype],
        kv_shape=(num_layers, 2, chunk, num_kv_heads, head_size),
        chunk_size=chunk,
    )
    # No torch.distributed here: every rank's engine is independent, so the broadcasts are identities.
    eng = LMCacheEngineBuilder.get_or_create(
        instance_id, cfg, md, connector, broadcast_fn=lambda t, r: None, broadcast_object_fn=lambda o, r: o
    )
    eng.post_init()  # creates the StorageManager and its backends; without it every call asserts
    return eng


TRANSFER_NICE = 10


def lower_transfer_priority(eng: LMCacheEngine, nice: int = TRANSFER_NICE) -> bool:
    """Run the storage loop's blocking transfer calls on threads at lower priority (Linux).

    LMCache's Mooncake connector runs each ``batch_get_into``/``batch_put_from`` through ``asyncio.to_thread``,
    i.e. on the storage event loop's default executor, and this Mooncake build has no event-driven completion: the
    calling thread polls for its transfer in a loop. On a few cores that poll competes with the transfer itself and
    with the install copy. bsr's own Mooncake tier runs its data calls at nice 10 for the same reason
    (bsr_cli/tiers/mooncake.py); this gives the loop a default executor whose threads do the same. Mooncake's own
    transfer threads (started at setup) keep their priority. bsr's restore calls it (once per engine); stock
    LMCache's retrieve, measured beside it by ``bsr bench peer``, runs without it. True when applied."""
    loop = getattr(getattr(eng, "storage_manager", None), "loop", None)
    if loop is None or not sys.platform.startswith("linux"):
        return False
    if getattr(loop, "_bsr_transfer_nice", None) == nice:
        return True
    pool = ThreadPoolExecutor(thread_name_prefix="bsr-lmc-transfer", initializer=lower_this_thread, initargs=(nice,))
    loop.set_default_executor(pool)
    loop._bsr_transfer_nice = nice  # type: ignore[attr-defined]
    return True


def lower_this_thread(nice: int = TRANSFER_NICE) -> None:
    """The calling thread at ``nice`` (Linux; a thread pool's initializer for threads that make transfer calls)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # not permitted here: the thread keeps the normal priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def destroy_engine(instance_id: str) -> None:
    """Required before the process exits: LMCache's storage event-loop thread is not a daemon (the interpreter
    would never exit otherwise)."""
    LMCacheEngineBuilder.destroy(instance_id)


def backends(eng: LMCacheEngine) -> dict[str, Any]:
    return dict(eng.storage_manager.storage_backends)


def mooncake_connector(eng: LMCacheEngine) -> Any | None:
    """LMCache's Mooncake connector behind its RemoteBackend (through its instrumentation wrappers): the object
    whose ``batched_put``/``batched_get`` move the stored bytes (bsr's checksums wrap them: integrity.py)."""
    rb = backends(eng).get("RemoteBackend")
    conn = getattr(rb, "connection", None)
    for _ in range(8):
        if conn is None or hasattr(conn, "store"):
            break
        conn = getattr(conn, "real_connector", None) or getattr(conn, "_connector", None) or conn.connector
    return conn if conn is not None and hasattr(conn, "store") else None


def mooncake_store(eng: LMCacheEngine) -> Any | None:
    """The MooncakeDistributedStore behind LMCache's RemoteBackend (through its instrumentation wrappers)."""
    return getattr(mooncake_connector(eng), "store", None)


def chunk_keys(eng: LMCacheEngine, tokens: Sequence[int]) -> list[tuple[int, int, Any]]:
    """[(start, end, CacheEngineKey)] of every full chunk LMCache would store for these tokens. No storage access."""
    return list(eng.token_database.process_tokens(tokens=torch.tensor(list(tokens), dtype=torch.long)))


def key_string(key: Any) -> str:
    return str(key.to_string())


def disk_contains(eng: LMCacheEngine, keys: Sequence[Any]) -> list[bool]:
    """LocalDiskBackend's in-memory index, with pin=False: no pin count, no LRU touch, nothing to release."""
    disk = backends(eng)["LocalDiskBackend"]
    return [bool(disk.contains(k, pin=False)) for k in keys]


def remote_exists(eng: LMCacheEngine, keys: Sequence[Any]) -> list[bool]:
    """One batch_is_exist RPC. Only 1 means present: a dead master answers -900, which LMCache's own
    RemoteBackend.contains would count as a hit."""
    store = mooncake_store(eng)
    if store is None:
        raise RuntimeError("LMCache has no Mooncake remote backend configured")
    codes = store.batch_is_exist([key_string(k) for k in keys])
    return [c == 1 for c in codes]


class PinnedState(TypedDict):
    """What a probe could have left behind in an engine."""

    lookup_pins: int
    disk_pin_counts: list[int]
    disk_keys_in_request: int


def pinned_state(eng: LMCacheEngine, keys: Sequence[Any]) -> PinnedState:
    """What a probe could have left behind: lookup pins, disk pin counts, L1 pinned objects (for tests)."""
    disk = backends(eng).get("LocalDiskBackend")
    pins = [int(getattr(disk.dict[k], "pin_count", 0)) for k in keys if disk is not None and k in disk.dict]
    return {
        "lookup_pins": len(getattr(eng, "lookup_pins", {}) or {}),
        "disk_pin_counts": pins,
        "disk_keys_in_request": len(getattr(disk, "keys_in_request", []) or []),
    }


# -- retrieve and store ----------------------------------------------------------------------------------------
# bsr's windowed retrieve drives the pieces of LMCache's own ``retrieve`` itself, so that the prefix's keys are
# computed once per request instead of once per window (``retrieve(tokens[:end], mask)`` turns the whole prefix up
# to the window's end into a tensor and re-hashes its chunk chain each time: K*N work instead of N), and so that
# one window's fetch can run while the previous one installs. The pieces are the ones ``retrieve`` calls in 0.5.6:
# the token database's keys, ``StorageManager.batched_get`` per backend, the connector's ``batched_to_gpu`` and
# ``ref_count_down`` on every memory object it got.
def fetch_window(eng: LMCacheEngine, keys: Sequence[Any], locations: Sequence[str]) -> list[Any | None]:
    """The memory objects (in L1) of one window's chunks, each read from the backend ``locations`` names for it:
    one batched get per backend, as LMCache's retrieve issues. None where a chunk did not arrive (a missing object,
    a failed transfer, an unknown location such as FAULT_LOCATION). Nothing is left allocated on an exception."""
    out: list[Any | None] = [None] * len(keys)
    if not eng.is_healthy():
        return out
    by_location: dict[str, list[int]] = {}
    for i, loc in enumerate(locations):
        by_location.setdefault(loc, []).append(i)
    try:
        for loc, idx in by_location.items():
            got = eng.storage_manager.batched_get(keys=[keys[i] for i in idx], location=loc)
            for i, obj in zip(idx, got, strict=True):
                out[i] = obj
    except BaseException:
        release_objects(out)
        raise
    return out


@torch.inference_mode()
def install_window(
    eng: LMCacheEngine, objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
) -> None:
    """Copy fetched memory objects into the destination KV through the engine's connector (``batched_to_gpu``,
    as LMCache's retrieve does; ``kwargs`` carry its ``kvcaches`` and ``slot_mapping``)."""
    eng.gpu_connector.batched_to_gpu(list(objs), list(starts), list(ends), **kwargs)


def release_objects(objs: Sequence[Any | None]) -> None:
    """Give fetched memory objects back to L1 (LMCache's retrieve does the same after its install)."""
    for obj in objs:
        if obj is not None:
            obj.ref_count_down()


def stock_retrieve(eng: LMCacheEngine, tokens: Sequence[int], **kwargs: Any) -> torch.Tensor:
    """LMCache's own retrieve of the whole prefix (for comparison: it stages the whole plan in L1)."""
    return eng.retrieve(torch.tensor(list(tokens), dtype=torch.long), **kwargs)


def store(eng: LMCacheEngine, tokens: Sequence[int], skip_tokens: int, **kwargs: Any) -> None:
    """LMCache's store of tokens, leaving out a chunk-aligned prefix of ``skip_tokens`` (mask False)."""
    toks = torch.tensor(list(tokens), dtype=torch.long)
    mask = None
    if skip_tokens:
        mask = torch.ones(len(toks), dtype=torch.bool)
        mask[:skip_tokens] = False
    eng.store(toks, mask=mask, **kwargs)


def disable_hot_cache(eng: LMCacheEngine) -> None:
    """Stop retrieves from writing disk/remote chunks back into L1 (they would grow it past the window)."""
    eng.set_hot_cache(False)


def wait_remote_visible(eng: LMCacheEngine, keys: Sequence[str], deadline_s: float) -> bool:
    """Wait until every key reads batch_is_exist == 1. LMCache's RemoteBackend.put_tasks does not track batched
    puts, and destroying the engine with puts in flight segfaults (Mooncake writes from freed L1). A full segment
    makes puts fail silently, so the wait always has a deadline. True when all are visible."""
    store_ = mooncake_store(eng)
    if store_ is None or not keys:
        return True
    deadline = time.monotonic() + deadline_s
    while True:
        codes = store_.batch_is_exist(list(keys))
        if all(c == 1 for c in codes):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


# -- L1 accounting ---------------------------------------------------------------------------------------------
class PeakTracker:
    """Peak bytes of LMCache's L1 (the LocalCPUBackend allocator), which LMCache does not record itself.

    Wraps the allocator's address manager (the one place both ``allocate`` and ``batched_allocate`` go through)
    and records ``total_allocated_size`` after each allocation."""

    def __init__(self, eng: LMCacheEngine) -> None:
        cpu = backends(eng)["LocalCPUBackend"]
        self.allocator = cpu.memory_allocator.pin_allocator
        am = self.allocator.address_manager
        self.heap_bytes = int(am.get_heap_size())
        self.peak = self.live
        self.window_peak = self.live  # since the last mark(): one window's staging
        for name in ("allocate", "batched_allocate"):
            orig = getattr(am, name)

            def wrapped(*a: Any, _orig: Callable[..., Any] = orig, **k: Any) -> Any:
                out = _orig(*a, **k)
                live = self.live
                self.peak = max(self.peak, live)
                self.window_peak = max(self.window_peak, live)
                return out

            setattr(am, name, wrapped)

    @property
    def live(self) -> int:
        return int(self.allocator.address_manager.total_allocated_size)

    def reset(self) -> None:
        self.peak = self.live

    def mark(self) -> None:
        self.window_peak = self.live


# -- destination -----------------------------------------------------------------------------------------------
class PerChunkBatches:
    """LMCache's batched connector calls, served one memory object at a time by the connector's own
    ``from_gpu``/``to_gpu`` (CPU copies gain nothing from batching)."""

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(o, s, e, **kwargs)  # type: ignore[attr-defined]

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kwargs: Any) -> None:
        for o, s, e in zip(memory_objs or [], starts or [], ends or [], strict=True):
            self.to_gpu(o, s, e, **kwargs)  # type: ignore[attr-defined]


class CPUPagedConnector(PerChunkBatches, GPUConnectorInterface):
    """Copies between LMCache MemoryObjs and a CPU paged KV cache (one ``[rows, 2, heads, head_size]`` tensor per
    layer, rows = block_id * block_size + offset).

    LMCache's object layout (KV_2LTD) is ``[2, layers, tokens, heads * head_size]``. store/retrieve kwargs:
    ``kvcaches`` (the per-layer tensors) and ``slot_mapping`` (a LongTensor of rows for every token passed to
    store/retrieve). On a GPU host use LMCache's real connector (``VLLMPagedMemGPUConnectorV2``, which the vLLM
    adapter builds); this one exists because CPU-only LMCache has no paged connector."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int) -> None:
        self.num_layers, self.heads, self.head_size = num_layers, num_kv_heads, head_size
        self.installs: list[tuple[int, int]] = []  # (start, end) of every chunk installed, for window checks

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.heads * self.head_size])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        rows = kwargs["slot_mapping"][start:end]
        for layer, kv in enumerate(kwargs["kvcaches"]):
            t = kv.index_select(0, rows)  # [T, 2, H, D]
            memory_obj.tensor[:, layer].copy_(t.permute(1, 0, 2, 3).reshape(2, end - start, -1))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """One pass over the object's bytes per layer. When the chunk's rows form one run (its blocks allocated
        consecutively, the usual case) a strided copy into that slice of rows (memcpy speed, ~4x the indexed
        copy here); otherwise the indexed copy, reading the permuted view directly (no contiguous temporary)."""
        rows = kwargs["slot_mapping"][start:end]
        n = end - start
        first = int(rows[0]) if n else 0
        run = n > 0 and int(rows[-1]) - first == n - 1 and bool((rows.diff() == 1).all())
        for layer, kv in enumerate(kwargs["kvcaches"]):
            src = memory_obj.tensor[:, layer].reshape(2, n, self.heads, self.head_size).permute(1, 0, 2, 3)
            if run:
                kv[first : first + n].copy_(src)
            else:
                kv.index_copy_(0, rows, src)
        self.installs.append((start, end))


# -- lookup RPC (the scheduler <-> worker transport of LMCache's vLLM integration) --------------------------------
class LookupRpc(TypedDict):
    """LMCache's lookup-RPC classes and its RPC path function (all LMCache's own: typed as LMCache types them)."""

    LookupClientInterface: Any
    LMCacheLookupClient: Any
    SocketParams: Any
    ZmqReqRepClientTransport: Any
    ZmqRouterServerTransport: Any
    get_zmq_rpc_path_lmcache: Any


def lookup_rpc() -> LookupRpc:
    """LMCache's lookup-RPC pieces, for bsr's probe-only lookup (vllm_bsr/probe_lookup.py): the scheduler-side
    ``LMCacheLookupClient`` and ``LookupClientInterface``, the ZMQ transports (``ZmqReqRepClientTransport``,
    ``ZmqRouterServerTransport``, ``SocketParams``) and ``get_zmq_rpc_path_lmcache``. None of them imports vLLM."""
    from lmcache.v1.lookup_client.abstract_client import LookupClientInterface
    from lmcache.v1.lookup_client.lmcache_lookup_client import LMCacheLookupClient
    from lmcache.v1.rpc.zmq_transport import SocketParams, ZmqReqRepClientTransport, ZmqRouterServerTransport
    from lmcache.v1.rpc_utils import get_zmq_rpc_path_lmcache

    return {
        "LookupClientInterface": LookupClientInterface,
        "LMCacheLookupClient": LMCacheLookupClient,
        "SocketParams": SocketParams,
        "ZmqReqRepClientTransport": ZmqReqRepClientTransport,
        "ZmqRouterServerTransport": ZmqRouterServerTransport,
        "get_zmq_rpc_path_lmcache": get_zmq_rpc_path_lmcache,
    }


# -- vLLM ------------------------------------------------------------------------------------------------------
def gpu_connector_factory() -> tuple[Any, Any, str]:
    """(the ``lmcache.v1.gpu_connector`` module, LMCache's ``EngineType``, LMCache's device type). LMCache's vLLM
    adapter looks ``CreateGPUConnector`` up on that module each time it builds an engine, which is where the CPU
    connector (plugins/lmcache_cpu) hooks in. No vLLM import."""
    import lmcache.v1.gpu_connector as factory
    from lmcache import torch_device_type
    from lmcache.utils import EngineType

    return factory, EngineType, str(torch_device_type)


def vllm_connector_base() -> type:
    """LMCache's vLLM V1 connector class (imports vLLM: only call it inside a vLLM process)."""
    from lmcache.integration.vllm.lmcache_connector_v1 import LMCacheConnectorV1Dynamic

    return LMCacheConnectorV1Dynamic


__all__ = [
    "FAULT_LOCATION",
    "LMCACHE_VERSION",
    "SUPPORTED_VERSION",
    "TIER_BACKENDS",
    "CPUPagedConnector",
    "GPUConnectorInterface",
    "PeakTracker",
    "PerChunkBatches",
    "build_engine",
    "chunk_keys",
    "destroy_engine",
    "disable_hot_cache",
    "disk_contains",
    "fetch_window",
    "gpu_connector_factory",
    "install_window",
    "lookup_rpc",
    "lower_this_thread",
    "lower_transfer_priority",
    "mooncake_connector",
    "mooncake_store",
    "release_objects",
    "remote_exists",
    "stock_retrieve",
    "store",
    "vllm_connector_base",
    "wait_remote_visible",
]
