"""Why a store probe matched nothing, from what the store does hold: the master's key listing, grouped by the
fields LMCache puts in a key besides the chunk hash (world size, dtype, tag set), each group scored by how many of
the prompt's chunk hashes it holds under each chain start, and the closest named with the flags that would ask for
its keys. Pure: the listing comes in as strings (bsr_cli.mooncake.store_probe reads it)."""

from __future__ import annotations

import shlex
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from bsr_cli.core.lmcache_keys import DTYPE_FLAG, ParsedKey, next_chunk_hash, parse_lmcache_key
from bsr_cli.core.store_match import KeyFormat
from bsr_cli.core.store_probe import Diagnosis, KeyFormatValue, KeyGroup

# A group of the store's keys for the model: the fields LMCache puts in a key besides the chunk hash.
_GroupKey = tuple[int, str, tuple[tuple[str, str], ...]]  # (world size, dtype, tags)
# A group's place in the ranking: holds the prompt, -(fields that differ), chunks held, keys, its description.
_Rank = tuple[bool, int, int, int, str]


def diagnose(
    keys: Sequence[str],
    fmt: KeyFormat,
    start_label: str,
    chains: Mapping[str, set[str]],
    *,
    auto: bool = False,
    tokens: Sequence[int] = (),
    chunk_size: int = 256,
) -> Diagnosis:
    """Explain a total miss from the store's ``keys``: group the model's keys by (world size, dtype, tag set), count
    in each how many of this prompt's chunk hashes (``chains``: hex, per chain start label) it holds under each
    candidate chain start (and whether it holds the prompt under a start no candidate gives), and rank the groups:
    the closest is the first (holds the prompt, then fewest differing fields, then most chunks, then most keys)."""
    model = fmt.model
    parsed = [p for p in (parse_lmcache_key(k) for k in keys) if p is not None and p.layer_id is None]
    mine = [p for p in parsed if p.model == model]
    models = Counter(p.model for p in parsed)
    causes: list[str] = []
    ranked: list[KeyGroup] = []
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
        groups: dict[_GroupKey, list[ParsedKey]] = defaultdict(list)
        for p in mine:
            groups[(p.world_size, p.dtype, p.tags)].append(p)
        want: _GroupKey = (fmt.world_size, fmt.dtype, fmt.tags)
        scored = [
            _score_group(group, members, want, chains, start_label, auto, tokens, chunk_size)
            for group, members in groups.items()
        ]
        # The diagnosis's ranking (ties broken by the description, never by the master's listing order).
        scored.sort(key=lambda s: (not s[0][0], -s[0][1], -s[0][2], -s[0][3], s[0][4]))
        ranked = [g for _, _, g in scored]
        causes.append(_closest_cause(scored[0][1], scored[0][2], model, chains))
        if len(groups) > 1:
            causes.append(
                f"keys of {model!r} are mixed: {len(groups)} groups ("
                + "; ".join(f"{d}: {g.keys} key(s)" for _, d, g in scored)
                + ")"
            )
    return Diagnosis(
        keys_listed=len(keys),
        keys_for_model=len(mine),
        groups=ranked,
        closest=0 if ranked else None,
        causes=causes,
    )


def changes_as_flags(changes: Mapping[str, KeyFormatValue]) -> list[str]:
    """The flags a diagnosis tells the user to pass (for its text; `explain` builds whole commands from them)."""
    out = []
    for field, value in changes.items():
        if field == "world_size":
            out.append(f"--world-size {value}")
        elif field == "dtype":
            out.append(f"--dtype {value}")
        elif field == "tags" and isinstance(value, list):
            out.append(" ".join(f"--tag {shlex.quote(t)}" for t in value) if value else "drop --tag")
        else:
            out.append(f"--vllm-hash-seed {value}")
    return out


def _describe(ws: int, dt: str, tags: tuple[tuple[str, str], ...]) -> str:
    t = ", tags " + "@".join(f"{k}%{v}" for k, v in tags) if tags else ", no tags"
    return f"world size {ws}, dtype {dt}{t}"


