"""The scheduler side of the BSR runtime: discovery, admission, the commit rule, force-local markers, faults.

Engine-agnostic: it drives TP ranks through the small `RankClient` interface (the embedded engine's ranks are
processes behind pipes; a plugin's ranks can be in-process objects) and never touches tensors itself.

A request's life, as a scheduler admits it (``submit``):

1. probe-only lookup on every rank → hit bitmap (rank × group × chunk × tier); the external prefix is what every
   rank and group holds in a tier not excluded by a force-local marker;
2. destination blocks are allocated for the whole prompt (the same block ids on every rank);
3. the external prefix is restored in windows of at most W chunks on every rank; the commit rule (every rank and
   every group valid) decides; any invalid cell collapses the external prefix to zero, every block of the request
   is invalidated, and a force-local marker excludes the failed tiers from the next pass;
4. the next pass re-runs admission without those tiers: a lower tier that holds the whole prefix, else local
   recompute. A successful admission clears the marker;
5. the rest of the prompt is computed locally and stored to the tiers that lack it; the output hash is taken.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

from bsr_cli import API_VERSION, __version__
from bsr_cli.core import accounting
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.commit import COMMITTED, FAILED_CLOSED, NOTHING_TO_RESTORE, commit_prefix
from bsr_cli.core.keys import chunk_hashes, object_key, prompt_hash
from bsr_cli.core.markers import Marker
from bsr_cli.core.plan import windows_for
from bsr_cli.core.registration import Registration
from bsr_cli.errors import BadRequest, CapacityError, FaultsDisabled, InvalidInput, ServerError
from bsr_cli.runtime import failures
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.faults import FaultSpec

MAX_PASSES = 3  # remote → lower tier → recompute
HEALTH_WAIT_S = 0.5  # how long /health waits for the ranks' view of their tiers (older answers fill in)
POLL_S = 0.1  # how often a wait on ranks checks their heartbeats and progress
TIER_FAILURE_TTL_S = 300.0  # a tier's real failure keeps it unhealthy this long unless a success clears it first
# Rank events that count as progress of a restore on that rank (window_waiting: blocked on admission).
PROGRESS_EVENTS = frozenset({"window_waiting", "window_fetched", "window_installed", "window_released"})


class RankUnresponsive(ServerError):
    """A rank stopped answering: no heartbeat, or no progress on a call within its deadline."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(
            f"rank {rank} is not responding: {reason}",
            hint="`bsr status` shows the rank's health; a stopped or hung rank process must be resumed or restarted",
        )
        self.rank = rank
        self.reason = reason


class RankClient(Protocol):
    rank: int

    def submit(self, op: str, **args: Any) -> Future[Any]: ...

    def abort(self, request: str) -> None: ...

    def alive(self) -> bool: ...

    # Optional: ``heartbeat_age() -> float``, seconds since the rank last showed a sign of life (a rank in another
    # process beats on its own). Rank clients without it (in-process ranks) are judged by progress alone.


@dataclass
class EngineSettings:
    w: int = 32
    tiers: tuple[str, ...] = ("mooncake", "fs")
    max_tokens: int = 131_072
    kv_tokens: int = 262_144
    pool_bytes: int = 0
    budget_bytes: int = 0
    fetch_timeout_s: float = 10.0
    admit_timeout_s: float = 60.0
    call_timeout_s: float = 120.0
    faults_enabled: bool = False
    fs_concurrency: int = 1
    name: str = "embedded"
    tokenizer: str = "bytes"  # how the host turns text into token ids (reported so clients can match it)


