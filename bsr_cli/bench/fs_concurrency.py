"""Filesystem load concurrency: the fs tier alone, concurrency 1 against 4, the disk's own rate beside it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    BenchRow,
    Bundle,
    OnRow,
    RestoreEvidence,
    RowMeta,
    RowStatus,
    Run,
    Target,
    WarmRow,
    completed,
    flat,
    isolate,
    median,
    new_salt,
    prompt_of,
    put_back,
    ratio,
    require_pool,
    require_tokens,
    restore_checks,
    target,
    warm_evidence,
)
from bsr_cli.bench.probes import DiskReadRate, PageEviction, cold_cache_method, disk_read_rate, evict_page_cache
from bsr_cli.core import accounting, wire
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


FS_SPEEDUP_TARGET = 1.5  # fs load concurrency 4 against 1


# -- the summary (fields in the order of its evidence keys) -----------------------------------------------------


@dataclass(frozen=True)
class FsParams:
    """What fs-concurrency was asked to measure, and how it evicts the tier's pages (None: it cannot)."""

    tokens: int
    W: int
    concurrencies: list[int]
    trials: int
    cold_method: str | None


@dataclass(frozen=True)
class FsConfigStats:
    """Medians over the restores of one cache state and load concurrency."""

    gbps: float | None
    seconds: float | None
    fetch_seconds: float | None  # per rank
    install_seconds: float | None  # per rank
    runs: int


@dataclass(frozen=True)
class FsSummary:
    by_config: dict[str, FsConfigStats]  # "cold/c=1", "warm/c=4", ...
    speedup: dict[str, float | None]  # per cache state: the highest concurrency against the lowest
    disk_gbps: dict[str, float | None]  # the disk alone, per concurrency
    # How far the disk itself lets the serial (c=1) cold restore speed up, and how much of it c=max uses.
    disk_headroom: float | None
    restore_share_of_disk: float | None
    peak_pool_bytes_per_rank: list[int]
    rws_unchanged: bool
    cold_method: str | None
    completed: int
    interrupted: int


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


@dataclass(frozen=True, kw_only=True)
class DiskRow(BenchRow):
    """The disk alone, read at the same total concurrency as a restore (no bsr)."""

    kind: str = "disk"
    concurrency: int
    threads: int
    trial: int
    meta: RowMeta
    disk: DiskReadRate | None = flat(present="gbps")  # None: interrupted before the read finished


@dataclass(frozen=True, kw_only=True)
class FsRestoreRow(BenchRow):
    """One restore from the fs tier at a load concurrency, its pages evicted first when the cache is cold."""

    kind: str = "restore"
    concurrency: int
    cache: str  # "cold" or "warm"
    trial: int
    tokens: int
    W: int
    meta: RowMeta
    evicted: PageEviction | None = wire.field(omit_none=True, default=None)  # the cold rows' eviction
    restore: RestoreEvidence | None = flat(present="outcome")  # None: interrupted before it finished


FsRow = WarmRow | DiskRow | FsRestoreRow


