"""Stock LMCache's side of `bsr bench trace`, run in the LMCache venv: a trace slice replayed through LMCache 0.5.6.

``python -m lmcache_bsr.trace_replay CASE.json`` builds the plugin host's ranks (one real LMCache engine per TP rank,
Mooncake as its remote backend, L1 of ``l1_bytes`` per rank, staging only) and replays the slice the way the
embedded engine's replay does (bsr_cli/bench/trace.py): every request from its own client thread at its sped-up
arrival time, at most ``max_clients`` in flight, its tokens synthesized from its block ids by the same function
(``core.trace.prompt_tokens``, same salt). Per request and on every rank at once, as the scheduler's path:

1. LMCache's own ``retrieve`` of the prompt (its lookup, then the whole found prefix staged in L1 and installed);
2. the rest of the prompt computed into the destination KV (bsr's synthetic model);
3. LMCache's ``store`` of the full chunks it did not load (the loaded prefix masked out, as vLLM's adapter
   does), waited for until Mooncake serves them, so a later request finds them.

Stock LMCache is not changed: no checksums, no bsr retrieve, no lower transfer priority; hot-cache write-back is
off and ``local_cpu`` is off (L1 is staging, every hit read from Mooncake), as in `bsr bench peer`. Measured: the
loaded tokens and seconds of each retrieve per rank, and LMCache's L1 allocator high-water per rank over the whole
replay (``PeakTracker``: retrieves and stores both stage there). With ``serial`` each rank's engine serves one
request at a time, as vLLM's worker thread calls LMCache; by default every client calls the engines itself.

Prints progress lines (``BSR-TRACE-PROGRESS <done>``) and one result line prefixed ``BSR-TRACE-RESULT``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from lmcache_bsr.peer import lmcache_config

if TYPE_CHECKING:
    from lmcache_bsr.host import HostConfig, ModelConfig
    from lmcache_bsr.peer import MasterAddress

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # keep Mooncake's transfer endpoint on loopback

RESULT_PREFIX = "BSR-TRACE-RESULT "
PROGRESS_PREFIX = "BSR-TRACE-PROGRESS "


class TraceRow(TypedDict):
    """One request of the slice: when it arrives (ms from the first), its length, the block ids it names."""

    arrival_ms: int
    input_length: int
    hash_ids: list[int]


class TraceCase(TypedDict):
    """The slice as `bsr bench trace` writes it for stock LMCache (bsr_cli/bench/trace.py)."""

    model: ModelConfig
    master: MasterAddress
    l1_bytes: int
    kv_tokens: int
    deadline_s: float
    max_clients: int
    serial: bool
    salt: int
    speedup: float
    block_tokens: int
    requests: list[TraceRow]


class RankRetrieve(TypedDict, total=False):
    """One rank's part of a request: the tokens LMCache's retrieve loaded, its seconds, what failed."""

    loaded: int
    seconds: float
    error: str


class RequestMeasure(TypedDict, total=False):
    """One request of the replay, as the result reports it (filled in as it goes)."""

    index: int
    arrival_s: float
    started_s: float
    loaded_by_rank: list[int]
    loaded_tokens: int
    restore_seconds: float
    error: str
    seconds: float


class ReplayResult(TypedDict):
    """The replay's measurement: each request's, and LMCache's L1 high-water per rank."""

    ok: bool
    requests: list[RequestMeasure]
    l1_peak_by_rank: dict[str, int]
    l1_capacity_bytes: int
    elapsed_s: float
    lmcache_version: str
    setup_seconds: NotRequired[float]


def host_config(case: TraceCase) -> HostConfig:
    mc = case["master"]
    deadline = float(case["deadline_s"])
    return {
        "model": case["model"].copy(),
        # As in `bsr bench peer`; stock LMCache stores and verifies no checksum.
        "lmcache": lmcache_config(mc, int(case["l1_bytes"]), deadline, checksums=False),
        "settings": {
            "w": 1,
            "tiers": ["mooncake"],
            "kv_tokens": int(case["kv_tokens"]),
            "faults_enabled": False,
        },
    }


