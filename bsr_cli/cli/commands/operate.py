"""Commands an on-call engineer types against a live engine: probe, submit, restore, faults, status, drill."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.core.evidence import Outcome
from bsr_cli.errors import (
    CapacityError,
    DrillViolation,
    InvalidInput,
    NothingToRestore,
    ServerError,
)

if TYPE_CHECKING:  # the result types are imported where a command uses them: `bsr probe --help` needs none
    from bsr_cli.cli.render.planning import CapacityFit
    from bsr_cli.core.events import Event
    from bsr_cli.core.faults import FaultSpec
    from bsr_cli.core.prompt import Prompt
    from bsr_cli.core.results import ManualRestoreResult
    from bsr_cli.core.status import EngineInfo, MarkerList

TokensFileOpt = Annotated[
    Path | None, typer.Option("--tokens-file", help="Token ids (JSON list or whitespace separated).")
]
PromptFileOpt = Annotated[Path | None, typer.Option("--prompt-file", help="Text, tokenized as the engine does.")]
SyntheticOpt = Annotated[int | None, typer.Option("--synthetic", help="A deterministic synthetic prompt of N tokens.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the synthetic prompt.")]
WOpt = Annotated[
    int | None, typer.Option("--W", "-W", "--window-size", help="Window size in chunks [default: the engine's].", min=0)
]


def _client(st: AppState) -> Any:
    from bsr_cli.client import AdminClient

    return AdminClient.from_settings(st.settings)


def _prompt(
    client: Any, tokens_file: Path | None, prompt_file: Path | None, synthetic: int | None, seed: int
) -> Prompt:
    from bsr_cli.prompts import prompt_body

    tokenizer = client.info().tokenizer if prompt_file is not None else None
    return prompt_body(tokens_file, prompt_file, synthetic, seed, tokenizer)


# `bsr probe --store`'s flags (read into probe_options.StoreProbeOptions).
StoreOpt = Annotated[
    str | None, typer.Option("--store", help="Probe a Mooncake store directly: mooncake://HOST:PORT (no engine).")
]
StoreModelOpt = Annotated[str | None, typer.Option("--model", help="With --store: model name in the keys.")]
StoreWorldSizeOpt = Annotated[
    int, typer.Option("--world-size", "--tp", help="With --store: TP world size in the keys.")
]
StoreMetadataOpt = Annotated[
    str | None,
    typer.Option("--metadata", help="With --store: metadata server URL [default: http://HOST:8080/metadata]."),
]
StoreMasterAdminOpt = Annotated[
    str | None, typer.Option("--master-admin", help="With --store: master admin URL [default: http://HOST:9003].")
]
StoreDtypeOpt = Annotated[
    str,
    typer.Option("--dtype", help="With --store: KV dtype in the keys (bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2, ...)."),
]
StoreTagOpt = Annotated[
    list[str] | None,
    typer.Option("--tag", help="With --store: an LMCache request tag KEY=VALUE in the keys (repeatable, in order)."),
]
StoreHashSeedOpt = Annotated[
    str,
    typer.Option(
        "--vllm-hash-seed",
        help="With --store: the PYTHONHASHSEED vLLM ran with when LMCache stored the keys (inside vLLM the hash "
        "chain starts from it); 'none' for LMCache without vLLM; 'auto' tries none and a few usual seeds "
        "against the store. Example: --vllm-hash-seed 0",
    ),
]
StoreVerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="With --store: show the Mooncake client's own log lines.")
]
StoreChunkSizeOpt = Annotated[int, typer.Option("--chunk-size", help="With --store: LMCache chunk size.", min=1)]


def probe(
    ctx: typer.Context,
    tokens_file: TokensFileOpt = None,
    prompt_file: PromptFileOpt = None,
    synthetic: SyntheticOpt = None,
    seed: SeedOpt = 0,
    store: StoreOpt = None,
    model: StoreModelOpt = None,
    world_size: StoreWorldSizeOpt = 1,
    metadata: StoreMetadataOpt = None,
    master_admin: StoreMasterAdminOpt = None,
    dtype: StoreDtypeOpt = "bf16",
    tag: StoreTagOpt = None,
    vllm_hash_seed: StoreHashSeedOpt = "auto",
    verbose: StoreVerboseOpt = False,
    chunk_size: StoreChunkSizeOpt = 256,
    width: Annotated[
        int | None, typer.Option("--width", help="Bitmap strip width in cells [default: fits the terminal].", min=8)
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Probe-only lookup: which rank, group and tier holds each chunk of a prompt. Changes nothing.

    With --store, asks the Mooncake store an LMCache deployment wrote, with no engine. Example, fp16 KV stored by
    LMCache inside vLLM started with PYTHONHASHSEED=0, TP 2:

    bsr probe --store mooncake://10.0.0.5:50051 --model meta-llama/Llama-3.1-8B --world-size 2 --dtype fp16
    --vllm-hash-seed 0 --tokens-file prompt.json
    """
    st = state(ctx, json_flag)
    if store is not None:
        from bsr_cli.cli.commands import store_probe
        from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions

        opts = StoreProbeOptions(
            store,
            model=model,
            world_size=world_size,
            metadata=metadata,
            admin=master_admin,
            dtype=dtype,
            tags=tuple(tag or ()),
            vllm_hash_seed=vllm_hash_seed,
            chunk_size=chunk_size,
            verbose=verbose,
        )
        prompt = PromptFlags(tokens_file, prompt_file, synthetic, seed)
        return store_probe.run(st, opts, prompt, width)
    from bsr_cli.cli.render import ops as render_ops

    with _client(st) as client:
        body = _prompt(client, tokens_file, prompt_file, synthetic, seed)
        result = client.probe(body)
    st.out.result(render_ops.ProbeView(result, width), render_ops.probe)


