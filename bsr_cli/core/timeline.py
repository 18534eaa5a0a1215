"""One request's timeline, as `bsr describe` shows it: its events folded into per-rank, per-window rows (when
each window was fetched, installed and released, and what its fetch moved), the failures (which window, its chunks,
the tier and stage blamed, why), the marker it left, the scrubs it started, and how it stands. Pure: the events come
in as types (from the engine's event log or a `bsr top --record` recording)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from bsr_cli.core import events as ev
from bsr_cli.core import wire
from bsr_cli.core.evidence import FailureKind, Outcome, Stage, WindowStep

if TYPE_CHECKING:
    from bsr_cli.core.status import MarkerView


@dataclass(frozen=True)
class WindowRow:
    """One window on one rank: when (seconds from the request's first event) each step happened, in the order
    they did, and what its fetch moved. ``window`` counts from 1."""

    rank: int
    window: int
    steps: dict[WindowStep, float] = field(default_factory=dict)
    bytes: int | None = None  # these three: once it was fetched
    tiers: tuple[str, ...] = ()
    fetch_s: float | None = None

    def facts(self) -> Iterator[tuple[str, wire.JsonValue]]:
        """The row's wire fields, in the order the steps happened (the fetch's numbers right after it)."""
        yield from (("rank", self.rank), ("window", self.window))
        for step, at in self.steps.items():
            yield step.value, at
            if step is WindowStep.FETCHED:
                yield "bytes", self.bytes
                yield "tiers", list(self.tiers)
                yield "fetch_s", self.fetch_s


@dataclass(frozen=True)
class TimelineFailure:
    """One rank's part of the restore that failed. ``window`` counts from 1 (None: before any window), ``chunks``
    are the failed window's [start, end) when the host said."""

    rank: int | None
    window: int | None
    at: float
    reason: str
    kind: FailureKind
    stage: Stage | None
    tier: str | None
    chunks: tuple[int, int] | None = None

    @classmethod
    def of(cls, f: ev.Failure, at: float) -> TimelineFailure:
        window = f.window + 1 if f.window is not None else None
        return cls(f.rank, window, at, f.reason, f.kind, f.stage, f.tier, f.chunks)

    def where(self) -> str:
        """``window G2 (chunks 4-7)``, or ``before any window``."""
        if not self.window:
            return "before any window"
        span = f" (chunks {self.chunks[0]}-{self.chunks[1] - 1})" if self.chunks else ""
        return f"window G{self.window}{span}"

    def why(self) -> str:
        """``tier fs, stage verify``: who is blamed and where (what is known)."""
        parts = [f"tier {self.tier}" if self.tier else "", f"stage {self.stage.value}" if self.stage else ""]
        return ", ".join(p for p in parts if p) or f"kind {self.kind.value}"

    def to_wire(self) -> wire.JsonObject:
        return {
            "rank": self.rank,
            "window": self.window,
            "label": f"G{self.window}" if self.window else None,
            "chunks": list(self.chunks) if self.chunks else None,
            "at": self.at,
            "reason": self.reason,
            "kind": self.kind.value,
            "stage": self.stage.value if self.stage else None,
            "tier": self.tier,
        }


@dataclass(frozen=True)
class TimelineOutcome:
    """How the request stands: in progress, how its restore ended (with the tokens committed), or finished (with
    where its tokens came from)."""

    state: str
    at: float | None = None
    tokens: int | None = None  # a restore's end
    source: str | None = None  # these three: a finished request
    external_tokens: int | None = None
    computed_tokens: int | None = None

    def facts(self) -> Iterator[tuple[str, wire.JsonValue]]:
        yield "state", self.state
        if self.source is not None:
            yield from (("source", self.source), ("external_tokens", self.external_tokens))
            yield "computed_tokens", self.computed_tokens
        elif self.tokens is not None:
            yield "tokens", self.tokens
        if self.at is not None:
            yield "at", self.at