def unknown_start_chunks(members: Sequence[ParsedKey], tokens: Sequence[int], chunk_size: int) -> int:
    """How many leading chunks of this prompt a group holds under a chain start none of the candidates gives: a
    key whose next link (the prompt's second chunk hashed after it) is also in the group is the prompt's first
    chunk under that start. 0 when none is (or the prompt has fewer than two full chunks: nothing to confirm)."""
    if len(tokens) < 2 * chunk_size:
        return 0
    hexes = {p.chunk_hash for p in members}
    second = tuple(tokens[chunk_size : 2 * chunk_size])
    for p in members:
        try:
            h = int(p.chunk_hash, 16)
        except ValueError:
            continue
        if f"{next_chunk_hash(h, second):x}" not in hexes:
            continue
        held, prefix = 1, h
        for i in range(chunk_size, len(tokens) - chunk_size + 1, chunk_size):
            prefix = next_chunk_hash(prefix, tokens[i : i + chunk_size])
            if f"{prefix:x}" not in hexes:
                break
            held += 1
        return held
    return 0


def _score_group(
    group: _GroupKey,
    members: list[ParsedKey],
    want: _GroupKey,
    chains: Mapping[str, set[str]],
    start_label: str,
    auto: bool,
    tokens: Sequence[int],
    chunk_size: int,
) -> tuple[_Rank, str, KeyGroup]:
    """(its rank, its description, the group as the diagnosis reports it): how many of the prompt's chunks the group
    holds under its best chain start, and which flags would make the probe ask for its keys."""
    ws, dt, tg = group
    hexes = {p.chunk_hash for p in members}
    hits = {label: len(hexes & chain) for label, chain in chains.items()}
    best_label = max(hits, key=lambda lbl: (hits[lbl], lbl == start_label))
    diff = [f for f, mine, theirs in zip(("world_size", "dtype", "tags"), want, group, strict=True) if mine != theirs]
    if hits[best_label] and best_label != start_label and not auto:
        diff.append("hash_start")  # under auto, the start is found once the other fields fit
    unknown_start = 0 if hits[best_label] else unknown_start_chunks(members, tokens, chunk_size)
    changes: dict[str, KeyFormatValue] = {}
    for f in diff:
        if f == "world_size":
            changes[f] = ws
        elif f == "dtype":
            changes[f] = DTYPE_FLAG.get(dt, dt)
        elif f == "tags":
            changes[f] = [f"{k}={v}" for k, v in tg]
        else:
            changes["vllm_hash_seed"] = best_label
    g = KeyGroup(
        world_size=ws,
        dtype=dt,
        tags=[f"{k}%{v}" for k, v in tg],
        keys=len(members),
        workers=sorted({p.worker_id for p in members}),
        prompt_chunks_held=hits[best_label],
        vllm_hash_seed=None if best_label == "none" or not hits[best_label] else best_label,
        unknown_start_chunks=unknown_start,
        differs_in=diff,
        changes=changes,
        flags=changes_as_flags(changes),
    )
    desc = _describe(ws, dt, tg)
    if hits[best_label] and best_label != "none":
        desc += f", vLLM hash seed {best_label}"
    held_any = hits[best_label] or unknown_start
    return (bool(held_any), -len(diff), hits[best_label] or unknown_start, len(members), desc), desc, g


def _closest_cause(desc: str, best: KeyGroup, model: str, chains: Mapping[str, set[str]]) -> str:
    """Why the closest group (described by ``desc``) did not answer the probe, and the flags that would fix it."""
    if best.prompt_chunks_held:
        if not best.differs_in:
            return f"the keys match ({desc}) but none is held now"
        return (
            f"closest group: {desc} holds {best.prompt_chunks_held} chunk(s) of this prompt "
            f"({best.keys} key(s)); pass {' and '.join(best.flags)}"
        )
    if best.unknown_start_chunks:
        tried = ", ".join(sorted(x for x in chains if x != "none"))
        return (
            f"{desc} holds {best.unknown_start_chunks} chunk(s) of this prompt under a hash chain start that "
            f"none of the vLLM hash seeds tried gives ({tried}; and no vLLM): vLLM ran with another "
            "PYTHONHASHSEED (pass --vllm-hash-seed SEED with the seed it ran with) or with none (random: "
            "unreproducible)" + (f", and {' and '.join(best.flags)}" if best.flags else "")
        )
    tried = ", ".join(sorted(chains))
    return (
        f"{best.keys} chunk(s) of {model!r} are stored ({desc}"
        + (f"; differs in {', '.join(best.differs_in)}: {', '.join(best.flags)}" if best.differs_in else "")
        + "), but none with this prompt's chunk hashes under any chain start tried (vLLM hash seeds: "
        f"{tried}): a different prompt prefix, tokenizer or chunk size, or vLLM ran with another "
        "PYTHONHASHSEED (pass --vllm-hash-seed SEED) or with none (random: unreproducible)"
    )
