"""Store bandwidth: the memcpy ceiling, raw Mooncake GET/PUT, and restores from Mooncake whole-plan against W,
each beside a paired raw GET."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    BenchRow,
    Bundle,
    OnRow,
    RankEvidence,
    RestoreEvidence,
    RowMeta,
    Run,
    Target,
    WarmRow,
    completed,
    flat,
    isolate,
    median,
    new_salt,
    pool_capacity,
    prompt_of,
    put_back,
    ratio,
    require_tokens,
    restore_checks,
    target,
    warm_evidence,
    written_with,
)
from bsr_cli.bench.probes import (
    CopyCeiling,
    MooncakeRate,
    PairedRawGet,
    RawGetRate,
    memcpy_ceiling,
    mooncake_bandwidth,
    object_sizes,
    store_clients,
)
from bsr_cli.core import accounting, wire
from bsr_cli.core.evidence import TimedStage
from bsr_cli.core.stage_costs import OTHER_CPU
from bsr_cli.core.units import MiB
from bsr_cli.errors import InvalidInput, ServiceError

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient

_POOL_HINT = "restart the engine with a larger --pool, or run the bench with --embedded"
_CLIENT_HINT = "install the engine extra (./scripts/setup) to measure the Mooncake ceiling"


OVERLAP_TARGET = 0.9  # W=32 (B = 2·RWS) restore throughput against the whole-plan path
RAW_TARGET = 0.9  # Mooncake restore against raw batch_get_into


# -- the summary (fields in the order of its evidence keys) -----------------------------------------------------


@dataclass(frozen=True)
class StoreParams:
    """What the store bench was asked to measure."""

    tokens: int
    W: int
    trials: int
    raw_bytes_per_client: int
    copy_bytes: int
    mooncake: dict[str, str] | None  # the engine's master address and metadata URL
    # A multi-host engine's cap on each link (bits/s): every byte a rank restores crosses its link to the holder.
    link_ceiling_bps: int | None
    tokens_restored: int | None = wire.field(omit_none=True, default=None)  # the prefix clamped to the pool


@dataclass(frozen=True)
class StoreRestoreStats:
    """One restore configuration (W=0, or W with B = RWS or 2·RWS): medians over its trials."""

    gbps_per_rank: float | None  # request-level
    rank_gbps: float | None
    seconds: float | None
    fetch_seconds: float | None
    install_seconds: float | None
    peak_pool_bytes: int
    runs: int
    # Each restore against the raw GET measured just before it (median of the per-restore ratios).
    paired_raw_gbps_per_client: float | None
    vs_paired_raw: float | None
    # CPU seconds per GB a rank restored, by stage (fetch, verify, install, wait) and the rest of the rank's process
    # ("other": the transport's own threads); medians over the ranks of every restore. None: no rank reported them.
    stage_cpu_s_per_gb: dict[str, float | None] | None = None


@dataclass(frozen=True)
class StoreSummary:
    memcpy_gbps: dict[str, float]  # per thread count
    checksum_gbps: float | None
    mooncake_gbps_per_client: dict[str, float]  # "raw get concurrent", ...
    mooncake_aggregate_gbps: dict[str, float | None]  # concurrent only: "raw get", ...
    restore: dict[str, StoreRestoreStats]  # "W=0", "W=32,B=RWS", "W=32,B=2RWS"
    link_ceiling_gbps: float | None
    ratios: dict[str, float | None]
    completed: int
    interrupted: int


@dataclass(frozen=True, kw_only=True)
class CeilingRow(BenchRow):
    """What the machine and the store sustain without the engine: the memory-copy ceiling ("memcpy") or the
    Mooncake GET/PUT rates per client ("mooncake-set")."""

    kind: str
    meta: RowMeta
    results: tuple[CopyCeiling, ...] | tuple[MooncakeRate, ...] | None = wire.field(omit_none=True, default=None)

    @classmethod
    def begun(cls, kind: str) -> Callable[[str], StoreRow]:
        return lambda started_at: cls(kind=kind, meta=RowMeta(started_at=started_at))


@dataclass(frozen=True, kw_only=True)
class StoreRestoreRow(BenchRow):
    """One restore from Mooncake (whole-plan or windowed), beside the raw GET measured right before it."""

    kind: str = "restore"
    W: int
    budget_bytes: int | None  # None: the whole-plan path's (the engine's budget unchanged)
    trial: int
    tokens: int
    meta: RowMeta
    restore: RestoreEvidence | None = flat(present="outcome")  # None: interrupted before it finished
    paired_raw_get: RawGetRate | None = written_with("restore")
    vs_paired_raw: float | None = written_with("restore")  # the restore's GB/s per rank over the raw GET's per client


StoreRow = CeilingRow | WarmRow | StoreRestoreRow


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
    engine_meta: dict[str, bool | float | None] | None = None,
    link_bps: int | None = None,
) -> Bundle:
    """Tier bandwidth beside the machine's memory-copy ceiling, all in one run: the memcpy ceiling; GET/PUT per
    client through the tier class and the raw store (needs ``mooncake``: the engine's master address and
    metadata URL), isolated and concurrent; restores through the engine from Mooncake only, whole-plan (W=0)
    against W with B = RWS(W) and B = 2·RWS(W), each paired with a raw concurrent GET measured right before it.
    Reports ratios beside the absolute numbers."""
    salt = new_salt() if salt is None else salt
    params = StoreParams(
        tokens=tokens,
        W=w,
        trials=trials,
        raw_bytes_per_client=raw_bytes,
        copy_bytes=copy_bytes,
        mooncake=mooncake,
        link_ceiling_bps=link_bps,
    )
    run: Run[StoreRow] = Run("store", "store", client, params, salt=salt, on_row=on_row, engine_meta=engine_meta)
    reg, info = run.reg, run.info
    _, exclude = isolate(info, "mooncake")
    rws = accounting.rws_bytes(reg, w)
    cap = pool_capacity(client)
    # The whole-plan path needs the whole prefix in the pool: clamp the prefix to what this pool holds.
    fit_chunks = accounting.max_window_for_capacity(reg, cap)
    n_tokens = min(tokens, fit_chunks * reg.chunk_size)
    if n_tokens <= 0:
        raise InvalidInput(f"the engine's pool ({cap:,} bytes per rank) cannot hold one chunk", hint=_POOL_HINT)
    run.params = replace(params, tokens_restored=n_tokens)
    require_tokens(info, n_tokens)

    # What the summary reads: measured in rows that finished (an interrupted row leaves its list empty).
    ceilings: list[CopyCeiling] = []
    rates: list[MooncakeRate] = []
    with run.row(CeilingRow.begun("memcpy")) as slot:
        measured = memcpy_ceiling(copy_bytes, max(trials, 3))
        judged = slot.row.meta.judged({"measured": bool(measured)})
        slot.row = CeilingRow(kind="memcpy", results=tuple(measured), meta=judged)
        ceilings = measured
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
                raise ServiceError(f"cannot load the Mooncake client here: {e}", hint=_CLIENT_HINT) from None
            with run.row(CeilingRow.begun("mooncake-set")) as slot:
                mc_rows = mooncake_bandwidth(reg, clients, trials=trials, run_id=run.run_id)
                judged = slot.row.meta.judged({"every_object_whole": all(r.passed for r in mc_rows)})
                slot.row = CeilingRow(kind="mooncake-set", results=tuple(mc_rows), meta=judged)
                rates = mc_rows
            if not run.stopped:
                paired = PairedRawGet(clients, run.run_id)
                stack.callback(paired.remove)
        configs = _store_restores(run, client, n_tokens, salt, w, rws, cap, exclude, trials, paired)
    summary, targets = _store_summary(run, configs, rws, ceilings, rates, link_bps)
    return run.finish(summary, targets)


def _store_restores(
    run: Run[StoreRow],
    client: AdminClient,
    n_tokens: int,
    salt: int,
    w: int,
    rws: int,
    cap: int,
    exclude: Sequence[str],
    trials: int,
    paired: PairedRawGet | None,
) -> list[tuple[int, int | None]]:
    """Warm the prompt, then per trial restore it whole-plan and windowed, each beside its paired raw GET."""
    original = {"budget_bytes": run.info.budget_bytes}
    prompt = prompt_of(n_tokens, salt)
    configs: list[tuple[int, int | None]] = [(0, None), (w, rws)]
    if cap >= 2 * rws:
        configs.append((w, 2 * rws))
    try:
        if not run.stopped:
            client.update_settings(budget_bytes=rws)
            with run.row(WarmRow.begun(n_tokens)) as slot:
                warm = warm_evidence(client.submit(prompt, w=w))
                judged = slot.row.meta.judged({"warm_hash_ok": warm.hash_ok is True})
                slot.row = WarmRow(tokens=n_tokens, warm=warm, meta=judged)
        for trial in range(trials):
            for cw, budget in configs:
                if run.stopped:
                    break
                begun = _restore_begun(cw, budget, trial, n_tokens)
                with run.row(begun) as slot:
                    if budget is not None:
                        client.update_settings(budget_bytes=budget)
                    raw = paired.measure() if paired else None
                    ev = run.restore(prompt, n_tokens, cw, exclude=exclude, verify=trial == 0)
                    vs_raw = ratio(ev.gbps_per_rank, raw.gbps_per_client) if raw else None
                    bound = ev.predicted_peak_bytes if budget is None or budget == rws else None
                    checks = restore_checks(ev, n_tokens, peak=bound, verified=trial == 0)
                    if raw:
                        checks["paired_raw_whole"] = raw.error is None
                    row = begun(slot.row.meta.started_at)
                    slot.row = replace(
                        row, restore=ev, paired_raw_get=raw, vs_paired_raw=vs_raw, meta=row.meta.judged(checks)
                    )
    finally:
        run.engine["settings_restored"] = put_back(client, original)
    return configs


def _restore_stats(sel: Sequence[StoreRestoreRow]) -> StoreRestoreStats:
    """Medians over one configuration's restores, each beside its paired raw GET."""
    evs = [r.restore for r in sel if r.restore]
    return StoreRestoreStats(
        gbps_per_rank=median([ev.gbps_per_rank for ev in evs]),
        rank_gbps=median([x.gbps for ev in evs for x in ev.ranks]),
        seconds=median([ev.seconds for ev in evs]),
        fetch_seconds=median([x.fetch_seconds for ev in evs for x in ev.ranks]),
        install_seconds=median([x.install_seconds for ev in evs for x in ev.ranks]),
        peak_pool_bytes=max(ev.peak_pool_bytes for ev in evs),
        runs=len(sel),
        paired_raw_gbps_per_client=median([r.paired_raw_get.gbps_per_client for r in sel if r.paired_raw_get]),
        vs_paired_raw=median([r.vs_paired_raw for r in sel if r.vs_paired_raw is not None]),
        stage_cpu_s_per_gb=stage_cpu_per_gb([x for ev in evs for x in ev.ranks]),
    )


