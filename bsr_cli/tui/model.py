"""The top view model: an engine's snapshot (``bsr_cli.core.status.Snapshot``) in, an immutable `View` out. Pure
data: no rich, no textual, no I/O.

Whatever collects snapshots hands the UI immutable values, and one view renders two ways
(`bsr_cli.tui.panels`): panel by panel in the Textual app, and once as text (`bsr pool --once`, a pipe). With
--json, `bsr pool` prints the view as data and never imports a renderer. A replayed recording goes through exactly
the code a live session runs.

`fold(prev, frame)` is the only way to build a View. It carries forward what a single snapshot cannot hold (per-rank
history, the event log beyond the engine's last 50 events) and depends on nothing but its arguments, so replaying a
recording twice yields the same frames.

Over 500 lines on purpose: the view's types and the fold, their only constructor, are read together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bsr_cli.core import events as ev
from bsr_cli.core import status, wire
from bsr_cli.core.evidence import EventKind, FailureKind, FaultAct, WindowStep
from bsr_cli.core.evidence import Outcome as EvidenceOutcome
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.units import format_bytes

STALL_S = 5.0  # a rank that releases no window for this long, while others wait on it, is marked stalled
HISTORY = 120  # snapshots of per-rank history kept (two minutes at the default 1 s)
EVENTS_KEPT = 500  # events carried across snapshots (the engine hands out only its last 50 each time)
KIND_FILTERS = ("all", "restores", "windows", "markers", "faults")
SPARK = "▁▂▃▄▅▆▇█"


# -- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One poll's answer as it arrived: what a recording stores and a replay feeds back."""

    snapshot: status.Snapshot = field(metadata=wire.meta(name="snap"))  # the engine's answer
    received_at: float = field(metadata=wire.meta(name="t"))  # local wall clock when the answer arrived
    latency_s: float = field(metadata=wire.meta(name="lat", absent=0.0))  # how long the poll took

    # A recording's line: {"t": ..., "lat": ..., "snap": {...}} (what `bsr top --replay` reads back).
    to_wire = wire.writer(order=("received_at", "latency_s", "snapshot"))
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineInfo:
    name: str = "?"
    version: str = "?"
    model: str = "?"
    registration: str = ""
    ranks: int = 0
    w: int = 0
    rws_bytes: int | None = None
    pool_bytes: int = 0
    budget_bytes: int = 0
    chunk_size: int = 0
    tiers: tuple[str, ...] = ()
    faults_enabled: bool = False
    started_at: float = 0.0
    groups: tuple[str, ...] = ()  # the registration's KV groups


@dataclass(frozen=True)
class RankGauge:
    rank: int
    alive: bool
    error: str
    capacity_bytes: int
    budget_bytes: int
    rws_bytes: int | None  # RWS(W) per rank: the bound one window of W chunks needs
    slot_bytes: int
    live_bytes: int
    peak_bytes: int
    windows_live: int
    waiters: int
    restore_bps: float
    high_water_bytes: int  # the most live bytes seen since the previous snapshot (window events), >= live
    history: tuple[int, ...]  # high water per snapshot, oldest first
    bps_history: tuple[float, ...]
    draining: bool = False  # B was cut below what is live: windows in flight finish, new ones fit the new B
    # LMCache's whole L1 where the host reports it (its own staging too, e.g. a store's chunks until written);
    # live_bytes is the restore windows' share, the one B bounds. None: the pool is only windows.
    l1_live_bytes: int | None = None

    @property
    def state(self) -> str:
        """ok | above-rws (B allows more than one window) | draining (B was cut; live still above it) |
        over-budget (the bound is broken) | down."""
        if not self.alive:
            return "down"
        if self.draining:
            return "draining"
        if self.budget_bytes and self.high_water_bytes > self.budget_bytes:
            return "over-budget"
        if self.rws_bytes and self.high_water_bytes > self.rws_bytes:
            return "above-rws"
        return "ok"


