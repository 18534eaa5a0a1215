"""The top view model: a raw engine snapshot in, an immutable `View` out, and the rich renderers that draw it.

nvitop's shape: whatever collects snapshots hands the UI immutable values, and one view renders two ways: panel by
panel in the Textual app, and once as text (`bsr pool --once`, a pipe). Nothing here does I/O or imports textual,
so a replayed recording goes through exactly the code a live session runs.

`fold(prev, frame)` is the only way to build a View. It carries forward what a single snapshot cannot hold (per-rank
history, the event log beyond the engine's last 50 events) and depends on nothing but its arguments, so replaying a
recording twice yields the same frames.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from bsr_cli.core.commit import COMMITTED, FAILED_CLOSED, NOTHING_TO_RESTORE

STALL_S = 5.0  # a rank that releases no window for this long, while others wait on it, is marked stalled
HISTORY = 120  # snapshots of per-rank history kept (two minutes at the default 1 s)
EVENTS_KEPT = 500  # events carried across snapshots (the engine hands out only its last 50 each time)
KIND_FILTERS = ("all", "restores", "windows", "markers", "faults")
SPARK = "▁▂▃▄▅▆▇█"


# -- the model ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    """One poll's answer as it arrived: what a recording stores and a replay feeds back."""

    snapshot: Mapping[str, Any]  # the engine's JSON, never mutated after it arrives
    received_at: float  # local wall clock when the answer arrived
    latency_s: float  # how long the poll took

    def to_record(self) -> dict[str, Any]:
        return {"t": self.received_at, "lat": round(self.latency_s, 6), "snap": self.snapshot}

    @classmethod
    def from_record(cls, d: Mapping[str, Any]) -> Frame:
        return cls(dict(d["snap"]), float(d["t"]), float(d.get("lat", 0.0)))


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

    @property
    def state(self) -> str:
        """ok | above-rws (B allows more than one window) | over-budget (the bound is broken) | down."""
        if not self.alive:
            return "down"
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


@dataclass(frozen=True)
class Admission:
    budget_bytes: int  # B, per rank
    ranks: int
    live_bytes: int  # every rank together
    queued: int

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


def _info(raw: Mapping[str, Any]) -> EngineInfo:
    reg = raw.get("registration") or {}
    rws = raw.get("rws_bytes")
    return EngineInfo(
        name=str(raw.get("engine", "?")),
        version=str(raw.get("version", "?")),
        model=str(reg.get("model", "?")),
        registration=str(reg.get("identity", "")),
        ranks=_int(raw.get("ranks")),
        w=_int(raw.get("W")),
        rws_bytes=None if rws is None else _int(rws),
        pool_bytes=_int(raw.get("pool_bytes")),
        budget_bytes=_int(raw.get("budget_bytes")),
        chunk_size=_int(raw.get("chunk_size")),
        tiers=tuple(str(t) for t in raw.get("tiers") or ()),
        faults_enabled=bool(raw.get("faults_enabled", False)),
        started_at=_float(raw.get("started_at")),
        groups=tuple(str(g) for g in reg.get("groups") or ()),
    )


def event_category(kind: str) -> str:
    if kind.startswith("window_"):
        return "windows"
    if kind.startswith("marker_"):
        return "markers"
    if kind.startswith("fault"):
        return "faults"
    if kind.startswith(("restore_", "request_", "abort_", "store_")):
        return "restores"
    return "other"


def _event(raw: Mapping[str, Any]) -> Event:
    kind = str(raw.get("type", "?"))
    ranks: set[int] = set()
    if isinstance(raw.get("rank"), int):
        ranks.add(raw["rank"])
    for f in raw.get("failures") or ():
        if isinstance(f, Mapping) and isinstance(f.get("rank"), int):
            ranks.add(f["rank"])
    return Event(
        seq=_int(raw.get("seq")),
        time=_float(raw.get("time")),
        type=kind,
        category=event_category(kind),
        ranks=tuple(sorted(ranks)),
        request=str(raw.get("request", "")),
        text=describe_event(raw),
    )