def stage_cpu_per_gb(ranks: Sequence[RankEvidence]) -> dict[str, float | None] | None:
    """Medians over ``ranks`` of each stage's CPU seconds per GB the rank restored, and of the rest of its process
    (``other``); None when no rank reported its stages."""
    staged = [(x.stages, x.bytes_restored / 1e9) for x in ranks if x.stages is not None and x.bytes_restored > 0]
    if not staged:
        return None
    out = {s.value: median([c.of(s).cpu_s / gb for c, gb in staged]) for s in TimedStage}
    out[OTHER_CPU] = median([max(c.process_cpu_s - c.staged_cpu_s, 0.0) / gb for c, gb in staged])
    return out


def _restore_begun(w: int, budget: int | None, trial: int, tokens: int) -> Callable[[str | None], StoreRestoreRow]:
    return lambda at: StoreRestoreRow(W=w, budget_bytes=budget, trial=trial, tokens=tokens, meta=RowMeta(started_at=at))


def _store_summary(
    run: Run[StoreRow],
    configs: list[tuple[int, int | None]],
    rws: int,
    memcpy: Sequence[CopyCeiling],
    mc: Sequence[MooncakeRate],
    link_bps: int | None,
) -> tuple[StoreSummary, list[Target]]:
    done = completed(run.rows)
    copies = [m for m in memcpy if m.op == "copy"]
    memcpy_1t = next((m.gbps for m in copies if m.threads == 1), None)
    checksum = next((m.gbps for m in memcpy if m.op != "copy"), None)
    restores = _restores_by_config(done, configs, rws)
    link_gbps = None if link_bps is None else link_bps / 8 / 1e9
    ratios = _store_ratios(mc, memcpy_1t, restores, link_gbps)
    summary = StoreSummary(
        memcpy_gbps={str(m.threads): m.gbps for m in copies},
        checksum_gbps=checksum,
        mooncake_gbps_per_client={f"{m.path} {m.op} {m.mode}": m.gbps_per_client for m in mc},
        mooncake_aggregate_gbps={f"{m.path} {m.op}": m.aggregate_gbps for m in mc if m.mode == "concurrent"},
        restore=restores,
        link_ceiling_gbps=link_gbps,
        ratios=ratios,
        completed=len(done),
        interrupted=len(run.rows) - len(done),
    )
    return summary, _store_targets(ratios)


