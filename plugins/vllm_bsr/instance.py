"""What one vLLM instance's bsr endpoints are, as every worker's admin API reports them (``info.worker.instance``).

One story for reaching a vLLM instance: point bsr at the admin API of its rank-0 worker (``bsr_admin_port``). Every
worker answers for the instance where the instance is one thing (the scheduler's markers, the forced-local
admissions, a request whose load failed on any rank: vllm_bsr/board.py) and lists here the admin URL of every TP
rank (``bsr_admin_port + r``, for what is per rank: the probe bitmap, that rank's own windows), the Mooncake
endpoints ``bsr probe --store`` needs, and LMCache's key format (model, world size, dtype, chunk size, hash seed),
so that ``bsr engine endpoints`` prints everything in one command. Plain standard library; the engine is read,
never changed. The token is never reported: the caller already holds it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from bsr_cli.core.wire import JsonObject

# LMCache's KV dtypes, by their torch names, as `bsr probe --store --dtype` spells them.
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def mooncake_endpoints(eng: Any, master_admin: str | None) -> JsonObject | None:
    """The Mooncake master's RPC address (``--store``), metadata server (``--metadata``) and admin/metrics URL
    (``--master-admin``; only the connector's ``bsr_mooncake_admin`` says it: LMCache never needs it), or None
    when this engine has no Mooncake backend."""
    cfg = getattr(eng, "config", None)
    remote = str(getattr(cfg, "remote_url", None) or "")
    if not remote.startswith("mooncakestore://"):
        return None
    extra = dict(getattr(cfg, "extra_config", None) or {})
    master = extra.get("mooncake_master_server_addr") or urlsplit(remote).netloc
    return {"store": f"mooncake://{master}", "metadata": extra.get("mooncake_metadata_server"), "admin": master_admin}


def describe(eng: Any, *, tp_rank: int, admin_url: str, master_admin: str | None = None) -> JsonObject:
    """The instance this worker belongs to, as far as this worker can see it."""
    md = eng.metadata
    world = int(getattr(md, "world_size", 1) or 1)
    parts = urlsplit(admin_url)
    base = int(parts.port or 0) - tp_rank
    return {
        "tp_size": world,
        "rank0_url": f"{parts.scheme}://{parts.hostname}:{base}",
        "rank_urls": [f"{parts.scheme}://{parts.hostname}:{base + r}" for r in range(world)],
        "mooncake": mooncake_endpoints(eng, master_admin),
        "key_format": {
            "model": str(md.model_name),
            "world_size": world,
            "dtype": DTYPE_NAMES.get(str(md.kv_dtype), str(md.kv_dtype).removeprefix("torch.")),
            "chunk_size": int(getattr(eng.config, "chunk_size", 0) or int(md.kv_shape[2])),
            # vLLM seeds LMCache's first hash from PYTHONHASHSEED (docs/deployment.md); unset = random, unprobeable.
            "hash_seed": os.environ.get("PYTHONHASHSEED"),
        },
    }


__all__ = ["describe", "mooncake_endpoints"]