def submit(
    ctx: typer.Context,
    tokens_file: TokensFileOpt = None,
    prompt_file: PromptFileOpt = None,
    synthetic: SyntheticOpt = None,
    seed: SeedOpt = 0,
    w: WOpt = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip the canonical-hash check.")] = False,
    json_flag: JsonFlag = False,
) -> None:
    """Submit a prompt as the scheduler would admit it: external hit, restore or local prefill, fallback."""
    from bsr_cli.cli.render import ops as render_ops

    st = state(ctx, json_flag)
    with _client(st) as client:
        body = _prompt(client, tokens_file, prompt_file, synthetic, seed)
        result = client.submit(body, w=w, verify=not no_verify)
    # The request was served (its KV is computed), so the exit code stays 0; a tier that refused the writes is
    # still said on stderr in every mode, so a script reading --json sees it too.
    for rank, per_tier in (result.stored.errors if result.stored is not None else {}).items():
        for tier, err in per_tier.items():
            st.out.warn(f"storing to tier {tier} failed on {rank}: {err}")
    if result.hash_ok is False:  # the engine invalidated the request's KV: it was not served
        from bsr_cli.core.results import OutputHashes
        from bsr_cli.runtime import failures

        hashes = OutputHashes(result.output_hash, result.canonical_hash, result.hash_ok)
        mismatch = failures.output_mismatch_error(result.request, hashes, result.external_tokens, result.source)
        st.out.fail(result, render_ops.submit, mismatch)
    st.out.result(result, render_ops.submit)


# How a manual restore can end without committing, other than finding nothing to restore (core.evidence.Outcome).
_FAILED_OUTCOMES = (Outcome.FAILED_CLOSED, Outcome.REFUSED, Outcome.ABORTED)


