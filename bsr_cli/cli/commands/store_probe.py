"""`bsr probe --store mooncake://HOST:PORT`: which ranks of a real LMCache deployment hold which chunks of a prompt,
asked of the Mooncake store directly (no engine), and why nothing matches when nothing does."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bsr_cli.cli.app import AppState
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.lmcache_keys import LMCACHE_DTYPES, lmcache_chunk_hashes, lmcache_key
from bsr_cli.core.units import canonical_dtype
from bsr_cli.errors import EngineUnreachable, InvalidInput
from bsr_cli.loaders import read_tokens_file


def run(
    st: AppState,
    store: str,
    model: str | None,
    world_size: int,
    metadata: str | None,
    tokens_file: Path | None,
    prompt_file: Path | None,
    synthetic: int | None,
    seed: int,
    width: int,
    *,
    dtype: str = "bf16",
    chunk_size: int = 256,
    admin: str | None = None,
) -> None:
    from bsr_cli.cli import render_ops

    url = urlsplit(store)
    try:
        port = url.port
    except ValueError:
        port = None  # not a number, or out of range
    if url.scheme != "mooncake" or not url.hostname or not port:
        raise InvalidInput(f"--store must look like mooncake://HOST:PORT (the master's RPC address), got {store!r}")
    if not model:
        raise InvalidInput("--store needs --model (the model name in LMCache's keys)")
    if world_size < 1:
        raise InvalidInput("--world-size must be positive")
    tokens = _tokens(tokens_file, prompt_file, synthetic, seed)
    host = url.hostname
    meta = metadata or f"http://{host}:8080/metadata"
    admin_url = admin or f"http://{host}:9003"
    key_dtype = LMCACHE_DTYPES.get(canonical_dtype(dtype), dtype)
    hashes = lmcache_chunk_hashes(tokens, chunk_size)

    from bsr_cli.engine.tiers.mooncake import MooncakeTier
    from bsr_cli.runtime.tiers import TierUnavailable

    try:
        tier = MooncakeTier(f"{host}:{url.port}", meta, deadline_s=st.settings.timeout_s)
    except TierUnavailable as e:
        raise EngineUnreachable(
            f"cannot reach the Mooncake store at {store}: {e}", hint="check --store (RPC port) and --metadata"
        ) from None
    try:
        rows = {}
        for wid in range(world_size):
            keys = [lmcache_key(model, world_size, wid, h, key_dtype) for h in hashes]
            held = tier.contains(keys, st.settings.timeout_s) if keys else []
            rows[(wid, "kv")] = "".join("1" if h else "0" for h in held)
    except TierUnavailable as e:
        raise EngineUnreachable(f"the Mooncake store at {store} did not answer: {e}") from None
    finally:
        tier.close()
    full_tokens = len(hashes) * chunk_size
    bitmap = HitBitmap(("mooncake",), world_size, ("kv",), full_tokens, chunk_size, rows, model=model)
    brk = bitmap.first_break()
    data: dict[str, Any] = {
        "kind": "bsr.store-probe",
        "store": store,
        "bitmap": bitmap.to_dict(),
        "prompt_tokens": len(tokens),
        "committable_chunks": bitmap.prefix_chunks(),
        "committable_tokens": bitmap.prefix_tokens(),
        "first_break": brk.to_dict() if brk else None,
        "tier_errors": {},
        "markers": [],
        "strip_width": width,
        "key_example": lmcache_key(model, world_size, 0, hashes[0], key_dtype) if hashes else None,
    }
    if hashes and not any("1" in r for r in rows.values()):
        data["diagnosis"] = diagnose(admin_url, model, world_size, key_dtype, {f"{h:x}" for h in hashes})
    st.out.result(data, render_ops.store_probe)


def _tokens(tokens_file: Path | None, prompt_file: Path | None, synthetic: int | None, seed: int) -> list[int]:
    from bsr_cli.core.keys import synthetic_tokens

    if sum(x is not None for x in (tokens_file, prompt_file, synthetic)) != 1:
        raise InvalidInput("give exactly one of --tokens-file, --prompt-file or --synthetic N")
    if prompt_file is not None:
        raise InvalidInput("--store needs token ids (--tokens-file): bsr cannot reproduce your model's tokenizer")
    if synthetic is not None:
        return synthetic_tokens(synthetic, seed)
    assert tokens_file is not None
    return read_tokens_file(tokens_file)


def diagnose(admin_url: str, model: str, world_size: int, dtype: str, hashes: set[str]) -> dict[str, Any]:
    """Explain a total miss from what the store does hold (the master's key listing)."""
    try:
        with urllib.request.urlopen(admin_url + "/get_all_keys", timeout=10) as r:
            text = r.read().decode(errors="replace")
    except OSError as e:
        return {
            "available": False,
            "why": f"could not list the store's keys at {admin_url}: {e}",
            "hint": "pass --master-admin http://HOST:PORT (the master's metrics/admin port)",
        }
    try:
        listed = json.loads(text)
        keys = [str(k) for k in (listed if isinstance(listed, list) else listed.get("keys", []))]
    except json.JSONDecodeError:
        keys = [line.strip() for line in text.replace(",", "\n").splitlines() if "@" in line]
    parsed = []
    for k in keys:
        parts = k.rsplit("@", 4)
        if len(parts) == 5:
            parsed.append(parts)
    mine = [p for p in parsed if p[0] == model]
    models = Counter(p[0] for p in parsed)
    causes = []
    if not parsed:
        causes.append(
            "the store holds no LMCache-format keys at all (nothing was stored, or the master restarted: "
            "Mooncake keeps its metadata in memory)"
        )
    elif not mine:
        causes.append(
            f"the store holds no keys for model {model!r}; it holds: "
            + ", ".join(f"{m} ({n})" for m, n in models.most_common(5))
        )
    else:
        sizes = Counter(p[1] for p in mine)
        workers = Counter(p[2] for p in mine if p[1] == str(world_size))
        dtypes = Counter(p[4] for p in mine)
        if str(world_size) not in sizes:
            causes.append(
                f"keys for {model!r} were written with world size {', '.join(sorted(sizes))}, "
                f"not {world_size} (a different TP degree)"
            )
        elif dtype not in dtypes:
            causes.append(f"keys for {model!r} use dtype {', '.join(sorted(dtypes))}, not {dtype}")
        else:
            seen = {p[3] for p in mine}
            if not seen & hashes:
                causes.append(
                    f"{len(seen)} chunk(s) of {model!r} at world size {world_size} (workers "
                    f"{', '.join(sorted(workers))}) are stored, but none with this prompt's chunk hashes: "
                    "a different hash seed (vLLM seeds LMCache's hash randomly unless PYTHONHASHSEED is set), "
                    "tokenizer, chunk size or prompt prefix"
                )
    return {"available": True, "keys_listed": len(keys), "keys_for_model": len(mine), "causes": causes}


__all__ = ["diagnose", "run"]