def describe_event(ev: Mapping[str, Any]) -> str:
    """One line a person reads during an incident. Windows are shown 1-based, as `window j of K` is."""
    kind = str(ev.get("type", "?"))
    req = str(ev.get("request", ""))
    win = ev.get("window")
    w1 = f"window {win + 1}" if isinstance(win, int) else "window ?"
    if kind == "window_fetched":
        tiers = ",".join(ev.get("tiers") or ())
        return f"{req} {w1} fetched {fb(_int(ev.get('bytes')))} in {_float(ev.get('seconds')) * 1e3:.0f} ms ({tiers})"
    if kind == "window_installed":
        return f"{req} {w1} installed"
    if kind == "window_released":
        pool = ev.get("pool") or {}
        of = f"/{ev['windows']}" if isinstance(ev.get("windows"), int) else ""
        return f"{req} {w1}{of} released · pool {fb(_int(pool.get('live_bytes')))}"
    if kind == "restore_started":
        tiers = ",".join(ev.get("tiers") or ())
        n = _int(ev.get("tokens"))
        return f"{req} started: {ev.get('windows')} windows of W={ev.get('W')}, {n:,} tok ({tiers})"
    if kind == "restore_committed":
        return (
            f"{req} committed {_int(ev.get('committed_tokens')):,}/{_int(ev.get('advertised_tokens')):,} tok"
            f" in {_float(ev.get('seconds')):.2f} s"
        )
    if kind == "restore_failed_closed":
        fails = [f for f in ev.get("failures") or () if isinstance(f, Mapping)]
        first = fails[0] if fails else {}
        at = f" rank {first.get('rank')} {_win(first.get('window'))}" if first else ""
        n = _int(ev.get("advertised_tokens"))
        return f"{req} FAILED CLOSED, 0/{n:,} tok:{at} {first.get('reason', '')}".rstrip()
    if kind == "restore_failed":
        return f"{req} rank {ev.get('rank')} failed at {_win(win)}: {ev.get('reason', '')}"
    if kind == "marker_set":
        excl = ",".join(ev.get("excluded_tiers") or ())
        return f"force-local marker on {str(ev.get('prompt', ''))[:12]}: exclude {excl} ({ev.get('reason', '')})"
    if kind == "marker_cleared":
        return f"marker cleared on {str(ev.get('prompt', ''))[:12]} ({ev.get('why', '')})"
    if kind == "fault_injected":
        f = _fault(ev)
        return f"INJECTED FAULT {f.describe()}"
    if kind == "faults_cleared":
        return f"faults cleared ({_int(ev.get('count'))})"
    if kind == "request_admitted":
        return f"{req} admitted: {_int(ev.get('tokens')):,} tok"
    if kind == "request_finished":
        return (
            f"{req} finished: {_int(ev.get('external_tokens')):,} restored from {ev.get('source', '?')},"
            f" {_int(ev.get('computed_tokens')):,} computed"
        )
    if kind == "abort_requested":
        return f"{req} abort requested"
    if kind == "store_failed":
        return f"store failed on rank {ev.get('rank')}: {ev.get('error', '')}"
    rest = {k: v for k, v in ev.items() if k not in ("seq", "time", "type", "pool")}
    return " ".join(f"{k}={v}" for k, v in rest.items())[:200]


def _win(index: Any) -> str:
    return f"window {index + 1}" if isinstance(index, int) else "before any window"


def _fault(d: Mapping[str, Any]) -> FaultView:
    rank, window, group = d.get("rank"), d.get("window"), d.get("group")
    return FaultView(
        id=_int(d.get("id")),
        kind=str(d.get("kind", "?")),
        rank=rank if isinstance(rank, int) else None,
        window=window if isinstance(window, int) else None,
        group=str(group) if group else None,
        count=_int(d.get("count"), 1),
        fired=_int(d.get("fired")),
    )