def restore(
    ctx: typer.Context,
    tokens_file: TokensFileOpt = None,
    prompt_file: PromptFileOpt = None,
    synthetic: SyntheticOpt = None,
    seed: SeedOpt = 0,
    w: WOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan from a live probe; restore nothing.")] = False,
    exclude_tier: Annotated[
        list[str] | None,
        typer.Option("--exclude-tier", metavar="TIER", help="Restore as if this tier were unusable (repeatable)."),
    ] = None,
    tier: Annotated[
        str | None,
        typer.Option("--tier", metavar="TIER", help="Restore from this tier only (as `bsr bench --tier`)."),
    ] = None,
    no_verify: Annotated[
        bool,
        typer.Option("--no-verify", help="Skip the canonical-hash check after the commit (can outlast the restore)."),
    ] = False,
    json_flag: JsonFlag = False,
) -> None:
    """A manual windowed restore into the engine, with live progress.

    Exit 0 committed, 10 failed closed, 12 refused for capacity, 16 a rank is being restarted (retry), 17 the host
    was overloaded (no rank or tier blamed; retry when the load drops), 19 output hash not canonical (invalidated),
    130 aborted."""
    st = state(ctx, json_flag)
    if tier is not None and exclude_tier:
        raise InvalidInput(
            "give --tier or --exclude-tier, not both",
            hint="--tier T restores from T alone; --exclude-tier T restores from every other tier",
        )
    with _client(st) as client:
        info = client.info()
        if tier is not None:
            exclude_tier = _tiers_besides(tier, info)
        body = _prompt(client, tokens_file, prompt_file, synthetic, seed)
        if dry_run:
            _plan_live(st, client, body, info.w if w is None else w, exclude_tier or [], info)
            return
        streamed = _run_restore(st, client, body, w, exclude_tier or [], not no_verify, info)
    _report_restore(st, streamed, info)


def _tiers_besides(tier: str, info: EngineInfo) -> list[str]:
    """Every tier of the engine but `tier` (--tier T excludes the others); refused when the engine has no `tier`."""
    tiers = list(info.tiers)
    if tier not in tiers:
        raise InvalidInput(f"this engine has no tier {tier!r}", hint=f"its tiers: {', '.join(tiers)}")
    return [t for t in tiers if t != tier]


def _plan_live(st: AppState, client: Any, body: Prompt, window: int, exclude: list[str], info: EngineInfo) -> None:
    """`bsr restore --dry-run`: the plan of a live probe, refused for capacity where the engine would refuse it."""
    from bsr_cli.core.plan import plan_restore

    probe = client.probe(body)
    reg = probe.registration
    plan = plan_restore(reg, window, bitmap=probe.bitmap, exclude_tiers=exclude)
    from bsr_cli.cli.render import planning as render

    fit = _capacity_check(window, plan.committable_chunks, reg.bytes_per_chunk, info)
    report = render.PlanReport(
        plan=plan, bytes_per_chunk=reg.bytes_per_chunk, model=reg.model, show_all_windows=False, capacity=fit
    )
    if not fit.fits:
        st.out.fail(report, render.plan, CapacityError(fit.message, hint=fit.hint))
    st.out.result(report, render.plan)


def _report_restore(st: AppState, streamed: _StreamedRestore, info: EngineInfo) -> None:
    """The restore's result, failing with the exit code of how it ended."""
    from bsr_cli.cli.render import ops as render_ops

    result = streamed.result
    assert result is not None  # _run_restore raised otherwise
    # The engine's budget B is the bound the peak is held to.
    view = render_ops.RestoreView(result, info.budget_bytes, streamed.hash_check_s)
    if result.output_mismatch and result.hashes is not None and result.report is not None:
        from bsr_cli.runtime import failures

        source = "+".join(result.report.tiers)
        mismatch = failures.output_mismatch_error(result.request, result.hashes, result.report.committed_tokens, source)
        st.out.fail(view, render_ops.restore, mismatch)
    if result.outcome in _FAILED_OUTCOMES:
        from bsr_cli.runtime import failures

        st.out.fail(view, render_ops.restore, failures.restore_error(result))
    if result.outcome is Outcome.NOTHING_TO_RESTORE:
        br = result.first_break
        where = f" (rank {br.rank} group {br.group}: {br.reason})" if br else ""
        error = NothingToRestore(
            f"nothing to restore: no tier holds the prompt's first chunk{where}",
            hint="`bsr probe` shows which tier holds what; `bsr submit` computes and stores the prompt",
        )
        st.out.fail(view, render_ops.restore, error)
    st.out.result(view, render_ops.restore)