class Blocks:
    """The destination KV's blocks, shared by the requests in flight (a request waits for its blocks, FIFO by
    nothing more than the condition's wake-up order; the wait is counted in its seconds, not its retrieve's)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))
        self.cond = threading.Condition()

    def take(self, n: int) -> list[int]:
        with self.cond:
            self.cond.wait_for(lambda: len(self.free) >= n)
            out, self.free = self.free[:n], self.free[n:]
            return out

    def give(self, blocks: list[int]) -> None:
        with self.cond:
            self.free.extend(blocks)
            self.cond.notify_all()


def replay(host: Any, case: TraceCase) -> ReplayResult:
    return _Replay(host, case).run()


class _Replay:
    """The slice replayed through the host's ranks: each request from a client thread at its arrival time, on every
    rank at once; its measurement in ``out``."""

    def __init__(self, host: Any, case: TraceCase) -> None:
        from bsr_cli.core.keys import chunk_hashes
        from bsr_cli.core.trace import TraceRequest, prompt_tokens
        from lmcache_bsr import _lmcache as lm
        from lmcache_bsr.peer import prefault

        self.lm, self.chunk_hashes = lm, chunk_hashes  # imported once, outside the timed retrieves
        self.ranks = [host.rank(r) for r in range(len(host.ranks))]
        for rk in self.ranks:
            prefault(rk)
        self.cs = host.reg.chunk_size
        self.bs = host.reg.groups[0].block_size
        salt, block_tokens, self.speedup = int(case["salt"]), int(case["block_tokens"]), float(case["speedup"])
        self.max_clients = int(case["max_clients"])
        self.reqs = [
            TraceRequest(int(r["arrival_ms"]), int(r["input_length"]), 0, tuple(int(x) for x in r["hash_ids"]))
            for r in case["requests"]
        ]
        self.prompts = [prompt_tokens(r, block_tokens, salt, i) for i, r in enumerate(self.reqs)]
        self.blocks = Blocks(int(case["kv_tokens"]) // self.bs)
        self.out: list[RequestMeasure] = [{"index": i} for i in range(len(self.reqs))]
        self.done = 0
        self.done_lock = threading.Lock()
        # ``serial``: each rank's engine serves one request at a time (retrieve, compute, store), as vLLM's worker
        # thread drives LMCache; the wait for the rank counts in the retrieve's seconds. Otherwise every client calls
        # the engines itself and retrieves overlap.
        self.rank_locks = {
            rk.rank: threading.Lock() if case.get("serial") else contextlib.nullcontext() for rk in self.ranks
        }
        self.origin = 0.0

    def run(self) -> ReplayResult:
        for rk in self.ranks:
            rk.tracker.reset()
        t_first = self.reqs[0].arrival_ms
        self.origin = time.monotonic()
        futures: list[Future[None]] = []
        with ThreadPoolExecutor(max_workers=self.max_clients, thread_name_prefix="stock-client") as pool:
            for i, r in enumerate(self.reqs):
                due = (r.arrival_ms - t_first) / 1000 / self.speedup
                delay = due - (time.monotonic() - self.origin)
                if delay > 0:
                    time.sleep(delay)  # pacing the arrivals, not synchronisation
                self.out[i]["arrival_s"] = round(due, 4)
                futures.append(pool.submit(self.one, i))
            for f in futures:
                f.result()
        return {
            "ok": True,
            "requests": self.out,
            "l1_peak_by_rank": {str(rk.rank): int(rk.tracker.peak) for rk in self.ranks},
            "l1_capacity_bytes": int(self.ranks[0].tracker.heap_bytes),
            "elapsed_s": round(time.monotonic() - self.origin, 3),
            "lmcache_version": self.lm.LMCACHE_VERSION,
        }

    def one(self, i: int) -> None:
        """Request ``i`` on every rank at once, in the destination KV's blocks it waits for."""
        toks = self.prompts[i]
        m = self.out[i]
        started = m["started_s"] = round(time.monotonic() - self.origin, 4)
        table = self.blocks.take(-(-len(toks) // self.bs))
        try:
            per_rank: list[RankRetrieve] = [{} for _ in self.ranks]
            threads = [
                threading.Thread(target=self.on_rank, args=(rk, toks, table, per_rank[k]), daemon=True)
                for k, rk in enumerate(self.ranks)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            loaded = m["loaded_by_rank"] = [int(p.get("loaded") or 0) for p in per_rank]
            m["loaded_tokens"] = min(loaded)
            m["restore_seconds"] = max(float(p.get("seconds") or 0.0) for p in per_rank)
            errors = [str(p["error"]) for p in per_rank if p.get("error")]
            if errors:
                m["error"] = errors[0]
        finally:
            self.blocks.give(table)
            m["seconds"] = round(time.monotonic() - self.origin - started, 4)
        with self.done_lock:
            self.done += 1
            print(f"{PROGRESS_PREFIX}{self.done}", flush=True)

    def on_rank(self, rk: Any, toks: list[int], table: list[int], into: RankRetrieve) -> None:
        t0 = time.perf_counter()
        with self.rank_locks[rk.rank]:
            self.work(rk, toks, table, into, t0)

    def work(self, rk: Any, toks: list[int], table: list[int], into: RankRetrieve, t0: float) -> None:
        """LMCache's retrieve of the prompt on one rank, the rest computed, then LMCache's store of what it lacked."""
        n, cs = len(toks), self.cs
        try:
            ret = self.lm.stock_retrieve(rk.engine, toks, kvcaches=rk.kvcaches, slot_mapping=rk.slots(table, n))
            loaded = int(ret.sum())
        except Exception as e:  # noqa: BLE001 - LMCache's failure is the measurement
            into.update(
                {"loaded": 0, "seconds": round(time.perf_counter() - t0, 4), "error": f"{type(e).__name__}: {e}"}
            )
            return
        into.update({"loaded": loaded, "seconds": round(time.perf_counter() - t0, 4)})
        try:
            hashes = self.chunk_hashes(toks, cs)
            rk.kv.prefill(hashes, n, loaded // cs, {rk.group: table})  # the rest, computed
            rk.store_tokens(toks, table, skip_chunks=loaded // cs)  # full chunks only: LMCache's default
        except Exception as e:  # noqa: BLE001 - a failed store is reported with the request
            into["error"] = f"store: {type(e).__name__}: {e}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lmcache_bsr.trace_replay CASE.json", file=sys.stderr)
        return 2
    case: TraceCase = json.loads(Path(argv[0]).read_text())
    host = None
    clean = True
    res: Mapping[str, object]
    try:
        from lmcache_bsr.host import LMCacheHost

        t0 = time.perf_counter()
        host = LMCacheHost(host_config(case))
        setup_s = round(time.perf_counter() - t0, 3)
        replayed = replay(host, case) | {"setup_seconds": setup_s}
        res = replayed
        # A retrieve that ran into LMCache's blocking timeout leaves its storage loop spinning on the allocator:
        # destroying that engine would wait forever, so such a process ends with os._exit after reporting.
        deadline = float(case["deadline_s"])
        clean = not any(float(r.get("restore_seconds") or 0.0) >= deadline for r in replayed["requests"])
    except Exception as e:  # noqa: BLE001 - reported to the parent as the replay's error
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    if not clean:
        sys.stderr.flush()
        os._exit(0)
    if host is not None:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
