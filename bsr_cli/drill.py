"""The paper's failure matrix as an operator drill against a live engine (shared by `bsr drill` and
`bsr bench failures`).

Each scenario warms a fresh prompt into every tier, injects one fault, submits the prompt as the scheduler would,
and checks the categorical outcome: the external prefix of the failed pass collapsed to zero, the force-local
marker was set (and cleared on admission), the request fell back to the expected tier (or recompute), the output
hash equals the canonical one, and every rank is healthy afterwards. Faults are always cleared afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

from bsr_cli.client import AdminClient
from bsr_cli.core import wire
from bsr_cli.core.commit import FAILED_CLOSED
from bsr_cli.core.events import Failure
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: FaultRequest
    expected_fallback: str  # the tier the second pass restores from, or "recompute"


SCENARIOS = (
    Scenario("remote-unavailable", FaultRequest("remote-unavailable", count=1), "fs"),
    # Remote and SSD both gone: the fault must outlive the first (remote) and the second (fs) pass.
    Scenario("remote-and-ssd-absent", FaultRequest("remote-and-ssd-absent", count=0), "recompute"),
    # A rank that fails its own install blames no tier: the prompt is recomputed locally.
    Scenario("one-rank-restore-fault", FaultRequest("restore-fault", rank=1, count=1), "recompute"),
)


@dataclass(frozen=True)
class InvalidChunk:
    """A (rank, layer group) whose restored data was found invalid."""

    rank: int
    group: str


@dataclass(frozen=True)
class FirstPass:
    """The restore of the pass that met the fault, as the engine reported it."""

    advertised_tokens: int | None
    committed_tokens: int | None
    invalid: tuple[InvalidChunk, ...] | None
    failures: tuple[Failure, ...] | None  # the engine's failures, classified and blamed


@dataclass(frozen=True)
class DrillChecks:
    """The categorical outcome of one scenario: each invariant, held or not."""

    warmed: bool
    prefix_collapsed: bool
    force_local_set: bool
    force_local_cleared: bool
    fallback: bool
    hash_canonical: bool
    ranks_healthy: bool

    @property
    def all_held(self) -> bool:
        return all(astuple(self))


@dataclass(frozen=True)
class ScenarioResult:
    """One scenario of the drill (fields in the order of its wire form)."""

    scenario: str
    fault: dict[str, str | int]
    tokens: int
    first_pass: FirstPass
    fallback: str
    expected_fallback: str
    external_tokens: int
    computed_tokens: int
    output_hash: str
    canonical_hash: str | None
    checks: DrillChecks
    ok: bool
    request: str


@dataclass(frozen=True)
class DrillResult:
    """`bsr drill`: every scenario against one engine, and whether every invariant held."""

    engine: str
    tokens: int
    W: int | None
    scenarios: tuple[ScenarioResult, ...]
    ok: bool

    to_wire = wire.writer()


def run_scenario(client: AdminClient, sc: Scenario, tokens: int, seed: int, w: int | None) -> ScenarioResult:
    prompt = Prompt.synthetic_of(tokens, seed)
    warm = client.submit(prompt, w=w)
    client.inject_fault(sc.fault)
    try:
        res = client.submit(prompt, w=w)
    finally:
        client.clear_faults()
    first = res.passes[0]
    first_restore = first.restore
    fallback = res.source if res.external_tokens else "recompute"
    health = client.health()
    checks = DrillChecks(
        warmed=warm.hash_ok is True and len(res.passes) >= 1 and first.external_tokens == tokens,
        prefix_collapsed=first_restore is not None
        and first_restore.outcome == FAILED_CLOSED
        and first_restore.committed_tokens == 0,
        force_local_set=any(h.pass_no >= 1 for h in res.marker_history),
        force_local_cleared=res.marker_cleared is True,
        fallback=fallback == sc.expected_fallback,
        hash_canonical=res.hash_ok is True,
        ranks_healthy=health.ok,
    )
    # The failed pass as the engine reported it (a pass that restored nothing has none of it).
    return ScenarioResult(
        scenario=sc.name,
        fault=sc.fault.to_wire(),
        tokens=tokens,
        first_pass=FirstPass(None, None, None, None)
        if first_restore is None
        else FirstPass(
            advertised_tokens=first_restore.advertised_tokens,
            committed_tokens=first_restore.committed_tokens,
            invalid=tuple(InvalidChunk(c.rank, c.group) for c in first_restore.invalid),
            failures=first_restore.failures,
        ),
        fallback=fallback,
        expected_fallback=sc.expected_fallback,
        external_tokens=res.external_tokens,
        computed_tokens=res.computed_tokens,
        output_hash=res.output_hash,
        canonical_hash=res.canonical_hash,
        checks=checks,
        ok=checks.all_held,
        request=res.request,
    )


def confirm_drill(engine: str, *, assume_yes: bool, ask: Callable[[str], str] | None = None) -> None:
    """The drill breaks an engine on purpose, and workers may have faults enabled: it runs only on an explicit yes.
    `--yes` is that yes; on a terminal the operator is asked; anywhere else (a script, a pipe) it is refused."""
    if assume_yes:
        return
    import sys

    from bsr_cli.errors import InvalidInput

    if ask is None and not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise InvalidInput(
            f"bsr drill injects faults into {engine}; refusing without confirmation",
            hint="add --yes to run it from a script",
        )
    prompt = f"bsr drill injects faults into {engine} (its restores fail on purpose while it runs). Go on? [y/N] "
    if ask is None:
        sys.stderr.write(prompt)
        sys.stderr.flush()
        answer = sys.stdin.readline()
    else:
        answer = ask(prompt)
    if answer.strip().lower() not in ("y", "yes"):
        from bsr_cli.errors import RestoreAborted

        raise RestoreAborted(
            "drill not run: not confirmed",
            hint="the drill injects faults into the engine: confirm at the prompt, or pass --yes",
        )


def run_drill(
    client: AdminClient,
    *,
    tokens: int = 8192,
    w: int | None = None,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    on_result: Callable[[ScenarioResult], None] | None = None,
) -> DrillResult:
    info = client.info()
    if not info.faults_enabled:
        from bsr_cli.errors import FaultsDisabled

        raise FaultsDisabled(
            "the drill needs an engine started with faults enabled", hint="bsr engine up --enable-faults"
        )
    base_seed = int(time.time() * 1000) % 1_000_000_000  # a fresh prompt per run: no state from earlier drills
    results = []
    try:
        for i, sc in enumerate(scenarios):
            r = run_scenario(client, sc, tokens, base_seed + i, w)
            results.append(r)
            if on_result:
                on_result(r)
    finally:
        client.clear_faults()
    return DrillResult(
        engine=client.url,
        tokens=tokens,
        W=w if w is not None else info.w,
        scenarios=tuple(results),
        ok=all(r.ok for r in results),
    )