def _capacity_check(w: int, chunks: int, slot_bytes: int, info: EngineInfo) -> CapacityFit:
    """Whether the planned windows can ever be admitted on this engine: a window of min(W, K) chunks against the
    budget B (the whole-plan path, W=0, against the pool). The engine would refuse it the same way."""
    from bsr_cli.runtime import failures

    budget, pool = info.budget_bytes, info.pool_bytes
    need_chunks = chunks if w == 0 else min(w, chunks)
    limit = pool if w == 0 else budget
    what = "pool" if w == 0 else "budget B"
    need = need_chunks * slot_bytes
    fits = need == 0 or not limit or need <= (limit // slot_bytes) * slot_bytes
    from bsr_cli.cli.render.planning import CapacityFit

    if fits:
        return CapacityFit(fits, need, budget, pool)
    from bsr_cli.core.evidence import CapacityCause

    cause = CapacityCause.WINDOW_OVER_POOL if w == 0 else CapacityCause.WINDOW_OVER_BUDGET
    return CapacityFit(
        fits,
        need,
        budget,
        pool,
        message=f"W={w}: a window of {need_chunks} chunk(s) needs {need:,} bytes per rank; the engine's {what} is "
        f"{limit:,} bytes, so the restore would be refused",
        hint=failures.capacity_hint(cause, w=w, slot_bytes=slot_bytes, budget_bytes=budget, pool_bytes=pool),
    )


@dataclass
class _StreamedRestore:
    """What the restore's worker thread hands the main thread: the request id once accepted, then its result or
    the error it raised."""

    request: str | None = None
    result: ManualRestoreResult | None = None
    error: BaseException | None = None
    committed_at: float | None = None  # when the engine said it committed: the output-hash check runs from then
    answered_at: float | None = None

    @property
    def hash_check_s(self) -> float | None:
        """Seconds from the commit to the answer: the output-hash check (and the answer's way back)."""
        if self.committed_at is None or self.answered_at is None or self.result is None or not self.result.hashes:
            return None
        return max(self.answered_at - self.committed_at, 0.0)


def _watch(st: AppState, box: _StreamedRestore, progress: Any, verify: bool) -> Callable[[Event], None]:
    """The restore's event listener: the progress display, and the moment it committed. The output-hash check runs
    from then until the answer, silently on the engine's side: the display (or, without one, a note) says so."""
    from bsr_cli.cli.render import ops as render_ops
    from bsr_cli.core.events import RestoreEnded

    def on_event(e: Event) -> None:
        if isinstance(e, RestoreEnded) and e.outcome is Outcome.COMMITTED and box.committed_at is None:
            box.committed_at = time.monotonic()
            if progress:
                progress.check_started(verify)
            else:
                st.out.note(f"committed; {render_ops.HASH_CHECK if verify else render_ops.HASH_ONLY} …")
        if progress:
            progress.update(e)

    return on_event


def _run_restore(
    st: AppState, client: Any, body: Prompt, w: int | None, exclude: list[str], verify: bool, info: EngineInfo
) -> _StreamedRestore:
    """Stream the restore in a worker thread so Ctrl-C reaches us: then ask the engine to abort (it ends
    fail-closed) and still report its final result. The result comes with when the engine committed and answered."""
    from bsr_cli.cli.render import ops as render_ops

    progress = render_ops.RestoreProgress(st.out, ranks=info.ranks) if st.out.interactive else None
    box = _StreamedRestore()
    on_event = _watch(st, box, progress, verify)
    accepted = threading.Event()
    finished = threading.Event()  # not Thread.join: an interrupted join() can leave is_alive() wrong

    def on_accepted(rid: str) -> None:
        box.request = rid
        accepted.set()

    def work() -> None:
        try:
            box.result = client.restore(
                body,
                w=w,
                verify=verify,
                exclude_tiers=exclude,
                on_event=on_event,
                on_accepted=on_accepted,
            )
            box.answered_at = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            box.error = e
        finally:
            finished.set()

    t = threading.Thread(target=work, name="bsr-restore", daemon=True)
    if progress:
        progress.start()
    try:
        t.start()
        interrupted = False
        while not finished.is_set():
            try:
                finished.wait(0.1)
            except KeyboardInterrupt:
                if interrupted:
                    raise
                interrupted = True
                st.out.note("[yellow]interrupted: asking the engine to abort the restore (it ends fail-closed)…[/]")
                if accepted.wait(5) and box.request is not None:
                    from bsr_cli.client import AdminClient
                    from bsr_cli.errors import AlreadyEnded

                    with AdminClient(client.url, client.token, timeout_s=5.0) as c2:
                        try:
                            c2.abort(box.request)
                        except AlreadyEnded as e:  # it committed first: its result follows
                            st.out.note(f"[yellow]{e.message}[/]")
        if interrupted:
            res = box.result
            if progress:
                progress.stop()
            st.out.note(
                f"restore {box.request or 'not yet accepted'} aborted: "
                f"outcome {res.outcome if res is not None else 'unknown'}, "
                f"{res.committed_tokens if res is not None else 0} tokens committed"
            )
            raise KeyboardInterrupt
    finally:
        if progress:
            progress.stop()
    if box.error is not None:
        raise box.error
    if box.result is None:
        raise ServerError(
            "the engine ended the restore without a result",
            hint="`bsr events --request REQ` shows how far it got; the engine's log says why it stopped",
        )
    return box


def inject_fault(
    ctx: typer.Context,
    kind: Annotated[
        str,
        typer.Option("--kind", help="remote-unavailable | remote-and-ssd-absent | restore-fault | timeout | corrupt"),
    ] = "restore-fault",
    rank: Annotated[int | None, typer.Option("--rank", help="Target rank [default: every rank].", min=0)] = None,
    window: Annotated[
        int | None, typer.Option("--window", help="Fire at window J (1-based, as G1..GK).", min=1)
    ] = None,
    group: Annotated[str | None, typer.Option("--group", help="Only this KV group.")] = None,
    count: Annotated[int, typer.Option("--count", help="Restores it fires on (0 = until cleared).", min=0)] = 1,
    json_flag: JsonFlag = False,
) -> None:
    """Arm a fault for the next restores. Refused unless the engine was started with faults enabled."""
    from bsr_cli.core.faults import FaultRequest, check_fault_target

    st = state(ctx, json_flag)
    fault = FaultRequest(kind, rank=rank, window=None if window is None else window - 1, group=group, count=count)
    with _client(st) as client:
        info = client.info()
        check_fault_target(rank, window, ranks=info.ranks, chunk_size=info.chunk_size, max_tokens=info.max_tokens)
        result = client.inject_fault(fault)

    def render(console: Any, f: FaultSpec) -> None:
        where = _fault_scope(info, f)
        win = f"window G{f.window + 1}" if f.window is not None else "the first window"
        times = "until cleared" if f.count == 0 else f"for {f.count} restore(s)"
        grp = f", group {f.group}" if f.group else ""
        console.print(f"[red]armed[/] fault #{f.id} {f.kind} on {where}, {win}{grp}, {times}")

    st.out.result(result, render)


def _fault_scope(info: EngineInfo, f: FaultSpec) -> str:
    """Where the fault is armed. A vLLM worker's admin API serves its own TP rank only (another rank: its own URL)."""
    worker = info.host_fields.get("worker")
    if isinstance(worker, dict) and worker.get("tp_rank") is not None:
        return f"tp-rank {worker['tp_rank']} (this worker only)"
    return f"rank {f.rank}" if f.rank is not None else "every rank"


faults_app = typer.Typer(help="Inject, list or clear faults.", no_args_is_help=True)


# The same command under `faults`, beside list and clear (`bsr inject-fault` stays: it is what runbooks use).
faults_app.command("inject", help="Arm a fault for the next restores (same as `bsr inject-fault`).")(inject_fault)


@faults_app.command("list")
def faults_list(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Faults armed on the engine."""
    from bsr_cli.cli.render import ops as render_ops

    st = state(ctx, json_flag)
    with _client(st) as client:
        st.out.result(client.faults(), render_ops.faults)


@faults_app.command("clear")
def faults_clear(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Disarm every injected fault."""
    st = state(ctx, json_flag)
    with _client(st) as client:
        n = client.clear_faults()
    st.out.result({"cleared": n}, lambda c, d: c.print(f"cleared {d['cleared']} fault(s)"))


markers_app = typer.Typer(help="Force-local markers (set after a failed external restore).", no_args_is_help=True)


@markers_app.command("list")
def markers_list(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Force-local markers standing now: which prompt, which tiers they exclude, why, since when."""
    from bsr_cli.core.status import MarkerList

    st = state(ctx, json_flag)
    with _client(st) as client:
        markers = client.markers()

    def render(console: Any, listed: MarkerList) -> None:
        if not listed.markers:
            console.print("no force-local markers")
            return
        for m in listed.markers:
            since = time.strftime("%H:%M:%S", time.localtime(m.set_at))
            console.print(
                f"prompt {m.prompt}  excludes {', '.join(m.excluded_tiers)}  since {since}"
                f"  (request {m.request}: {m.reason})"
            )

    st.out.result(MarkerList(tuple(markers)), render)


@markers_app.command("clear")
def markers_clear(
    ctx: typer.Context,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="Clear this prompt's marker (its key as `bsr markers list` shows).")
    ] = None,
    tier: Annotated[
        str | None, typer.Option("--tier", help="Take this tier out of every marker (once the tier is fixed).")
    ] = None,
    all_markers: Annotated[bool, typer.Option("--all", help="Clear every marker (asks first, unless --yes).")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before clearing every marker.")] = False,
    json_flag: JsonFlag = False,
) -> None:
    """Clear force-local markers: one prompt's (--prompt), one tier out of every marker (--tier), or all (--all).
    Each marker cleared is a marker_cleared event naming the scope."""
    import sys

    st = state(ctx, json_flag)
    given = [
        name
        for name, on in (("--prompt", prompt is not None), ("--tier", tier is not None), ("--all", all_markers))
        if on
    ]
    if len(given) != 1:
        raise InvalidInput(
            "give exactly one of --prompt KEY, --tier T or --all" + (f" (got {' and '.join(given)})" if given else ""),
            hint="`bsr markers list` shows each marker's prompt key and the tiers it excludes",
        )
    if all_markers and not yes:
        if not sys.stdin.isatty():
            raise InvalidInput(
                "--all clears every marker on the engine: confirm with --yes when not at a terminal",
                hint="or clear only what you mean: --prompt KEY or --tier T",
            )
        if not typer.confirm("clear every force-local marker on the engine?", default=False, err=True):
            raise InvalidInput("nothing cleared", hint="--prompt KEY or --tier T clear less")
    with _client(st) as client:
        n = client.clear_markers(prompt=prompt, tier=tier)
    scope = f"prompt {prompt}" if prompt is not None else f"tier {tier}" if tier is not None else "all"
    st.out.result(
        {"cleared": n, "scope": scope}, lambda c, d: c.print(f"cleared {d['cleared']} marker(s) ({d['scope']})")
    )


EnginesFromOpt = Annotated[
    str | None,
    typer.Option(
        "--engines-from",
        metavar="SOURCE",
        help="Discover a fleet: prometheus://HOST:PORT?job=JOB (its active targets), dns://NAME:PORT (every "
        "address of NAME), or a file with one URL or profile per line.",
        show_default=False,
    ),
]


def status(ctx: typer.Context, engines_from: EnginesFromOpt = None, json_flag: JsonFlag = False) -> None:
    """Engine identity, ranks and their health, tiers, registration, pool and budget, markers, faults."""
    from bsr_cli.cli.render import ops as render_ops
    from bsr_cli.core.status import EngineStatus

    st = state(ctx, json_flag)
    from bsr_cli import fleet

    many = fleet.targets(st.settings, engines_from)
    if many is not None:
        return fleet_status(st, many)
    with _client(st) as client:
        snap = client.snapshot(health=True)
        health = client.health()
    result = EngineStatus(url=client.url, health=health, snapshot=snap)
    bad = [r for r in health.ranks if not r.healthy]
    if bad:
        error = ServerError(
            "unhealthy: " + "; ".join(f"rank {r.rank} {r.reason or 'unhealthy'}" for r in bad),
            hint="resume the stopped rank process, or restart the engine (bsr engine down; bsr engine up)",
        )
        st.out.fail(result, render_ops.status, error)
    st.out.result(result, render_ops.status)


def fleet_status(st: AppState, targets: list[Any]) -> None:
    """Every engine polled at once: one row per engine and per rank, worst first. The exit status is the worst
    engine's, as `bsr status` on it alone would exit (bsr_cli.fleet.exit_code): 3 when one does not answer, 9 when
    one is unhealthy; every row is printed first."""
    from bsr_cli import fleet
    from bsr_cli.cli.render import ops as render_ops
    from bsr_cli.errors import BsrError, ExitCode

    memory = fleet.Memory.for_settings(st.settings)
    rows = memory.observe(fleet.poll_all(targets, fleet.http_poll(min(st.settings.timeout_s, 10.0))))
    memory.save()
    result = fleet.fleet_result(rows)
    code = fleet.exit_code(rows)
    if code == ExitCode.OK:
        st.out.result(result, render_ops.fleet)
        return
    down = [r for r in rows if r.down]
    bad = [r for r in rows if r.severity >= fleet.UNHEALTHY]
    if len(down) == len(rows):
        message = f"none of the {len(rows)} engines answered"
    else:
        message = "fleet unhealthy: " + "; ".join(f"{r.engine} {r.state} ({r.problems[0]})" for r in bad)
    err = BsrError(message, hint="`bsr status --engine URL` on one of them for its details")
    err.exit_code = ExitCode(code)
    err.kind = str(rows[0].error or "server-error")
    st.out.fail(result, render_ops.fleet, err)


def drill(
    ctx: typer.Context,
    tokens: Annotated[int, typer.Option("--tokens", "-n", help="Prompt length per scenario.", min=1)] = 8192,
    w: WOpt = None,
    yes: Annotated[
        bool,
        typer.Option("--yes", "-y", help="Inject the drill's faults without asking (needed when not on a terminal)."),
    ] = False,
    json_flag: JsonFlag = False,
) -> None:
    """The paper's failure matrix against a live engine: injects faults into it (asks first, or --yes). Exit 11 on
    any violated invariant."""
    from bsr_cli.cli.render import ops as render_ops
    from bsr_cli.drill import confirm_drill, run_drill

    st = state(ctx, json_flag)
    with _client(st) as client:
        confirm_drill(client.url, assume_yes=yes)
        result = run_drill(
            client,
            tokens=tokens,
            w=w,
            on_result=(lambda r: st.out.note(f"{r.scenario}: {'PASS' if r.ok else 'FAIL'}")),
        )
    if not result.ok:
        bad = [s.scenario for s in result.scenarios if not s.ok]
        error = DrillViolation(
            f"drill found violated invariants in: {', '.join(bad)}",
            hint="the table says which check failed; `bsr events --since 1h` and `bsr bundle` keep the evidence",
        )
        st.out.fail(result, render_ops.drill, error)
    st.out.result(result, render_ops.drill)
