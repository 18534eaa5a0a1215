"""`bsr bench peer`: stock LMCache 0.5.6 against bsr's windowed retrieve inside LMCache, in one run.

LMCache lives only in the plugin venv (``.venv-lmcache``, built by ``scripts/test-plugins``), so this module never
imports it: it starts a real ``mooncake_master`` and segment holder on loopback, stores the prompt once through
LMCache, then runs every measurement as its own process in the plugin venv's interpreter
(``python -m lmcache_bsr.peer CASE.json``, see plugins/lmcache_bsr/peer.py), on the same objects in the same store:

* ``raw``: a raw Mooncake ``batch_get_into`` of exactly the objects LMCache stored (the transport's rate);
* ``stock``: LMCache's own retrieve of the whole prefix into the paged KV with its L1 at the rung that holds the
  whole plan, and again with smaller L1s (below the rung stock LMCache returns 0 tokens after its
  ``blocking_timeout_secs``, with a thread left spinning: reported as "0 tokens, timed out", the process killed if
  it does not end in time);
* ``stock_contiguous``: the same retrieve after an untimed ``lookup``, its transfer threads at bsr's lower priority,
  into one contiguous buffer in LMCache's own object layout (a plain copy per chunk): the most favourable setup
  for stock, so bsr's ratio is also stated against it;
* ``bsr``: the plugin host's windowed restore (W chunks per window) with L1 = B = ``bsr_windows`` * RWS(W): at 2
  (the default) the next window's fetch overlaps this window's install; at 1 the restore is serialized.

Throughput is GB/s per rank; staging bytes are LMCache's L1 allocator high-water mark (measured); CPU seconds come
from /proc for the case process, the master and the segment holder, around the operation only.

Over 500 lines on purpose: the store, the cases and the summary all follow one run's objects, and reading them in
one place is how a reader checks that stock and bsr were measured on the same bytes. The result types they build
are in bsr_cli/bench/peer_results.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bsr_cli.bench.evidence import Interruption, OnRow, RowStatus, Target, gbps
from bsr_cli.bench.peer_results import (
    MEASURED_KINDS,
    BelowRung,
    CaseResult,
    CpuCost,
    ModelOnRanks,
    PeerBundle,
    PeerKind,
    PeerMeasurement,
    PeerModel,
    PeerParams,
    PeerPrefix,
    PeerRow,
    PeerSide,
    PeerSummary,
    StockStages,
)
from bsr_cli.core import wire
from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S
from bsr_cli.core.registration import KVGroup, Registration, TensorSpec
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.errors import CapacityError, ServiceError
from bsr_cli.mooncake.segment_watch import SegmentWatch

RESULT_PREFIX = "BSR-PEER-RESULT "
ENV_PYTHON = "BSR_LMCACHE_PYTHON"
SETUP_HINT = (
    "build it with ./scripts/test-plugins (LMCache 0.5.6, CPU), or point BSR_LMCACHE_PYTHON at a Python with it"
)
CASE_SETUP_S = 180.0  # LMCache import, engine build and KV allocation of one case process, on a loaded machine
THROUGHPUT_TARGET = 1.0  # bsr against stock LMCache's faster install (contiguous, after its lookup), GB/s per rank
PAGED_TARGET = 1.15  # bsr against stock LMCache into the paged KV, GB/s per rank
STAGING_TARGET = 1 / 8  # bsr's L1 peak against stock's at the largest prefix
CPU_TARGET = 1.25  # CPU seconds per GB restored against a raw GET's
CPU_VS_STOCK_TARGET = 1.0  # CPU seconds per GB restored against stock's faster install's


# 16 KiB per token per rank (bf16): 4 MiB per 256-token chunk, 2 GiB at 131,072 tokens.
DEFAULT_MODEL = PeerModel("bsr/peer-16k", layers=8, kv_heads=4, head_size=128)


# -- where LMCache is --------------------------------------------------------------------------------------------


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def plugin_python() -> tuple[Path, Path]:
    """(interpreter of the LMCache venv, the plugins directory). One-line error with the setup command if absent."""
    plugins = repo_root() / "plugins"
    if not (plugins / "lmcache_bsr" / "peer.py").is_file():
        raise ServiceError(
            "bsr bench peer needs the lmcache_bsr plugin, which ships with the source checkout (plugins/)",
            hint="run it from a clone of the repository",
        )
    env = os.environ.get(ENV_PYTHON)
    py = Path(env) if env else repo_root() / ".venv-lmcache" / "bin" / "python"
    if not py.exists():
        where = f"{ENV_PYTHON}={env}" if env else str(py)
        raise ServiceError(f"no Python with LMCache 0.5.6 at {where}", hint=SETUP_HINT)
    return py, plugins


def case_env(plugins: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo_root()), str(plugins), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONHASHSEED"] = "0"  # LMCache's builtin-hash keys must match across the case processes
    env["LMCACHE_TRACK_USAGE"] = "false"
    env.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    return env


# -- the registration ----------------------------------------------------------------------------------------------


def registration(model: PeerModel, tp: int) -> Registration:
    """The plugin host's registration for this model (lmcache_bsr.host.registration_from builds the same)."""
    shape = (2, model.kv_heads, model.head_size)
    return Registration(
        model=model.name,
        tp_size=tp,
        groups=(KVGroup("attn", model.block_size),),
        tensors=tuple(TensorSpec(f"layers.{i}.kv", model.dtype, shape, "attn") for i in range(model.layers)),
        chunk_size=model.chunk_size,
        source="lmcache-host",
    )


