"""The whole-plan ladder (W=0): raise the pool capacity rung by rung (one engine start each) until full reuse
succeeds, against the core's prediction."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from bsr_cli.bench.evidence import (
    UNKNOWN_OUTCOME,
    BenchRow,
    Bundle,
    Interruption,
    OnRow,
    RankEvidence,
    RowMeta,
    Run,
    WarmEvidence,
    completed,
    flat,
    new_salt,
    prompt_of,
    read_row,
    require_tokens,
    target,
    warm_evidence,
)
from bsr_cli.core import accounting, wire
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.status import EngineInfo
from bsr_cli.core.units import MiB
from bsr_cli.errors import CapacityError, EngineError, InvalidInput, ServiceError

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient


# The paper's E1 rows (tokens), its W sweep, and a ladder scaled to the demo registration (1 MiB per chunk per
# rank, ~1/16 of the paper's 16,408,576 bytes): the paper steps 1..64 GiB, this steps 64 MiB..4 GiB.
LADDER_PREFIXES: tuple[int, ...] = (32_768, 65_536, 131_072, 262_144, 524_032)
SCALED_LADDER: tuple[int, ...] = tuple(n * MiB for n in (64, 128, 256, 512, 1024, 2048, 4096))

EngineFactory = Callable[[int], AbstractContextManager["AdminClient"]]
"""pool_bytes -> a context manager that starts an engine with that restore-pool capacity per rank, yields a client
of it, and stops it on exit."""


# -- what the ladder measures (fields in the order of their evidence keys) -----------------------------------------


@dataclass(frozen=True, kw_only=True)
class LadderAttempt:
    """One prefix restored whole-plan (W=0) on one rung's engine."""

    rung: int  # pool capacity per rank, bytes
    warm: WarmEvidence | None  # the warming submit's evidence; None when a tier already held the whole prompt
    outcome: str = wire.field(absent=UNKNOWN_OUTCOME)  # an Outcome, or "unknown" when the engine said none
    committed_tokens: int
    failure: str | None
    peak_pool_bytes: int
    seconds: float
    gbps: float
    tiers: list[str]
    hash_ok: bool | None
    healthy: bool
    ranks: tuple[RankEvidence, ...]  # per rank: pool peak, bytes, seconds (the shared restore evidence)
    passed: bool

    to_wire = wire.writer()
    from_wire = wire.reader()


def _passing_wire(ev: LadderAttempt) -> wire.JsonObject:
    """The first passing attempt's evidence as its row holds it."""
    return {
        "measured_peak_bytes": ev.peak_pool_bytes,
        "ranks": wire.value_to_wire(ev.ranks),
        "seconds": ev.seconds,
        "gbps": ev.gbps,
        "tiers": ev.tiers,
        "hash_ok": ev.hash_ok,
        "healthy": ev.healthy,
    }


@dataclass(frozen=True, kw_only=True)
class LadderRow(BenchRow):
    """One prefix's climb: every attempt, its first passing rung and measured peak beside the core's prediction.
    It gathers attempts made on several engines, so it has no start time or duration of its own."""

    tokens: int
    chunks: int
    whole_plan_bytes: int
    predicted_rung: int | None  # None: the core predicts no rung of the ladder holds it
    first_passing_rung: int | None
    attempts: tuple[LadderAttempt, ...]
    # The first passing attempt's evidence, written beside the row's keys (``measured_peak_bytes``...).
    passing: LadderAttempt | None = flat(present="measured_peak_bytes", write=_passing_wire)
    meta: RowMeta  # no start time or duration

    @classmethod
    def from_wire(cls, data: object) -> LadderRow:
        """A row read back from a bundle (`bsr bench show`, `bsr bench plot`): the passing attempt is the one of
        its attempts at the first passing rung."""
        row = read_row(cls, data)
        if row.passing is None:
            return row
        passing = next((a for a in row.attempts if a.passed and a.rung == row.first_passing_rung), None)
        return replace(row, passing=passing)