class BlockAllocator:
    """One group's block pool: the same block ids are used on every rank, as vLLM's scheduler does."""

    def __init__(self, group: str, num_blocks: int) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self._free = deque(range(num_blocks))
        self._lock = threading.Lock()

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise CapacityError(
                    f"KV group {self.group}: {n} blocks needed, {len(self._free)} free of {self.num_blocks}",
                    hint="wait for running requests to finish, or start the engine with more --kv-tokens",
                )
            return [self._free.popleft() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(ids)

    @property
    def free_blocks(self) -> int:
        return len(self._free)


class Coordinator:
    def __init__(self, reg: Registration, ranks: Sequence[RankClient], settings: EngineSettings, events: EventLog):
        if len(ranks) != reg.tp_size:
            raise InvalidInput(f"registration has tp_size {reg.tp_size} but {len(ranks)} ranks were given")
        self.reg = reg
        self.ranks = list(ranks)
        self.settings = settings
        self.events = events
        self.started_at = time.time()
        self.allocators = {g.name: BlockAllocator(g.name, -(-settings.kv_tokens // g.block_size)) for g in reg.groups}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.markers: dict[str, Marker] = {}
        self.faults: list[FaultSpec] = []
        self.active: dict[str, dict[str, Any]] = {}
        self._open_requests: set[str] = set()  # accepted and not yet finished (abortable)
        self.recent: deque[dict[str, Any]] = deque(maxlen=50)
        self._rate: dict[int, deque[tuple[float, int]]] = {r.rank: deque(maxlen=4096) for r in ranks}
        self._waiting = 0
        # Liveness: per (request, rank) the time and kind of the last progress event of a running restore; the
        # last fault seen on each rank; per request the rank calls still running after it was failed (its blocks
        # stay allocated until they return, so a late install can never land in another request's blocks).
        self._progress: dict[tuple[str, int], tuple[float, str]] = {}
        self.rank_faults: dict[int, dict[str, Any]] = {}
        self._stuck: dict[int, set[str]] = {}
        self._outstanding: dict[str, list[Future[Any]]] = {}
        # Tier health from real restores: the last failure per tier, cleared by a later committed restore from it.
        self.tier_failures: dict[str, dict[str, Any]] = {}
        # Each rank's last answer about its tiers (for a quick /health), and the ranks asked and not answered yet.
        self._tier_views: dict[int, tuple[float, dict[str, Any]]] = {}
        self._tier_asks: set[int] = set()

    # -- small helpers -----------------------------------------------------------------------------------------
    @property
    def stall_s(self) -> float:
        """A rank silent this long (no heartbeat) is stalled: derived from the fetch timeout, at least 1 s."""
        return max(1.0, float(self.settings.fetch_timeout_s))

    def _silent(self, r: RankClient) -> str | None:
        """Why rank ``r`` cannot answer now (dead, or no heartbeat for longer than stall_s), or None."""
        if not r.alive():
            return "its process is not running"
        age_fn = getattr(r, "heartbeat_age", None)
        age = age_fn() if age_fn is not None else None
        if age is not None and age > self.stall_s:
            return f"no heartbeat for {age:.1f}s (process stopped or hung)"
        return None

    def _rank_fault(self, rank: int, reason: str, request: str | None = None) -> None:
        with self._lock:
            self.rank_faults[rank] = {"reason": reason, "request": request, "at": time.time()}
        self.events.append({"type": "rank_unresponsive", "rank": rank, "reason": reason, "request": request})

    def _gather(self, futures: Sequence[Future[Any]], timeout_s: float, what: str) -> list[Any]:
        """Every rank's answer to one call, failing fast (RankUnresponsive) when a rank stops beating instead of
        waiting out the whole deadline."""
        deadline = time.monotonic() + timeout_s
        pending = [f for f in futures if not f.done()]
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                r = next(r for r, f in zip(self.ranks, futures, strict=True) if not f.done())
                reason = f"did not answer {what} within {timeout_s:.0f}s"
                self._rank_fault(r.rank, reason)
                raise RankUnresponsive(r.rank, reason)
            wait(pending, timeout=min(POLL_S, left), return_when=FIRST_COMPLETED)
            pending = [f for f in pending if not f.done()]
            for r, f in zip(self.ranks, futures, strict=True):
                why = None if f.done() else self._silent(r)
                if why:
                    self._rank_fault(r.rank, f"{why} during {what}")
                    raise RankUnresponsive(r.rank, f"{why} during {what}")
        return [f.result() for f in futures]

    def _all(self, op: str, timeout_s: float | None = None, **args: Any) -> list[Any]:
        futures = [r.submit(op, **args) for r in self.ranks]
        return self._gather(futures, timeout_s or self.settings.call_timeout_s, op)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids):05d}"

    def check_tokens(self, tokens: Sequence[int]) -> None:
        if not tokens:
            raise BadRequest("the prompt is empty")
        if len(tokens) > self.settings.max_tokens:
            raise BadRequest(
                f"prompt of {len(tokens):,} tokens exceeds this engine's limit of {self.settings.max_tokens:,}",
                hint="start the engine with a larger --max-tokens",
            )

    # -- discovery ---------------------------------------------------------------------------------------------
    def probe(self, tokens: Sequence[int], hashes: list[str] | None = None) -> tuple[HitBitmap, dict[str, Any]]:
        """Probe-only lookup on every rank: the complete hit bitmap; no object bytes move, nothing stays pinned."""
        self.check_tokens(tokens)
        hashes = hashes or chunk_hashes(tokens, self.reg.chunk_size)
        answers = self._all("probe", hashes=hashes, tiers=list(self.settings.tiers))
        rows = {
            (r.rank, g): a["rows"][g] for r, a in zip(self.ranks, answers, strict=True) for g in self.reg.group_names
        }
        errors = {f"rank{r.rank}": a["errors"] for r, a in zip(self.ranks, answers, strict=True) if a["errors"]}
        bitmap = HitBitmap(
            tiers=self.settings.tiers,
            ranks=len(self.ranks),
            groups=self.reg.group_names,
            tokens=len(tokens),
            chunk_size=self.reg.chunk_size,
            rows=rows,
            registration=self.reg.identity,
            model=self.reg.model,
        )
        return bitmap, errors

    # -- restore -----------------------------------------------------------------------------------------------
    def _objects_for(self, bitmap: HitBitmap, rank: int, k: int, exclude: set[str], hashes: list[str]) -> dict:
        cs = self.reg.chunk_size
        out: dict[str, list[tuple[str, str, int]]] = {}
        for g in self.reg.group_names:
            bpt = self.reg.group_bytes_per_chunk(g) // cs
            objs = []
            for c in range(k):
                tier = bitmap.choose_tier(rank, g, c, exclude)
                n = min((c + 1) * cs, bitmap.tokens) - c * cs
                objs.append((object_key(self.reg, rank, g, hashes[c]), tier or "", n * bpt))
            out[g] = objs
        return out

    def _restore_external(
        self,
        request: str,
        bitmap: HitBitmap,
        hashes: list[str],
        exclude: set[str],
        w: int,
        block_tables: dict[str, list[int]],
        prompt: str = "",
    ) -> dict[str, Any]:
        k = bitmap.prefix_chunks(exclude)
        ext_tokens = bitmap.prefix_tokens(exclude)
        windows = windows_for(self.reg, w, k, ext_tokens)
        tiers_used: set[str] = set()
        objects = {}
        for r in self.ranks:
            objects[r.rank] = self._objects_for(bitmap, r.rank, k, exclude, hashes)
            tiers_used |= {o[1] for objs in objects[r.rank].values() for o in objs}
        with self._lock:
            faults = [f.to_dict() for f in self.faults if not f.exhausted()]
        started = time.monotonic()
        state = {
            "request": request,
            "W": w,
            "windows": len(windows),
            "tokens": ext_tokens,
            "tiers": sorted(tiers_used),
            "started": time.time(),
            "done": {r.rank: 0 for r in self.ranks},
            "bytes": {r.rank: 0 for r in self.ranks},
        }
        with self._lock:
            self.active[request] = state
        self.events.append(
            {
                "type": "restore_started",
                "request": request,
                "prompt": prompt,
                "W": w,
                "windows": len(windows),
                "tokens": ext_tokens,
                "tiers": sorted(tiers_used),
            }
        )
        futures = []
        for r in self.ranks:
            job = {
                "request_id": request,
                "w": w,
                "windows": [
                    {
                        "index": win.index,
                        "chunk_start": win.chunk_start,
                        "chunk_end": win.chunk_end,
                        "token_start": win.token_start,
                        "token_end": win.token_end,
                        "blocks": {b.group: (b.start, b.end) for b in win.blocks},
                    }
                    for win in windows
                ],
                "objects": {str(r.rank): objects[r.rank]},
                "block_tables": block_tables,
                "faults": faults,
                "fetch_timeout_s": self.settings.fetch_timeout_s,
                "admit_timeout_s": self.settings.admit_timeout_s,
            }
            futures.append(r.submit("restore", job=job))
        try:
            outcomes = self._await_restore(request, futures)
        finally:
            with self._lock:
                self.active.pop(request, None)
                for r in self.ranks:
                    self._progress.pop((request, r.rank), None)
        validity = {(o["rank"], g): v for o in outcomes for g, v in o["valid"].items()}
        decision = commit_prefix(ext_tokens, validity, [r.rank for r in self.ranks], self.reg.group_names)
        fired = {fid for o in outcomes for fid in o["fired_faults"]}
        if fired:
            with self._lock:
                self.faults = [f.after_firing() if f.id in fired else f for f in self.faults]
                self.faults = [f for f in self.faults if not f.exhausted()]
        seconds = time.monotonic() - started
        total_bytes = sum(o["bytes_restored"] for o in outcomes)
        fails = [
            {
                "rank": o["rank"],
                "window": o["failed_window"],
                "reason": o["reason"],
                "kind": o.get("kind") or failures.TIER,
                "tier": o.get("tier"),
            }
            for o in outcomes
            if not o["ok"]
        ]
        kind = None if decision.committed_tokens else (failures.classify(fails) or failures.TIER)
        blamed = failures.blamed_tiers(kind, fails, sorted(tiers_used))
        hint = None
        if kind == failures.CAPACITY:
            first = next(f for f in fails if f["kind"] == failures.CAPACITY)
            hint = failures.capacity_hint(
                first["reason"],
                w=w,
                slot_bytes=self.reg.bytes_per_chunk,
                budget_bytes=self.settings.budget_bytes,
                pool_bytes=self.settings.pool_bytes,
            )
        self._note_tier_health(decision.committed_tokens > 0, tiers_used, blamed, fails, request, bool(fired))
        result = {
            "request": request,
            "W": w,
            "tiers": sorted(tiers_used),
            "advertised_tokens": ext_tokens,
            "committed_tokens": decision.committed_tokens,
            "outcome": COMMITTED if decision.committed_tokens else FAILED_CLOSED,
            "invalid": [{"rank": r, "group": g} for r, g in decision.invalid],
            "failures": fails,
            "failure_kind": kind,
            "blamed_tiers": sorted(blamed),
            "hint": hint,
            "windows": len(windows),
            "chunks": k,
            "seconds": seconds,
            "bytes": total_bytes,
            "gbps": total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "ranks": outcomes,
            "rws_bytes": accounting.rws_bytes(self.reg, w) if w else None,
            "whole_plan_bytes": accounting.whole_plan_bytes(self.reg, k),
            "fired_faults": sorted(fired),
        }
        self.events.append(
            {
                "type": "restore_committed" if decision.committed_tokens else "restore_failed_closed",
                "request": request,
                "committed_tokens": decision.committed_tokens,
                "advertised_tokens": ext_tokens,
                "failures": fails,
                "failure_kind": kind,
                "seconds": seconds,
            }
        )
        with self._lock:
            self.recent.appendleft(
                {
                    "request": request,
                    "outcome": result["outcome"],
                    "tokens": ext_tokens,
                    "W": w,
                    "tiers": sorted(tiers_used),
                    "seconds": seconds,
                    "finished": time.time(),
                    "reason": fails[0]["reason"] if fails else "",
                    "failure_kind": kind,
                }
            )
        return result

    def _await_restore(self, request: str, futures: Sequence[Future[Any]]) -> list[dict[str, Any]]:
        """Every rank's restore outcome, with liveness: a rank that stops beating, or makes no progress within
        its window deadline (derived from the fetch timeout), fails the restore as a rank fault within seconds.
        Then every rank is told to abort; a call that is still running keeps its blocks allocated (see
        _release_tables)."""
        start = time.monotonic()
        with self._lock:
            for r in self.ranks:
                self._progress[(request, r.rank)] = (start, "started")
        by_rank = {r.rank: r for r in self.ranks}
        pending = {r.rank: f for r, f in zip(self.ranks, futures, strict=True)}
        outcomes: dict[int, dict[str, Any]] = {}
        stalled: dict[int, str] = {}
        while pending and not stalled:
            wait(list(pending.values()), timeout=POLL_S, return_when=FIRST_COMPLETED)
            for rk, f in list(pending.items()):
                if f.done():
                    del pending[rk]
                    try:
                        outcomes[rk] = f.result()
                    except Exception as e:  # noqa: BLE001 - a rank whose call broke is a rank fault
                        stalled[rk] = f"its restore call failed: {e}"
            now = time.monotonic()
            for rk in pending:
                why = self._silent(by_rank[rk]) or self._overdue(request, rk, now)
                if why:
                    stalled[rk] = why
        if not stalled:
            return [outcomes[r.rank] for r in self.ranks]
        for r in self.ranks:
            r.abort(request)
        for rk, why in stalled.items():
            self._rank_fault(rk, why, request)
        # The healthy ranks end their own restore fail-closed (abort); give them a short grace to say so.
        grace_end = time.monotonic() + min(5.0, self.stall_s)
        for rk, f in list(pending.items()):
            if rk in stalled:
                continue
            wait([f], timeout=max(0.0, grace_end - time.monotonic()))
            if f.done():
                del pending[rk]
                try:
                    outcomes[rk] = f.result()
                except Exception as e:  # noqa: BLE001 - as above
                    stalled[rk] = f"its restore call failed: {e}"
        for rk, f in pending.items():
            self._quarantine(request, rk, f)
        elapsed = time.monotonic() - start
        for rk in by_rank:
            if rk not in outcomes or rk in stalled:
                why = stalled.get(rk) or f"still running after rank(s) {sorted(stalled)} stopped responding"
                outcomes[rk] = {
                    "rank": rk,
                    "ok": False,
                    "valid": dict.fromkeys(self.reg.group_names, False),
                    "windows_done": 0,
                    "bytes_restored": 0,
                    "seconds": elapsed,
                    "reason": why,
                    "failed_window": None,
                    "fired_faults": [],
                    "fetch_seconds": 0.0,
                    "install_seconds": 0.0,
                    "peak_live_bytes": 0,
                    "kind": failures.RANK if rk in stalled else failures.ABORTED,
                    "tier": None,
                }
        return [outcomes[r.rank] for r in self.ranks]

    def _overdue(self, request: str, rank: int, now: float) -> str | None:
        """The per-window progress deadline: 2 × the fetch timeout since the rank's last progress (plus the
        admission deadline while it waits for budget), else the rank is stalled."""
        with self._lock:
            at, what = self._progress.get((request, rank), (now, ""))
        limit = 2 * self.settings.fetch_timeout_s + (self.settings.admit_timeout_s if what == "window_waiting" else 0)
        if now - at > limit:
            return f"no restore progress for {now - at:.1f}s (window deadline {limit:g}s)"
        return None

    def _quarantine(self, request: str, rank: int, fut: Future[Any]) -> None:
        """A rank call still running after its restore was failed: the rank is unhealthy until it returns, and
        the request's blocks are not reused before then."""
        with self._lock:
            self._outstanding.setdefault(request, []).append(fut)
            self._stuck.setdefault(rank, set()).add(request)

        def done(_: Future[Any]) -> None:
            with self._lock:
                self._stuck.get(rank, set()).discard(request)

        fut.add_done_callback(done)

    def _release_tables(self, request: str, tables: dict[str, list[int]]) -> None:
        """Free a request's blocks now, or once the last of its quarantined rank calls has returned."""
        with self._lock:
            left = [f for f in self._outstanding.pop(request, []) if not f.done()]
        if not left:
            self._free(tables)
            return
        remaining = [len(left)]
        gate = threading.Lock()

        def done(_: Future[Any]) -> None:
            with gate:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._free(tables)

        for f in left:
            f.add_done_callback(done)

    def _note_tier_health(
        self,
        committed: bool,
        used: set[str],
        blamed: set[str],
        fails: list[dict[str, Any]],
        request: str,
        injected: bool = False,
    ) -> None:
        with self._lock:
            if committed:
                for t in used:
                    self.tier_failures.pop(t, None)
                return
            for t in blamed:
                f = next((x for x in fails if x.get("tier") == t), fails[0] if fails else {})
                self.tier_failures[t] = {
                    "reason": f.get("reason", ""),
                    "rank": f.get("rank"),
                    "request": request,
                    "at": time.time(),
                    "injected": injected,  # an armed fault fired: forgotten when the operator clears faults
                }

    def rank_health(self) -> list[dict[str, Any]]:
        """Per rank: healthy when its process runs, it beats, and no call of it is stuck past its deadline."""
        out = []
        for r in self.ranks:
            why = self._silent(r)
            with self._lock:
                stuck = sorted(self._stuck.get(r.rank, ()))
                last = self.rank_faults.get(r.rank)
            if why is None and stuck:
                why = f"restore of {', '.join(stuck)} still running past its deadline"
            age_fn = getattr(r, "heartbeat_age", None)
            out.append(
                {
                    "rank": r.rank,
                    "healthy": why is None,
                    "alive": r.alive(),
                    "heartbeat_age_s": round(age_fn(), 3) if age_fn is not None else None,
                    "reason": why,
                    "last_fault": last,
                }
            )
        return out

    def health(self) -> dict[str, Any]:
        """What /health answers: ``ok`` when every rank is healthy (the engine can serve); ``degraded`` names
        the tiers that are not (the engine still serves, from a lower tier or by recomputing)."""
        ranks = self.rank_health()
        tiers = self._tier_health(self._rank_tier_views(HEALTH_WAIT_S))
        return {
            "ok": all(r["healthy"] for r in ranks),
            "ranks_alive": [r["alive"] for r in ranks],
            "ranks": ranks,
            "unhealthy_ranks": [r["rank"] for r in ranks if not r["healthy"]],
            "tiers": tiers,
            "degraded_tiers": sorted(t for t, v in tiers.items() if not v["ok"]),
        }

    def _rank_tier_views(self, wait_s: float) -> list[dict[str, Any]]:
        """Each rank's own view of its tiers, for /health, which must stay quick: ask every rank that beats (one
        question in flight per rank), wait at most ``wait_s``, and use the freshest answer from the last 30 s
        (a slow answer lands in the cache for the next call)."""
        futures = []
        for r in self.ranks:
            with self._lock:
                busy = r.rank in self._tier_asks
            if busy or not r.alive() or self._silent(r) is not None:
                continue
            fut = r.submit("stats", health=True)
            with self._lock:
                self._tier_asks.add(r.rank)
            fut.add_done_callback(functools.partial(self._keep_tier_view, r.rank))
            futures.append(fut)
        if futures:
            wait(futures, timeout=wait_s)
        now = time.monotonic()
        with self._lock:
            return [
                {"rank": rk, "tiers": tiers} for rk, (at, tiers) in sorted(self._tier_views.items()) if now - at <= 30
            ]

    def _keep_tier_view(self, rank: int, fut: Future[Any]) -> None:
        with self._lock:
            self._tier_asks.discard(rank)
            if fut.exception() is None:
                self._tier_views[rank] = (time.monotonic(), dict(fut.result().get("tiers") or {}))

    def _tier_health(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """Per tier ``{"ok", "detail"}``: what each rank sees of it (``pool(health=True)``) joined with what the
        coordinator knows (armed faults, recent real failures)."""
        tiers: dict[str, Any] = {}
        for r in ranks:
            for name, h in (r.get("tiers") or {}).items():
                t = tiers.setdefault(name, {"ok": True, "detail": []})
                t["ok"] = t["ok"] and h["ok"]
                if not h["ok"]:
                    t["detail"].append(f"rank{r['rank']}: {h['detail']}")
        for name, why in self._tier_flags().items():
            t = tiers.setdefault(name, {"ok": True, "detail": []})
            if why:
                t["ok"] = False
                t["detail"].extend(why)
        return tiers

    def _tier_flags(self) -> dict[str, list[str]]:
        """Per tier, what the coordinator itself knows makes it unhealthy: armed faults that take it down, and
        a recent real failure that no committed restore from it has cleared since."""
        now = time.time()
        with self._lock:
            armed = [f for f in self.faults if not f.exhausted()]
            recent = {t: dict(v) for t, v in self.tier_failures.items() if now - v["at"] <= TIER_FAILURE_TTL_S}
        out: dict[str, list[str]] = {t: [] for t in self.settings.tiers}
        for f in armed:
            for t in f.tiers_affected():
                out.setdefault(t, []).append(f"fault #{f.id} {f.kind} armed")
        for t, v in recent.items():
            out.setdefault(t, []).append(
                f"restore from it failed {now - v['at']:.0f}s ago on rank {v['rank']}: {v['reason']}"
            )
        return out

    def on_rank_event(self, ev: dict[str, Any]) -> None:
        """Rank progress: update the live view, then log it."""
        if ev.get("type") in PROGRESS_EVENTS:
            key = (str(ev.get("request", "")), int(ev.get("rank", -1)))
            with self._lock:
                if key in self._progress:
                    self._progress[key] = (time.monotonic(), str(ev["type"]))
        if ev.get("type") == "window_released":
            with self._lock:
                st = self.active.get(ev.get("request", ""))
                if st is not None:
                    st["done"][ev["rank"]] = st["done"].get(ev["rank"], 0) + 1
                    st["bytes"][ev["rank"]] = st["bytes"].get(ev["rank"], 0) + ev.get("bytes", 0)
                self._rate.setdefault(ev["rank"], deque(maxlen=4096)).append((time.monotonic(), ev.get("bytes", 0)))
        self.events.append(ev)

    # -- markers -----------------------------------------------------------------------------------------------
    def _set_marker(self, prompt: str, tiers: set[str], reason: str, request: str) -> Marker:
        with self._lock:
            m = self.markers.get(prompt)
            if m is None:
                m = self.markers[prompt] = Marker(prompt, set(tiers), reason, request)
            else:
                m.excluded |= tiers
                m.reason = reason
        self.events.append(
            {
                "type": "marker_set",
                "request": request,
                "prompt": prompt,
                "excluded_tiers": sorted(m.excluded),
                "reason": reason,
            }
        )
        return m

    def _clear_marker(self, prompt: str, request: str, why: str) -> bool:
        with self._lock:
            m = self.markers.pop(prompt, None)
        if m is not None:
            self.events.append({"type": "marker_cleared", "request": request, "prompt": prompt, "why": why})
        return m is not None

    def clear_markers(self) -> int:
        with self._lock:
            n = len(self.markers)
            prompts = list(self.markers)
            self.markers.clear()
        for p in prompts:
            self.events.append({"type": "marker_cleared", "prompt": p, "why": "operator"})
        return n

    # -- requests ----------------------------------------------------------------------------------------------
    def _allocate(self, n_tokens: int) -> dict[str, list[int]]:
        tables: dict[str, list[int]] = {}
        try:
            for g in self.reg.groups:
                tables[g.name] = self.allocators[g.name].allocate(-(-n_tokens // g.block_size))
        except CapacityError:
            self._free(tables)
            raise
        return tables

    def _free(self, tables: dict[str, list[int]]) -> None:
        for g, ids in tables.items():
            self.allocators[g].free(ids)

    def _combined_hash(self, per_rank: Sequence[dict[str, str]]) -> str:
        h = hashlib.sha256()
        for r, groups in enumerate(per_rank):
            for g in self.reg.group_names:
                h.update(f"{r}:{g}:{groups[g]};".encode())
        return h.hexdigest()[:32]

    def _open(
        self,
        tokens: Sequence[int],
        w: int | None,
        request: str | None,
        progress: Callable[[dict[str, Any]], None] | None,
    ) -> tuple[int, str, str, list[str], Callable[[], None]]:
        """What every request starts with: a checked prompt, its W, id, prompt hash, chunk hashes, and the
        progress listener (with the function that removes it)."""
        self.check_tokens(tokens)
        w = self.settings.w if w is None else accounting.check_window(w)
        request = request or self.new_request_id()
        unlisten = self.events.listen(request, progress) if progress else (lambda: None)
        # Open from acceptance (the client learns the id then) to the end: an abort in between, before its
        # windows start, still ends it fail-closed (each rank keeps the abort for the job that follows).
        with self._lock:
            self._open_requests.add(request)

        def stop() -> None:
            unlisten()
            with self._lock:
                self._open_requests.discard(request)

        return w, request, prompt_hash(tokens), chunk_hashes(tokens, self.reg.chunk_size), stop

    def submit(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        store: bool = True,
        progress: Callable[[dict[str, Any]], None] | None = None,
        request: str | None = None,
    ) -> dict[str, Any]:
        """Admit a prompt as the scheduler would: restore the external prefix (with fallback), compute the rest."""
        w, request, prompt, hashes, stop = self._open(tokens, w, request, progress)
        started = time.monotonic()
        tables = self._allocate(len(tokens))
        passes: list[dict[str, Any]] = []
        try:
            self.events.append(
                {"type": "request_admitted", "request": request, "prompt": prompt, "tokens": len(tokens)}
            )
            marker = self.markers.get(prompt)
            exclude = set(marker.excluded) if marker else set()
            marker_history = [{"pass": 0, "marker": marker.to_dict()}] if marker else []
            committed, source = 0, "recompute"
            bitmap: HitBitmap | None = None
            for pass_no in range(1, MAX_PASSES + 1):
                bitmap, tier_errors = self.probe(tokens, hashes)
                ext = bitmap.prefix_tokens(exclude)
                entry: dict[str, Any] = {
                    "pass": pass_no,
                    "excluded_tiers": sorted(exclude),
                    "external_tokens": ext,
                    "tier_errors": tier_errors,
                }
                passes.append(entry)
                if ext == 0:
                    break
                res = self._restore_external(request, bitmap, hashes, exclude, w, tables, prompt)
                entry["restore"] = res
                if res["committed_tokens"]:
                    committed, source = res["committed_tokens"], "+".join(res["tiers"])
                    break
                # Fail closed: every block of the request is invalid now (each rank scrubbed its own). Only a tier
                # fault sets a marker (the next pass skips that tier); a stalled rank ends the request; a capacity
                # refusal or an abort blames no tier: the rest is computed locally.
                entry["failure_kind"] = res["failure_kind"]
                if res["failure_kind"] == failures.RANK:
                    bad = next(f for f in res["failures"] if f["kind"] == failures.RANK)
                    raise RankUnresponsive(bad["rank"], bad["reason"])
                if res["failure_kind"] != failures.TIER:
                    break
                m = self._set_marker(prompt, set(res["blamed_tiers"]), failures.summary(res), request)
                exclude = set(m.excluded)
                marker_history.append({"pass": pass_no, "marker": m.to_dict()})
            # Successful admission (RUNNING): the marker has served its purpose.
            cleared = self._clear_marker(prompt, request, "admitted")
            computed = len(tokens) - committed
            first_chunk = committed // self.reg.chunk_size
            if computed > 0:
                self._all("prefill", hashes=hashes, n_tokens=len(tokens), first_chunk=first_chunk, block_tables=tables)
            store_result: dict[str, Any] = {}
            if store and bitmap is not None:
                store_result = self._store_missing(bitmap, hashes, len(tokens), tables)
            out_hashes = self._all("output_hash", block_tables=tables, n_tokens=len(tokens))
            output_hash = self._combined_hash(out_hashes)
            canonical = None
            if verify:
                canonical = self._combined_hash(self._all("canonical_hash", hashes=hashes, n_tokens=len(tokens)))
            result = {
                "request": request,
                "prompt": prompt,
                "tokens": len(tokens),
                "W": w,
                "external_tokens": committed,
                "computed_tokens": computed,
                "source": source if committed else "recompute",
                "passes": passes,
                "force_local": {"history": marker_history, "cleared": cleared},
                "stored": store_result,
                "output_hash": output_hash,
                "canonical_hash": canonical,
                "hash_ok": None if canonical is None else canonical == output_hash,
                "seconds": time.monotonic() - started,
            }
            self.events.append(
                {
                    "type": "request_finished",
                    "request": request,
                    "external_tokens": committed,
                    "computed_tokens": computed,
                    "source": result["source"],
                    "hash_ok": result["hash_ok"],
                }
            )
            return result
        finally:
            self._release_tables(request, tables)  # teardown
            stop()

    def _store_missing(self, bitmap: HitBitmap, hashes: list[str], n_tokens: int, tables: dict[str, list[int]]) -> dict:
        futures = []
        for r in self.ranks:
            chunks: dict[str, list[int]] = {}
            for i, tier in enumerate(bitmap.tiers):
                lacking = [
                    c
                    for c in range(bitmap.chunks)
                    if any(not (bitmap.mask(r.rank, g, c) >> i) & 1 for g in bitmap.groups)
                ]
                if lacking:
                    chunks[tier] = lacking
            futures.append(r.submit("store", hashes=hashes, n_tokens=n_tokens, block_tables=tables, chunks=chunks))
        errors: dict[str, dict[str, str]] = {}
        objects: dict[str, Any] = {}
        for r, fut in zip(self.ranks, futures, strict=True):
            try:
                res = fut.result(timeout=self.settings.call_timeout_s)
            except Exception as e:  # noqa: BLE001 - a tier that cannot take writes loses reuse, not the request
                res = {"objects": {}, "errors": {"*": str(e)}}
            objects[f"rank{r.rank}"] = res["objects"]
            for tier, err in res.get("errors", {}).items():
                errors.setdefault(f"rank{r.rank}", {})[tier] = err
                self.events.append({"type": "store_failed", "rank": r.rank, "tier": tier, "error": err})
        return {"objects": objects, "errors": errors}

    def restore(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        exclude: Sequence[str] = (),
        progress: Callable[[dict[str, Any]], None] | None = None,
        request: str | None = None,
    ) -> dict[str, Any]:
        """A manual windowed restore of a prompt's external prefix (no fallback, nothing computed)."""
        w, request, prompt, hashes, stop = self._open(tokens, w, request, progress)
        try:
            try:
                bitmap, tier_errors = self.probe(tokens, hashes)
            except RankUnresponsive as e:
                return self._rank_failed(request, prompt, len(tokens), w, e)
            excl = set(exclude)
            ext = bitmap.prefix_tokens(excl)
            brk = bitmap.first_break(excl)
            base = {
                "request": request,
                "prompt": prompt,
                "tokens": len(tokens),
                "W": w,
                "tier_errors": tier_errors,
                "first_break": brk.to_dict() if brk else None,
                "bitmap": bitmap.to_dict(),
            }
            if ext == 0:
                return base | {"outcome": NOTHING_TO_RESTORE, "committed_tokens": 0, "advertised_tokens": 0}
            tables = self._allocate(ext)
            try:
                res = self._restore_external(request, bitmap, hashes, excl, w, tables, prompt)
                out = base | res
                if res["committed_tokens"]:
                    out["output_hash"] = self._combined_hash(
                        self._all("output_hash", block_tables=tables, n_tokens=ext)
                    )
                    if verify:
                        out["canonical_hash"] = self._combined_hash(
                            self._all("canonical_hash", hashes=hashes[: -(-ext // self.reg.chunk_size)], n_tokens=ext)
                        )
                        out["hash_ok"] = out["canonical_hash"] == out["output_hash"]
                elif res["failure_kind"] == failures.TIER:
                    marker = self._set_marker(prompt, set(res["blamed_tiers"]), failures.summary(res), request)
                    out["marker"] = marker.to_dict()
                return out
            finally:
                self._release_tables(request, tables)
        finally:
            stop()

    def _rank_failed(self, request: str, prompt: str, n_tokens: int, w: int, e: RankUnresponsive) -> dict[str, Any]:
        """A manual restore that could not start because a rank stopped answering: failed closed (nothing was
        restored or committed), blamed on the rank, no marker."""
        fail = {"rank": e.rank, "window": None, "reason": e.reason, "kind": failures.RANK, "tier": None}
        self.events.append(
            {"type": "restore_failed_closed", "request": request, "committed_tokens": 0, "failures": [fail]}
        )
        return {
            "request": request,
            "prompt": prompt,
            "tokens": n_tokens,
            "W": w,
            "outcome": FAILED_CLOSED,
            "advertised_tokens": 0,
            "committed_tokens": 0,
            "failures": [fail],
            "failure_kind": failures.RANK,
            "blamed_tiers": [],
            "invalid": [],
            "tiers": [],
            "ranks": [],
            "windows": 0,
            "hint": e.hint,
        }

    def abort(self, request: str) -> bool:
        with self._lock:
            known = request in self.active or request in self._open_requests
        if not known:
            return False
        for r in self.ranks:
            r.abort(request)
        if known:
            self.events.append({"type": "abort_requested", "request": request})
        return known

    # -- faults ------------------------------------------------------------------------------------------------
    def inject(self, spec: dict[str, Any]) -> FaultSpec:
        if not self.settings.faults_enabled:
            raise FaultsDisabled(
                "this engine does not allow fault injection",
                hint="start it with faults enabled (bsr engine up --enable-faults)",
            )
        f = FaultSpec.parse(spec, ranks=len(self.ranks), groups=self.reg.group_names)
        with self._lock:
            self.faults.append(f)
        self.events.append({"type": "fault_injected", **f.to_dict()})
        return f

    def list_faults(self) -> list[dict[str, Any]]:
        with self._lock:
            return [f.to_dict() for f in self.faults]

    def clear_faults(self) -> int:
        with self._lock:
            n = len(self.faults)
            self.faults = []
            # A tier that failed only because of an injected fault is not remembered as failing once faults are
            # cleared; a real failure stays until its TTL or the tier's next committed restore.
            self.tier_failures = {t: v for t, v in self.tier_failures.items() if not v.get("injected")}
        self.events.append({"type": "faults_cleared", "count": n})
        return n

    # -- observability -----------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        s = self.settings
        return {
            "api": API_VERSION,
            "version": __version__,
            "engine": s.name,
            "started_at": self.started_at,
            "ranks": len(self.ranks),
            "registration": {
                "identity": self.reg.identity,
                "model": self.reg.model,
                "tensors": len(self.reg.tensors),
                "bytes_per_chunk": self.reg.bytes_per_chunk,
                "groups": list(self.reg.group_names),
            },
            "chunk_size": self.reg.chunk_size,
            "tiers": list(s.tiers),
            "W": s.w,
            "rws_bytes": accounting.rws_bytes(self.reg, s.w) if s.w else None,
            "pool_bytes": s.pool_bytes,
            "budget_bytes": s.budget_bytes,
            "max_tokens": s.max_tokens,
            "kv_tokens": s.kv_tokens,
            "fetch_timeout_s": s.fetch_timeout_s,
            "faults_enabled": s.faults_enabled,
            "fs_concurrency": s.fs_concurrency,
            "tokenizer": s.tokenizer,
        }

    def pool(self, health: bool = False) -> list[dict[str, Any]]:
        out = []
        futures = []
        states = self.rank_health()
        for r in self.ranks:
            # A silent rank is not asked (it would only make the caller wait): its health says why.
            futures.append(r.submit("stats", health=health) if r.alive() and self._silent(r) is None else None)
        now = time.monotonic()
        for r, fut, h in zip(self.ranks, futures, states, strict=True):
            entry: dict[str, Any] = {
                "rank": r.rank,
                "alive": r.alive(),
                "healthy": h["healthy"],
                "reason": h["reason"],
                "heartbeat_age_s": h["heartbeat_age_s"],
                "last_fault": h["last_fault"],
            }
            if fut is not None:
                try:
                    entry |= fut.result(timeout=5.0)
                    if health:
                        with self._lock:
                            self._tier_views[r.rank] = (time.monotonic(), dict(entry.get("tiers") or {}))
                except Exception as e:  # noqa: BLE001 - a rank that cannot answer is shown as such
                    entry["alive"] = False
                    entry["healthy"] = False
                    entry["error"] = entry["reason"] = str(e) or "no answer to stats within 5s"
            with self._lock:
                recent = [(t, b) for t, b in self._rate.get(r.rank, ()) if now - t <= 5.0]
            entry["restore_bps"] = sum(b for _, b in recent) / 5.0
            out.append(entry)
        return out

    def snapshot(self, health: bool = True, events_since: int | None = None) -> dict[str, Any]:
        """Everything a monitor draws at once. ``events_since``: every event after that sequence number (up to
        2,000) instead of the last 50, so a poller sees bursts whole."""
        ranks = self.pool(health=health)
        with self._lock:
            active = [
                {
                    **st,
                    "done": {str(k): v for k, v in st["done"].items()},
                    "bytes": {str(k): v for k, v in st["bytes"].items()},
                }
                for st in self.active.values()
            ]
            recent = list(self.recent)
            markers = [m.to_dict() for m in self.markers.values()]
            faults = [f.to_dict() for f in self.faults]
        tiers = self._tier_health(ranks)
        live = sum(r.get("pool", {}).get("live_bytes", 0) for r in ranks)
        return {
            "time": time.time(),
            "info": self.info(),
            "ranks": ranks,
            "active": active,
            "recent": recent,
            "admission": {
                "budget_bytes": self.settings.budget_bytes,
                "live_bytes": live,
                "queued": sum(r.get("pool", {}).get("waiters", 0) for r in ranks),
            },
            "tiers": tiers,
            "markers": markers,
            "faults": faults,
            "events": self.events.recent(50) if events_since is None else self.events.since(events_since, limit=2000),
            "seq": self.events.last_seq,
        }

    def reset_peak(self) -> None:
        self._all("reset_peak")