@dataclass(frozen=True)
class ActiveRestore:
    request: str
    w: int
    windows: int  # K
    tokens: int
    tiers: tuple[str, ...]
    elapsed_s: float
    done: tuple[tuple[int, int], ...]  # (rank, windows released)
    bytes_done: int
    failed: tuple[int, ...] = ()  # ranks that already failed this restore (the rest may still be running)
    stalled: tuple[int, ...] = ()  # ranks whose window count has not moved for STALL_S (and have not failed)
    # (rank, windows released, engine time when that count was first seen): carried across snapshots
    progress_seen: tuple[tuple[int, int, float], ...] = ()

    @property
    def current_window(self) -> int:
        """1-based: the window the slowest rank is on (K once every rank has released its last)."""
        slowest = min((d for _, d in self.done), default=0)
        return min(slowest + 1, self.windows) if self.windows else 0

    @property
    def progress_text(self) -> str:
        return f"window {self.current_window} of {self.windows}"


@dataclass(frozen=True)
class Outcome:
    request: str
    outcome: str
    tokens: int
    w: int
    tiers: tuple[str, ...]
    seconds: float
    finished: float
    reason: str
    failure_kind: str = ""  # tier, rank, capacity, aborted ("" when it did not fail)
    failure_stage: str = ""  # where the deciding failure happened (fetch, verify, install, ...), when known

    @property
    def failed(self) -> bool:
        return self.outcome == EvidenceOutcome.FAILED_CLOSED


@dataclass(frozen=True)
class Admission:
    budget_bytes: int  # B, per rank
    ranks: int
    live_bytes: int  # every rank together
    queued: int
    waiting_for_blocks: int = 0  # requests waiting for destination KV blocks (before any restore budget)

    @property
    def budget_total(self) -> int:
        return self.budget_bytes * self.ranks


@dataclass(frozen=True)
class TierHealth:
    name: str
    ok: bool
    detail: tuple[str, ...]


@dataclass(frozen=True)
class MarkerView:
    prompt: str
    excluded: tuple[str, ...]
    reason: str
    request: str
    set_at: float


@dataclass(frozen=True)
class FaultView:
    id: int
    kind: str
    rank: int | None
    window: int | None
    group: str | None
    count: int
    fired: int

    def describe(self) -> str:
        where = "every rank" if self.rank is None else f"rank {self.rank}"
        win = "first window" if self.window is None else f"window {self.window + 1}"
        grp = f" · group {self.group}" if self.group else ""
        times = "until cleared" if self.count == 0 else f"{self.fired}/{self.count} fired"
        return f"#{self.id} {self.kind} · {where} · {win}{grp} · {times}"

    def short(self) -> str:
        return f"#{self.id} {self.kind} {'all' if self.rank is None else f'r{self.rank}'}"


@dataclass(frozen=True)
class Event:
    seq: int
    time: float
    type: str
    category: str
    ranks: tuple[int, ...]
    request: str
    text: str