def _high_water(events: Iterable[Mapping[str, Any]], after_seq: int) -> dict[int, int]:
    """Per rank, the most live pool bytes any window event reported after ``after_seq``: a restore can start and
    finish between two polls, and the gauge must still show how full the pool got."""
    out: dict[int, int] = {}
    for ev in events:
        pool = ev.get("pool")
        if _int(ev.get("seq")) > after_seq and isinstance(pool, Mapping) and isinstance(ev.get("rank"), int):
            out[ev["rank"]] = max(out.get(ev["rank"], 0), _int(pool.get("live_bytes")))
    return out


def fold(prev: View | None, frame: Frame) -> View:
    """The next view: ``frame``'s snapshot, with history and events carried over from ``prev``."""
    snap = frame.snapshot
    info = _info(snap.get("info") or {})
    raw_events = [e for e in snap.get("events") or () if isinstance(e, Mapping)]
    seq = _int(snap.get("seq"))
    # A different start time (or a sequence that went backwards) is a restarted engine: its events start over.
    same_engine = prev is not None and prev.info.started_at == info.started_at and seq >= prev.seq
    after = prev.seq if (prev is not None and same_engine) else 0
    new_events = [_event(e) for e in raw_events if _int(e.get("seq")) > after]
    missed = prev.events_missed if prev is not None else 0
    if prev is not None and same_engine and new_events and new_events[0].seq > prev.seq + 1:
        missed += new_events[0].seq - prev.seq - 1
    if prev is not None and not same_engine:
        # Old and new request ids would interleave in the log: mark where the new engine's events begin.
        new_events.insert(0, _restart_event(info, frame.received_at))
    events = ((prev.events if prev is not None else ()) + tuple(new_events))[-EVENTS_KEPT:]
    # Only events newer than the previous poll count toward the high water; on the first frame the live value is all
    # this view can vouch for.
    high = _high_water(raw_events, after) if prev is not None else {}
    old = {g.rank: g for g in prev.gauges} if prev is not None else {}

    gauges = []
    for r in snap.get("ranks") or ():
        if not isinstance(r, Mapping):
            continue
        rank = _int(r.get("rank"))
        pool = r.get("pool") or {}
        live = _int(pool.get("live_bytes"))
        hw = max(live, high.get(rank, 0))
        bps = _float(r.get("restore_bps"))
        before = old.get(rank)
        gauges.append(
            RankGauge(
                rank=rank,
                alive=bool(r.get("alive", False)),
                error=str(r.get("error", "")),
                capacity_bytes=_int(pool.get("capacity_bytes"), info.pool_bytes),
                budget_bytes=_int(pool.get("budget_bytes"), info.budget_bytes),
                rws_bytes=info.rws_bytes,
                slot_bytes=_int(pool.get("slot_bytes")),
                live_bytes=live,
                peak_bytes=_int(pool.get("peak_bytes")),
                windows_live=_int(pool.get("windows_live")),
                waiters=_int(pool.get("waiters")),
                restore_bps=bps,
                high_water_bytes=hw,
                history=((before.history if before else ()) + (hw,))[-HISTORY:],
                bps_history=((before.bps_history if before else ()) + (bps,))[-HISTORY:],
            )
        )

    now = _float(snap.get("time"), frame.received_at)
    failed_by_request: dict[str, set[int]] = {}
    for e in events:
        if e.type == "restore_failed" and e.request:
            failed_by_request.setdefault(e.request, set()).update(e.ranks)
    before_active = {a.request: a for a in prev.active} if prev is not None and same_engine else {}
    active = tuple(
        _active(a, now, failed_by_request, before_active) for a in snap.get("active") or () if isinstance(a, Mapping)
    )
    recent = tuple(
        Outcome(
            request=str(o.get("request", "")),
            outcome=str(o.get("outcome", "?")),
            tokens=_int(o.get("tokens")),
            w=_int(o.get("W")),
            tiers=tuple(o.get("tiers") or ()),
            seconds=_float(o.get("seconds")),
            finished=_float(o.get("finished")),
            reason=str(o.get("reason", "")),
        )
        for o in snap.get("recent") or ()
        if isinstance(o, Mapping)
    )
    adm = snap.get("admission") or {}
    admission = Admission(
        budget_bytes=_int(adm.get("budget_bytes"), info.budget_bytes),
        ranks=len(gauges) or info.ranks,
        live_bytes=_int(adm.get("live_bytes")),
        queued=_int(adm.get("queued")),
    )
    tiers = tuple(
        TierHealth(str(name), bool(h.get("ok", False)), tuple(str(d) for d in h.get("detail") or ()))
        for name, h in (snap.get("tiers") or {}).items()
        if isinstance(h, Mapping)
    )
    markers = tuple(
        MarkerView(
            prompt=str(m.get("prompt", "")),
            excluded=tuple(m.get("excluded_tiers") or ()),
            reason=str(m.get("reason", "")),
            request=str(m.get("request", "")),
            set_at=_float(m.get("set_at")),
        )
        for m in snap.get("markers") or ()
        if isinstance(m, Mapping)
    )
    faults = tuple(_fault(f) for f in snap.get("faults") or () if isinstance(f, Mapping))
    return View(
        info=info,
        time=now,
        seq=seq,
        received_at=frame.received_at,
        latency_s=frame.latency_s,
        gauges=tuple(gauges),
        active=active,
        recent=recent,
        admission=admission,
        tiers=tiers,
        markers=markers,
        faults=faults,
        events=events,
        events_missed=missed,
        frames=(prev.frames + 1) if prev is not None else 1,
    )


