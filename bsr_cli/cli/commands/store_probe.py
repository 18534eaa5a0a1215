"""`bsr probe --store mooncake://HOST:PORT`: which ranks of a real LMCache deployment hold which chunks of a prompt,
asked of the Mooncake store directly (no engine), whether the processes holding them are still alive, and why
nothing matches when nothing does.

The keys are LMCache 0.5.6's (bsr_cli.core.lmcache_keys): its dtype names, request tags, and the hash chain's start,
which is 0 for LMCache alone and vLLM's PYTHONHASHSEED-derived start for LMCache inside vLLM. By default the start
is detected: the candidates (no vLLM, and vLLM with a few usual seeds) are tried against the store in one probe."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions
from bsr_cli.cli.context import AppState
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.lmcache_keys import (
    DTYPE_FLAG,
    lmcache_chunk_hashes,
    lmcache_dtype,
    lmcache_key,
    parse_lmcache_key,
    parse_tags,
    vllm_seeded_start,
)
from bsr_cli.errors import EngineUnreachable, InvalidInput
from bsr_cli.loaders import read_tokens_file

# Seeds tried by --vllm-hash-seed auto (besides bsr's own PYTHONHASHSEED): the values deployment guides use.
AUTO_SEEDS = ("0", "1", "42", "123", "1234", "12345")
# Chunks per candidate start tried by auto-detection (all workers, one batch_is_exist for every candidate).
DETECT_CHUNKS = 64
# Held keys whose replicas are looked up one by one when only some segment holders are gone.
MAX_REPLICA_QUERIES = 1024
# Keys the master's /query_key can be asked about verbatim (it reads its query string without URL-decoding).
_QUERYABLE = re.compile(r"[!$%'-~]+")  # printable ASCII without space, '"', '#' and '&'


def run(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> None:
    from bsr_cli.cli.render import ops as render_ops

    st.out.result(collect(st, opts, prompt, width), render_ops.store_probe)


def collect(st: AppState, opts: StoreProbeOptions, prompt: PromptFlags, width: int | None) -> dict[str, Any]:
    """The store probe's result: bitmap, key format, liveness and (on a total miss) the diagnosis."""
    store, model, world_size, chunk_size = opts.store, opts.model, opts.world_size, opts.chunk_size
    vllm_hash_seed = opts.vllm_hash_seed
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
    key_dtype = lmcache_dtype(opts.dtype)
    tag_pairs = parse_tags(opts.tags)
    starts = hash_starts(vllm_hash_seed)
    tokens = _tokens(prompt)
    host = url.hostname
    meta = opts.metadata or f"http://{host}:8080/metadata"
    admin_url = opts.admin or f"http://{host}:9003"
    chains = {label: lmcache_chunk_hashes(tokens, chunk_size, start) for label, start in starts}

    def keys_for(label: str, wid: int, n: int | None = None) -> list[str]:
        hs = chains[label] if n is None else chains[label][:n]
        return [lmcache_key(model, world_size, wid, h, key_dtype, tag_pairs) for h in hs]

    if not opts.verbose:
        os.environ.setdefault("GLOG_minloglevel", "3")  # Mooncake's glog: read when its library loads
    from bsr_cli.runtime.tiers import TierUnavailable
    from bsr_cli.tiers.mooncake import MooncakeTier

    with _native_stderr_silenced(not opts.verbose):
        try:
            tier = MooncakeTier(f"{host}:{url.port}", meta, deadline_s=st.settings.timeout_s)
        except TierUnavailable as e:
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store}: {e}", hint="check --store (RPC port) and --metadata"
            ) from None
        try:
            tried: dict[str, int] = {}
            chosen = starts[0][0]
            if len(starts) > 1:  # auto: one probe of every candidate's first chunks, the most hits wins
                batch = [
                    (label, k)
                    for label, _ in starts
                    for w in range(world_size)
                    for k in keys_for(label, w, DETECT_CHUNKS)
                ]
                held = tier.contains([k for _, k in batch], st.settings.timeout_s) if batch else []
                tried = dict(Counter(label for (label, _), h in zip(batch, held, strict=True) if h))
                if tried:
                    chosen = max(starts, key=lambda s: tried.get(s[0], 0))[0]
            rows = {}
            held_keys: dict[tuple[int, int], str] = {}
            for wid in range(world_size):
                keys = keys_for(chosen, wid)
                held = tier.contains(keys, st.settings.timeout_s) if keys else []
                rows[(wid, "kv")] = "".join("1" if h else "0" for h in held)
                held_keys |= {(wid, i): k for i, (k, h) in enumerate(zip(keys, held, strict=True)) if h}
        except TierUnavailable as e:
            raise EngineUnreachable(f"the Mooncake store at {store} did not answer: {e}") from None
        finally:
            tier.close()

    hashes = chains[chosen]
    full_tokens = len(hashes) * chunk_size
    bitmap = HitBitmap(("mooncake",), world_size, ("kv",), full_tokens, chunk_size, rows, model=model)
    brk = bitmap.first_break()
    start_value = dict(starts)[chosen]
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
        "key_format": {
            "dtype": key_dtype,
            "tags": [f"{k}%{v}" for k, v in tag_pairs],
            "hash_start": {
                "requested": vllm_hash_seed,
                "vllm_hash_seed": None if chosen == "none" else chosen,
                "start": start_value,
                "detected": bool(tried) if len(starts) > 1 else None,
                "candidates_held": tried,
            },
        },
        "key_example": keys_for(chosen, 0, 1)[0] if hashes else None,
    }
    data["liveness"] = liveness(admin_url, meta, held_keys, rows, chunk_size)
    if hashes and not held_keys:
        every = dict(starts) | dict(hash_starts("auto"))
        hex_chains = {
            label: {
                f"{h:x}" for h in (chains[label] if label in chains else lmcache_chunk_hashes(tokens, chunk_size, s))
            }
            for label, s in every.items()
        }
        data["diagnosis"] = diagnose(
            admin_url, model, world_size, key_dtype, tag_pairs, chosen, hex_chains, auto=len(starts) > 1
        )
    return data