@dataclass(frozen=True)
class View:
    info: EngineInfo
    time: float  # the engine's clock when it took the snapshot
    seq: int
    received_at: float
    latency_s: float
    gauges: tuple[RankGauge, ...]
    active: tuple[ActiveRestore, ...]
    recent: tuple[Outcome, ...]
    admission: Admission
    tiers: tuple[TierHealth, ...]
    markers: tuple[MarkerView, ...]
    faults: tuple[FaultView, ...]
    events: tuple[Event, ...]  # oldest first, at most EVENTS_KEPT
    events_missed: int = 0  # events the engine dropped from its window before a poll saw them
    frames: int = 1

    def filtered_events(self, rank: int | None = None, kind: str = "all") -> list[Event]:
        return [e for e in self.events if (rank is None or rank in e.ranks) and (kind == "all" or e.category == kind)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for g, gauge in zip(d["gauges"], self.gauges, strict=True):
            g["state"] = gauge.state
        for a, act in zip(d["active"], self.active, strict=True):
            a["current_window"] = act.current_window
        return d


@dataclass(frozen=True)
class LogPage:
    """One page of an event log as `bsr top`'s full log reads it, newest page first: the engine's store through
    GET /events, or what a recording holds. ``older`` is the cursor that reads the page before this one (None: this
    page reaches the oldest event held); ``held`` and ``oldest_seq`` say how much there is (None: not said, as by an
    engine that predates them); ``note`` says why paging stops early."""

    events: tuple[Event, ...]  # oldest first
    older: int | None
    held: int | None
    oldest_seq: int | None
    last_seq: int
    note: str = ""


# -- folding a snapshot into a view -------------------------------------------------------------------------------
def _int(v: Any, default: int = 0) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _float(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _info(info: status.EngineInfo) -> EngineInfo:
    reg = info.registration
    return EngineInfo(
        name=info.engine if info.engine is not None else "?",
        version=info.version or "?",
        model=reg.model or "?",
        registration=reg.identity,
        ranks=info.ranks,
        w=info.w,
        rws_bytes=info.rws_bytes,
        pool_bytes=info.pool_bytes,
        budget_bytes=info.budget_bytes,
        chunk_size=info.chunk_size,
        tiers=tuple(str(t) for t in info.tiers),
        faults_enabled=info.faults_enabled,
        started_at=info.started_at,
        groups=tuple(str(g) for g in reg.groups),
    )


_CATEGORY = {
    EventKind.WINDOW_WAITING: "windows",
    EventKind.WINDOW_FETCHED: "windows",
    EventKind.WINDOW_INSTALLED: "windows",
    EventKind.WINDOW_RELEASED: "windows",
    EventKind.MARKER_SET: "markers",
    EventKind.MARKER_CLEARED: "markers",
    EventKind.FAULT_INJECTED: "faults",
    EventKind.FAULT_FIRED: "faults",
    EventKind.FAULTS_CLEARED: "faults",
    EventKind.RESTORE_STARTED: "restores",
    EventKind.RESTORE_FAILED: "restores",
    EventKind.RESTORE_COMMITTED: "restores",
    EventKind.RESTORE_FAILED_CLOSED: "restores",
    EventKind.RESTORE_REFUSED: "restores",
    EventKind.RESTORE_ABORTED: "restores",
    EventKind.REQUEST_ADMITTED: "restores",
    EventKind.REQUEST_FINISHED: "restores",
    EventKind.ABORT_REQUESTED: "restores",
    EventKind.STORE_FAILED: "restores",
    EventKind.OUTPUT_MISMATCH: "restores",
    EventKind.OBJECT_QUARANTINED: "restores",
    EventKind.SCRUB_STARTED: "restores",
    EventKind.SCRUB_FINISHED: "restores",
    EventKind.SEGMENT_LOST: "restores",
}
# The events `bsr top` and a replay treat as a failure (the `n` key jumps to the next one).
FAILURE_KINDS = frozenset({EventKind.RESTORE_FAILED, EventKind.RESTORE_FAILED_CLOSED, EventKind.OUTPUT_MISMATCH})
# The events that end a restore, whatever its outcome: where a restore's full "why" (its failures) is read.
ENDING_KINDS = tuple(ev.ENDINGS.values())


def category_kinds(category: str) -> tuple[EventKind, ...]:
    """The event kinds a kind filter (restores, windows, ...) shows; () for "all" (every kind, known or not)."""
    return tuple(k for k, c in _CATEGORY.items() if c == category)


def event_category(kind: str) -> str:
    """The filter an event kind falls under (restores, windows, markers, faults, other)."""
    try:
        return _CATEGORY.get(EventKind(kind), "other")
    except ValueError:
        return "other"


def parse_wire(raw: Mapping[str, Any]) -> ev.Event | None:
    """The typed event of a wire event as an engine or a recording holds it, or None for a kind this bsr does not
    know (a newer engine's: shown generically, never misread). Recordings made before failures carried their kind
    are read as they were meant then: every failure was blamed on a tier."""
    try:
        return ev.parse_event(raw)
    except ValueError:
        pass
    try:
        return ev.parse_event(_legacy(raw))
    except ValueError:
        return None


def _legacy(raw: Mapping[str, wire.JsonValue]) -> wire.JsonObject:
    d = dict(raw)
    tier = FailureKind.TIER.value
    if d.get("type") == EventKind.RESTORE_FAILED:
        d.setdefault("kind", tier)
        d.setdefault("reason", "")
    failures = d.get("failures")
    if isinstance(failures, list):
        d["failures"] = [{"kind": tier, **f} if isinstance(f, Mapping) else f for f in failures]
    return d


def event_of(raw: Mapping[str, Any]) -> Event:
    """An event as the engine sent it (its wire form), as the view shows it."""
    typed = parse_wire(raw)
    kind = typed.kind.value if typed is not None else str(raw.get("type", "unknown"))
    ranks: set[int] = set()
    rank = ev.rank_of(typed) if typed is not None else None
    if rank is not None:
        ranks.add(rank)
    if isinstance(typed, ev.RestoreEnded):
        ranks.update(f.rank for f in typed.failures if f.rank is not None)
    return Event(
        seq=_int(raw.get("seq")),
        time=_float(raw.get("time")),
        type=kind,
        category=event_category(kind),
        ranks=tuple(sorted(ranks)),
        request=(ev.request_of(typed) if typed is not None else None) or "",
        text=describe(typed) if typed is not None else _describe_unknown(raw),
    )


def describe_event(raw: Mapping[str, Any]) -> str:
    """One line a person reads during an incident, of an event as the engine sent it (one of a kind this bsr does
    not know is shown as its fields)."""
    e = parse_wire(raw)
    return describe(e) if e is not None else _describe_unknown(raw)


def _describe_unknown(raw: Mapping[str, Any]) -> str:
    rest = {k: v for k, v in raw.items() if k not in ("seq", "time", "pool")}
    return " ".join(f"{k}={v}" for k, v in rest.items())[:200]


def describe(e: ev.Event) -> str:
    """One line a person reads during an incident. Windows are shown 1-based, as `window j of K` is; a restore's
    events name its admission pass (a submit's fallback is pass 2) and a failure the tier it blames."""
    req = ev.request_of(e) or ""
    pass_no = getattr(e, "pass_no", None)
    if req and pass_no is not None:
        req = f"{req} pass {pass_no}"
    line = _request_line(e, req)
    if line is not None:
        return line
    for describe_group in (_operator_line, _storage_line, _process_line):
        line = describe_group(e)
        if line is not None:
            return line
    return e.kind.value


def _request_line(e: ev.Event, req: str) -> str | None:
    """The line of an event of one request's restore (`req` names the request and its pass), or None."""
    if isinstance(e, ev.WindowFetched):
        return f"{req} {_win(e.window)} fetched {_fb(e.bytes)} in {e.seconds * 1e3:.0f} ms ({','.join(e.tiers)})"
    if isinstance(e, ev.WindowStepped):
        step = "waiting for room in the budget" if e.step is WindowStep.WAITING else e.step.value
        return f"{req} {_win(e.window)} {step}"
    if isinstance(e, ev.WindowReleased):
        of = f"/{e.windows}" if e.windows else ""
        return f"{req} {_win(e.window)}{of} released · pool {_fb(_int(e.pool.get('live_bytes')))}"
    if isinstance(e, ev.RestoreStarted):
        return f"{req} started: {e.windows} windows of W={e.W}, {e.tokens:,} tok ({','.join(e.tiers)})"
    if isinstance(e, ev.RestoreEnded) and e.outcome is EvidenceOutcome.COMMITTED:
        return f"{req} committed {e.committed_tokens:,}/{e.advertised_tokens:,} tok in {e.seconds:.2f} s"
    if isinstance(e, ev.RestoreEnded):
        first = e.failures[0] if e.failures else None
        at = f" rank {first.rank} {_win(first.window)}" if first is not None and first.rank is not None else ""
        at += f" tier {first.tier}" if first is not None and first.tier else ""
        why = f" {first.reason}" if first is not None else ""
        # Shouted: failing closed is the one ending that is a fault (refused and aborted are not).
        label = "FAILED CLOSED" if e.outcome is EvidenceOutcome.FAILED_CLOSED else e.outcome.value
        return f"{req} {label}, 0/{e.advertised_tokens:,} tok:{at}{why}".rstrip(":")
    if isinstance(e, ev.RestoreFailed):
        where = [x for x in (e.stage.value if e.stage else "", f"tier {e.tier}" if e.tier else "") if x]
        stage = f" ({', '.join(where)})" if where else ""
        return f"{req} rank {e.rank} failed at {_win(e.window)}{stage}: {e.reason}"
    if isinstance(e, ev.RequestAdmitted):
        return f"{req} admitted: {e.tokens:,} tok"
    if isinstance(e, ev.RequestFinished):
        return (
            f"{req} finished: {e.external_tokens:,} restored from {e.source or 'no tier'},"
            f" {e.computed_tokens:,} computed"
        )
    if isinstance(e, ev.AbortRequested):
        return f"{req} abort requested"
    return None


def _operator_line(e: ev.Event) -> str | None:
    """The line of a force-local marker or an injected fault, or None."""
    if isinstance(e, ev.MarkerSet):
        why = f" ({e.reason})" if e.reason else ""
        scope = f"exclude {','.join(e.excluded_tiers)}" if e.excluded_tiers else "recompute locally"
        return f"force-local marker on {e.prompt[:12]}: {scope}{why}"
    if isinstance(e, ev.MarkerCleared):
        return f"marker cleared on {e.prompt[:12]}" + (f" ({e.why})" if e.why else "")
    if isinstance(e, ev.FaultEvent) and e.act is FaultAct.INJECTED:
        return f"INJECTED FAULT {_fault(e).describe()}"
    if isinstance(e, ev.FaultEvent):
        return f"fault fired {_fault(e).describe()}" + (f" in {e.request}" if e.request else "")
    if isinstance(e, ev.FaultsCleared):
        return f"faults cleared ({e.count})"
    return None


def _storage_line(e: ev.Event) -> str | None:
    """The line of a store failure, a quarantined object, a scrub or a lost store, or None."""
    if isinstance(e, ev.StoreFailed):
        return f"store failed on rank {e.rank} (tier {e.tier}): {e.error}"
    if isinstance(e, ev.ObjectQuarantined):
        what = f"chunk {e.chunk} group {e.group}" if e.chunk is not None else "an object"
        return f"rank {e.rank} quarantined {what} of tier {e.tier}: {e.reason}"
    if isinstance(e, ev.ScrubStarted):
        what = f"prompt {e.prompt[:12]}" if e.prompt else f"every {e.tier} object"
        return f"rank {e.rank} scrubbing {what} on tier {e.tier}" + (f" (after {e.request})" if e.request else "")
    if isinstance(e, ev.ScrubFinished):
        return (
            f"rank {e.rank} scrub {e.scrub} {e.state.value}: {e.checked} checked, {e.damaged} damaged, "
            f"{e.quarantined} quarantined" + (f" ({e.reason})" if e.reason else "")
        )
    if isinstance(e, ev.SegmentLost):
        return f"STORE LOST ({e.tier}): {e.loss.line()}"
    return None


def _process_line(e: ev.Event) -> str | None:
    """The line of a rank's or the engine's life (unresponsive, starved, restarted, started, stopped) or of a
    settings change, or None."""
    if isinstance(e, ev.RankUnresponsive):
        return f"rank {e.rank} unresponsive: {e.reason}" + (f" (during {e.request})" if e.request else "")
    if isinstance(e, ev.RankStarved):
        return f"rank {e.rank} starved (the host, not the rank): {e.reason}" + (
            f" (during {e.request})" if e.request else ""
        )
    if isinstance(e, ev.RankRestarted):
        return f"rank {e.rank} restarted (pid {e.pid}, restart {e.restarts})" + (f": {e.reason}" if e.reason else "")
    if isinstance(e, ev.EngineStarted):
        if not e.restart:
            return f"engine started (bsr {e.version}, pid {e.pid})"
        how = {"clean": "after a clean stop", "crash": "after a crash (it stopped without saying so)"}
        dropped = f"; {e.faults_dropped} armed fault(s) dropped" if e.faults_dropped else ""
        return f"engine restarted {how.get(e.previous_stop, '')} (bsr {e.version}, pid {e.pid}){dropped}".replace(
            "  ", " "
        )
    if isinstance(e, ev.EngineStopped):
        return "engine stopped" + (f" ({e.reason})" if e.reason else "")
    if isinstance(e, ev.SettingsChanged):
        return "settings changed: " + ", ".join(f"{k}={v}" for k, v in sorted(e.changes.items()))
    return None


def _win(index: Any) -> str:
    return f"window {index + 1}" if isinstance(index, int) else "before any window"


def fault_view(f: FaultSpec) -> FaultView:
    """An armed fault as the view shows it."""
    return FaultView(id=f.id, kind=f.kind, rank=f.rank, window=f.window, group=f.group, count=f.count, fired=f.fired)


def _fault(e: ev.FaultEvent) -> FaultView:
    return FaultView(
        id=e.fault_id,
        kind=e.fault,
        rank=e.rank,
        window=e.window,
        group=e.group or None,
        count=e.count,
        fired=e.fired,
    )


def _high_water(events: Iterable[ev.Event], after_seq: int) -> dict[int, int]:
    """Per rank, the most live pool bytes any window event reported after ``after_seq``: a restore can start and
    finish between two polls, and the gauge must still show how full the pool got."""
    out: dict[int, int] = {}
    for e in events:
        if e.seq <= after_seq:
            continue
        if isinstance(e, ev.WindowFetched | ev.WindowReleased) and e.pool:
            out[e.rank] = max(out.get(e.rank, 0), _int(e.pool.get("live_bytes")))
    return out


def _known(raw_events: Iterable[Mapping[str, Any]]) -> list[ev.Event]:
    """The snapshot's events (their wire form) that this bsr knows, as types."""
    return [e for e in map(parse_wire, raw_events) if e is not None]


def fold(prev: View | None, frame: Frame) -> View:
    """The next view: ``frame``'s snapshot, with history and events carried over from ``prev``."""
    snap = frame.snapshot
    info = _info(snap.info)
    raw_events = snap.events
    seq = snap.seq
    # A different start time (or a sequence that went backwards) is a restarted engine: its events start over.
    same_engine = prev is not None and prev.info.started_at == info.started_at and seq >= prev.seq
    after = prev.seq if (prev is not None and same_engine) else 0
    events, missed = _carry_events(prev, same_engine, raw_events, after, info, frame.received_at)
    # Only events newer than the previous poll count toward the high water; on the first frame the live value is all
    # this view can vouch for.
    high = _high_water(_known(raw_events), after) if prev is not None else {}
    gauges = _gauges(snap, info, high, prev)
    now = snap.time or frame.received_at
    failed_by_request: dict[str, set[int]] = {}
    for e in events:
        if e.type == EventKind.RESTORE_FAILED and e.request:
            failed_by_request.setdefault(e.request, set()).update(e.ranks)
    before_active = {a.request: a for a in prev.active} if prev is not None and same_engine else {}
    active = tuple(_active(a, now, failed_by_request, before_active) for a in snap.active)
    adm = snap.admission
    admission = Admission(
        budget_bytes=adm.budget_bytes,
        ranks=len(gauges) or info.ranks,
        live_bytes=adm.live_bytes,
        queued=adm.queued,
        waiting_for_blocks=adm.waiting_for_blocks,
    )
    tiers = tuple(TierHealth(name, h.ok, h.detail) for name, h in snap.tiers.items())
    return View(
        info=info,
        time=now,
        seq=seq,
        received_at=frame.received_at,
        latency_s=frame.latency_s,
        gauges=gauges,
        active=active,
        recent=tuple(_outcome(o) for o in snap.recent),
        admission=admission,
        tiers=tiers,
        markers=tuple(_marker(m) for m in snap.markers),
        faults=tuple(fault_view(f) for f in snap.faults),
        events=events,
        events_missed=missed,
        frames=(prev.frames + 1) if prev is not None else 1,
    )


def _carry_events(
    prev: View | None,
    same_engine: bool,
    raw_events: Sequence[Mapping[str, Any]],
    after: int,
    info: EngineInfo,
    received_at: float,
) -> tuple[tuple[Event, ...], int]:
    """(the events the view keeps: ``prev``'s then those after sequence ``after``, the newest EVENTS_KEPT; how many
    events no poll saw, counted from the gaps in the sequence numbers)."""
    new_events = [event_of(e) for e in raw_events if _int(e.get("seq")) > after]
    missed = prev.events_missed if prev is not None else 0
    if prev is not None and same_engine and new_events and new_events[0].seq > prev.seq + 1:
        missed += new_events[0].seq - prev.seq - 1
    if prev is not None and not same_engine:
        # Old and new request ids would interleave in the log: mark where the new engine's events begin.
        new_events.insert(0, restart_event(info.started_at, received_at))
    return ((prev.events if prev is not None else ()) + tuple(new_events))[-EVENTS_KEPT:], missed


def _gauges(
    snap: status.Snapshot, info: EngineInfo, high: Mapping[int, int], prev: View | None
) -> tuple[RankGauge, ...]:
    """Each rank's pool gauge, its history carried over from ``prev``'s gauge of the same rank."""
    old = {g.rank: g for g in prev.gauges} if prev is not None else {}
    gauges = []
    for r in snap.ranks:
        rank = r.rank
        pool = r.pool or {}
        live = _int(pool.get("live_bytes"))
        hw = max(live, high.get(rank, 0))
        bps = _float(r.restore_bps)
        before = old.get(rank)
        gauges.append(
            RankGauge(
                rank=rank,
                alive=r.alive,
                error=r.error or "",
                capacity_bytes=_int(pool.get("capacity_bytes"), info.pool_bytes),
                budget_bytes=_int(pool.get("budget_bytes"), info.budget_bytes),
                rws_bytes=info.rws_bytes,
                slot_bytes=_int(pool.get("slot_bytes")),
                live_bytes=live,
                peak_bytes=_int(pool.get("peak_bytes")),
                windows_live=_int(pool.get("windows_live")),
                waiters=_int(pool.get("waiters")),
                draining=bool(pool.get("draining", False)),
                l1_live_bytes=_int(pool["l1_live_bytes"]) if "l1_live_bytes" in pool else None,
                restore_bps=bps,
                high_water_bytes=hw,
                history=((before.history if before else ()) + (hw,))[-HISTORY:],
                bps_history=((before.bps_history if before else ()) + (bps,))[-HISTORY:],
            )
        )
    return tuple(gauges)


def _outcome(o: status.RecentRestore) -> Outcome:
    return Outcome(
        request=o.request,
        outcome=o.outcome.value if o.outcome is not None else "?",
        tokens=o.tokens,
        w=o.w,
        tiers=o.tiers,
        seconds=o.seconds,
        finished=o.finished,
        reason=o.reason,
        failure_kind=o.failure_kind.value if o.failure_kind is not None else "",
        failure_stage=o.failure_stage.value if o.failure_stage is not None else "",
    )


def _marker(m: status.MarkerView) -> MarkerView:
    return MarkerView(prompt=m.prompt, excluded=m.excluded_tiers, reason=m.reason, request=m.request, set_at=m.set_at)


def _active(
    a: status.ActiveRestore,
    now: float,
    failed_by_request: Mapping[str, set[int]],
    before: Mapping[str, ActiveRestore],
) -> ActiveRestore:
    request = a.request
    done = tuple(sorted(a.done.items()))
    windows = a.windows
    failed = tuple(sorted(failed_by_request.get(request, ())))
    # When each rank's window count last moved, on the engine's clock (carried while the count stands still).
    seen = {r: (d, t) for r, d, t in before[request].progress_seen} if request in before else {}
    progress = tuple((r, d, seen[r][1] if r in seen and seen[r][0] == d else now) for r, d in done)
    ahead = max((d for _, d in done), default=0)

    def is_stalled(rank: int, count: int, since: float) -> bool:
        if rank in failed or count >= windows:
            return False
        quiet = now - since
        # Behind the others and quiet for STALL_S, or quiet twice as long even with nobody ahead.
        return quiet >= (STALL_S if count < ahead else 2 * STALL_S)

    stalled = tuple(r for r, d, since in progress if is_stalled(r, d, since))
    return ActiveRestore(
        request=request,
        w=a.w,
        windows=windows,
        tokens=a.tokens,
        tiers=a.tiers,
        elapsed_s=max(0.0, now - (a.started or now)),
        done=done,
        bytes_done=sum(a.bytes.values()),
        failed=failed,
        stalled=stalled,
        progress_seen=progress,
    )


def restart_event(started_at: float, at: float) -> Event:
    """The separator line the event log shows where a restarted engine's events begin (seen at ``at``)."""
    since = clock(started_at) if started_at else "?"
    return Event(
        seq=0,
        time=at,
        type=EventKind.ENGINE_STARTED.value,
        category="other",
        ranks=(),
        request="",
        text=f"──── engine restarted (up since {since}): request ids and sequence numbers start again ────",
    )


def fold_all(frames: Iterable[Frame]) -> Iterator[View]:
    view: View | None = None
    for f in frames:
        view = fold(view, f)
        yield view


# -- filters the UI cycles through --------------------------------------------------------------------------------
def next_rank(current: int | None, ranks: Sequence[int]) -> int | None:
    """all → rank 0 → rank 1 → ... → all."""
    order: list[int | None] = [None, *sorted(ranks)]
    try:
        return order[(order.index(current) + 1) % len(order)]
    except ValueError:
        return None


def next_kind(current: str) -> str:
    try:
        return KIND_FILTERS[(KIND_FILTERS.index(current) + 1) % len(KIND_FILTERS)]
    except ValueError:
        return "all"


def clock(ts: float) -> str:
    """A wall-clock time as the panels and event lines write it (HH:MM:SS, local time)."""
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "--:--:--"


def _fb(n: float | None) -> str:
    return format_bytes(n, compact=True)