@dataclass(frozen=True)
class LadderParams:
    prefixes: list[int]
    rungs: list[int]
    warm_W: int


@dataclass(frozen=True)
class LadderSummary:
    first_passing_rung: dict[str, int | None]  # by prefix length
    predicted_rung: dict[str, int | None]
    measured_peak_bytes: dict[str, int | None]  # completed rows only
    engine_starts: int
    completed: int
    interrupted: int


@dataclass(frozen=True)
class RungEngine:
    """The engine one rung started."""

    pool_bytes: int
    startup_s: float
    url: str
    info: EngineInfo  # its /info


@dataclass
class _PrefixClimb:
    """One prefix so far: its attempts, and the first rung that passed with that attempt (None while it fails)."""

    attempts: list[LadderAttempt] = field(default_factory=list)
    first: int | None = None
    evidence: LadderAttempt | None = None


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
    on_attempt: Callable[[int, LadderAttempt], None] | None = None,
    engine_meta: dict[str, bool | float | None] | None = None,
) -> Bundle:
    """The whole-plan path (W=0): raise the pool capacity through ``rungs`` (one engine start per rung, every
    still-failing prefix tried at each) until full reuse succeeds. Each prefix's row reports its first passing
    rung and measured peak beside the core's prediction, ``ladder_rung(whole_plan_bytes)``."""
    tokens = sorted(set(prefixes))
    steps = sorted(set(rungs))
    if not tokens or not steps:
        raise InvalidInput(
            "the ladder needs prefix lengths and capacity rungs",
            hint="give the prefix lengths (--tokens) and the capacity rungs (--rungs)",
        )
    climb = _Climb(tokens, warm_w, new_salt() if salt is None else salt)
    params = LadderParams(prefixes=tokens, rungs=steps, warm_W=warm_w)
    for rung in steps:
        if not climb.pending or climb.stop_reason:
            break
        if on_rung:
            on_rung(rung)
        climb.rung(factory, rung, params, on_row, on_attempt, engine_meta)
    run = climb.run
    assert run is not None  # the first rung either started an engine or raised
    run.engine["rungs"] = wire.value_to_wire(climb.engines)
    for n in tokens:
        run.add(_prefix_row(run, n, steps, climb))
    done = completed(run.rows)
    summary = LadderSummary(
        first_passing_rung={str(r.tokens): r.first_passing_rung for r in run.rows},
        predicted_rung={str(r.tokens): r.predicted_rung for r in run.rows},
        measured_peak_bytes={str(r.tokens): r.passing.peak_pool_bytes if r.passing else None for r in done},
        engine_starts=len(climb.engines),
        completed=len(done),
        interrupted=len(run.rows) - len(done),
    )
    match = all((r.meta.checks or {}).get("rung_matches_prediction") for r in done) if done else None
    targets = [
        target(
            "first passing rung equals the core's prediction (ladder_rung of the whole-plan need)",
            "equal for every prefix",
            summary.first_passing_rung,
            match,
        )
    ]
    return run.finish(summary, targets)


