"""The one check of an engine's tunable settings, shared by `bsr engine up` and ``POST /bsr/v1/settings``.

Every bound follows from the registration (the slot size: bytes of one chunk on one rank), the restore pool and
the prompt limit:

    slot ≤ budget B ≤ pool          B below one slot admits nothing; B above the pool promises bytes that do not exist
    RWS(W) ≤ pool  (W > 0)          a larger window could never be staged, whatever the budget
    RWS(W) ≤ B  (W > 0, at start)   `bsr engine up` also refuses a default W its own budget never admits (at run
                                    time B may be set for the W of particular requests, as the benchmarks do)
    W ≤ chunks of the longest prompt (a request's W, or one set at run time): a larger window holds nothing more
    1 ≤ fs_concurrency ≤ 256        loader threads per rank; more only adds threads, never bandwidth
    0 < fetch timeout ≤ 3600 s      finite: a NaN or negative deadline fails every restore
    1 ≤ max_tokens ≤ kv_tokens      the destination KV must hold the longest prompt
    1 ≤ store client TTL ≤ 1 day    whole seconds: how long the Mooncake master keeps a silent segment holder

The caller names each setting the way its user spells it (``--budget`` on the command line, ``budget_bytes`` in
the API), so the message names the thing to change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:  # annotations only: `bsr --help` reads this module's defaults without the registration's types
    from bsr_cli.core.registration import Registration

MAX_FS_CONCURRENCY = 256
MAX_FETCH_TIMEOUT_S = 3600.0

# How long the Mooncake master keeps a client (a segment holder among them) after its last heartbeat before it
# unmounts the client's segment and forgets every object on it (`mooncake_master --client_ttl`; bsr starts every
# master of its own with it). Mooncake's default, 10 s, is shorter than a holder starved of CPU or stopped on a busy
# host can miss, and the loss is silent: the holder lives on and mounts its segment again, empty. Clients beat every
# second and the master looks every second, so a holder stopped for N s survives a TTL above N + 2 s; 120 s covers a
# host's bad minute twice over. The cost: a holder that dies without refusing connections (its host is gone) keeps
# its segment listed, and its objects probed as held, for this long (docs/deployment.md, "The store's client TTL").
DEFAULT_STORE_CLIENT_TTL_S = 120
MOONCAKE_DEFAULT_CLIENT_TTL_S = 10  # the master's own, without --client_ttl
MAX_STORE_CLIENT_TTL_S = 86_400

# How the API spells each setting; the CLI passes its flag names instead.
API_NAMES: dict[str, str] = {
    "w": "W",
    "pool_bytes": "pool_bytes",
    "budget_bytes": "budget_bytes",
    "max_tokens": "max_tokens",
    "kv_tokens": "kv_tokens",
    "fs_concurrency": "fs_concurrency",
    "fetch_timeout_s": "fetch_timeout_s",
}


def check_client_ttl(seconds: Any, name: str = "the store's client TTL") -> int:
    """A client TTL a Mooncake master takes: whole seconds in [1, MAX_STORE_CLIENT_TTL_S]. InvalidInput otherwise."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MAX_STORE_CLIENT_TTL_S:
        raise InvalidInput(
            f"{name} must be whole seconds in [1, {MAX_STORE_CLIENT_TTL_S}], got {seconds!r}",
            hint=f"e.g. {DEFAULT_STORE_CLIENT_TTL_S}s (a holder stopped for N s needs more than N + 2)",
        )
    return seconds


def _int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInput(
            f"{name} must be an integer >= {minimum}, got {value!r}",
            hint=f"give {name} a whole number of at least {minimum}",
        )
    return value