def hash_starts(option: str) -> list[tuple[str, int]]:
    """(label, start) candidates for --vllm-hash-seed: 'none' is LMCache without vLLM (start 0)."""
    opt = str(option).strip().lower()
    if opt == "none":
        return [("none", 0)]
    if opt != "auto":
        return [(opt, vllm_seeded_start(opt))]
    seeds = [s for s in (os.environ.get("PYTHONHASHSEED", ""), *AUTO_SEEDS) if s.isdigit()]
    return [("none", 0)] + [(s, vllm_seeded_start(s)) for s in dict.fromkeys(seeds)]


def _tokens(prompt: PromptFlags) -> list[int]:
    from bsr_cli.core.keys import synthetic_tokens

    if prompt.given() != 1:
        raise InvalidInput("give exactly one of --tokens-file, --prompt-file or --synthetic N")
    if prompt.prompt_file is not None:
        raise InvalidInput("--store needs token ids (--tokens-file): bsr cannot reproduce your model's tokenizer")
    if prompt.synthetic is not None:
        return synthetic_tokens(prompt.synthetic, prompt.seed)
    assert prompt.tokens_file is not None
    return read_tokens_file(prompt.tokens_file)


@contextlib.contextmanager
def _native_stderr_silenced(enabled: bool) -> Iterator[None]:
    """Mooncake's C++ client logs (glog) straight to file descriptor 2; keep that off the terminal (--verbose
    shows it). Python's own error reporting happens after the block, on the restored descriptor."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode(errors="replace"))


def _data_endpoint(metadata_url: str, segment: str, fallback: str) -> str:
    """Where the segment's holder serves its bytes: the transfer engine's TCP data port (or its RPC port) from the
    segment descriptor on the metadata server; the master's te_endpoint when the descriptor cannot be read."""
    if not metadata_url.startswith("http") or not segment:
        return fallback
    for key, host_f, port_f in (
        (f"mooncake/ram/{segment}", "tcp_data_host", "tcp_data_port"),
        (f"mooncake/rpc_meta/{segment}", "ip_or_host_name", "rpc_port"),
    ):
        try:
            doc = json.loads(_get(f"{metadata_url}?key={urllib.parse.quote(key, safe='')}", timeout=2.0))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get(host_f) and doc.get(port_f):
            return f"{doc[host_f]}:{doc[port_f]}"
    return fallback