def _restores_by_config(
    done: Sequence[StoreRow], configs: list[tuple[int, int | None]], rws: int
) -> dict[str, StoreRestoreStats]:
    """The completed restores of each (W, B) measured, labelled "W=0", "W=32,B=RWS" or "W=32,B=2RWS"."""
    restores: dict[str, StoreRestoreStats] = {}
    for cw, budget in configs:
        sel = [
            r for r in done if isinstance(r, StoreRestoreRow) and r.restore and (r.W, r.budget_bytes) == (cw, budget)
        ]
        if not sel:
            continue
        label = "W=0" if cw == 0 else f"W={cw},B={'RWS' if budget == rws else '2RWS'}"
        restores[label] = _restore_stats(sel)
    return restores


def _store_ratios(
    mc: Sequence[MooncakeRate],
    memcpy_1t: float | None,
    restores: dict[str, StoreRestoreStats],
    link_gbps: float | None,
) -> dict[str, float | None]:
    """Each rate against the one it is judged by: the store against a one-thread memcpy, the tier class against the
    raw store, each restore against its paired raw GET and the windowed restores against the whole-plan path."""

    def mc_gbps(path: str, op: str, mode: str) -> float | None:
        return next((m.gbps_per_client for m in mc if (m.path, m.op, m.mode) == (path, op, mode)), None)

    whole = restores.get("W=0")
    w0 = whole.gbps_per_rank if whole else None
    bsr1 = next((v.gbps_per_rank for k, v in restores.items() if k.endswith("B=RWS")), None)
    bsr2 = next((v.gbps_per_rank for k, v in restores.items() if k.endswith("B=2RWS")), None)

    def paired(label_end: str) -> float | None:
        return next((v.vs_paired_raw for k, v in restores.items() if k.endswith(label_end)), None)

    raw_get_c = mc_gbps("raw", "get", "concurrent")
    ratios = {
        "raw_get_isolated/memcpy_1thread": ratio(mc_gbps("raw", "get", "isolated"), memcpy_1t),
        "raw_get_concurrent/memcpy_1thread": ratio(raw_get_c, memcpy_1t),
        "raw_put_concurrent/memcpy_1thread": ratio(mc_gbps("raw", "put", "concurrent"), memcpy_1t),
        "tier_get/raw_get (concurrent)": ratio(mc_gbps("tier", "get", "concurrent"), raw_get_c),
        "tier_put/raw_put (concurrent)": ratio(
            mc_gbps("tier", "put", "concurrent"), mc_gbps("raw", "put", "concurrent")
        ),
        "restore_W0/raw_get (paired)": paired("W=0"),
        "restore_W,B=RWS/raw_get (paired)": paired("B=RWS"),
        "restore_W,B=2RWS/raw_get (paired)": paired("B=2RWS"),
        "restore_W,B=RWS/restore_W0": ratio(bsr1, w0),
        "restore_W,B=2RWS/restore_W0": ratio(bsr2, w0),
        "restore_W0/memcpy_1thread": ratio(w0, memcpy_1t),
    }
    if link_gbps is not None:
        ratios["restore_W,B=RWS/link_ceiling"] = ratio(bsr1, link_gbps)
    return ratios


def _store_targets(ratios: dict[str, float | None]) -> list[Target]:
    """The store run's targets: the windowed restore against the whole-plan path, and against a raw GET."""
    best = ratios["restore_W,B=2RWS/restore_W0"]
    raw_ratio = ratios["restore_W,B=2RWS/raw_get (paired)"]
    return [
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