def check_engine_settings(
    reg: Registration,
    *,
    w: Any,
    pool_bytes: Any,
    budget_bytes: Any,
    max_tokens: Any,
    kv_tokens: Any,
    fs_concurrency: Any,
    fetch_timeout_s: Any,
    names: Mapping[str, str] = API_NAMES,
    window_within_budget: bool = True,
) -> None:
    """Raise InvalidInput naming the first setting out of bounds; return None when all are consistent.

    ``pool_bytes`` None means a host that does not size its pool itself (the plugins): no pool bound is applied."""
    n = {**API_NAMES, **names}
    slot = reg.bytes_per_chunk
    w = _int(w, n["w"], 0)
    pool = None if pool_bytes is None else _int(pool_bytes, n["pool_bytes"], 1)
    budget = _int(budget_bytes, n["budget_bytes"], 1)
    max_t = _int(max_tokens, n["max_tokens"], 1)
    kv = _int(kv_tokens, n["kv_tokens"], 1)
    fsc = _int(fs_concurrency, n["fs_concurrency"], 1)
    if pool is not None and pool < slot:
        raise InvalidInput(
            f"{n['pool_bytes']} {pool:,} bytes cannot hold one chunk ({slot:,} bytes)",
            hint=f"give a pool of at least {slot:,} bytes ({n['pool_bytes']})",
        )
    if budget < slot:
        raise InvalidInput(
            f"{n['budget_bytes']} {budget:,} bytes is below one chunk slot ({slot:,} bytes): nothing could be admitted",
            hint=f"raise {n['budget_bytes']} to at least RWS(W), or lower {n['w']}",
        )
    if pool is not None and budget > pool:
        raise InvalidInput(
            f"{n['budget_bytes']} {budget:,} exceeds the pool capacity {pool:,}",
            hint=f"lower {n['budget_bytes']} to at most the pool, or raise {n['pool_bytes']}",
        )
    if w:
        rws = w * slot + reg.aux_bytes
        if pool is not None and rws > pool:
            raise InvalidInput(
                f"{n['w']} {w:,} needs RWS(W={w}) = {rws:,} bytes, more than the pool {pool:,}: no window could "
                f"ever be staged (the largest W this pool holds is {max((pool - reg.aux_bytes) // slot, 0):,})",
                hint=f"lower {n['w']} or raise {n['pool_bytes']}",
            )
        if window_within_budget and rws > budget:
            raise InvalidInput(
                f"{n['budget_bytes']} {budget:,} bytes is below RWS(W={w}) = {rws:,}: no window could ever be "
                f"admitted (the largest W this budget admits is {max((budget - reg.aux_bytes) // slot, 0):,})",
                hint=f"raise {n['budget_bytes']} to at least {rws:,} or lower {n['w']}",
            )
    if kv < max_t:
        raise InvalidInput(
            f"{n['kv_tokens']} must be at least {n['max_tokens']} ({kv:,} < {max_t:,})",
            hint=f"raise {n['kv_tokens']} or lower {n['max_tokens']}: the engine's KV must hold its longest prompt",
        )
    if fsc > MAX_FS_CONCURRENCY:
        raise InvalidInput(
            f"{n['fs_concurrency']} must be at most {MAX_FS_CONCURRENCY}, got {fsc:,}",
            hint=f"e.g. {n['fs_concurrency']} 8",
        )
    t = fetch_timeout_s
    if (
        isinstance(t, bool)
        or not isinstance(t, int | float)
        or not math.isfinite(t)
        or t <= 0
        or t > MAX_FETCH_TIMEOUT_S
    ):
        raise InvalidInput(
            f"{n['fetch_timeout_s']} must be a number of seconds in (0, {MAX_FETCH_TIMEOUT_S:.0f}], got {t!r}",
            hint=f"e.g. {n['fetch_timeout_s']} 10",
        )


def longest_prompt_chunks(reg: Registration, max_tokens: int) -> int:
    """The chunks of the engine's longest prompt: the most one window can hold."""
    return max(1, -(-max_tokens // reg.chunk_size))


def check_request_window(reg: Registration, w: int, max_tokens: int, name: str = "W") -> int:
    """A W given with a request or set at run time: at most the chunks of the engine's longest prompt (0: the whole
    plan at once). Raises InvalidInput for a larger one, however many digits it has."""
    most = longest_prompt_chunks(reg, max_tokens)
    if w > most:
        shown = f"{w:,}" if w.bit_length() <= 64 else f"a {w.bit_length()}-bit integer"
        raise InvalidInput(
            f"{name} {shown} is more than the {most:,} chunks of this engine's longest prompt ({max_tokens:,} "
            "tokens): a window never holds more",
            hint=f"give {name} at most {most:,} (0: the whole plan at once)",
        )
    return w