def fs_row_from_wire(d: object) -> FsRow:
    """An fs-concurrency row read back from a bundle, by its kind."""
    kind = d.get("kind") if isinstance(d, Mapping) else None
    if kind == "disk":
        return DiskRow.from_wire(d)
    if kind == "restore":
        return FsRestoreRow.from_wire(d)
    return WarmRow.from_wire(d)


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
    engine_meta: dict[str, bool | float | None] | None = None,
) -> Bundle:
    """Restore from the filesystem tier only (the others excluded), load concurrency 1 against 4 at the same W and
    B = RWS(W): throughput may change, the pool peak must not. Cold rows evict the tier's pages first."""
    conc = sorted(set(concurrencies))
    if not conc or conc[0] < 1 or trials < 1:
        raise InvalidInput(
            "concurrencies must be >= 1 and trials positive", hint="e.g. --concurrency 1,2,4,8 --trials 3"
        )
    salt = new_salt() if salt is None else salt
    method = cold_cache_method(fs_dir) if cold else None
    params = FsParams(tokens=tokens, W=w, concurrencies=conc, trials=trials, cold_method=method)
    run: Run[FsRow] = Run("fs-concurrency", "fs", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    require_tokens(info, tokens)
    _, exclude = isolate(info, "fs")
    rws = accounting.rws_bytes(reg, w)
    require_pool(client, rws, f"W={w}")
    original = {"budget_bytes": info.budget_bytes, "fs_concurrency": info.fs_concurrency}
    prompt = prompt_of(tokens, salt)
    caches = ["cold", "warm"] if method else ["warm"]
    try:
        client.update_settings(budget_bytes=rws)
        with run.row(WarmRow.begun(tokens, w)) as slot:
            warm = warm_evidence(client.submit(prompt, w=w))
            checks = {"warm_hash_ok": warm.hash_ok is True}
            slot.row = WarmRow(tokens=tokens, W=w, warm=warm, meta=slot.row.meta.judged(checks))
        files = _prompt_files(fs_dir, reg, tokens, salt) if method == "posix_fadvise" and fs_dir else []
        for trial in range(trials):
            for c in conc if files else ():
                if run.stopped:
                    break
                # The disk alone at the same total concurrency (every rank loads c objects at once).
                threads = c * reg.tp_size
                with run.row(_disk_row(c, threads, trial)) as slot:
                    disk = disk_read_rate(files, threads)
                    checks = {"read_whole": disk.error is None and disk.bytes > 0}
                    slot.row = DiskRow(
                        concurrency=c, threads=threads, trial=trial, disk=disk, meta=slot.row.meta.judged(checks)
                    )
            for cache in caches:
                for c in conc:
                    if run.stopped:
                        break
                    _restore_row(run, prompt, tokens, w, exclude, c, cache, trial, fs_dir, method)
    finally:
        run.engine["settings_restored"] = put_back(client, original)
    summary = _summary(run, reg, tokens, w, conc, caches, method)
    targets = _targets(summary, conc, method, rws, bool(summary.completed))
    return run.finish(summary, targets)


def _disk_row(c: int, threads: int, trial: int) -> Callable[[str], FsRow]:
    return lambda started_at: DiskRow(concurrency=c, threads=threads, trial=trial, meta=RowMeta(started_at=started_at))


def _restore_row(
    run: Run[FsRow],
    prompt: Prompt,
    tokens: int,
    w: int,
    exclude: list[str],
    c: int,
    cache: str,
    trial: int,
    fs_dir: Path | None,
    method: str | None,
) -> None:
    """One restore from the fs tier at load concurrency ``c``, its pages evicted first when ``cache`` is cold."""

    def begun(started_at: str | None) -> FsRestoreRow:
        meta = RowMeta(started_at=started_at)
        return FsRestoreRow(concurrency=c, cache=cache, trial=trial, tokens=tokens, W=w, meta=meta)

    with run.row(begun) as slot:
        row = begun(slot.row.meta.started_at)  # the slot holds it as any fs row
        run.client.update_settings(fs_concurrency=c)
        evicted = True
        if cache == "cold" and method:
            eviction = evict_page_cache(fs_dir, method)
            slot.row = row = replace(row, evicted=eviction)
            evicted = eviction.ok
        # Verify once per configuration; the restore's own seconds exclude the verification.
        ev = run.restore(prompt, tokens, w, exclude=exclude, verify=trial == 0)
        checks = restore_checks(ev, tokens, peak=ev.predicted_peak_bytes, verified=trial == 0)
        slot.row = replace(row, restore=ev, meta=row.meta.judged(checks | {"cache_evicted": evicted}))


def _summary(
    run: Run[FsRow],
    reg: Registration,
    tokens: int,
    w: int,
    conc: Sequence[int],
    caches: Sequence[str],
    method: str | None,
) -> FsSummary:
    """Medians per cache state and concurrency, the speedups, the disk's own rates and the pool peaks."""
    done = [r.restore for r in completed(run.rows) if isinstance(r, FsRestoreRow) and r.restore]
    done_at = [(r.cache, r.concurrency) for r in completed(run.rows) if isinstance(r, FsRestoreRow) and r.restore]
    by: dict[str, FsConfigStats] = {}
    for cache in caches:
        for c in conc:
            sel = [ev for ev, at in zip(done, done_at, strict=True) if at == (cache, c)]
            if sel:
                by[f"{cache}/c={c}"] = FsConfigStats(
                    gbps=median([r.gbps for r in sel]),
                    seconds=median([r.seconds for r in sel]),
                    fetch_seconds=median([x.fetch_seconds for r in sel for x in r.ranks]),
                    install_seconds=median([x.install_seconds for r in sel for x in r.ranks]),
                    runs=len(sel),
                )
    speedups: dict[str, float | None] = {}
    for cache in caches:
        lo, hi = by.get(f"{cache}/c={conc[0]}"), by.get(f"{cache}/c={conc[-1]}")
        if lo and hi:
            speedups[cache] = ratio(hi.gbps, lo.gbps)
    disk = [(r.concurrency, r.disk) for r in completed(run.rows) if isinstance(r, DiskRow) and r.disk]
    disk_gbps = {c: median([d.gbps for at, d in disk if at == c]) for c in conc}
    disk_ceiling = max((v for v in disk_gbps.values() if v is not None), default=None)
    serial_cold, top_cold = by.get(f"cold/c={conc[0]}"), by.get(f"cold/c={conc[-1]}")
    serial = serial_cold.gbps if serial_cold else None
    top = top_cold.gbps if top_cold else None
    peaks = sorted({x.pool_peak_bytes for r in done for x in r.ranks})
    return FsSummary(
        by_config=by,
        speedup=speedups,
        disk_gbps={str(c): v for c, v in disk_gbps.items()} if disk else {},
        disk_headroom=ratio(disk_ceiling, serial),
        restore_share_of_disk=ratio(top, disk_ceiling),
        peak_pool_bytes_per_rank=peaks,
        rws_unchanged=peaks == [accounting.peak_bytes(reg, w, accounting.chunks_for_tokens(tokens, reg.chunk_size))],
        cold_method=method,
        completed=len(done),
        interrupted=sum(r.meta.status == RowStatus.INTERRUPTED for r in run.rows),
    )


def _targets(summary: FsSummary, conc: Sequence[int], method: str | None, rws: int, any_done: bool) -> list[Target]:
    speedups = summary.speedup
    basis = "cold" if "cold" in speedups else "warm"
    measured = speedups.get(basis)
    # "Where the disk allows it": the disk read alone (cold, same files) must reach 1.5x the serial restore's rate,
    # else no load concurrency could give 1.5x and the target does not apply.
    headroom = summary.disk_headroom
    disk_allows = None if headroom is None else headroom >= FS_SPEEDUP_TARGET
    peaks = summary.peak_pool_bytes_per_rank
    return [
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
            "RWS unchanged across concurrencies",
            f"== {rws:,} bytes",
            peaks,
            summary.rws_unchanged if any_done else None,
        ),
    ]
