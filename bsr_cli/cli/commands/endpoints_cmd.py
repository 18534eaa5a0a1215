"""`bsr engine endpoints`: every endpoint bsr needs for the engine `--engine` points at, in one command.

Against a vLLM worker's admin API (the BSR connector's ``bsr_admin_port``) it prints the admin URL of each TP rank
of that vLLM instance, whether the token was accepted and where it came from, the Mooncake master's store,
metadata and admin endpoints, and the `bsr probe --store` line with LMCache's key format filled in; the worker
reports all of it (plugins/vllm_bsr/instance.py). Against bsr's own engines, one admin URL serves every rank.
"""

from __future__ import annotations

import shlex
from typing import Any

import typer

from bsr_cli.cli.context import JsonFlag, state

PROMPT_PLACEHOLDER = "prompt.json"


def probe_store_line(mooncake: dict[str, Any], key_format: dict[str, Any]) -> str:
    """The `bsr probe --store` command for this instance's store and key format (the prompt file left to fill)."""
    words = ["bsr", "probe", "--store", mooncake["store"]]
    if mooncake.get("metadata"):
        words += ["--metadata", mooncake["metadata"]]
    if mooncake.get("admin"):
        words += ["--master-admin", mooncake["admin"]]
    words += ["--model", key_format["model"], "--world-size", str(key_format["world_size"])]
    words += ["--dtype", key_format["dtype"]]
    if key_format.get("chunk_size"):
        words += ["--chunk-size", str(key_format["chunk_size"])]
    if key_format.get("hash_seed") not in (None, "", "random"):
        words += ["--vllm-hash-seed", str(key_format["hash_seed"])]
    return shlex.join([*words, "--tokens-file", PROMPT_PLACEHOLDER])


def endpoints_of(url: str, token_source: str, info: dict[str, Any]) -> dict[str, Any]:
    """The endpoints, from the admin API's `info` (wire dict in, plain result out; only known keys kept)."""
    inst = info.get("vllm_instance")
    out: dict[str, Any] = {"engine": url, "token": {"accepted": True, "source": token_source}}
    if not isinstance(inst, dict):
        out |= {"kind": "bsr", "tp_size": int(info.get("tp_size") or 1), "rank_urls": [url]}
        return out
    out |= {
        "kind": "vllm",
        "tp_size": int(inst["tp_size"]),
        "rank0_url": inst["rank0_url"],
        "rank_urls": list(inst["rank_urls"]),
        "all_ranks": ",".join(inst["rank_urls"]),
        "key_format": {k: v for k, v in dict(inst["key_format"]).items() if v is not None},
    }
    mc = inst.get("mooncake")
    if isinstance(mc, dict):
        out["mooncake"] = {k: v for k, v in mc.items() if v}
        out["probe_store"] = probe_store_line(mc, inst["key_format"])
        if not mc.get("admin"):
            out["mooncake_admin_hint"] = (
                "set kv_connector_extra_config.bsr_mooncake_admin to the master's metrics URL for liveness"
            )
    return out


def render(console: Any, d: dict[str, Any]) -> None:
    tok = d["token"]
    if d["kind"] != "vllm":
        console.print(f"bsr engine at {d['engine']}: one admin API serves all {d['tp_size']} rank(s)")
        console.print(f"token: accepted (from {tok['source']})")
        return
    console.print(f"vLLM instance behind {d['engine']}: TP {d['tp_size']}, model {d['key_format']['model']}")
    console.print(
        "admin API, one per TP rank (rank 0 answers for the instance: markers, failed loads, status, explain):"
    )
    for r, url in enumerate(d["rank_urls"]):
        console.print(f"  rank {r}  {url}")
    console.print(f"token: accepted (from {tok['source']})")
    console.print(f"every rank at once: bsr status --engine {d['all_ranks']}")
    mc = d.get("mooncake")
    if not mc:
        console.print("Mooncake: not configured in LMCache (no `bsr probe --store`)")
        return
    parts = [f"store {mc['store']}"] + [f"{k} {mc[k]}" for k in ("metadata", "admin") if k in mc]
    console.print("Mooncake: " + "  ".join(parts))
    if "mooncake_admin_hint" in d:
        console.print(f"  master admin unknown: {d['mooncake_admin_hint']}")
    console.print(f"probe the store: {d['probe_store']}")


def engine_endpoints(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Every endpoint bsr needs for this engine: for a vLLM instance (--engine = a worker's admin URL) the admin
    URL of each TP rank, the token's source, the Mooncake store/metadata/admin endpoints and the `bsr probe
    --store` line."""
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import resolve_engine

    st = state(ctx, json_flag)
    url, _token, how = resolve_engine(st.settings)
    with AdminClient.from_settings(st.settings) as client:
        info = client.info().to_wire()  # authenticated: an answer means the token was accepted
    source = st.settings.sources.get("token", how) if st.settings.token else how
    st.out.result(endpoints_of(url, source, info), render)


__all__ = ["endpoints_of", "engine_endpoints", "probe_store_line", "render"]
