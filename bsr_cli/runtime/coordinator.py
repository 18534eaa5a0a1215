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

import hashlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from bsr_cli import API_VERSION, __version__
from bsr_cli.core import accounting
from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.commit import commit_prefix
from bsr_cli.core.keys import chunk_hashes, object_key, prompt_hash
from bsr_cli.core.plan import windows_for
from bsr_cli.core.registration import Registration
from bsr_cli.errors import BadRequest, CapacityError, FaultsDisabled, InvalidInput, ServerError
from bsr_cli.runtime.events import EventLog
from bsr_cli.runtime.faults import FaultSpec

MAX_PASSES = 3  # remote → lower tier → recompute


class RankClient(Protocol):
    rank: int

    def submit(self, op: str, **args: Any) -> Future[Any]: ...

    def abort(self, request: str) -> None: ...

    def alive(self) -> bool: ...


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


@dataclass
class Marker:
    prompt: str
    excluded: set[str]
    reason: str
    request: str
    set_at: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "excluded_tiers": sorted(self.excluded),
            "reason": self.reason,
            "request": self.request,
            "set_at": self.set_at,
        }


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

    # -- small helpers -----------------------------------------------------------------------------------------
    def _gather(self, futures: Sequence[Future[Any]], timeout_s: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        out = []
        for r, fut in zip(self.ranks, futures, strict=True):
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                raise ServerError(f"rank {r.rank} did not answer {what} within {timeout_s:.0f}s") from None
        return out

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
        budget = self.settings.admit_timeout_s + len(windows) * (self.settings.fetch_timeout_s + 30) + 30
        try:
            outcomes = self._gather(futures, budget, "restore")
        except Exception:
            for r in self.ranks:
                r.abort(request)
            raise
        finally:
            with self._lock:
                self.active.pop(request, None)
        validity = {(o["rank"], g): v for o in outcomes for g, v in o["valid"].items()}
        decision = commit_prefix(ext_tokens, validity, [r.rank for r in self.ranks], self.reg.group_names)
        fired = {fid for o in outcomes for fid in o["fired_faults"]}
        if fired:
            with self._lock:
                self.faults = [f.after_firing() if f.id in fired else f for f in self.faults]
                self.faults = [f for f in self.faults if not f.exhausted()]
        seconds = time.monotonic() - started
        total_bytes = sum(o["bytes_restored"] for o in outcomes)
        failures = [
            {"rank": o["rank"], "window": o["failed_window"], "reason": o["reason"]} for o in outcomes if not o["ok"]
        ]
        result = {
            "request": request,
            "W": w,
            "tiers": sorted(tiers_used),
            "advertised_tokens": ext_tokens,
            "committed_tokens": decision.committed_tokens,
            "outcome": "committed" if decision.committed_tokens else "failed_closed",
            "invalid": [{"rank": r, "group": g} for r, g in decision.invalid],
            "failures": failures,
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
                "failures": failures,
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
                    "reason": failures[0]["reason"] if failures else "",
                }
            )
        return result

    def on_rank_event(self, ev: dict[str, Any]) -> None:
        """Rank progress: update the live view, then log it."""
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
                res = self._restore_external(request, bitmap, hashes, exclude, w, tables)
                entry["restore"] = res
                if res["committed_tokens"]:
                    committed, source = res["committed_tokens"], "+".join(res["tiers"])
                    break
                # Fail closed: every block of the request is invalid now (each rank scrubbed its own); the
                # marker keeps the next pass from retrying the same external fault.
                m = self._set_marker(
                    prompt,
                    set(res["tiers"]),
                    res["failures"][0]["reason"] if res["failures"] else "invalid group",
                    request,
                )
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
            self._free(tables)  # teardown
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
            bitmap, tier_errors = self.probe(tokens, hashes)
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
                return base | {"outcome": "nothing_to_restore", "committed_tokens": 0, "advertised_tokens": 0}
            tables = self._allocate(ext)
            try:
                res = self._restore_external(request, bitmap, hashes, excl, w, tables)
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
                else:
                    reason = res["failures"][0]["reason"] if res["failures"] else "invalid group"
                    out["marker"] = self._set_marker(prompt, set(res["tiers"]), reason, request).to_dict()
                return out
            finally:
                self._free(tables)
        finally:
            stop()

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
        for r in self.ranks:
            futures.append(r.submit("stats", health=health) if r.alive() else None)
        now = time.monotonic()
        for r, fut in zip(self.ranks, futures, strict=True):
            entry: dict[str, Any] = {"rank": r.rank, "alive": r.alive()}
            if fut is not None:
                try:
                    entry |= fut.result(timeout=5.0)
                except Exception as e:  # noqa: BLE001 - a rank that cannot answer is shown as such
                    entry["alive"] = False
                    entry["error"] = str(e)
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
        tiers: dict[str, Any] = {}
        for r in ranks:
            for name, h in (r.get("tiers") or {}).items():
                t = tiers.setdefault(name, {"ok": True, "detail": []})
                t["ok"] = t["ok"] and h["ok"]
                if not h["ok"]:
                    t["detail"].append(f"rank{r['rank']}: {h['detail']}")
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
