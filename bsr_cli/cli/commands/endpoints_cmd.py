"""`bsr engine endpoints`: every endpoint bsr needs for the engine `--engine` points at, in one command.

Against a vLLM worker's admin API (the BSR connector's ``bsr_admin_port``) it prints the admin URL of each TP rank
of that vLLM instance, whether the token was accepted and where it came from, the Mooncake master's store,
metadata and admin endpoints, and the `bsr probe --store` line with LMCache's key format filled in; the worker
reports all of it (plugins/vllm_bsr/instance.py). Against bsr's own engines, one admin URL serves every rank.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from typing import Any

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core import wire
from bsr_cli.core.status import EngineInfo

PROMPT_PLACEHOLDER = "prompt.json"


@dataclass(frozen=True)
class KeyFormat:
    """How LMCache names this instance's objects in the store (what `bsr probe --store` needs to find them)."""

    model: str
    world_size: int
    dtype: str
    chunk_size: int | None = None
    hash_seed: str | None = None  # vLLM's PYTHONHASHSEED; None or "random" when unseeded


@dataclass(frozen=True)
class StoreEndpoints:
    """The Mooncake master an instance's LMCache uses: its store URL, metadata server and admin (metrics) URL."""

    store: str
    metadata: str | None = None
    admin: str | None = None


@dataclass(frozen=True)
class EngineEndpoints:
    """`bsr engine endpoints`: every endpoint bsr needs for one engine. A vLLM instance (``key_format`` set) has
    one admin URL per TP rank and, with Mooncake configured, the store's; bsr's own engines one admin URL."""

    engine: str
    token_source: str  # where the accepted token came from
    tp_size: int
    rank_urls: tuple[str, ...]
    rank0_url: str | None = None
    key_format: KeyFormat | None = None
    mooncake: StoreEndpoints | None = None

    @property
    def all_ranks(self) -> str:
        return ",".join(self.rank_urls)

    @property
    def probe_store(self) -> str | None:
        if self.mooncake is None or self.key_format is None:
            return None
        return probe_store_line(self.mooncake, self.key_format)

    def to_wire(self) -> wire.JsonObject:
        head: wire.JsonObject = {"engine": self.engine, "token": {"accepted": True, "source": self.token_source}}
        kf = self.key_format
        if kf is None:
            return head | {"kind": "bsr", "tp_size": self.tp_size, "rank_urls": list(self.rank_urls)}
        out: wire.JsonObject = head | {
            "kind": "vllm",
            "tp_size": self.tp_size,
            "rank0_url": self.rank0_url,
            "rank_urls": list(self.rank_urls),
            "all_ranks": self.all_ranks,
            "key_format": {k: v for k, v in asdict(kf).items() if v is not None},
        }
        mc = self.mooncake
        if mc is not None:
            out["mooncake"] = {k: v for k, v in asdict(mc).items() if v}
            out["probe_store"] = self.probe_store
            if not mc.admin:
                out["mooncake_admin_hint"] = MOONCAKE_ADMIN_HINT
        return out


MOONCAKE_ADMIN_HINT = "set kv_connector_extra_config.bsr_mooncake_admin to the master's metrics URL for liveness"


def probe_store_line(mooncake: StoreEndpoints, key_format: KeyFormat) -> str:
    """The `bsr probe --store` command for this instance's store and key format (the prompt file left to fill)."""
    words = ["bsr", "probe", "--store", mooncake.store]
    if mooncake.metadata:
        words += ["--metadata", mooncake.metadata]
    if mooncake.admin:
        words += ["--master-admin", mooncake.admin]
    words += ["--model", key_format.model, "--world-size", str(key_format.world_size)]
    words += ["--dtype", key_format.dtype]
    if key_format.chunk_size:
        words += ["--chunk-size", str(key_format.chunk_size)]
    if key_format.hash_seed not in (None, "", "random"):
        words += ["--vllm-hash-seed", str(key_format.hash_seed)]
    return shlex.join([*words, "--tokens-file", PROMPT_PLACEHOLDER])


@dataclass(frozen=True)
class VllmInstance:
    """What a vLLM worker reports of its instance (its info's ``vllm_instance``, plugins/vllm_bsr/instance.py)."""

    tp_size: int
    rank0_url: str
    rank_urls: tuple[str, ...]
    key_format: KeyFormat
    mooncake: StoreEndpoints | None = None

    from_wire = wire.reader()


def endpoints_of(url: str, token_source: str, info: EngineInfo) -> EngineEndpoints:
    """The endpoints, from the admin API's `info`: a vLLM worker adds its instance, bsr's own engines do not."""
    inst = info.host_fields.get("vllm_instance")
    if not isinstance(inst, dict):
        return EngineEndpoints(url, token_source, info.ranks or 1, (url,))  # bsr's engine: one URL, every rank
    vllm = VllmInstance.from_wire(inst)
    return EngineEndpoints(
        url,
        token_source,
        vllm.tp_size,
        vllm.rank_urls,
        rank0_url=vllm.rank0_url,
        key_format=vllm.key_format,
        mooncake=vllm.mooncake,
    )


def render(console: Any, d: EngineEndpoints) -> None:
    kf = d.key_format
    if kf is None:
        console.print(f"bsr engine at {d.engine}: one admin API serves all {d.tp_size} rank(s)")
        console.print(f"token: accepted (from {d.token_source})")
        return
    console.print(f"vLLM instance behind {d.engine}: TP {d.tp_size}, model {kf.model}")
    console.print(
        "admin API, one per TP rank (rank 0 answers for the instance: markers, failed loads, status, explain):"
    )
    for r, url in enumerate(d.rank_urls):
        console.print(f"  rank {r}  {url}")
    console.print(f"token: accepted (from {d.token_source})")
    console.print(f"every rank at once: bsr status --engine {d.all_ranks}")
    mc = d.mooncake
    if mc is None:
        console.print("Mooncake: not configured in LMCache (no `bsr probe --store`)")
        return
    parts = [f"store {mc.store}"] + [f"{k} {v}" for k, v in (("metadata", mc.metadata), ("admin", mc.admin)) if v]
    console.print("Mooncake: " + "  ".join(parts))
    if not mc.admin:
        console.print(f"  master admin unknown: {MOONCAKE_ADMIN_HINT}")
    console.print(f"probe the store: {d.probe_store}")


def engine_endpoints(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Every endpoint bsr needs for this engine: for a vLLM instance (--engine = a worker's admin URL) the admin
    URL of each TP rank, the token's source, the Mooncake store/metadata/admin endpoints and the `bsr probe
    --store` line."""
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import resolve_engine

    st = state(ctx, json_flag)
    url, _token, how = resolve_engine(st.settings)
    with AdminClient.from_settings(st.settings) as client:
        info = client.info()  # authenticated: an answer means the token was accepted
    source = st.settings.sources.get("token", how) if st.settings.token else how
    st.out.result(endpoints_of(url, source, info), render)


__all__ = [
    "EngineEndpoints",
    "KeyFormat",
    "StoreEndpoints",
    "VllmInstance",
    "endpoints_of",
    "engine_endpoints",
    "probe_store_line",
    "render",
]