class _Climb:
    """The ladder so far: per prefix its attempts and first passing rung (with that attempt's evidence), the
    prefixes still failing, each rung's engine, and why the climb stopped early (None while it goes on)."""

    def __init__(self, tokens: Sequence[int], warm_w: int, salt: int) -> None:
        self.tokens, self.warm_w, self.salt = list(tokens), warm_w, salt
        self.state = {n: _PrefixClimb() for n in tokens}
        self.pending = list(tokens)
        self.engines: list[RungEngine] = []
        self.run: Run[LadderRow] | None = None
        self.stop_reason: str | None = None

    def rung(
        self,
        factory: EngineFactory,
        rung: int,
        params: LadderParams,
        on_row: OnRow | None,
        on_attempt: Callable[[int, LadderAttempt], None] | None,
        engine_meta: dict[str, bool | float | None] | None,
    ) -> None:
        """Start an engine with ``rung`` bytes of pool and try every still-failing prefix on it."""
        current: int | None = None
        try:
            t0 = time.monotonic()
            with factory(rung) as client:
                startup = time.monotonic() - t0
                if self.run is None:
                    meta = {"restarted_per_rung": True} | (engine_meta or {})
                    self.run = Run("ladder", "ladder", client, params, salt=self.salt, on_row=on_row, engine_meta=meta)
                    require_tokens(self.run.info, self.tokens[-1])
                else:
                    self.run.client = client
                self.engines.append(RungEngine(rung, round(startup, 3), client.url, client.info()))
                for n in list(self.pending):
                    current = n
                    att = _ladder_attempt(self.run, n, rung, self.warm_w, self.salt)
                    state = self.state[n]
                    state.attempts.append(att)
                    if on_attempt:
                        on_attempt(n, att)
                    if att.passed:
                        state.first, state.evidence = rung, att
                        self.pending.remove(n)
                current = None
        except KeyboardInterrupt:
            if self.run is None:
                raise
            self.run.abort_inflight()
            self.stop_reason = "interrupted by the operator (Ctrl-C)"
            self.run.interrupt(Interruption.OPERATOR)
        except (EngineError, ServiceError, CapacityError) as e:
            if self.run is None:
                raise
            self.stop_reason = f"{e.kind}: {e.message} (rung {rung:,} bytes, prefix {current})"
            self.run.interrupt(Interruption.ERROR)


def _prefix_row(run: Run[LadderRow], n: int, steps: Sequence[int], climb: _Climb) -> LadderRow:
    """One prefix's evidence row: its first passing rung and measured peak beside the core's prediction, judged."""
    s = climb.state[n]
    chunks = accounting.chunks_for_tokens(n, run.reg.chunk_size)
    need = accounting.whole_plan_bytes(run.reg, chunks)
    predicted = accounting.ladder_rung(need, steps)
    row = LadderRow(
        tokens=n,
        chunks=chunks,
        whole_plan_bytes=need,
        predicted_rung=predicted,
        first_passing_rung=s.first,
        attempts=tuple(s.attempts),
        meta=RowMeta(),  # judged or stopped below
    )
    ev = s.evidence
    if ev is None and climb.stop_reason and n in climb.pending:
        return replace(row, meta=row.meta.stopped(climb.stop_reason))
    if ev is None:
        # The ladder topped out: consistent only when the core predicted that too.
        return replace(row, meta=row.meta.judged({"rung_matches_prediction": predicted is None}))
    checks = {
        "rung_matches_prediction": s.first == predicted,
        "peak_equals_whole_plan": all(r.pool_peak_bytes == need for r in ev.ranks),
        "hash_canonical": ev.hash_ok is True,
        "ranks_healthy": bool(ev.healthy),
    }
    return replace(row, passing=ev, meta=row.meta.judged(checks))


def _ladder_attempt(run: Run, n: int, rung: int, warm_w: int, salt: int) -> LadderAttempt:
    c, reg = run.client, run.reg
    prompt = prompt_of(n, salt)
    warm = None
    # The fs tier outlives engine restarts: warm only when no tier holds the whole prompt yet.
    if c.probe(prompt).committable_tokens < n:
        w = max(1, min(warm_w, rung // reg.bytes_per_chunk))
        warm = warm_evidence(c.submit(prompt, w=w))
    ev = run.restore(prompt, n, 0)
    return LadderAttempt(
        rung=rung,
        warm=warm,
        outcome=ev.outcome or UNKNOWN_OUTCOME,
        committed_tokens=ev.committed_tokens,
        failure=ev.failure,
        peak_pool_bytes=ev.peak_pool_bytes,
        seconds=ev.seconds,
        gbps=ev.gbps,
        tiers=ev.tiers,
        hash_ok=ev.hash_ok,
        healthy=ev.healthy,
        ranks=ev.ranks,
        passed=ev.outcome == Outcome.COMMITTED and ev.committed_tokens == n,
    )