def rung_for(nbytes: int) -> int:
    """The smallest power of two of at least ``nbytes`` (the L1 sizes an operator provisions)."""
    r = 1 << 20
    while r < nbytes:
        r <<= 1
    return r


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- running one case --------------------------------------------------------------------------------------------


class StoreLost(Exception):
    """The store lost the prompt's objects: every case after it would read nothing, so the run ends here."""

    def __init__(self, loss: SegmentLoss) -> None:
        super().__init__(loss.line())
        self.loss = loss


class CaseRunner:
    """Runs each case in its own process, and looks at the store before and after each one (``watch``): a case
    the store's loss would fail is reported as that loss, never as the case's own 0 tokens."""

    def __init__(
        self, python: Path, plugins: Path, workdir: Path, base: CaseBase, watch: SegmentWatch | None = None
    ) -> None:
        self.python, self.plugins, self.workdir, self.base, self.watch = python, plugins, workdir, base, watch
        self.n = 0

    def store_lost(self) -> SegmentLoss | None:
        """A segment the store lost since the last look (the first, when several went at once)."""
        lost = self.watch.poll() if self.watch is not None else []
        return lost[0] if lost else None

    def need_bytes(self, case: Case, reg: Registration) -> int:
        tokens = case.tokens + reg.chunk_size
        kv = tokens * reg.bytes_per_token * reg.tp_size  # the destination KV of every rank
        l1 = case.l1_bytes * reg.tp_size
        # The raw GET's buffer, or stock's contiguous destination beside the paged KV.
        extra = case.mode == "raw" or case.destination == "contiguous"
        raw = tokens * reg.bytes_per_token * reg.tp_size if extra else 0
        return kv + l1 + raw + (600 << 20) * reg.tp_size  # + LMCache, torch and Mooncake per engine

    def run(self, case: Case, reg: Registration) -> CaseResult:
        """The case's result (``error`` set when the process failed); killed at its deadline."""
        need, avail = self.need_bytes(case, reg), mem_available()
        if avail and need > avail:
            return CaseResult(error=f"capacity: needs ~{need >> 20:,} MiB, {avail >> 20:,} MiB available")
        self.n += 1
        path = self.workdir / f"case-{self.n:03d}-{case.mode}.json"
        path.write_text(json.dumps(self.base.to_wire() | case.to_wire()))
        log = path.with_suffix(".log")
        deadline = CASE_SETUP_S + self.base.deadline_s * 4 + 60.0
        with log.open("w") as err:
            proc = subprocess.Popen(
                [str(self.python), "-m", "lmcache_bsr.peer", str(path)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=case_env(self.plugins),
                cwd=str(self.workdir),
                start_new_session=True,
                text=True,
            )
            try:
                out, _ = proc.communicate(timeout=deadline)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return CaseResult(killed=True, error=f"the case did not end within {deadline:.0f}s")
            except BaseException:
                _kill_group(proc)
                raise
            finally:
                _kill_group(proc)  # nothing it started may outlive it (it runs in its own session)
        for line in reversed(out.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return CaseResult.from_wire(json.loads(line[len(RESULT_PREFIX) :]))
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:]
        return CaseResult(error=f"the case exited {proc.returncode} without a result: {' '.join(tail)}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@dataclass(frozen=True)
class MasterAddress:
    """Where a case process reaches the Mooncake master."""

    rpc_address: str
    metadata_url: str

    to_wire = wire.writer()


@dataclass(frozen=True)
class WatchPids:
    """The service processes a case process watches (it gives up when one of them dies)."""

    master: int
    segment_holder: int

    to_wire = wire.writer()


@dataclass(frozen=True)
class CaseBase:
    """What every case of one run shares: the model, the store, the prompt's seed and the retrieve deadline."""

    model: ModelOnRanks
    master: MasterAddress
    seed: int
    deadline_s: float
    watch_pids: WatchPids

    to_wire = wire.writer()


@dataclass(frozen=True)
class Case:
    """One measurement for a case process: its mode, the prefix, its L1 (and W for the windowed modes)."""

    mode: str  # store, raw, stock or bsr (plugins/lmcache_bsr/peer.py)
    tokens: int
    l1_bytes: int
    w: int | None = wire.field(name="W", omit_none=True, default=None)
    # stock only: "contiguous" after an untimed lookup, else the paged KV (no key)
    destination: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer(order=("mode", "tokens", "l1_bytes", "destination", "w"))


# -- the experiment ----------------------------------------------------------------------------------------------


def _cpu_per_gb(cpu: dict[str, float], nbytes_total: int) -> dict[str, float]:
    gb = nbytes_total / 1e9
    if gb <= 0:
        return {}
    out = {k: round(v / gb, 4) for k, v in cpu.items()}
    out["total"] = round(sum(cpu.values()) / gb, 4)
    return out


def case_row(kind: PeerKind, n: int, l1: int, trial: int, res: CaseResult, reg: Registration, w: int | None) -> PeerRow:
    """The bundle row of one case process's result ``res`` (a ``kind`` of restore of ``n`` tokens with ``l1`` bytes
    of L1): its measurements and the checks its kind must pass, with ``status`` pass, fail or interrupted."""
    per_rank = n * reg.bytes_per_token
    if res.error and not res.killed:
        return PeerRow(kind, n, RowStatus.INTERRUPTED, l1, trial, w, reason=res.error)
    loaded = res.loaded_tokens
    timed_out = res.timed_out or res.killed
    stages = StockStages(res.stage_seconds, res.destination, res.untimed_lookup_seconds) if res.stage_seconds else None
    cpu = None
    if res.cpu and loaded == n:
        cpu = CpuCost(
            res.cpu,
            _cpu_per_gb(res.cpu, per_rank * reg.tp_size),
            round(res.install_cpu_seconds / (per_rank * reg.tp_size / 1e9), 4),
        )
    m = PeerMeasurement(
        outcome=res.outcome or ("timed_out" if timed_out else "error"),
        loaded_tokens=loaded,
        seconds=round(res.seconds, 4),
        gbps_per_rank=gbps(per_rank, res.seconds) if loaded == n else 0.0,
        l1_peak_bytes=res.l1_peak_bytes,
        l1_capacity_bytes=res.l1_capacity_bytes or l1,
        hash_ok=res.hash_ok,
        timed_out=timed_out,
        windows=res.windows,
        setup_seconds=res.setup_seconds,
        nice=res.nice,
        ranks=res.ranks,
        stages=stages,
        cpu=cpu,
        stage_costs=res.stage_costs,
    )
    whole = -(-n // reg.chunk_size) * reg.bytes_per_chunk
    if kind == PeerKind.RAW:
        checks = {"every_object_read": loaded == n}
    elif kind == PeerKind.BSR:
        rws = int(w or 0) * reg.bytes_per_chunk
        checks = {
            "committed_all": loaded == n,
            "hash_ok": res.hash_ok is True,
            # L1 = B: never more than the budget, in whole windows' worth of chunks.
            "l1_peak_at_most_budget": 0 < m.l1_peak_bytes <= l1,
            "l1_peak_whole_chunks": rws > 0 and m.l1_peak_bytes % reg.bytes_per_chunk == 0,
        }
    elif l1 >= whole:
        checks = {"loaded_all": loaded == n, "hash_ok": res.hash_ok is True}
    else:
        # Below the rung the finding is stock LMCache's own behaviour; what must hold is that it was bounded.
        checks = {"bounded_by_deadline": True, "not_partially_reported_as_loaded": loaded in (0, n)}
    status = RowStatus.PASS if all(checks.values()) else RowStatus.FAIL
    return PeerRow(kind, n, status, l1, trial, w, m, res.error if res.killed else None, checks)


class _Plan:
    """What one run measures: the prefixes, W, bsr's budget and the L1 sizes tried, fixed before anything runs."""

    def __init__(
        self,
        tokens: Sequence[int],
        w: int,
        tp: int,
        below_rung: Sequence[int],
        trials: int,
        bsr_windows: int,
        model: PeerModel | None,
    ) -> None:
        self.model = model or DEFAULT_MODEL
        self.reg = registration(self.model, tp)
        self.tokens = sorted({int(n) // self.reg.chunk_size * self.reg.chunk_size for n in tokens})
        if not self.tokens or self.tokens[0] <= 0:
            raise CapacityError(
                f"every prefix must hold at least one {self.reg.chunk_size}-token chunk",
                hint=f"give prefixes of at least {self.reg.chunk_size} tokens (--tokens)",
            )
        if bsr_windows < 1:
            raise CapacityError(
                "bsr's L1 must hold at least one window (bsr_windows >= 1)", hint="give --bsr-windows 1 or more"
            )
        self.w, self.tp, self.trials, self.bsr_windows = w, tp, trials, bsr_windows
        self.rws = w * self.reg.bytes_per_chunk
        self.budget = bsr_windows * self.rws  # bsr's L1: B
        self.below_rung = sorted({*below_rung, self.budget})
        self.largest = self.tokens[-1] * self.reg.bytes_per_token

    def whole(self, n: int) -> int:
        return -(-n // self.reg.chunk_size) * self.reg.bytes_per_chunk


def run_peer(
    *,
    tokens: Sequence[int],
    w: int,
    tp: int = 1,
    below_rung: Sequence[int] = (),
    trials: int = 1,
    deadline_s: float = 10.0,
    bsr_windows: int = 2,
    salt: int | None = None,
    model: PeerModel | None = None,
    workdir: Path,
    on_row: OnRow | None = None,
    store_client_ttl_s: int = DEFAULT_STORE_CLIENT_TTL_S,
) -> PeerBundle:
    """Run the whole comparison and return its evidence bundle (see docs/benchmarks.md). The store's master keeps
    a silent segment holder ``store_client_ttl_s`` seconds; a store that loses the prompt's objects anyway ends the
    run with a row naming the loss (`StoreLost`)."""
    from bsr_cli.bench import evidence as ex

    python, plugins = plugin_python()
    plan = _Plan(tokens, w, tp, below_rung, trials, bsr_windows, model)
    salt = ex.new_salt() if salt is None else salt
    run_id, started_at, machine = ex.new_run_id("peer"), ex.now(), ex.machine_info()
    t_start = time.monotonic()
    rows: list[PeerRow] = []
    workdir.mkdir(parents=True, exist_ok=True)
    setup = _RunSetup(python, plugins, workdir, salt, deadline_s, store_client_ttl_s)
    interrupted_by = _run_cases(setup, plan, rows, on_row)
    summary = summarize(rows, plan.reg, plan.w)
    return PeerBundle(
        run_id=run_id,
        salt=salt,
        started_at=started_at,
        finished_at=ex.now(),
        elapsed_s=round(time.monotonic() - t_start, 3),
        registration=ex.registration_identity(plan.reg),
        lmcache_python=_shown(python),
        machine=machine,
        params=PeerParams(
            tuple(plan.tokens),
            plan.w,
            plan.tp,
            plan.trials,
            deadline_s,
            tuple(plan.below_rung),
            plan.bsr_windows,
            plan.budget,
            plan.model,
            plan.rws,
        ),
        rows=tuple(rows),
        summary=summary,
        targets=tuple(targets(summary)),
        interrupted_by=interrupted_by,
    )


@dataclass(frozen=True)
class _RunSetup:
    """Where and how one run's case processes run: the LMCache interpreter, the plugins, the work directory, the
    prompt's seed, the retrieve deadline and how long the master keeps a silent segment holder."""

    python: Path
    plugins: Path
    workdir: Path
    salt: int
    deadline_s: float
    store_client_ttl_s: int


def _run_cases(setup: _RunSetup, plan: _Plan, rows: list[PeerRow], on_row: OnRow | None) -> Interruption | None:
    """Start the store, store the prompt and measure every prefix, each row into ``rows`` (and to ``on_row``); the
    store is stopped however it ends. What interrupted the run (None: nothing did)."""
    from bsr_cli.mooncake import services

    def add(row: PeerRow) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    mooncake, tp = setup.workdir / "mooncake", plan.tp
    master = holder = None
    try:
        master = services.start_master(mooncake, client_ttl_s=setup.store_client_ttl_s)
        holder = services.start_segment_holder(mooncake, master, int(plan.largest * tp * 1.1) + (64 << 20))
        label = f"segment_holder pid {holder.pid}"
        watch = SegmentWatch(master.admin_url, master.metadata_url, label=lambda _segment: label)
        base = CaseBase(
            ModelOnRanks(model=plan.model, tp_size=tp),
            MasterAddress(master.rpc_address, master.metadata_url),
            setup.salt,
            setup.deadline_s,
            WatchPids(master.pid, holder.pid),
        )
        runner = CaseRunner(setup.python, setup.plugins, setup.workdir, base, watch)
        _store_prompt(runner, plan, add)
        for n in plan.tokens:
            _measure_prefix(runner, plan, n, add)
    except KeyboardInterrupt:
        return Interruption.OPERATOR
    except StoreLost:
        return Interruption.ERROR  # its row says what was lost
    except (ServiceError, CapacityError) as e:
        if not rows or rows[-1].status != RowStatus.INTERRUPTED:
            rows.append(PeerRow(PeerKind.SETUP, plan.tokens[-1], RowStatus.INTERRUPTED, reason=e.message))
        return Interruption.ERROR
    finally:
        if holder is not None:
            services.stop(holder, timeout=10)
        if master is not None:
            services.stop(master, timeout=10)
    return None


def _store_prompt(runner: CaseRunner, plan: _Plan, add: Callable[[PeerRow], None]) -> None:
    """The longest prompt once: synthetic prompts of one seed are prefixes of each other, so every shorter
    prefix's chunks are the same objects."""
    reg, n = plan.reg, plan.tokens[-1]
    store_l1 = min(rung_for(plan.largest + reg.bytes_per_chunk), 256 << 20)
    runner.store_lost()  # the store as it is before anything is stored
    res = runner.run(Case("store", n, store_l1, plan.w), reg)
    lost = runner.store_lost()
    if lost is not None:
        add(PeerRow(PeerKind.STORE, n, RowStatus.INTERRUPTED, reason=f"storing: {lost.line()}", store_lost=lost))
        raise StoreLost(lost)
    if not res.ok:
        why = res.error or "the case reported no success"
        add(PeerRow(PeerKind.STORE, n, RowStatus.INTERRUPTED, reason=f"storing: {why}"))
        raise ServiceError(
            f"storing the prompt through LMCache failed: {why}",
            hint="the LMCache stage's log above says why; `./scripts/test-plugins` checks the LMCache install",
        )


def _measure(runner: CaseRunner, reg: Registration, add: Callable[[PeerRow], None], row: PeerRow, case: Case) -> None:
    """One case and its row (``row`` says which: kind, prefix, L1, trial, W). A store that lost the prompt's
    objects before the case or while it ran is the row's reason, and ends the run: the case's own result (0 tokens,
    or bytes read as the segment went) is no measurement of LMCache or bsr."""
    lost = runner.store_lost()
    if lost is None:
        res = runner.run(case, reg)
        lost = runner.store_lost()
        if lost is None:
            add(case_row(row.kind, row.tokens, row.l1_bytes or 0, row.trial, res, reg, row.w))
            return
    add(replace(row, status=RowStatus.INTERRUPTED, reason=lost.line(), store_lost=lost))
    raise StoreLost(lost)


def _measure_prefix(runner: CaseRunner, plan: _Plan, n: int, add: Callable[[PeerRow], None]) -> None:
    """Per trial raw, stock (paged), stock into a contiguous destination and bsr, back to back: the machine's load
    drifts, and pairs seconds apart compare fairly. Then stock below its rung, once per L1 size."""
    reg = plan.reg
    rung = rung_for(plan.whole(n))

    def measure(kind: PeerKind, l1: int, trial: int, w: int | None, case: Case) -> None:
        _measure(runner, reg, add, PeerRow(kind, n, RowStatus.PASS, l1, trial, w), case)

    for trial in range(plan.trials):
        measure(PeerKind.RAW, 0, trial, None, Case("raw", n, reg.bytes_per_chunk))
        measure(PeerKind.STOCK, rung, trial, None, Case("stock", n, rung))
        measure(PeerKind.STOCK_CONTIGUOUS, rung, trial, None, Case("stock", n, rung, destination="contiguous"))
        measure(PeerKind.BSR, plan.budget, trial, plan.w, Case("bsr", n, plan.budget, plan.w))
    for l1 in plan.below_rung:
        if l1 < plan.whole(n):
            measure(PeerKind.STOCK, l1, 0, None, Case("stock", n, l1))


def _shown(path: Path) -> str:
    """A path inside the checkout relative to it (bundles are published; the machine's layout is not)."""
    try:
        return str(path.absolute().relative_to(repo_root()))
    except ValueError:
        return path.name


def _ratio(a: float | None, b: float | None, digits: int = 4) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def _per_trial_ratios(mine: Sequence[PeerRow], a: PeerKind, b: PeerKind) -> list[float]:
    """a's GB/s over b's within each trial (the pairs measured seconds apart), in trial order."""
    gbps = {(r.kind, r.trial): r.measured.gbps_per_rank for r in mine if r.measured is not None}
    out = []
    for t in sorted({r.trial for r in mine}):
        x, y = gbps.get((a, t)), gbps.get((b, t))
        if x and y:
            out.append(round(x / y, 4))
    return out


def summarize(rows: Sequence[PeerRow], reg: Registration, w: int) -> PeerSummary:
    """Per prefix: medians of raw, both stock installs at their rung and bsr; ratios from the same run (of the
    medians, and per trial); below-rung outcomes."""
    done = [r for r in rows if r.measured is not None and r.kind in MEASURED_KINDS]
    by_prefix: dict[str, PeerPrefix] = {}
    for n in sorted({r.tokens for r in done}):
        whole = -(-n // reg.chunk_size) * reg.bytes_per_chunk
        stocks = (PeerKind.STOCK, PeerKind.STOCK_CONTIGUOUS)
        mine = [r for r in done if r.tokens == n and (r.kind not in stocks or (r.l1_bytes or 0) >= whole)]
        below = [r for r in done if r.tokens == n and r.kind == PeerKind.STOCK and (r.l1_bytes or 0) < whole]
        nbytes = n * reg.bytes_per_token * reg.tp_size  # what each case restored, every rank's bytes
        sides = {
            k: PeerSide.of([r.measured for r in mine if r.kind == k and r.measured], nbytes) for k in MEASURED_KINDS
        }
        gb = {k: v.gbps_per_rank for k, v in sides.items()}
        cpu = {k: v.cpu_s_per_gb for k, v in sides.items()}
        bsr = [r for r in mine if r.kind == PeerKind.BSR and r.measured]
        raw, stock, contig = PeerKind.RAW, PeerKind.STOCK, PeerKind.STOCK_CONTIGUOUS
        by_prefix[str(n)] = PeerPrefix(
            tokens=n,
            whole_plan_bytes=whole,
            stock_rung_bytes=rung_for(whole),
            raw=sides[raw],
            stock=sides[stock],
            stock_contiguous=sides[contig],
            bsr=sides[PeerKind.BSR],
            bsr_vs_stock_gbps=_ratio(gb[PeerKind.BSR], gb[stock]),
            bsr_vs_stock_contiguous_gbps=_ratio(gb[PeerKind.BSR], gb[contig]),
            bsr_vs_raw_gbps=_ratio(gb[PeerKind.BSR], gb[raw]),
            stock_vs_raw_gbps=_ratio(gb[stock], gb[raw]),
            stock_contiguous_vs_raw_gbps=_ratio(gb[contig], gb[raw]),
            per_trial={
                "bsr_vs_stock": _per_trial_ratios(mine, PeerKind.BSR, stock),
                "bsr_vs_stock_contiguous": _per_trial_ratios(mine, PeerKind.BSR, contig),
                "stock_vs_raw": _per_trial_ratios(mine, stock, raw),
                "stock_contiguous_vs_raw": _per_trial_ratios(mine, contig, raw),
                "bsr_vs_raw": _per_trial_ratios(mine, PeerKind.BSR, raw),
            },
            bsr_vs_stock_staging=_ratio(sides[PeerKind.BSR].l1_peak_bytes, sides[stock].l1_peak_bytes, 6),
            bsr_vs_raw_cpu=_ratio(cpu[PeerKind.BSR], cpu[raw]),
            stock_vs_raw_cpu=_ratio(cpu[stock], cpu[raw]),
            stock_contiguous_vs_raw_cpu=_ratio(cpu[contig], cpu[raw]),
            below_rung=tuple(
                BelowRung(
                    l1_bytes=r.l1_bytes or 0,
                    loaded_tokens=r.measured.loaded_tokens,
                    outcome=r.measured.outcome,
                    timed_out=r.measured.timed_out,
                    seconds=r.measured.seconds,
                    bsr_committed_at_this_l1=any(
                        b.measured is not None
                        and b.measured.loaded_tokens == n
                        and (b.l1_bytes or 0) <= (r.l1_bytes or 0)
                        for b in bsr
                    ),
                )
                for r in below
                if r.measured is not None
            ),
        )
    return PeerSummary(by_prefix, w, w * reg.bytes_per_chunk)


def targets(summary: PeerSummary) -> list[Target]:
    top = summary.top
    if top is None:
        return []
    # Against the faster of stock's two installs (paged, or contiguous after its lookup): the claim is not
    # allowed to rest on stock's slower destination.
    ratios = [r for r in (top.bsr_vs_stock_gbps, top.bsr_vs_stock_contiguous_gbps) if r is not None]
    tp_ratio, st_ratio = (min(ratios) if ratios else None), top.bsr_vs_stock_staging
    paged = top.bsr_vs_stock_gbps
    out = [
        Target(
            f"bsr against stock LMCache at {top.tokens:,} tokens",
            f">= {THROUGHPUT_TARGET}x stock GB/s (its faster install) and >= {PAGED_TARGET}x stock into the paged KV,"
            f" at <= 1/{round(1 / STAGING_TARGET)} of its L1 peak",
            f"{tp_ratio}x GB/s at {st_ratio} of the L1 peak"
            + (
                f" (paged {paged}x, contiguous {top.bsr_vs_stock_contiguous_gbps}x)"
                if top.bsr_vs_stock_contiguous_gbps is not None
                else ""
            ),
            None
            if tp_ratio is None or st_ratio is None or paged is None
            else (tp_ratio >= THROUGHPUT_TARGET and paged >= PAGED_TARGET and st_ratio <= STAGING_TARGET),
        )
    ]
    below = [(p.tokens, b) for p in summary.by_prefix.values() for b in p.below_rung]
    out.append(
        Target(
            "bsr commits where stock LMCache returns 0 tokens",
            "every below-rung L1 where stock loads nothing, bsr commits at that L1 or less",
            ", ".join(
                f"{n:,} tok @ {b.l1_bytes >> 20} MiB: stock {b.loaded_tokens} tokens"
                + (" (timed out)" if b.timed_out else "")
                + (", bsr committed" if b.bsr_committed_at_this_l1 else ", bsr did not commit")
                for n, b in below
            )
            or "no below-rung case run",
            None if not below else all(b.bsr_committed_at_this_l1 for _, b in below if b.loaded_tokens == 0),
        )
    )
    cpu = top.bsr_vs_raw_cpu
    out.append(
        Target(
            f"CPU seconds per GB restored against a raw GET's, at {top.tokens:,} tokens",
            f"<= {CPU_TARGET}x",
            f"{cpu}x (stock LMCache {top.stock_vs_raw_cpu}x)",
            None if cpu is None else cpu <= CPU_TARGET,
        )
    )
    contig = top.stock_contiguous
    vs_stock = _ratio(top.bsr.cpu_s_per_gb, contig.cpu_s_per_gb if contig is not None else None)
    out.append(
        Target(
            f"CPU seconds per GB restored against stock LMCache's faster install, at {top.tokens:,} tokens",
            f"<= {CPU_VS_STOCK_TARGET}x stock contiguous",
            f"{vs_stock}x (bsr {top.bsr.cpu_s_per_gb}, stock contiguous "
            f"{contig.cpu_s_per_gb if contig is not None else None} CPU s/GB)",
            None if vs_stock is None else vs_stock <= CPU_VS_STOCK_TARGET,
        )
    )
    return out


if __name__ == "__main__":  # pragma: no cover - the CLI is the entry point
    sys.exit("use `bsr bench peer`")
