"""The paper's evaluation as functions over the admin API, each returning a JSON evidence bundle.

Every experiment takes an `AdminClient` (the ladder takes an engine factory instead: it must change the pool
capacity, which only an engine restart can do) and returns a plain dict that validates against
docs/bench-schema.json (`bsr_cli.bench.bundle`): a run id (``br-<tag>-`` + 12 hex), the salt (the synthetic
prompt seed), the registration identity, the engine's settings (``/info``), machine facts, timestamps, one row
per measurement, a summary and the targets it was measured against.

Rows are evidence, not timings to assert: each carries its acceptance checks and a status ``pass`` / ``fail``, or
``interrupted`` when it could not finish (Ctrl-C, an engine error). Interrupted rows stay in the bundle, marked,
and are never counted in a summary. After Ctrl-C the experiment stops, asks the engine to abort the restore in
flight, restores the settings it changed and still returns its bundle.

Experiments change engine settings (the admission budget B, the filesystem load concurrency) through
``POST /settings`` and put them back afterwards; they never restart an engine, except the ladder through its
factory. Against an engine bsr did not start, run the ladder rung by rung yourself: restart the engine with
``--pool <rung>`` and call `run_ladder` with a factory that yields a client of the restarted engine.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import platform
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bsr_cli import __version__
from bsr_cli.client import local_engine
from bsr_cli.core import accounting
from bsr_cli.core.registration import Registration
from bsr_cli.core.units import MiB
from bsr_cli.errors import BadRequest, CapacityError, EngineError, FaultsDisabled, InvalidInput, ServiceError

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions

BUNDLE_SCHEMA = "bsr.bench/1"

# The paper's E1 rows (tokens), its W sweep, and a ladder scaled to the demo registration (1 MiB per chunk per
# rank, ~1/16 of the paper's 16,408,576 bytes): the paper steps 1..64 GiB, this steps 64 MiB..4 GiB.
E1_PREFIXES: tuple[int, ...] = (32_768, 65_536, 131_072, 262_144, 393_216, 524_032)
LADDER_PREFIXES: tuple[int, ...] = (32_768, 65_536, 131_072, 262_144, 524_032)
SCALED_LADDER: tuple[int, ...] = tuple(n * MiB for n in (64, 128, 256, 512, 1024, 2048, 4096))
W_LAW: tuple[int, ...] = accounting.DEFAULT_W_SWEEP

SWEEP_TIME_TARGET_S = 600.0
OVERLAP_TARGET = 0.9  # W=32 (B = 2·RWS) restore throughput against the whole-plan path
RAW_TARGET = 0.8  # Mooncake restore against raw batch_get_into
FS_SPEEDUP_TARGET = 1.5  # fs load concurrency 4 against 1

OnRow = Callable[[dict[str, Any]], None]
EngineFactory = Callable[[int], AbstractContextManager["AdminClient"]]
"""pool_bytes -> a context manager that starts an engine with that restore-pool capacity per rank, yields a client
of it, and stops it on exit."""

_MOONCAKE_BATCH = 1024  # keys per raw batch call (the tier issues the same)


# -- small helpers ---------------------------------------------------------------------------------------------


def new_run_id(tag: str) -> str:
    return f"br-{tag}-{secrets.token_hex(6)}"


def new_salt() -> int:
    return secrets.randbelow(1 << 31)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Facts about the machine running the benchmark (the engine's, when it is the embedded one)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu_count": os.cpu_count() or 0,
        "memory_bytes": int(memory),
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "mooncake": _dist_version("mooncake-transfer-engine-non-cuda") or _dist_version("mooncake-transfer-engine"),
        "platform": platform.platform(),
        # Other work on the machine skews timings; the load average at the start says how busy it was.
        "loadavg": load,
    }


def registration_identity(reg: Registration) -> dict[str, Any]:
    return {
        "identity": reg.identity,
        "model": reg.model,
        "tp_size": reg.tp_size,
        "chunk_size": reg.chunk_size,
        "bytes_per_token": reg.bytes_per_token,
        "bytes_per_chunk": reg.bytes_per_chunk,
        "aux_bytes": reg.aux_bytes,
        "groups": {g: reg.group_bytes_per_chunk(g) for g in reg.group_names},
    }


def completed(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows that produced evidence: the only ones a summary may count."""
    return [r for r in rows if r.get("status") != "interrupted"]


def judge(row: dict[str, Any], checks: dict[str, bool]) -> None:
    row["checks"] = checks
    row["status"] = "pass" if all(checks.values()) else "fail"


def target(name: str, wanted: str, measured: Any, met: bool | None, note: str = "") -> dict[str, Any]:
    return {"name": name, "target": wanted, "measured": measured, "met": met, "note": note}


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _pool_capacity(client: AdminClient) -> int:
    ranks = client.pool()
    caps = [int(r.get("pool", {}).get("capacity_bytes", 0)) for r in ranks]
    return min(caps) if caps else 0


def _require_tokens(info: dict[str, Any], tokens: int) -> None:
    if info.get("serves_restores", True) is False:  # e.g. a vLLM worker: KV moves only through vLLM there
        raise BadRequest(
            f"the bench is not served from {info.get('engine', 'this engine')}: it submits and restores, which this "
            "endpoint refuses (not served from a vLLM worker: KV moves only through vLLM's scheduler)",
            hint="run the bench against the embedded engine or the LMCache host (--embedded)",
        )
    if tokens > int(info.get("max_tokens", 0)) or tokens > int(info.get("kv_tokens", 0)):
        raise InvalidInput(
            f"the engine accepts prompts up to {info.get('max_tokens'):,} tokens with {info.get('kv_tokens'):,} KV "
            f"tokens; this experiment needs {tokens:,}",
            hint=f"restart it with --max-tokens {tokens} --kv-tokens {tokens}, or run the bench with --embedded",
        )


def _require_pool(client: AdminClient, need: int, what: str) -> int:
    cap = _pool_capacity(client)
    if cap < need:
        raise InvalidInput(
            f"{what} needs a restore pool of {need:,} bytes per rank; the engine's holds {cap:,}",
            hint="restart the engine with a larger --pool, or run the bench with --embedded",
        )
    return cap


def _isolate(info: dict[str, Any], tier: str | None) -> tuple[str, list[str]]:
    """The tier to restore from and the tiers to exclude so nothing else can serve (tier isolation)."""
    tiers = [str(t) for t in info.get("tiers", [])]
    chosen = tier or (tiers[0] if tiers else "")
    if chosen not in tiers:
        raise InvalidInput(f"the engine has no tier {chosen!r} (it has {', '.join(tiers) or 'none'})")
    return chosen, [t for t in tiers if t != chosen]


def _put_back(client: AdminClient, original: dict[str, Any]) -> bool:
    try:
        client.update_settings(**original)
        return True
    except EngineError:
        return False


def _prompt(tokens: int, salt: int) -> dict[str, Any]:
    # Synthetic prompts with one seed are prefixes of each other, so rows of one salt share their leading chunks.
    return {"synthetic": {"n": tokens, "seed": salt}}


def _warm_evidence(res: dict[str, Any]) -> dict[str, Any]:
    stored = res.get("stored") or {}
    return {
        "request": res.get("request"),
        "seconds": round(float(res.get("seconds", 0.0)), 4),
        "external_tokens": int(res.get("external_tokens", 0)),
        "computed_tokens": int(res.get("computed_tokens", 0)),
        "hash_ok": res.get("hash_ok"),
        "store_errors": stored.get("errors") or {},
    }


# -- one experiment block ----------------------------------------------------------------------------------------