def _active(
    a: Mapping[str, Any], now: float, failed_by_request: Mapping[str, set[int]], before: Mapping[str, ActiveRestore]
) -> ActiveRestore:
    request = str(a.get("request", ""))
    done = tuple(sorted((_int(k), _int(v)) for k, v in (a.get("done") or {}).items()))
    windows = _int(a.get("windows"))
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
        w=_int(a.get("W")),
        windows=windows,
        tokens=_int(a.get("tokens")),
        tiers=tuple(a.get("tiers") or ()),
        elapsed_s=max(0.0, now - _float(a.get("started"), now)),
        done=done,
        bytes_done=sum(_int(v) for v in (a.get("bytes") or {}).values()),
        failed=failed,
        stalled=stalled,
        progress_seen=progress,
    )


def _restart_event(info: EngineInfo, at: float) -> Event:
    since = clock(info.started_at) if info.started_at else "?"
    return Event(
        seq=0,
        time=at,
        type="engine_restarted",
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


# -- formatting ---------------------------------------------------------------------------------------------------
def fb(n: float | None) -> str:
    """Compact binary bytes for dense panels: 4.0 MiB, 512 KiB, 0 B."""
    if n is None:
        return "—"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 or (v == int(v) and v >= 10) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def clock(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "--:--:--"


def ago(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


STATE_STYLE = {"ok": "green", "above-rws": "yellow", "over-budget": "bold red", "down": "bold red"}
OUTCOME_STYLE = {COMMITTED: "green", FAILED_CLOSED: "bold red", NOTHING_TO_RESTORE: "dim"}
CATEGORY_STYLE = {"windows": "dim", "restores": "cyan", "markers": "magenta", "faults": "bold red", "other": ""}


class Bar:
    """A pool gauge as wide as it is given: live bytes against capacity, with the RWS(W) bound and budget B marked.

    █ live now   ▓ high water since the previous snapshot   │ RWS(W)   ┆ B (when it differs)   ░ admissible   · beyond B
    """

    def __init__(self, g: RankGauge) -> None:
        self.g = g

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(8, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(options.max_width)

    def text(self, width: int) -> Text:
        g = self.g
        cap = g.capacity_bytes or max(g.budget_bytes, g.high_water_bytes, 1)

        def cells(n: float) -> int:
            return max(0, min(width, round(n / cap * width)))

        live, hw = cells(g.live_bytes), cells(g.high_water_bytes)
        if g.live_bytes and not live:
            live = 1  # a non-empty pool never looks empty
        if g.high_water_bytes and not hw:
            hw = 1
        budget = cells(g.budget_bytes) if g.budget_bytes else width
        rws = cells(g.rws_bytes) if g.rws_bytes else None
        style = STATE_STYLE[g.state] if g.state != "ok" else "green"
        out = Text()
        for i in range(width):
            if rws is not None and i == min(rws, width - 1):
                out.append("┃" if i < hw else "│", f"bold {style}" if i < hw else "bold")
            elif i == min(budget, width - 1) and budget != rws and budget < width:
                out.append("┆", "yellow")
            elif i < live:
                out.append("█", style)
            elif i < hw:
                out.append("▓", style)
            elif i < budget:
                out.append("░", "dim")
            else:
                out.append("·", "dim")
        return out


class Spark:
    """A sparkline of the newest values that fit, scaled to ``top`` (a fixed scale keeps the bound meaningful)."""

    def __init__(self, values: Sequence[float], top: float | None = None, style: str = "cyan") -> None:
        self.values, self.top, self.style = values, top, style

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(4, options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(options.max_width)

    def text(self, width: int) -> Text:
        vals = list(self.values)[-width:]
        top = self.top or max(vals, default=0) or 1
        out = Text(" " * (width - len(vals)))
        for v in vals:
            if v <= 0:
                out.append(SPARK[0], "dim")
            else:
                level = min(len(SPARK) - 1, max(1, math.ceil(v / top * (len(SPARK) - 1))))
                out.append(SPARK[level], self.style)
        return out


# -- panels (shared by the app and render_text) -------------------------------------------------------------------
def header(view: View) -> Text:
    i = view.info
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("bsr top ", "bold")
    if view.faults:  # first, so no terminal is too narrow to show it
        t.append(f" ⚠ {len(view.faults)} INJECTED FAULT{'S' if len(view.faults) > 1 else ''} ", "bold reverse red")
        t.append(" ")
    t.append(f" {i.name} {i.version} · {i.model} · {i.ranks} ranks · W={i.w} · faults ")
    t.append("on" if i.faults_enabled else "off", "yellow" if i.faults_enabled else "dim")
    t.append(f" · tiers {','.join(i.tiers) or '—'}")
    return t


def gauges_title(view: View) -> str:
    i = view.info
    return (
        f"Restore pool per rank · RWS(W={i.w}) {fb(i.rws_bytes)} · B {fb(i.budget_bytes)} · capacity {fb(i.pool_bytes)}"
    )


def gauges(view: View, rank: int | None = None, dense: bool = False) -> RenderableType:
    """Two lines per rank (gauge, then high-water history), or one when ``dense`` (many ranks, little room)."""
    if not view.gauges:
        return Text("no ranks reported", "dim")
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=4, no_wrap=True)
    grid.add_column(ratio=2 if dense else 1, no_wrap=True)
    if dense:
        grid.add_column(ratio=1, no_wrap=True)
    grid.add_column(width=30, no_wrap=True)
    for g in view.gauges:
        label = Text(f"{'▶' if rank == g.rank else ' '}r{g.rank}", "bold" if rank == g.rank else "")
        spark = Spark(g.history, g.capacity_bytes or None)
        if not g.alive:
            down = Text(f"✖ DOWN {g.error}".rstrip(), "bold red")
            grid.add_row(label, down, *([spark] if dense else []), Text(""))
            if not dense:
                grid.add_row(Text(" hw", "dim"), spark, Text(""))
            continue
        stats = Text()
        stats.append(fb(g.live_bytes), STATE_STYLE[g.state] if g.state != "ok" else "bold")
        stats.append(f" live · peak {fb(g.peak_bytes)}")
        if g.state == "over-budget":
            stats = Text(f"{fb(g.high_water_bytes)} OVER B!", "bold reverse red")
        rate = Text(f"{g.windows_live} win · {g.waiters} wait · {fb(g.restore_bps)}/s", "dim")
        if dense:
            grid.add_row(label, Bar(g), spark, stats)
        else:
            grid.add_row(label, Bar(g), stats)
            grid.add_row(Text(" hw", "dim"), spark, rate)
    return grid


def active_title(view: View) -> str:
    return f"Active restores ({len(view.active)})"


def active(view: View, width: int | None = None) -> RenderableType:
    """In-flight restores; columns drop right to left as ``width`` shrinks (None: every column)."""
    if not view.active:
        return Text("no restore in flight", "dim")
    per_rank = width is None or width >= 45
    full = width is None or width >= 64
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, header_style="bold")
    t.add_column("request", no_wrap=True)
    t.add_column("progress", no_wrap=True)
    if per_rank:
        t.add_column("done per rank", no_wrap=True, overflow="ellipsis")
    if full:
        t.add_column("tok", justify="right", no_wrap=True)
        t.add_column("tiers", no_wrap=True, overflow="ellipsis")
    t.add_column("age", justify="right", no_wrap=True)
    for a in view.active:
        short = f"{a.current_window}/{a.windows}"
        if a.failed:
            state = Text(f"✖ r{','.join(map(str, a.failed))} failed · {short}", "bold red")
        elif a.stalled:
            state = Text(f"STALLED r{','.join(map(str, a.stalled))} · {short}", "bold yellow")
        else:
            state = Text(a.progress_text, "bold cyan")
        cells: list[RenderableType] = [a.request, state]
        if per_rank:
            per = Text()
            for i, (r, d) in enumerate(a.done):
                style = "bold red" if r in a.failed else "bold yellow" if r in a.stalled else ""
                per.append(("" if i == 0 else " ") + f"r{r}:{d}" + ("✖" if r in a.failed else ""), style)
            cells.append(per)
        if full:
            cells += [f"{a.tokens:,}", ",".join(a.tiers)]
        cells.append(f"{a.elapsed_s:.1f}s")
        t.add_row(*cells)
    return t


def recent_title(view: View) -> str:
    failed = sum(1 for o in view.recent if o.outcome == FAILED_CLOSED)
    return f"Recent outcomes ({len(view.recent)}, {failed} failed closed)"


def recent(view: View, limit: int = 8, compact: bool = False) -> RenderableType:
    if not view.recent:
        return Text("no restore finished yet", "dim")
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, header_style="bold")
    t.add_column("request", no_wrap=True)
    t.add_column("outcome", no_wrap=True)
    if not compact:
        t.add_column("tok", justify="right", no_wrap=True)
        t.add_column("secs", justify="right", no_wrap=True)
    t.add_column("ago", justify="right", no_wrap=True)
    t.add_column("why", no_wrap=True, overflow="ellipsis", ratio=1)
    for o in view.recent[: max(1, limit - 1)]:  # one row goes to the header
        cells: list[RenderableType] = [o.request, Text(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))]
        if not compact:
            cells += [f"{o.tokens:,}", f"{o.seconds:.2f}"]
        cells += [ago(view.time - o.finished), o.reason]
        t.add_row(*cells)
    return t


def health_title(view: View, compact: bool = False) -> str:
    return "Health" if compact else "Admission · tiers · markers · faults"


def health(view: View, compact: bool = False) -> RenderableType:
    a = view.admission
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(width=7 if compact else 9, no_wrap=True, style="bold")
    grid.add_column(ratio=1, overflow="fold")
    if compact:
        admit = f"{fb(a.live_bytes)} / {fb(a.budget_total)} · {a.queued} queued"
    else:
        per_rank = f"(B {fb(a.budget_bytes)} × {a.ranks})"
        admit = f"{fb(a.live_bytes)} live of {fb(a.budget_total)} {per_rank} · {a.queued} queued"
    grid.add_row("admit" if compact else "admission", Text(admit, "yellow" if a.queued else ""))
    tiers = Text()
    if not view.tiers:
        tiers.append("not reported", "dim")
    for i, th in enumerate(view.tiers):
        if i:
            tiers.append("  ")
        tiers.append(f"● {th.name}" if th.ok else f"✖ {th.name} DOWN", "green" if th.ok else "bold red")
        if th.detail:
            tiers.append(f" ({'; '.join(th.detail)})", "red")
    grid.add_row("tiers", tiers)
    if view.recent:
        o = view.recent[0]
        last = Text(f"{o.request} ")
        last.append(o.outcome.replace("_", " "), OUTCOME_STYLE.get(o.outcome, ""))
        last.append(f" {ago(view.time - o.finished)}{'' if compact else ' ago'}")
        grid.add_row("last", last)
    if not view.markers:
        grid.add_row("markers", Text("none", "dim"))
    for m in view.markers:
        excl = ",".join(m.excluded)
        text = f"{m.prompt[:8]} exclude {excl}"
        if not compact:
            text = f"{m.prompt[:12]} exclude {excl} · {m.request}: {m.reason}"
        grid.add_row("marker", Text(text, "magenta"))
    if not view.faults:
        grid.add_row("faults", Text("none injected", "dim"))
    for f in view.faults:
        line = Text()
        line.append("INJECTED" if compact else " INJECTED ", "bold reverse red")
        line.append(f" {f.short() if compact else f.describe()}", "red")
        grid.add_row("fault", line)
    return grid


def events_title(view: View, rank: int | None = None, kind: str = "all") -> str:
    who = "all ranks" if rank is None else f"rank {rank}"
    missed = f" · {view.events_missed} not seen (poll faster)" if view.events_missed else ""
    return f"Events · {who} · {kind}{missed}"


def events(
    view: View, rank: int | None = None, kind: str = "all", limit: int = 200, compact: bool = False
) -> RenderableType:
    shown = view.filtered_events(rank, kind)[-limit:]
    if not shown:
        return Text("no events match" if view.events else "no events yet", "dim")
    t = Table(box=None, padding=(0, 1), pad_edge=False, expand=True, show_edge=False, show_header=False)
    if not compact:
        t.add_column(no_wrap=True, style="dim")  # time
    t.add_column(no_wrap=True, width=2)  # rank
    t.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
    for e in reversed(shown):  # newest first: what just happened is what an operator looks for
        who = ",".join(str(r) for r in e.ranks) if e.ranks else "·"
        cells: list[RenderableType] = [] if compact else [clock(e.time)]
        t.add_row(*cells, who, Text(e.text, CATEGORY_STYLE.get(e.category, "")))
    return t


def render_text(view: View, *, events_limit: int = 12) -> RenderableType:
    """The whole view once, for `bsr pool --once` and pipes: the same panels the app draws."""
    return Group(
        header(view),
        Panel(gauges(view), title=gauges_title(view), title_align="left"),
        Panel(active(view), title=active_title(view), title_align="left"),
        Panel(recent(view), title=recent_title(view), title_align="left"),
        Panel(health(view), title=health_title(view), title_align="left"),
        Panel(events(view, limit=events_limit), title=events_title(view), title_align="left"),
        Text(
            f"snapshot {clock(view.time)} · seq {view.seq} · poll {view.latency_s * 1e3:.0f} ms",
            "dim",
        ),
    )