def liveness(
    admin_url: str,
    metadata_url: str,
    held_keys: dict[tuple[int, int], str],
    rows: dict[tuple[int, str], str],
    chunk_size: int,
) -> dict[str, Any]:
    """Whether the processes holding the held chunks are alive. The master's key and segment listings keep a dead
    holder's entries until its client TTL runs out (~10 s), so each segment's data endpoint is asked directly (a TCP
    connect). Which holder has a chunk comes from the master's replica listing (``/query_key``)."""
    from bsr_cli.errors import ServiceError
    from bsr_cli.mooncake import health

    try:
        segs = health.segments(admin_url)
    except ServiceError as e:
        return {"available": False, "why": str(e)}
    out_segs = []
    alive_eps: set[str] = set()
    for s in segs:
        ep = _data_endpoint(metadata_url, str(s.get("segment_name") or ""), str(s.get("te_endpoint") or ""))
        alive = bool(ep) and health.tcp_reachable(ep, timeout=0.5)
        if alive:  # replicas name their holder by its te_endpoint (= the segment name)
            alive_eps |= {str(s.get("te_endpoint") or ""), str(s.get("segment_name") or "")}
        out_segs.append({"name": s.get("segment_name"), "endpoint": ep, "alive": alive, "bytes": s.get("size_bytes")})
    dead = [s for s in out_segs if not s["alive"]]
    stale: dict[tuple[int, int], bool] = {}
    unknown = 0
    if held_keys and dead:
        if not alive_eps:
            stale = dict.fromkeys(held_keys, True)
        else:
            for i, (cell, key) in enumerate(sorted(held_keys.items())):
                if i >= MAX_REPLICA_QUERIES:
                    unknown += 1
                    continue
                if not _QUERYABLE.fullmatch(key):  # the master does not URL-decode its query string
                    unknown += 1
                    continue
                try:
                    doc = json.loads(_get(f"{admin_url}/query_key?key={key}"))
                    eps = {str(r.get("transport_endpoint_")) for r in doc.get("data") or []}
                except (OSError, ValueError, AttributeError):
                    unknown += 1
                    continue
                stale[cell] = not (eps & alive_eps)
    live_rows = {}
    for (wid, _group), cells in rows.items():
        live_rows[wid] = "".join(
            "1" if c == "1" and not stale.get((wid, i), False) else "0" for i, c in enumerate(cells)
        )
    live_prefix = 0
    if live_rows:
        n = len(next(iter(live_rows.values())))
        while live_prefix < n and all(r[live_prefix] == "1" for r in live_rows.values()):
            live_prefix += 1
    return {
        "available": True,
        "segments": out_segs,
        "segments_alive": len(out_segs) - len(dead),
        "held_chunks": len(held_keys),
        "stale_chunks": sum(stale.values()),
        "unknown_chunks": unknown,
        "live_rows": live_rows,
        "live_committable_chunks": live_prefix,
        "live_committable_tokens": live_prefix * chunk_size,
    }


def _list_keys(admin_url: str) -> list[str]:
    text = _get(admin_url + "/get_all_keys", timeout=10)
    try:
        listed = json.loads(text)
        return [str(k) for k in (listed if isinstance(listed, list) else listed.get("keys", []))]
    except json.JSONDecodeError:
        return [line.strip() for line in text.replace(",", "\n").splitlines() if "@" in line]


def _flag_for(field: str, value: Any) -> str:
    if field == "world_size":
        return f"--world-size {value}"
    if field == "dtype":
        return f"--dtype {DTYPE_FLAG.get(value, value)}"
    if field == "tags":
        return " ".join(f"--tag {k}={v}" for k, v in value) if value else "drop --tag"
    return f"--vllm-hash-seed {value}"


def _describe(ws: int, dt: str, tags: tuple[tuple[str, str], ...]) -> str:
    t = ", tags " + "@".join(f"{k}%{v}" for k, v in tags) if tags else ", no tags"
    return f"world size {ws}, dtype {dt}{t}"