class Run:
    """One experiment block: its envelope and rows, and the restore in flight (aborted on Ctrl-C)."""

    def __init__(
        self,
        experiment: str,
        tag: str,
        client: AdminClient,
        params: dict[str, Any],
        *,
        salt: int | None = None,
        on_row: OnRow | None = None,
        engine_meta: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.on_row = on_row
        self.request: str | None = None
        self.stopped = False
        self._t0 = time.monotonic()
        self.info = client.info()
        self.reg = Registration.from_dict(client.registration(), source="engine")
        self.bundle: dict[str, Any] = {
            "schema": BUNDLE_SCHEMA,
            "kind": "bsr.bench",
            "experiment": experiment,
            "run_id": new_run_id(tag),
            "salt": salt,
            "bsr_version": __version__,
            "started_at": _now(),
            "finished_at": None,
            "elapsed_s": None,
            "registration": registration_identity(self.reg),
            "engine": {"url": client.url, "info": self.info} | (engine_meta or {}),
            "machine": machine_info(),
            "params": params,
            "rows": [],
            "summary": {},
            "targets": [],
            "interrupted": False,
            "interrupted_by": None,
            "ok": False,
        }

    @property
    def rows(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.bundle["rows"]
        return rows

    def accepted(self, request: str) -> None:
        self.request = request

    def interrupt(self, by: str) -> None:
        self.stopped = True
        self.bundle["interrupted"] = True
        self.bundle["interrupted_by"] = self.bundle["interrupted_by"] or by

    def _abort_inflight(self) -> None:
        if self.request:
            with contextlib.suppress(EngineError):
                self.client.abort(self.request)

    @contextlib.contextmanager
    def row(self, rows: list[dict[str, Any]] | None = None, **base: Any) -> Iterator[dict[str, Any]]:
        """Collect one row. Ctrl-C or an engine error inside marks it interrupted and stops the block."""
        row: dict[str, Any] = {"status": "interrupted", **base, "started_at": _now()}
        t0 = time.monotonic()
        try:
            yield row
        except KeyboardInterrupt:
            self._abort_inflight()
            row |= {"status": "interrupted", "reason": "interrupted by the operator (Ctrl-C)"}
            self.interrupt("operator")
        except (EngineError, ServiceError, CapacityError) as e:
            row |= {"status": "interrupted", "reason": f"{e.kind}: {e.message}"}
            self.interrupt("error")
        finally:
            row["elapsed_s"] = round(time.monotonic() - t0, 3)
            self.request = None
            (self.rows if rows is None else rows).append(row)
            if self.on_row:
                self.on_row(row)

    def finish(
        self,
        summary: dict[str, Any],
        targets: list[dict[str, Any]],
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        b = self.bundle
        every = list(self.rows if rows is None else rows)
        b["finished_at"] = _now()
        b["elapsed_s"] = round(time.monotonic() - self._t0, 3)
        b["summary"] = summary
        b["targets"] = targets
        b["ok"] = bool(every) and not b["interrupted"] and all(r["status"] == "pass" for r in every)
        return b

    # -- the measurement every experiment shares ---------------------------------------------------------------
    def restore(
        self, prompt: dict[str, Any], tokens: int, w: int, *, exclude: Sequence[str] = (), verify: bool = True
    ) -> dict[str, Any]:
        """reset the pool peak, restore, read the pool and health: the evidence of one restore."""
        c, reg = self.client, self.reg
        c.reset_peak()
        res = c.restore(prompt, w=w, verify=verify, exclude_tiers=list(exclude) or None, on_accepted=self.accepted)
        self.request = None
        pool = c.pool()
        health = c.health()
        chunks = accounting.chunks_for_tokens(tokens, reg.chunk_size)
        outcomes = {int(o["rank"]): o for o in res.get("ranks", [])}
        ranks = []
        for p in pool:
            o = outcomes.get(int(p["rank"]), {})
            secs = float(o.get("seconds", 0.0))
            nbytes = int(o.get("bytes_restored", 0))
            ranks.append(
                {
                    "rank": int(p["rank"]),
                    "pool_peak_bytes": int(p.get("pool", {}).get("peak_bytes", 0)),
                    "peak_live_bytes": int(o.get("peak_live_bytes", 0)),
                    "bytes_restored": nbytes,
                    "seconds": round(secs, 4),
                    "fetch_seconds": round(float(o.get("fetch_seconds", 0.0)), 4),
                    "install_seconds": round(float(o.get("install_seconds", 0.0)), 4),
                    "gbps": round(nbytes / secs / 1e9, 4) if secs > 0 else 0.0,
                    "ok": bool(o.get("ok", False)),
                }
            )
        seconds = float(res.get("seconds", 0.0))
        total = int(res.get("bytes", 0))
        failures = res.get("failures") or []
        return {
            "request": res.get("request"),
            "outcome": res.get("outcome", "unknown"),
            "tiers": list(res.get("tiers") or []),
            "excluded_tiers": list(exclude),
            "advertised_tokens": int(res.get("advertised_tokens", 0)),
            "committed_tokens": int(res.get("committed_tokens", 0)),
            "chunks": chunks,
            "windows": int(res.get("windows", 0)),
            "expected_windows": accounting.num_windows(chunks, w),
            "seconds": round(seconds, 4),
            "bytes": total,
            "gbps": round(total / seconds / 1e9, 4) if seconds > 0 else 0.0,
            # Request-level throughput per rank: what one rank receives over the whole request's time.
            "gbps_per_rank": round(total / max(len(ranks), 1) / seconds / 1e9, 4) if seconds > 0 else 0.0,
            "peak_pool_bytes": max((r["pool_peak_bytes"] for r in ranks), default=0),
            "predicted_peak_bytes": accounting.peak_bytes(reg, w, chunks),
            "rws_bytes": accounting.rws_bytes(reg, w) if w else None,
            "whole_plan_bytes": accounting.whole_plan_bytes(reg, chunks),
            "ranks": ranks,
            "output_hash": res.get("output_hash"),
            "canonical_hash": res.get("canonical_hash"),
            "hash_ok": res.get("hash_ok"),
            "healthy": bool(health.get("ok")),
            "failure": failures[0]["reason"] if failures else None,
        }


def _restore_checks(ev: dict[str, Any], tokens: int, *, peak: int | None, verified: bool = True) -> dict[str, bool]:
    checks = {
        "committed_all": ev["outcome"] == "committed" and ev["committed_tokens"] == tokens,
        "windows": ev["windows"] == ev["expected_windows"],
        "ranks_healthy": ev["healthy"],
    }
    if peak is not None:
        checks["peak_equals_bound"] = bool(ev["ranks"]) and all(r["pool_peak_bytes"] == peak for r in ev["ranks"])
    if verified:
        checks["hash_canonical"] = ev["hash_ok"] is True
    return checks


# -- sweep (E1) ------------------------------------------------------------------------------------------------


def run_sweep(
    client: AdminClient,
    *,
    prefixes: Sequence[int] = E1_PREFIXES,
    w: int = 32,
    repeat: bool = True,
    salt: int | None = None,
    tier: str | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The paper's E1: one block on one running engine (no restart), rows in ascending prefix length at W with
    B = RWS(W); then a fresh salt repeats the largest row. Each row warms its prompt (submit), resets the pool
    peak and restores from one tier only."""
    if w <= 0:
        raise InvalidInput("the sweep measures bounded restores: W must be positive")
    rows_in = sorted(set(prefixes))
    if not rows_in:
        raise InvalidInput("the sweep needs at least one prefix length")
    salt = new_salt() if salt is None else salt
    params = {"prefixes": rows_in, "W": w, "repeat": repeat, "tier": tier}
    run = Run("sweep", "e1", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    _require_tokens(info, rows_in[-1])
    chosen, exclude = _isolate(info, tier)
    params["tier"] = chosen
    rws = accounting.rws_bytes(reg, w)
    _require_pool(client, rws, f"W={w}")
    original = {"budget_bytes": info["budget_bytes"]}
    # B = RWS(W): one live window per rank, the paper's serialized restore.
    client.update_settings(budget_bytes=rws)
    repeat_rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for n in rows_in:
            with run.row(tokens=n, W=w, salt=salt) as row:
                row |= _sweep_row(run, n, salt, w, exclude)
            if run.stopped:
                break
        if repeat and not run.stopped:
            salt2 = new_salt()
            run.bundle["repeat"] = {"run_id": new_run_id("e1"), "salt": salt2, "rows": repeat_rows}
            with run.row(rows=repeat_rows, tokens=rows_in[-1], W=w, salt=salt2) as row:
                row |= _sweep_row(run, rows_in[-1], salt2, w, exclude)
    finally:
        block_s = time.monotonic() - t0
        run.bundle["engine"]["settings_restored"] = _put_back(client, original)
    every = run.rows + repeat_rows
    done = completed(every)
    peaks = sorted({r["pool_peak_bytes"] for row in done for r in row["ranks"]})
    main_done = completed(run.rows)
    summary = {
        "rows": len(run.rows),
        "completed": len(main_done),
        "interrupted": len(run.rows) - len(main_done),
        "passed": sum(r["status"] == "pass" for r in main_done),
        "repeat_status": repeat_rows[0]["status"] if repeat_rows else None,
        "rws_bytes": rws,
        "peak_pool_bytes_per_rank": peaks,
        "peak_identical": len(peaks) == 1,
        "peak_equals_rws": peaks == [rws],
        "whole_plan_bytes": {str(r["tokens"]): r["whole_plan_bytes"] for r in main_done},
        "restore_seconds": {str(r["tokens"]): r["seconds"] for r in main_done},
        "gbps": {str(r["tokens"]): r["gbps"] for r in main_done},
        "block_seconds": round(block_s, 3),
    }
    full = tuple(rows_in) == E1_PREFIXES
    targets = [
        target(
            "peak pool per rank identical for every row and equal to RWS(W)",
            f"== {rws:,} bytes",
            peaks,
            (len(peaks) == 1 and peaks == [rws]) if done else None,
        ),
        target(
            "the whole sweep finishes in under 10 minutes",
            f"< {SWEEP_TIME_TARGET_S:.0f} s",
            round(block_s, 1),
            (block_s < SWEEP_TIME_TARGET_S) if full and not run.stopped else None,
            "" if full else "reduced sweep: the time target applies to the paper's six rows only",
        ),
    ]
    return run.finish(summary, targets, every)


def _sweep_row(run: Run, n: int, salt: int, w: int, exclude: Sequence[str]) -> dict[str, Any]:
    prompt = _prompt(n, salt)
    warm = _warm_evidence(run.client.submit(prompt, w=w))
    ev = run.restore(prompt, n, w, exclude=exclude)
    row = {"warm": warm, **ev}
    judge(row, {"warm_hash_ok": warm["hash_ok"] is True} | _restore_checks(ev, n, peak=ev["predicted_peak_bytes"]))
    return row


# -- W law -------------------------------------------------------------------------------------------------------


def run_wlaw(
    client: AdminClient,
    *,
    tokens: int = 262_144,
    ws: Sequence[int] = W_LAW,
    salt: int | None = None,
    tier: str | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Measured RWS against W·Σc_i + aux at one prefix, B = RWS(W) for each W."""
    w_list = sorted(set(ws))
    if not w_list or w_list[0] <= 0:
        raise InvalidInput("the W law needs positive window sizes")
    salt = new_salt() if salt is None else salt
    params = {"tokens": tokens, "W": w_list, "tier": tier}
    run = Run("wlaw", "wlaw", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    _require_tokens(info, tokens)
    chosen, exclude = _isolate(info, tier)
    params["tier"] = chosen
    _require_pool(client, accounting.rws_bytes(reg, w_list[-1]), f"W={w_list[-1]}")
    original = {"budget_bytes": info["budget_bytes"]}
    prompt = _prompt(tokens, salt)
    try:
        warm: dict[str, Any] | None = None
        for w in w_list:
            with run.row(W=w, tokens=tokens) as row:
                rws = accounting.rws_bytes(reg, w)
                client.update_settings(budget_bytes=rws)
                if warm is None:
                    warm = row["warm"] = _warm_evidence(client.submit(prompt, w=w))
                ev = run.restore(prompt, tokens, w, exclude=exclude)
                row |= ev | {"law_bytes": rws}
                judge(row, _restore_checks(ev, tokens, peak=ev["predicted_peak_bytes"]))
            if run.stopped:
                break
    finally:
        run.bundle["engine"]["settings_restored"] = _put_back(client, original)
    done = completed(run.rows)
    xs = [float(r["W"]) for r in done]
    ys = [float(max(x["pool_peak_bytes"] for x in r["ranks"])) for r in done if r["ranks"]]
    slope = intercept = None
    if len(xs) >= 2 and len(xs) == len(ys) and len(set(xs)) > 1:
        fit = statistics.linear_regression(xs, ys)
        slope, intercept = round(fit.slope, 3), round(fit.intercept, 3)
    law = all(r["checks"].get("peak_equals_bound") for r in done) if done else None
    summary = {
        "tokens": tokens,
        "coefficient_bytes": reg.bytes_per_chunk,
        "aux_bytes": reg.aux_bytes,
        "measured": {str(r["W"]): max((x["pool_peak_bytes"] for x in r["ranks"]), default=0) for r in done},
        "predicted": {str(r["W"]): r["law_bytes"] for r in done},
        "fit_slope_bytes_per_W": slope,
        "fit_intercept_bytes": intercept,
        "law_holds": law,
        "completed": len(done),
        "interrupted": len(run.rows) - len(done),
    }
    targets = [
        target(
            "measured RWS equals W·Σc_i + aux for every W",
            f"slope {reg.bytes_per_chunk:,} B/W, intercept {reg.aux_bytes:,} B",
            {"slope": slope, "intercept": intercept},
            law,
        )
    ]
    return run.finish(summary, targets)


# -- filesystem load concurrency --------------------------------------------------------------------------------


def cold_cache_method(fs_dir: Path | None) -> str | None:
    """How this process can evict the fs tier's pages: posix_fadvise on its files when the directory is known
    (targeted, no privilege needed), else the machine-wide drop_caches when writable (root), else none."""
    if fs_dir is not None and fs_dir.is_dir() and hasattr(os, "posix_fadvise"):
        return "posix_fadvise"
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        return "drop_caches"
    return None


def evict_page_cache(fs_dir: Path | None, method: str) -> dict[str, Any]:
    os.sync()  # only clean pages can be dropped
    try:
        return _evict(fs_dir, method)
    except OSError as e:
        return {"method": method, "error": str(e)}


def _evict(fs_dir: Path | None, method: str) -> dict[str, Any]:
    if method == "posix_fadvise" and fs_dir is not None:
        return {"method": method, "files": _drop_pages(fs_dir.rglob("*.bsr"))}
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    return {"method": "drop_caches"}


def _drop_pages(files: Iterable[Path]) -> int:
    """Evict each file's clean pages from the page cache; returns how many files it reached."""
    done = 0
    for path in files:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done += 1
            finally:
                os.close(fd)
    return done


def disk_read_rate(files: Sequence[Path], threads: int, chunk_bytes: int = 4 * MiB) -> dict[str, Any]:
    """The disk's own rate at a concurrency, without bsr: ``threads`` threads read whole files (``preadv`` in
    chunks into one reused buffer each, as the fs tier reads), after their pages were evicted. Its best rate is the
    ceiling a restore's concurrency speedup can approach: where that ceiling is under 1.5x the serial restore's
    rate, the disk, not the tier, forbids a 1.5x speedup."""
    os.sync()  # only clean pages can be dropped
    evicted = _drop_pages(files)
    queue = list(files)
    lock = threading.Lock()
    moved = [0] * threads
    errors: list[str] = []

    def work(i: int) -> None:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while True:
            with lock:
                if not queue:
                    return
                path = queue.pop()
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    pos = 0
                    while (got := os.preadv(fd, [view], pos)) > 0:
                        pos += got
                    moved[i] += pos
                finally:
                    os.close(fd)
            except OSError as e:
                errors.append(f"{path}: {e}")

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work, args=(i,), name=f"bsr-bench-disk-{i}") for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    secs = time.perf_counter() - t0
    return {
        "threads": threads,
        "files": len(files),
        "bytes": sum(moved),
        "seconds": round(secs, 4),
        "gbps": round(sum(moved) / secs / 1e9, 4) if secs > 0 else 0.0,
        "evicted_files": evicted,
        "error": errors[0] if errors else None,
    }


def _prompt_files(fs_dir: Path, reg: Registration, tokens: int, salt: int) -> list[Path]:
    """The fs tier's files of a synthetic prompt's objects, every rank and group (those present)."""
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.tiers.fs import FilesystemTier

    tier = FilesystemTier(fs_dir, create=False)
    hashes = chunk_hashes(synthetic_tokens(tokens, salt), reg.chunk_size)
    paths = [
        tier.path_for(object_key(reg, rank, g, h))
        for rank in range(reg.tp_size)
        for g in reg.group_names
        for h in hashes
    ]
    return [p for p in paths if p.is_file()]


def run_fs_concurrency(
    client: AdminClient,
    *,
    tokens: int = 524_032,
    w: int = 32,
    concurrencies: Sequence[int] = (1, 4),
    trials: int = 2,
    fs_dir: Path | None = None,
    cold: bool = True,
    salt: int | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore from the filesystem tier only (the others excluded), load concurrency 1 against 4 at the same W and
    B = RWS(W): throughput may change, the pool peak must not. Cold rows evict the tier's pages first."""
    conc = sorted(set(concurrencies))
    if not conc or conc[0] < 1 or trials < 1:
        raise InvalidInput("concurrencies must be >= 1 and trials positive")
    salt = new_salt() if salt is None else salt
    method = cold_cache_method(fs_dir) if cold else None
    params = {"tokens": tokens, "W": w, "concurrencies": conc, "trials": trials, "cold_method": method}
    run = Run("fs-concurrency", "fs", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    _require_tokens(info, tokens)
    _, exclude = _isolate(info, "fs")
    rws = accounting.rws_bytes(reg, w)
    _require_pool(client, rws, f"W={w}")
    original = {"budget_bytes": info["budget_bytes"], "fs_concurrency": info["fs_concurrency"]}
    prompt = _prompt(tokens, salt)
    caches = ["cold", "warm"] if method else ["warm"]
    try:
        client.update_settings(budget_bytes=rws)
        with run.row(kind="warm", tokens=tokens, W=w) as row:
            row["warm"] = _warm_evidence(client.submit(prompt, w=w))
            judge(row, {"warm_hash_ok": row["warm"]["hash_ok"] is True})
        files = _prompt_files(fs_dir, reg, tokens, salt) if method == "posix_fadvise" and fs_dir else []
        for trial in range(trials):
            for c in conc if files else ():
                if run.stopped:
                    break
                # The disk alone at the same total concurrency (every rank loads c objects at once).
                with run.row(kind="disk", concurrency=c, threads=c * reg.tp_size, trial=trial) as row:
                    row |= disk_read_rate(files, c * reg.tp_size)
                    judge(row, {"read_whole": row["error"] is None and row["bytes"] > 0})
            for cache in caches:
                for c in conc:
                    if run.stopped:
                        break
                    with run.row(kind="restore", concurrency=c, cache=cache, trial=trial, tokens=tokens, W=w) as row:
                        client.update_settings(fs_concurrency=c)
                        evicted = True
                        if cache == "cold" and method:
                            row["evicted"] = evict_page_cache(fs_dir, method)
                            evicted = "error" not in row["evicted"]
                        # Verify once per configuration; the restore's own seconds exclude the verification.
                        ev = run.restore(prompt, tokens, w, exclude=exclude, verify=trial == 0)
                        row |= ev
                        checks = _restore_checks(ev, tokens, peak=ev["predicted_peak_bytes"], verified=trial == 0)
                        judge(row, checks | {"cache_evicted": evicted})
    finally:
        run.bundle["engine"]["settings_restored"] = _put_back(client, original)
    done = [r for r in completed(run.rows) if r.get("kind") == "restore"]
    by: dict[str, dict[str, Any]] = {}
    for cache in caches:
        for c in conc:
            sel = [r for r in done if r["cache"] == cache and r["concurrency"] == c]
            if sel:
                by[f"{cache}/c={c}"] = {
                    "gbps": _median([r["gbps"] for r in sel]),
                    "seconds": _median([r["seconds"] for r in sel]),
                    "fetch_seconds": _median([x["fetch_seconds"] for r in sel for x in r["ranks"]]),
                    "install_seconds": _median([x["install_seconds"] for r in sel for x in r["ranks"]]),
                    "runs": len(sel),
                }
    speedups = {}
    for cache in caches:
        lo, hi = by.get(f"{cache}/c={conc[0]}"), by.get(f"{cache}/c={conc[-1]}")
        if lo and hi:
            speedups[cache] = _ratio(hi["gbps"], lo["gbps"])
    disk = [r for r in completed(run.rows) if r.get("kind") == "disk"]
    disk_gbps = {c: _median([r["gbps"] for r in disk if r["concurrency"] == c]) for c in conc}
    disk_ceiling = max((v for v in disk_gbps.values() if v is not None), default=None)
    serial = (by.get(f"cold/c={conc[0]}") or {}).get("gbps")
    top = (by.get(f"cold/c={conc[-1]}") or {}).get("gbps")
    peaks = sorted({x["pool_peak_bytes"] for r in done for x in r["ranks"]})
    summary = {
        "by_config": by,
        "speedup": speedups,
        "disk_gbps": {str(c): v for c, v in disk_gbps.items()} if disk else {},
        # How far the disk itself lets the serial (c=1) cold restore speed up, and how much of it c=max uses.
        "disk_headroom": _ratio(disk_ceiling, serial),
        "restore_share_of_disk": _ratio(top, disk_ceiling),
        "peak_pool_bytes_per_rank": peaks,
        "rws_unchanged": peaks == [accounting.peak_bytes(reg, w, accounting.chunks_for_tokens(tokens, reg.chunk_size))],
        "cold_method": method,
        "completed": len(done),
        "interrupted": sum(r["status"] == "interrupted" for r in run.rows),
    }
    basis = "cold" if "cold" in speedups else "warm"
    measured = speedups.get(basis)
    # "Where the disk allows it": the disk read alone (cold, same files) must reach 1.5x the serial restore's rate,
    # else no load concurrency could give 1.5x and the target does not apply.
    headroom = summary["disk_headroom"]
    disk_allows = None if headroom is None else headroom >= FS_SPEEDUP_TARGET
    targets = [
        target(
            f"fs load concurrency {conc[-1]} at least {FS_SPEEDUP_TARGET}x concurrency {conc[0]}, where the disk "
            "allows it",
            f">= {FS_SPEEDUP_TARGET}",
            measured,
            None if measured is None or disk_allows is False else measured >= FS_SPEEDUP_TARGET,
            f"{basis} page cache"
            + ("" if method else "; cold runs were not possible here")
            + (
                ""
                if disk_allows is not False
                else f"; not applicable: the disk's own ceiling is {headroom}x the serial restore's rate"
            ),
        ),
        target(
            "RWS unchanged across concurrencies", f"== {rws:,} bytes", peaks, summary["rws_unchanged"] if done else None
        ),
    ]
    return run.finish(summary, targets)


# -- store bandwidth -------------------------------------------------------------------------------------------


def memcpy_ceiling(nbytes: int, trials: int, threads: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The machine's memory-copy ceiling: torch copies of an ``nbytes`` buffer (median of ``trials``), and the
    rate of the object checksum (CRC32C) over it."""
    import torch

    from bsr_cli.runtime.checksum import ALGORITHM, crc32c_at

    prev = torch.get_num_threads()
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(7)  # touch every page before timing
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    out = []
    try:
        for n in threads or sorted({1, prev}):
            torch.set_num_threads(n)
            dst.copy_(src)
            times = []
            for _ in range(trials):
                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
            out.append(_ceiling("copy", n, nbytes, times))
        # The restore verifies every object's checksum: one more pass over every restored byte.
        times = []
        for _ in range(trials):
            t0 = time.perf_counter()
            crc32c_at(src.data_ptr(), nbytes)
            times.append(time.perf_counter() - t0)
        out.append(_ceiling(ALGORITHM, 1, nbytes, times))
    finally:
        torch.set_num_threads(prev)
    return out


def _ceiling(op: str, threads: int, nbytes: int, times: list[float]) -> dict[str, Any]:
    return {
        "op": op,
        "threads": threads,
        "bytes": nbytes,
        "gbps_trials": [round(nbytes / t / 1e9, 4) for t in times],
        "gbps": round(nbytes / statistics.median(times) / 1e9, 4),
    }


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Mute fd 2 while Mooncake clients set up: each logs a dozen glog INFO lines there, and this build ignores
    GLOG_minloglevel. Setup failures still surface as return codes."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _StoreClient:
    """One rank-like Mooncake client: the engine's tier class and a raw store, with registered buffers holding
    objects shaped like the registration's (one object per KV group per chunk)."""

    def __init__(self, master: str, metadata: str, sizes: list[int]) -> None:
        import torch
        from mooncake.store import MooncakeDistributedStore

        from bsr_cli.runtime.checksum import crc32c
        from bsr_cli.runtime.tiers import StagingSlice
        from bsr_cli.tiers.mooncake import MooncakeTier

        with _quiet_stderr():
            self.tier = MooncakeTier(master, metadata, deadline_s=30.0, call_timeout_s=300.0)
            self.raw = MooncakeDistributedStore()
            rc = self.raw.setup("127.0.0.1", metadata, 0, 0, "tcp", "", master)
        if rc != 0:
            self.tier.close()
            raise ServiceError(f"raw mooncake client setup against {master} failed with code {rc}")
        self.sizes = sizes
        total = sum(sizes)
        self.total = total
        self.src = torch.randint(0, 256, (total,), dtype=torch.uint8)
        self.dst = torch.zeros(total, dtype=torch.uint8)
        sp, dp = self.src.data_ptr(), self.dst.data_ptr()
        sview = memoryview((ctypes.c_ubyte * total).from_address(sp)).cast("B")
        dview = memoryview((ctypes.c_ubyte * total).from_address(dp)).cast("B")
        offs = [0]
        for s in sizes[:-1]:
            offs.append(offs[-1] + s)
        self.src_ptrs = [sp + o for o in offs]
        self.dst_ptrs = [dp + o for o in offs]
        self.payloads = [sview[o : o + s] for o, s in zip(offs, sizes, strict=True)]
        self.crcs = [crc32c(p) for p in self.payloads]
        self.dests = [StagingSlice(dp + o, dview[o : o + s]) for o, s in zip(offs, sizes, strict=True)]
        for ptr in (sp, dp):
            self.tier.register(ptr, total)
            self.raw.register_buffer(ptr, total)

    def op(self, path: str, kind: str, keys: list[str]) -> str:
        """Run one measured operation; returns an error description, or "" when every object moved whole."""
        n = len(keys)
        if path == "tier" and kind == "put":
            try:
                self.tier.put(keys, self.payloads, self.crcs)
            except (OSError, RuntimeError) as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - TierUnavailable and friends: reported as the row's failure
                return f"{type(e).__name__}: {e}"
            return ""
        if path == "tier":
            codes, _ = self.tier.get_into(keys, self.dests, 300.0)
            bad = [c for c, s in zip(codes, self.sizes, strict=True) if c != s]
            return f"{len(bad)} of {n} objects failed (first code {bad[0]})" if bad else ""
        rcs: list[int] = []
        for lo in range(0, n, _MOONCAKE_BATCH):
            hi = min(lo + _MOONCAKE_BATCH, n)
            if kind == "put":
                rcs += list(self.raw.batch_put_from(keys[lo:hi], self.src_ptrs[lo:hi], self.sizes[lo:hi]))
            else:
                rcs += list(self.raw.batch_get_into(keys[lo:hi], self.dst_ptrs[lo:hi], self.sizes[lo:hi]))
        want = [0] * n if kind == "put" else self.sizes
        bad = [rc for rc, x in zip(rcs, want, strict=True) if rc != x]
        return f"{len(bad)} of {n} objects failed (first code {bad[0]})" if bad else ""

    def remove(self, keys: list[str]) -> None:
        with contextlib.suppress(Exception):  # best effort: the segment is the engine's, keep it from filling
            self.tier.remove(keys)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing after the measurement; nothing left to report
            self.raw.close()
        with contextlib.suppress(Exception):
            self.tier.close()


def _timed_parallel(
    clients: Sequence[_StoreClient], path: str, kind: str, keys: Sequence[list[str]]
) -> tuple[list[float], float, list[str]]:
    """Run one op on every client at once (released together by a barrier): per-client seconds, the wall time
    from the first start to the last end, per-client errors."""
    n = len(clients)
    barrier = threading.Barrier(n)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    errors = [""] * n

    def work(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        errors[i] = clients[i].op(path, kind, keys[i])
        spans[i] = (t0, time.perf_counter())

    threads = [threading.Thread(target=work, args=(i,), name=f"bsr-bench-store-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(e for _, e in spans) - min(s for s, _ in spans)
    return [e - s for s, e in spans], wall, errors


def object_sizes(reg: Registration, bytes_per_client: int) -> list[int]:
    """Objects shaped like the registration's (one per KV group per chunk), about ``bytes_per_client`` in all."""
    per_chunk = [reg.group_bytes_per_chunk(g) for g in reg.group_names]
    return per_chunk * max(1, bytes_per_client // reg.bytes_per_chunk)


@contextlib.contextmanager
def store_clients(master: str, metadata: str, sizes: list[int], n: int) -> Iterator[list[_StoreClient]]:
    """``n`` rank-like Mooncake clients, closed afterwards."""
    made: list[_StoreClient] = []
    try:
        for _ in range(n):
            made.append(_StoreClient(master, metadata, sizes))
        yield made
    finally:
        for c in made:
            c.close()


class PairedRawGet:
    """The raw reference measured beside each restore: the same clients GET the same objects (stored once) with
    ``batch_get_into``, all at once, right before the restore it is compared with. On a noisy machine a ratio of
    two measurements taken seconds apart is far steadier than one against a reference taken minutes earlier."""

    def __init__(self, clients: Sequence[_StoreClient], run_id: str) -> None:
        self.clients = clients
        self.keys = [[f"bsr-bench/{run_id}/paired/{i}/{j}" for j in range(len(c.sizes))] for i, c in enumerate(clients)]
        errs = [c.op("raw", "put", k) for c, k in zip(clients, self.keys, strict=True)]
        if any(errs):
            raise ServiceError(f"storing the paired raw reference failed: {next(e for e in errs if e)}")

    def measure(self) -> dict[str, Any]:
        """GB/s per client until *every* client is done, as a restore's request-level rate per rank runs until
        its slowest rank is done; the median client's own rate is kept beside it."""
        secs, wall, errs = _timed_parallel(self.clients, "raw", "get", self.keys)
        total = self.clients[0].total
        return {
            "gbps_per_client": round(total / wall / 1e9, 4),
            "gbps_median_client": round(total / statistics.median(secs) / 1e9, 4),
            "bytes_per_client": total,
            "error": next((e for e in errs if e), None),
        }

    def remove(self) -> None:
        for c, k in zip(self.clients, self.keys, strict=True):
            c.remove(k)


def mooncake_bandwidth(
    reg: Registration, made: Sequence[_StoreClient], *, trials: int, run_id: str
) -> list[dict[str, Any]]:
    """GET and PUT per client through the engine's tier class and through the raw store, isolated (one client at
    a time) and concurrent (all at once, as TP ranks restore), after one discarded warm-up round."""
    clients = len(made)
    sizes = made[0].sizes
    total = sum(sizes)
    per_chunk = [reg.group_bytes_per_chunk(g) for g in reg.group_names]
    samples: dict[tuple[str, str, str], list[list[float]]] = {}
    walls: dict[tuple[str, str, str], list[float]] = {}
    errors: dict[tuple[str, str, str], str] = {}
    for trial in range(trials + 1):
        for mode in ("isolated", "concurrent"):
            groups = [[i] for i in range(clients)] if mode == "isolated" else [list(range(clients))]
            for group in groups:
                who = [made[i] for i in group]
                keys = {
                    p: [[f"bsr-bench/{run_id}/{p}/{mode}/{trial}/{i}/{j}" for j in range(len(sizes))] for i in group]
                    for p in ("tier", "raw")
                }
                try:
                    for path in ("tier", "raw"):
                        for kind in ("put", "get"):
                            if kind == "get":
                                for c in who:
                                    c.dst.zero_()  # a stale copy must never pass as this one
                            secs, wall, errs = _timed_parallel(who, path, kind, keys[path])
                            if kind == "get" and not any(errs):
                                errs = ["" if c.dst.equal(c.src) else "wrong bytes" for c in who]
                            k = (path, kind, mode)
                            if any(errs):
                                errors.setdefault(k, next(e for e in errs if e))
                            if trial > 0:
                                samples.setdefault(k, []).append(secs)
                                walls.setdefault(k, []).append(wall)
                finally:
                    for i, c in zip(group, who, strict=True):
                        c.remove(keys["tier"][group.index(i)] + keys["raw"][group.index(i)])
    rows: list[dict[str, Any]] = []
    for (path, kind, mode), per_trial in samples.items():
        flat = [s for trial in per_trial for s in trial]
        row = {
            "kind": "mooncake",
            "path": path,
            "op": kind,
            "mode": mode,
            "clients": clients,
            "objects_per_client": len(sizes),
            "object_bytes": per_chunk,
            "bytes_per_client": total,
            "gbps_per_client": round(total / statistics.median(flat) / 1e9, 4),
            "gbps_trials": [round(total / s / 1e9, 4) for s in flat],
            "aggregate_gbps": (
                round(clients * total / statistics.median(walls[(path, kind, mode)]) / 1e9, 4)
                if mode == "concurrent"
                else None
            ),
        }
        err = errors.get((path, kind, mode))
        row["error"] = err or None
        row["checks"] = {"every_object_whole": not err}
        row["status"] = "fail" if err else "pass"
        rows.append(row)
    return rows


def run_store(
    client: AdminClient,
    *,
    tokens: int = 131_072,
    w: int = 32,
    trials: int = 2,
    raw_bytes: int = 512 * MiB,
    copy_bytes: int = 1024 * MiB,
    mooncake: dict[str, str] | None = None,
    salt: int | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tier bandwidth beside the machine's memory-copy ceiling, all in one run: the memcpy ceiling; GET/PUT per
    client through the tier class and the raw store (needs ``mooncake``: the engine's master address and
    metadata URL), isolated and concurrent; restores through the engine from Mooncake only, whole-plan (W=0)
    against W with B = RWS(W) and B = 2·RWS(W), each paired with a raw concurrent GET measured right before it.
    Reports ratios beside the absolute numbers."""
    salt = new_salt() if salt is None else salt
    params: dict[str, Any] = {
        "tokens": tokens,
        "W": w,
        "trials": trials,
        "raw_bytes_per_client": raw_bytes,
        "copy_bytes": copy_bytes,
        "mooncake": mooncake,
    }
    run = Run("store", "store", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    _, exclude = _isolate(info, "mooncake")
    rws = accounting.rws_bytes(reg, w)
    cap = _pool_capacity(client)
    # The whole-plan path needs the whole prefix in the pool: clamp the prefix to what this pool holds.
    fit_chunks = accounting.max_window_for_capacity(reg, cap)
    n_tokens = min(tokens, fit_chunks * reg.chunk_size)
    if n_tokens <= 0:
        raise InvalidInput(f"the engine's pool ({cap:,} bytes per rank) cannot hold one chunk")
    params["tokens_restored"] = n_tokens
    _require_tokens(info, n_tokens)

    with run.row(kind="memcpy") as row:
        row["results"] = memcpy_ceiling(copy_bytes, max(trials, 3))
        judge(row, {"measured": bool(row["results"])})
    with contextlib.ExitStack() as stack:
        paired: PairedRawGet | None = None
        if mooncake and not run.stopped:
            try:
                clients = stack.enter_context(
                    store_clients(
                        mooncake["master_address"],
                        mooncake["metadata_url"],
                        object_sizes(reg, raw_bytes),
                        reg.tp_size,
                    )
                )
            except ImportError as e:
                raise ServiceError(f"cannot load the Mooncake client here: {e}") from None
            with run.row(kind="mooncake-set") as row:
                mc_rows = mooncake_bandwidth(reg, clients, trials=trials, run_id=run.bundle["run_id"])
                row["results"] = mc_rows
                judge(row, {"every_object_whole": all(r["status"] == "pass" for r in mc_rows)})
            if not run.stopped:
                paired = PairedRawGet(clients, run.bundle["run_id"])
                stack.callback(paired.remove)
        configs = _store_restores(run, client, n_tokens, w, rws, cap, exclude, trials, paired)
    return run.finish(*_store_summary(run, configs, rws))


def _store_restores(
    run: Run,
    client: AdminClient,
    n_tokens: int,
    w: int,
    rws: int,
    cap: int,
    exclude: Sequence[str],
    trials: int,
    paired: PairedRawGet | None,
) -> list[tuple[int, int | None]]:
    """Warm the prompt, then per trial restore it whole-plan and windowed, each beside its paired raw GET."""
    original = {"budget_bytes": run.info["budget_bytes"]}
    prompt = _prompt(n_tokens, run.bundle["salt"])
    configs: list[tuple[int, int | None]] = [(0, None), (w, rws)]
    if cap >= 2 * rws:
        configs.append((w, 2 * rws))
    try:
        if not run.stopped:
            client.update_settings(budget_bytes=rws)
            with run.row(kind="warm", tokens=n_tokens) as row:
                row["warm"] = _warm_evidence(client.submit(prompt, w=w))
                judge(row, {"warm_hash_ok": row["warm"]["hash_ok"] is True})
        for trial in range(trials):
            for cw, budget in configs:
                if run.stopped:
                    break
                with run.row(kind="restore", W=cw, budget_bytes=budget, trial=trial, tokens=n_tokens) as row:
                    if budget is not None:
                        client.update_settings(budget_bytes=budget)
                    raw = paired.measure() if paired else None
                    ev = run.restore(prompt, n_tokens, cw, exclude=exclude, verify=trial == 0)
                    row |= ev
                    row["paired_raw_get"] = raw
                    row["vs_paired_raw"] = _ratio(ev["gbps_per_rank"], raw["gbps_per_client"]) if raw else None
                    bound = ev["predicted_peak_bytes"] if budget is None or budget == rws else None
                    checks = _restore_checks(ev, n_tokens, peak=bound, verified=trial == 0)
                    if raw:
                        checks["paired_raw_whole"] = raw["error"] is None
                    judge(row, checks)
    finally:
        run.bundle["engine"]["settings_restored"] = _put_back(client, original)
    return configs


def _store_summary(
    run: Run, configs: list[tuple[int, int | None]], rws: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    done = completed(run.rows)
    memcpy: list[dict[str, Any]] = next((r["results"] for r in done if r.get("kind") == "memcpy"), [])
    copies = [m for m in memcpy if m.get("op", "copy") == "copy"]
    memcpy_1t = next((m["gbps"] for m in copies if m["threads"] == 1), None)
    checksum = next((m["gbps"] for m in memcpy if m.get("op", "copy") != "copy"), None)
    mc: list[dict[str, Any]] = next((r["results"] for r in done if r.get("kind") == "mooncake-set"), [])

    def mc_gbps(path: str, op: str, mode: str) -> float | None:
        return next((m["gbps_per_client"] for m in mc if (m["path"], m["op"], m["mode"]) == (path, op, mode)), None)

    restores: dict[str, Any] = {}
    for cw, budget in configs:
        sel = [r for r in done if r.get("kind") == "restore" and r["W"] == cw and r["budget_bytes"] == budget]
        if not sel:
            continue
        label = "W=0" if cw == 0 else f"W={cw},B={'RWS' if budget == rws else '2RWS'}"
        restores[label] = {
            "gbps_per_rank": _median([r["gbps_per_rank"] for r in sel]),
            "rank_gbps": _median([x["gbps"] for r in sel for x in r["ranks"]]),
            "seconds": _median([r["seconds"] for r in sel]),
            "fetch_seconds": _median([x["fetch_seconds"] for r in sel for x in r["ranks"]]),
            "install_seconds": _median([x["install_seconds"] for r in sel for x in r["ranks"]]),
            "peak_pool_bytes": max(r["peak_pool_bytes"] for r in sel),
            "runs": len(sel),
            # Each restore against the raw GET measured just before it (median of the per-restore ratios).
            "paired_raw_gbps_per_client": _median(
                [r["paired_raw_get"]["gbps_per_client"] for r in sel if r.get("paired_raw_get")]
            ),
            "vs_paired_raw": _median([r["vs_paired_raw"] for r in sel if r.get("vs_paired_raw") is not None]),
        }
    w0 = (restores.get("W=0") or {}).get("gbps_per_rank")
    bsr1 = next((v["gbps_per_rank"] for k, v in restores.items() if k.endswith("B=RWS")), None)
    bsr2 = next((v["gbps_per_rank"] for k, v in restores.items() if k.endswith("B=2RWS")), None)

    def paired(label_end: str) -> float | None:
        return next((v["vs_paired_raw"] for k, v in restores.items() if k.endswith(label_end)), None)

    raw_get_c = mc_gbps("raw", "get", "concurrent")
    ratios = {
        "raw_get_isolated/memcpy_1thread": _ratio(mc_gbps("raw", "get", "isolated"), memcpy_1t),
        "raw_get_concurrent/memcpy_1thread": _ratio(raw_get_c, memcpy_1t),
        "raw_put_concurrent/memcpy_1thread": _ratio(mc_gbps("raw", "put", "concurrent"), memcpy_1t),
        "tier_get/raw_get (concurrent)": _ratio(mc_gbps("tier", "get", "concurrent"), raw_get_c),
        "tier_put/raw_put (concurrent)": _ratio(
            mc_gbps("tier", "put", "concurrent"), mc_gbps("raw", "put", "concurrent")
        ),
        "restore_W0/raw_get (paired)": paired("W=0"),
        "restore_W,B=RWS/raw_get (paired)": paired("B=RWS"),
        "restore_W,B=2RWS/raw_get (paired)": paired("B=2RWS"),
        "restore_W,B=RWS/restore_W0": _ratio(bsr1, w0),
        "restore_W,B=2RWS/restore_W0": _ratio(bsr2, w0),
        "restore_W0/memcpy_1thread": _ratio(w0, memcpy_1t),
    }
    summary = {
        "memcpy_gbps": {str(m["threads"]): m["gbps"] for m in copies},
        "checksum_gbps": checksum,
        "mooncake_gbps_per_client": {f"{m['path']} {m['op']} {m['mode']}": m["gbps_per_client"] for m in mc},
        "mooncake_aggregate_gbps": {
            f"{m['path']} {m['op']}": m["aggregate_gbps"] for m in mc if m["mode"] == "concurrent"
        },
        "restore": restores,
        "ratios": ratios,
        "completed": len(done),
        "interrupted": len(run.rows) - len(done),
    }
    best = ratios["restore_W,B=2RWS/restore_W0"]
    raw_ratio = ratios["restore_W,B=2RWS/raw_get (paired)"]
    targets = [
        target(
            f"W restore throughput with B = 2·RWS at least {OVERLAP_TARGET} of the whole-plan path (W=0)",
            f">= {OVERLAP_TARGET}",
            best,
            None if best is None else best >= OVERLAP_TARGET,
            "request-level GB/s per rank, same prefix, Mooncake only",
        ),
        target(
            f"Mooncake restore at least {RAW_TARGET} of raw batch_get_into in the same run",
            f">= {RAW_TARGET}",
            raw_ratio,
            None if raw_ratio is None else raw_ratio >= RAW_TARGET,
            "BSR restore (B = 2·RWS) per rank against raw GET per client, both ranks/clients at once, each restore "
            "against the raw GET measured right before it (median of the ratios)",
        ),
    ]
    return summary, targets


# -- failure matrix ----------------------------------------------------------------------------------------------


def run_failures(
    client: AdminClient,
    *,
    tokens: int = 8192,
    w: int | None = None,
    on_row: OnRow | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The paper's failure matrix (the scenarios of `bsr drill`), one row per scenario."""
    from bsr_cli.drill import SCENARIOS, run_drill

    run = Run("failures", "fail", client, {"tokens": tokens, "W": w}, on_row=on_row, engine_meta=engine_meta)
    _require_tokens(run.info, tokens)
    if not run.info.get("faults_enabled"):
        # Checked here: inside a row, the drill's refusal would read as an interrupted scenario.
        raise FaultsDisabled(
            "the failure matrix needs an engine started with faults enabled",
            hint="bsr engine up --enable-faults, or run the bench with --embedded",
        )
    for sc in SCENARIOS:
        with run.row(scenario=sc.name) as row:
            # One scenario per drill call, so an interruption marks just the scenario it hit.
            res = run_drill(client, tokens=tokens, w=w, scenarios=(sc,))["scenarios"][0]
            row |= res
            judge(row, dict(res["checks"]))
        if run.stopped:
            break
    done = completed(run.rows)
    summary = {
        "scenarios": {r["scenario"]: r["status"] for r in run.rows},
        "passed": sum(r["status"] == "pass" for r in done),
        "completed": len(done),
        "interrupted": len(run.rows) - len(done),
    }
    ok = bool(done) and all(r["status"] == "pass" for r in done) and len(done) == len(SCENARIOS)
    targets = [target("every failure scenario fails closed and recovers", "all PASS", summary["scenarios"], ok)]
    return run.finish(summary, targets)


# -- whole-plan ladder ---------------------------------------------------------------------------------------------


def run_ladder(
    factory: EngineFactory,
    *,
    prefixes: Sequence[int] = LADDER_PREFIXES,
    rungs: Sequence[int] = SCALED_LADDER,
    warm_w: int = 32,
    salt: int | None = None,
    on_row: OnRow | None = None,
    on_rung: Callable[[int], None] | None = None,
    on_attempt: Callable[[int, dict[str, Any]], None] | None = None,
    engine_meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole-plan path (W=0): raise the pool capacity through ``rungs`` (one engine start per rung, every
    still-failing prefix tried at each) until full reuse succeeds. Each prefix's row reports its first passing
    rung and measured peak beside the core's prediction, ``ladder_rung(whole_plan_bytes)``."""
    tokens = sorted(set(prefixes))
    steps = sorted(set(rungs))
    if not tokens or not steps:
        raise InvalidInput("the ladder needs prefix lengths and capacity rungs")
    salt = new_salt() if salt is None else salt
    state: dict[int, dict[str, Any]] = {n: {"attempts": [], "first": None, "evidence": None} for n in tokens}
    pending = list(tokens)
    engines: list[dict[str, Any]] = []
    run: Run | None = None
    stop_reason: str | None = None
    params = {"prefixes": tokens, "rungs": steps, "warm_W": warm_w}
    for rung in steps:
        if not pending or stop_reason:
            break
        if on_rung:
            on_rung(rung)
        current: int | None = None
        try:
            t0 = time.monotonic()
            with factory(rung) as client:
                startup = time.monotonic() - t0
                if run is None:
                    meta = {"restarted_per_rung": True} | (engine_meta or {})
                    run = Run("ladder", "ladder", client, params, salt=salt, on_row=on_row, engine_meta=meta)
                    _require_tokens(run.info, tokens[-1])
                else:
                    run.client = client
                engines.append(
                    {"pool_bytes": rung, "startup_s": round(startup, 3), "url": client.url, "info": client.info()}
                )
                for n in list(pending):
                    current = n
                    att = _ladder_attempt(run, n, rung, warm_w, salt)
                    state[n]["attempts"].append(att)
                    if on_attempt:
                        on_attempt(n, att)
                    if att["passed"]:
                        state[n]["first"], state[n]["evidence"] = rung, att
                        pending.remove(n)
                current = None
        except KeyboardInterrupt:
            if run is None:
                raise
            run._abort_inflight()
            stop_reason = "interrupted by the operator (Ctrl-C)"
            run.interrupt("operator")
        except (EngineError, ServiceError, CapacityError) as e:
            if run is None:
                raise
            stop_reason = f"{e.kind}: {e.message} (rung {rung:,} bytes, prefix {current})"
            run.interrupt("error")
    assert run is not None  # the first rung either started an engine or raised
    run.bundle["engine"]["rungs"] = engines
    reg = run.reg
    for n in tokens:
        s = state[n]
        chunks = accounting.chunks_for_tokens(n, reg.chunk_size)
        need = accounting.whole_plan_bytes(reg, chunks)
        predicted = accounting.ladder_rung(need, steps)
        row: dict[str, Any] = {
            "status": "interrupted",
            "tokens": n,
            "chunks": chunks,
            "whole_plan_bytes": need,
            "predicted_rung": predicted,
            "first_passing_rung": s["first"],
            "attempts": s["attempts"],
        }
        ev = s["evidence"]
        if ev is None and stop_reason and n in pending:
            row["reason"] = stop_reason
        elif ev is None:
            # The ladder topped out: consistent only when the core predicted that too.
            judge(row, {"rung_matches_prediction": predicted is None})
        else:
            row |= {
                "measured_peak_bytes": ev["peak_pool_bytes"],
                "ranks": ev["ranks"],
                "seconds": ev["seconds"],
                "gbps": ev["gbps"],
                "tiers": ev["tiers"],
                "hash_ok": ev["hash_ok"],
                "healthy": ev["healthy"],
            }
            judge(
                row,
                {
                    "rung_matches_prediction": s["first"] == predicted,
                    "peak_equals_whole_plan": all(r["pool_peak_bytes"] == need for r in ev["ranks"]),
                    "hash_canonical": ev["hash_ok"] is True,
                    "ranks_healthy": bool(ev["healthy"]),
                },
            )
        run.rows.append(row)
        if on_row:
            on_row(row)
    done = completed(run.rows)
    summary = {
        "first_passing_rung": {str(r["tokens"]): r["first_passing_rung"] for r in run.rows},
        "predicted_rung": {str(r["tokens"]): r["predicted_rung"] for r in run.rows},
        "measured_peak_bytes": {str(r["tokens"]): r.get("measured_peak_bytes") for r in done},
        "engine_starts": len(engines),
        "completed": len(done),
        "interrupted": len(run.rows) - len(done),
    }
    match = all(r["checks"]["rung_matches_prediction"] for r in done) if done else None
    targets = [
        target(
            "first passing rung equals the core's prediction (ladder_rung of the whole-plan need)",
            "equal for every prefix",
            summary["first_passing_rung"],
            match,
        )
    ]
    return run.finish(summary, targets)


def _ladder_attempt(run: Run, n: int, rung: int, warm_w: int, salt: int) -> dict[str, Any]:
    c, reg = run.client, run.reg
    prompt = _prompt(n, salt)
    att: dict[str, Any] = {"rung": rung, "warm": None}
    # The fs tier outlives engine restarts: warm only when no tier holds the whole prompt yet.
    if int(c.probe(prompt).get("committable_tokens", 0)) < n:
        w = max(1, min(warm_w, rung // reg.bytes_per_chunk))
        att["warm"] = _warm_evidence(c.submit(prompt, w=w))
    ev = run.restore(prompt, n, 0)
    att |= {
        k: ev[k]
        for k in (
            "outcome",
            "committed_tokens",
            "failure",
            "peak_pool_bytes",
            "seconds",
            "gbps",
            "tiers",
            "hash_ok",
            "healthy",
            "ranks",
        )
    }
    att["passed"] = ev["outcome"] == "committed" and ev["committed_tokens"] == n
    return att


# -- embedded engines sized for each experiment -----------------------------------------------------------------


@contextlib.contextmanager
def embedded_engine(state_dir: Path, opts: EngineOptions) -> Iterator[AdminClient]:
    """Start an embedded engine in ``state_dir``, yield a client of it, and always stop it."""
    from bsr_cli.client import AdminClient
    from bsr_cli.engine import supervisor

    try:
        supervisor.up(state_dir, opts)
        conn = local_engine.connection(state_dir)
        if conn is None:
            raise ServiceError(f"the embedded engine in {state_dir} recorded no admin URL")
        with AdminClient(conn[0], conn[1] or None, timeout_s=120.0) as client:
            yield client
    finally:
        supervisor.down(state_dir)


def embedded_options(experiment: str, reg: Registration, **p: Any) -> EngineOptions:
    """Engine options sized for one experiment on this machine (pool, prompt limit, store capacity)."""
    from bsr_cli.engine.supervisor import EngineOptions

    def per_prompt(n: int) -> int:  # store bytes of one prompt, every rank
        return n * reg.bytes_per_token * reg.tp_size

    headroom = 512 * MiB

    def sized(w: int, n: int, pool: int, segment: int, fetch_timeout_s: float = 60.0) -> EngineOptions:
        # B = RWS(W) in every profile: one live window, the paper's serialized restore.
        return EngineOptions(
            reg,
            w=w,
            pool_bytes=pool,
            budget_bytes=accounting.rws_bytes(reg, w),
            max_tokens=n,
            kv_tokens=n,
            segment_bytes=segment,
            fetch_timeout_s=fetch_timeout_s,
        )

    if experiment == "sweep":
        w, top = int(p["w"]), max(p["prefixes"])
        copies = 2 if p.get("repeat", True) else 1
        # The pool is fixed for the whole block.
        return sized(w, top, 2 * accounting.rws_bytes(reg, w), copies * per_prompt(top) + headroom)
    if experiment == "wlaw":
        top_w, n = max(p["ws"]), int(p["tokens"])
        return sized(top_w, n, accounting.rws_bytes(reg, top_w), per_prompt(n) + headroom)
    if experiment == "fs-concurrency":
        w, n = int(p["w"]), int(p["tokens"])
        return sized(w, n, 2 * accounting.rws_bytes(reg, w), per_prompt(n) + headroom)
    if experiment == "store":
        w, n = int(p["w"]), int(p["tokens"])
        whole = accounting.whole_plan_bytes(reg, accounting.chunks_for_tokens(n, reg.chunk_size))
        return sized(
            w,
            n,
            max(whole, 2 * accounting.rws_bytes(reg, w)),  # the whole-plan path stages the whole prefix at once
            # The prompt, plus the tier's and the raw client's copies of every client's objects at once.
            per_prompt(n) + 2 * reg.tp_size * int(p["raw_bytes"]) + headroom,
            fetch_timeout_s=600.0,  # one whole-plan window holds the entire prefix
        )
    if experiment == "failures":
        n = int(p["tokens"])
        return EngineOptions(reg, w=int(p.get("w") or 32), max_tokens=n, kv_tokens=2 * n, faults_enabled=True)
    raise InvalidInput(f"no embedded engine profile for experiment {experiment!r}")


def embedded_ladder_factory(state_dir: Path, reg: Registration, *, max_tokens: int) -> EngineFactory:
    """Restart the embedded engine in ``state_dir`` with each rung as its pool (W=0, B = the pool). The state
    directory, and so the filesystem tier, survives restarts: later rungs restore without re-warming."""
    from bsr_cli.engine.supervisor import EngineOptions

    def factory(pool_bytes: int) -> AbstractContextManager[AdminClient]:
        opts = EngineOptions(
            reg,
            w=0,
            pool_bytes=pool_bytes,
            budget_bytes=pool_bytes,
            max_tokens=max_tokens,
            kv_tokens=max_tokens,
            segment_bytes=max_tokens * reg.bytes_per_token * reg.tp_size + 512 * MiB,
            fetch_timeout_s=600.0,  # the whole plan is one window
        )
        return embedded_engine(state_dir, opts)

    return factory


def mooncake_of(state_dir: Path, url: str) -> dict[str, str] | None:
    """The Mooncake master of the embedded engine in ``state_dir`` when it is the one serving ``url``."""
    from bsr_cli.client.local_engine import read_state

    st = read_state(state_dir)
    if not st or str(st.get("admin_url", "")).rstrip("/") != url.rstrip("/"):
        return None
    urls = (st.get("services", {}).get("mooncake_master") or {}).get("urls") or {}
    if not urls.get("rpc_address") or not urls.get("metadata_url"):
        return None
    return {"master_address": str(urls["rpc_address"]), "metadata_url": str(urls["metadata_url"])}


def fs_dir_of(state_dir: Path, url: str) -> Path | None:
    """The filesystem tier directory of the embedded engine in ``state_dir`` when it serves ``url``."""
    from bsr_cli.client.local_engine import read_state

    st = read_state(state_dir)
    if not st or str(st.get("admin_url", "")).rstrip("/") != url.rstrip("/"):
        return None
    path = state_dir / "fs-tier"
    return path if path.is_dir() else None


__all__ = [
    "E1_PREFIXES",
    "LADDER_PREFIXES",
    "SCALED_LADDER",
    "W_LAW",
    "EngineFactory",
    "Run",
    "embedded_engine",
    "embedded_ladder_factory",
    "embedded_options",
    "run_failures",
    "run_fs_concurrency",
    "run_ladder",
    "run_store",
    "run_sweep",
    "run_wlaw",
]