@dataclass(frozen=True)
class TimelineMarker:
    """The force-local marker the request's failure left: under its prompt id, as `bsr markers list` shows it."""

    prompt: str
    excluded_tiers: tuple[str, ...]
    reason: str

    to_wire = wire.writer()


@dataclass(frozen=True)
class Timeline:
    """`bsr describe`: one request's prompt, windows per rank, its failures (which window, its chunks, why), the
    marker it left and the scrubs it started, and its outcome."""

    request: str
    started_at: float
    outcome: TimelineOutcome
    failures: tuple[TimelineFailure, ...]
    windows: tuple[WindowRow, ...]
    prompt: str = ""
    marker: TimelineMarker | None = None
    scrubs: tuple[ev.ScrubFinished, ...] = ()

    def to_wire(self) -> wire.JsonObject:
        return {
            "request": self.request,
            "prompt": self.prompt or None,
            "started_at": self.started_at,
            "outcome": dict(self.outcome.facts()),
            "failures": [f.to_wire() for f in self.failures],
            "marker": self.marker.to_wire() if self.marker else None,
            "scrubs": [
                {k: v for k, v in s.to_wire().items() if k not in ("type", "seq", "time", "request")}
                for s in self.scrubs
            ],
            "windows": [dict(r.facts()) for r in self.windows],
        }


def timeline(request: str, evs: list[ev.Event], markers: Sequence[MarkerView] = ()) -> Timeline:
    """Fold one request's events into per-(rank, window) rows, its failures, marker and scrubs, and an outcome.
    ``markers``: the engine's standing ones (a host whose marker is no event of the request, found by request)."""
    t0 = min(e.time for e in evs)
    windows: dict[tuple[int, int], WindowRow] = {}
    outcome = TimelineOutcome("in progress")
    failures: list[TimelineFailure] = []
    ended: tuple[ev.Failure, ...] = ()
    ended_at = 0.0
    prompt, marker, scrubs = "", None, []
    for e in sorted(evs, key=lambda e: (e.time, e.seq)):
        at = round(e.time - t0, 6)
        if isinstance(e, ev.WindowStepped | ev.WindowFetched | ev.WindowReleased):
            row = windows.setdefault((e.rank, e.window), WindowRow(e.rank, e.window + 1))
            row.steps[e.step] = at  # the column the step fills
            if isinstance(e, ev.WindowFetched):
                windows[(e.rank, e.window)] = replace(row, bytes=e.bytes, tiers=tuple(e.tiers), fetch_s=e.seconds)
        elif isinstance(e, ev.RestoreStarted | ev.RequestAdmitted):
            prompt = prompt or e.prompt
        elif isinstance(e, ev.RestoreFailed):
            failures.append(TimelineFailure.of(e.failure, at))
        elif isinstance(e, ev.RestoreEnded):
            tokens = e.committed_tokens if e.outcome is Outcome.COMMITTED else 0
            outcome = TimelineOutcome(e.outcome.value.replace("_", " "), at=at, tokens=tokens)
            ended, ended_at = e.failures, at
        elif isinstance(e, ev.MarkerSet):
            marker = TimelineMarker(e.prompt, tuple(e.excluded_tiers), e.reason)
        elif isinstance(e, ev.ScrubFinished):
            scrubs.append(e)
        elif isinstance(e, ev.RequestFinished):
            outcome = TimelineOutcome(
                "finished",
                at=at,
                source=e.source,
                external_tokens=e.external_tokens,
                computed_tokens=e.computed_tokens,
            )
    # A host that reports a failure only with the restore's end (a vLLM worker's load): the end names it.
    told = {f.rank for f in failures}
    failures += [TimelineFailure.of(f, ended_at) for f in ended if f.rank not in told]
    if marker is None:
        m = next((m for m in markers if m.request == request), None)
        marker = TimelineMarker(m.prompt, tuple(m.excluded_tiers), m.reason) if m is not None else None
    rows = tuple(windows[k] for k in sorted(windows))
    return Timeline(request, t0, outcome, tuple(failures), rows, prompt, marker, tuple(scrubs))