def diagnose(
    admin_url: str,
    model: str,
    world_size: int,
    dtype: str,
    tags: tuple[tuple[str, str], ...],
    start_label: str,
    chains: dict[str, set[str]],
    *,
    auto: bool = False,
) -> dict[str, Any]:
    """Explain a total miss from what the store does hold (the master's key listing): group the model's keys by
    (world size, dtype, tag set), count in each how many of this prompt's chunk hashes it holds under each candidate
    chain start, and name the closest group with the flags that would make it match."""
    try:
        keys = _list_keys(admin_url)
    except OSError as e:
        return {
            "available": False,
            "why": f"could not list the store's keys at {admin_url}: {e}",
            "hint": "pass --master-admin http://HOST:PORT (the master's metrics/admin port)",
        }
    parsed = [p for p in (parse_lmcache_key(k) for k in keys) if p is not None and p.layer_id is None]
    mine = [p for p in parsed if p.model == model]
    models = Counter(p.model for p in parsed)
    causes: list[str] = []
    groups_out: list[dict[str, Any]] = []
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
        groups: dict[tuple[int, str, tuple[tuple[str, str], ...]], list[Any]] = defaultdict(list)
        for p in mine:
            groups[(p.world_size, p.dtype, p.tags)].append(p)
        want = {"world_size": world_size, "dtype": dtype, "tags": tags}
        scored: list[tuple[bool, int, int, str, dict[str, Any]]] = []
        for (ws, dt, tg), members in groups.items():
            hexes = {p.chunk_hash for p in members}
            hits = {label: len(hexes & chain) for label, chain in chains.items()}
            best_label = max(hits, key=lambda lbl: (hits[lbl], lbl == start_label))
            diff = [f for f, v in (("world_size", ws), ("dtype", dt), ("tags", tg)) if want[f] != v]
            if hits[best_label] and best_label != start_label and not auto:
                diff.append("hash_start")  # under auto, the start is found once the other fields fit
            flags = [
                _flag_for(f, best_label if f == "hash_start" else {"world_size": ws, "dtype": dt, "tags": tg}[f])
                for f in diff
            ]
            g = {
                "world_size": ws,
                "dtype": dt,
                "tags": [f"{k}%{v}" for k, v in tg],
                "keys": len(members),
                "workers": sorted({p.worker_id for p in members}),
                "prompt_chunks_held": hits[best_label],
                "vllm_hash_seed": None if best_label == "none" else best_label,
                "differs_in": diff,
                "flags": flags,
            }
            groups_out.append(g)
            desc = _describe(ws, dt, tg)
            if hits[best_label] and best_label != "none":
                desc += f", vLLM hash seed {best_label}"
            scored.append((hits[best_label] > 0, -len(diff), len(members), desc, g))
        scored.sort(key=lambda s: s[:3], reverse=True)
        desc, best = scored[0][3], scored[0][4]
        if best["prompt_chunks_held"]:
            if not best["differs_in"]:
                causes.append(f"the keys match ({desc}) but none is held now")
            else:
                causes.append(
                    f"closest group: {desc} holds {best['prompt_chunks_held']} chunk(s) of this prompt "
                    f"({best['keys']} key(s)); pass {' and '.join(best['flags'])}"
                )
        else:
            tried = ", ".join(sorted(chains))
            causes.append(
                f"{best['keys']} chunk(s) of {model!r} are stored ({desc}"
                + (
                    f"; differs in {', '.join(best['differs_in'])}: {', '.join(best['flags'])}"
                    if best["differs_in"]
                    else ""
                )
                + "), but none with this prompt's chunk hashes under any chain start tried (vLLM hash seeds: "
                f"{tried}): a different prompt prefix, tokenizer or chunk size, or vLLM ran with another "
                "PYTHONHASHSEED (pass --vllm-hash-seed SEED) or with none (random: unreproducible)"
            )
        if len(groups) > 1:
            causes.append(
                f"keys of {model!r} are mixed: {len(groups)} groups ("
                + "; ".join(f"{d}: {g['keys']} key(s)" for _, _, _, d, g in scored)
                + ")"
            )
    return {
        "available": True,
        "keys_listed": len(keys),
        "keys_for_model": len(mine),
        "groups": groups_out,
        "causes": causes,
    }


__all__ = ["collect", "diagnose", "hash_starts", "liveness", "run"]
