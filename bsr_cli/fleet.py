"""Several engines at once: `bsr status` and `bsr top` over a fleet.

A fleet is what `--engine` names when it names more than one engine: a comma-separated list (or `--engine`
repeated) of admin URLs and profile names, where a profile may itself list several (`urls = [...]` in the config
file, URLs or other profiles' names). A vLLM deployment at TP=2 serves one admin API per rank, so a fleet of
instances is many URLs.

Every engine is polled concurrently, each with its own deadline: an engine that is down or slow is one row saying
so, never a blank screen for the others. `summarize` folds one engine's snapshot into a row with a severity;
`order` sorts rows worst first (down, then unhealthy ranks, then degraded tiers or a pool at its budget, then
markers, faults and restores that failed closed in the last five minutes, then healthy); ranks within an engine
likewise.

`--engines-from` discovers a fleet instead of listing it (`discover`): a file of engines, a DNS name with several
addresses, or a Prometheus server's active scrape targets. Each engine is read with its own token (`credential`):
one named for it (a profile's, an engines file entry's `token_file=`, a Prometheus target's `bsr_token_file`
label), else that of the embedded engine on this machine serving its URL (read from its state directory), else
--token / BSR_TOKEN.

`Memory` is what the fleet remembers of each engine between polls (and between invocations, in a small file under
the state directory): when it last answered, and, once it stops answering, since when and how it went away
(`Departure`; an engine on this machine is asked its own durable record of how it stopped), and a timeline of what
happened to each (`Incident`: ranks restarted with their reason, engines gone and back). `exit_code` is the one
rule for a fleet's exit status (docs/fleet.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bsr_cli.client import local_engine
from bsr_cli.core import wire
from bsr_cli.core.events import (
    EngineStarted,
    EngineStopped,
    Event,
    RankRestarted,
    RankUnresponsive,
    known_event,
    parse_event,
)
from bsr_cli.core.evidence import EventKind, Outcome, RankState
from bsr_cli.core.status import PoolEntry, Snapshot
from bsr_cli.errors import (
    BsrError,
    EngineBusy,
    EngineError,
    EngineUnreachable,
    ExitCode,
    InvalidInput,
    Unauthorized,
    VersionMismatch,
)
from bsr_cli.settings import Settings


class Severity(IntEnum):
    """How bad an engine (or a rank) is, worst highest."""

    OK = 0
    ATTENTION = 1  # force-local markers, armed faults, recent failed-closed restores, a rank the host starves
    DEGRADED = 2  # a tier is unhealthy or a rank's pool is at the admission budget
    UNHEALTHY = 3  # a rank is down, stopped or failing its heartbeat: the engine cannot serve
    DOWN = 4  # the engine did not answer

    @property
    def state(self) -> str:
        return STATE[self]


DOWN, UNHEALTHY, DEGRADED = Severity.DOWN, Severity.UNHEALTHY, Severity.DEGRADED
ATTENTION, OK = Severity.ATTENTION, Severity.OK
RECENT_S = 300.0  # a failed-closed restore counts against its engine for five minutes
# Each severity's name, worst first.
STATE = {DOWN: "down", UNHEALTHY: "unhealthy", DEGRADED: "degraded", ATTENTION: "attention", OK: "ok"}


@dataclass(frozen=True)
class Target:
    """One engine of a fleet, and the token it is read with (`credential`): its own (``token``, or ``token_file``,
    read at every poll so a rotated token is picked up), else the embedded engine's on this machine serving ``url``,
    else ``fallback`` (--token / BSR_TOKEN). One token is never sent to engines that each have their own."""

    name: str  # what the operator typed (a URL or a profile name, with an index when a profile lists several)
    url: str
    token: str | None = None
    token_file: Path | None = None
    fallback: str | None = None


@dataclass(frozen=True)
class Credential:
    """The token an engine is read with, where it came from (for the line that says it was refused), and the
    state directory of an embedded engine on this machine serving the target's URL (its own record of how it
    stopped lies there)."""

    token: str | None
    source: str
    state_dir: Path | None = None


def credential(t: Target) -> Credential:
    """``t``'s token: its own, else the local embedded engine's, else the fallback (InvalidInput when its token
    file cannot be read)."""
    local = local_engine.serving(t.url)
    state = local.state_dir if local is not None else None
    if t.token:
        return Credential(t.token, f"the token given for {t.name}", state)
    if t.token_file is not None:
        return Credential(local_engine.read_token_file(t.token_file), f"token file {t.token_file}", state)
    if local is not None:
        return Credential(local.token, f"the engine's own, from {local.state_dir}", state)
    if t.fallback:
        return Credential(t.fallback, "--token / BSR_TOKEN")
    return Credential(None, "none: none is named for this engine, and no engine on this machine serves its URL")


TOKEN_HINT = (
    "name this engine's token: token_file=PATH after its URL in the engines file, a bsr_token_file label on its "
    "Prometheus target, or token_file in its profile (docs/fleet.md)"
)


def split_engines(value: str | None) -> list[str]:
    return [p.strip() for p in (value or "").split(",") if p.strip()]


def targets(settings: Settings, engines_from: str | None = None) -> list[Target] | None:
    """The engines `--engine` names (and `--engines-from` discovers), or None when they are at most one engine and
    none was discovered (the single-engine commands apply)."""
    names = split_engines(settings.engine) if (engines_from is None or settings.sources.get("engine") == "flag") else []
    out: list[Target] = []
    for name in names:
        out.extend(_resolve(settings, name))
    if engines_from is not None:
        out.extend(discover(engines_from, settings=settings))
    elif len(out) <= 1:
        return None
    seen: set[str] = set()
    dupes = [t.url for t in out if t.url in seen or seen.add(t.url)]  # type: ignore[func-returns-value]
    if dupes:
        raise InvalidInput(f"engine {dupes[0]} is named twice in --engine", hint="name each engine once")
    return out


def _resolve(settings: Settings, name: str, token_file: Path | None = None) -> list[Target]:
    """The engines ``name`` stands for (a profile, or a URL, read with ``token_file`` when given)."""
    if name in settings.profiles:
        prof = settings.profiles[name]

        def target(label: str, url: str) -> Target:
            return Target(label, url.rstrip("/"), prof.token, prof.token_file, settings.token)

        many = prof.urls  # checked when the config file was read (bsr_cli/settings.py)
        if many is not None:
            found: list[Target] = []
            for i, u in enumerate(many):
                if u in settings.profiles and u != name:
                    found.extend(_resolve(settings, u))
                elif u.startswith(("http://", "https://")):
                    found.append(target(f"{name}[{i}]", u))
                else:
                    raise InvalidInput(
                        f"profile {name!r}: {u!r} is neither a URL nor a profile",
                        hint=f"profile {name!r} in {settings.config_path}: urls lists URLs or other profiles' names",
                    )
            return found
        url = prof.url
        if not url:
            raise InvalidInput(
                f"profile {name!r} has no url",
                hint=f'add url = "http://HOST:PORT" to profile {name!r} in {settings.config_path}',
            )
        return [target(name, url)]
    if not name.startswith(("http://", "https://")):
        raise InvalidInput(
            f"--engine {name!r} is neither a URL nor a profile",
            hint=f"profiles in {settings.config_path}: {', '.join(settings.profiles) or 'none'}",
        )
    return [Target(name, name.rstrip("/"), token_file=token_file, fallback=settings.token)]


# -- discovery ----------------------------------------------------------------------------------------------------
Resolver = Callable[[str, int], list[str]]


def _resolve_addresses(host: str, port: int) -> list[str]:
    """Every address ``host`` has (A and AAAA), in the resolver's order, each once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise EngineUnreachable(f"cannot resolve {host}: {e.strerror}", hint="check the DNS name") from None
    out: list[str] = []
    for _family, _type, _proto, _canon, addr in infos:
        if addr[0] not in out:
            out.append(str(addr[0]))
    return out


def discover(
    spec: str,
    *,
    settings: Settings | None = None,
    timeout_s: float = 5.0,
    resolver: Resolver = _resolve_addresses,
) -> list[Target]:
    """The engines ``spec`` names: ``prometheus://HOST:PORT?job=JOB`` (a Prometheus server's active targets of that
    job; a target's ``bsr_token_file`` label names its token file), ``dns://NAME:PORT`` (one engine per address of
    NAME), or a file (``file:PATH`` or a path) with one engine per line: a URL, optionally followed by
    ``token_file=PATH``, or a profile name (``#`` starts a comment). Nothing found is an error: an empty fleet is
    never "all ok"."""
    token = settings.token if settings is not None else None
    if spec.startswith("prometheus://"):
        found = _from_prometheus(spec, token, timeout_s=settings.timeout_s if settings else timeout_s)
    elif spec.startswith("dns://"):
        found = _from_dns(spec, token, resolver)
    else:
        found = _from_file(Path(spec.removeprefix("file:")).expanduser(), settings)
    if not found:
        raise InvalidInput(
            f"--engines-from {spec}: no engine found",
            hint="give prometheus://HOST:PORT?job=JOB, dns://NAME:PORT, or a file with one URL or profile per line",
        )
    return found


def _from_dns(spec: str, token: str | None, resolver: Resolver) -> list[Target]:
    u = urlsplit(spec)
    if not u.hostname or not u.port:
        raise InvalidInput(
            f"--engines-from {spec}: give dns://NAME:PORT (the admin port every address serves)",
            hint="e.g. --engines-from dns://bsr-engines.lab:8470",
        )
    scheme = (parse_qs(u.query).get("scheme") or ["http"])[0]
    out = []
    for addr in resolver(u.hostname, u.port):
        host = f"[{addr}]" if ":" in addr else addr
        out.append(Target(f"{u.hostname}/{addr}", f"{scheme}://{host}:{u.port}", fallback=token))
    return out


ENTRY_OPTIONS = ("token_file",)  # what an engines file's line may say after its URL, as KEY=VALUE


def _from_file(path: Path, settings: Settings | None) -> list[Target]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InvalidInput(
            f"--engines-from {path}: {e.strerror or e}",
            hint="give a file with one engine URL or profile name per line (or prometheus://..., dns://...)",
        ) from None
    out: list[Target] = []
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        try:
            name, token_file = _entry(path, words)
            if settings is None:
                if not name.startswith(("http://", "https://")):
                    raise InvalidInput(
                        f"{name!r} is not a URL",
                        hint="each line is an engine URL (http://HOST:PORT) or, with a config file, a profile name",
                    )
                out.append(Target(name, name.rstrip("/"), token_file=token_file))
            else:
                out.extend(_resolve(settings, name, token_file))
        except InvalidInput as e:
            raise InvalidInput(f"{path}:{n}: {e.message}", hint=e.hint) from None
    return out


def _entry(path: Path, words: list[str]) -> tuple[str, Path | None]:
    """One line of an engines file: its URL or profile name, and the token file it names (relative to the file)."""
    name, options = words[0], dict(w.partition("=")[::2] for w in words[1:])
    unknown = [w for w in words[1:] if "=" not in w or w.partition("=")[0] not in ENTRY_OPTIONS]
    if unknown:
        raise InvalidInput(
            f"{unknown[0]!r} after {name}: not an option of an engine's line",
            hint="a line is a URL, optionally followed by token_file=PATH, or a profile name",
        )
    if "token_file" not in options:
        return name, None
    if not name.startswith(("http://", "https://")):
        raise InvalidInput(
            f"token_file= after profile {name}: a profile names its own token",
            hint=f"set token_file (or token) in [profiles.{name}] of the config file",
        )
    if not options["token_file"]:
        raise InvalidInput(f"token_file= after {name} names no file", hint="token_file=PATH (relative to this file)")
    return name, path.parent / Path(options["token_file"]).expanduser()


TOKEN_FILE_LABEL = "bsr_token_file"  # a Prometheus target's label naming the file that holds its admin token


def _from_prometheus(spec: str, token: str | None, *, timeout_s: float) -> list[Target]:
    """A Prometheus server's active targets (its /api/v1/targets), those of ``job`` when given: each target's
    scrape URL with its /metrics path dropped is an engine's admin URL (the admin API serves /metrics itself)."""
    import httpx

    u = urlsplit(spec)
    if not u.hostname or not u.port:
        raise InvalidInput(
            f"--engines-from {spec}: give prometheus://HOST:PORT?job=JOB",
            hint="e.g. --engines-from prometheus://prom.lab:9090?job=bsr",
        )
    query = parse_qs(u.query)
    job = query["job"][0] if query.get("job") else None
    scheme = (query.get("scheme") or ["http"])[0]
    api = f"{scheme}://{u.hostname}:{u.port}/api/v1/targets"
    try:
        r = httpx.get(api, params={"state": "active"}, timeout=timeout_s)
        r.raise_for_status()
        data = r.json()
    except httpx.HTTPStatusError as e:
        raise EngineUnreachable(
            f"Prometheus at {api} answered {e.response.status_code}",
            hint="check the Prometheus address and that it serves /api/v1/targets",
        ) from None
    except (httpx.HTTPError, ValueError) as e:
        raise EngineUnreachable(
            f"cannot read Prometheus targets at {api}: {e}", hint="check --engines-from prometheus://HOST:PORT"
        ) from None
    active = (data.get("data") or {}).get("activeTargets") or []
    jobs = sorted({str((t.get("labels") or {}).get("job", "")) for t in active})
    out = []
    for t in active:
        labels = t.get("labels") or {}
        if job is not None and labels.get("job") != job:
            continue
        scrape = urlsplit(str(t.get("scrapeUrl") or ""))
        if not scrape.netloc:
            continue
        # A token file per target, named by a label (the token itself never is: labels are stored with every series).
        token_file = labels.get(TOKEN_FILE_LABEL) or (t.get("discoveredLabels") or {}).get(TOKEN_FILE_LABEL)
        out.append(
            Target(
                str(labels.get("instance") or scrape.netloc),
                f"{scrape.scheme}://{scrape.netloc}",
                token_file=Path(str(token_file)) if token_file else None,
                fallback=token,
            )
        )
    if not out:
        raise InvalidInput(
            f"Prometheus at {u.hostname}:{u.port} has no active target" + (f" in job {job!r}" if job else ""),
            hint=f"its jobs: {', '.join(j for j in jobs if j) or 'none'}",
        )
    return sorted(out, key=lambda t: t.name)


# -- what an engine answers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankAnswer:
    """One rank as the engine's snapshot reports it."""

    rank: int | None
    alive: bool
    healthy: bool
    reason: str  # why it is not healthy, when it says
    live_bytes: int
    peak_bytes: int
    capacity_bytes: int
    windows_live: int
    waiters: int  # restores waiting for pool room
    restore_bps: float
    heartbeat_age_s: float | None
    starved: bool = False  # the host keeps it from running (healthy: the host's doing, not the rank's)


@dataclass(frozen=True)
class RecentOutcome:
    """One finished restore among the snapshot's recent ones, as far as the fleet looks at it."""

    failed_closed: bool
    finished: float | None
    reason: str
    request: str


# -- what happened to an engine: the fleet's timeline ------------------------------------------------------------
class Happened(StrEnum):
    """What the fleet's timeline records of an engine: its own events that say what happened to it (read from its
    durable history, with its token), and what the fleet saw (it stopped answering, it answered again)."""

    RANK_RESTARTED = EventKind.RANK_RESTARTED.value
    RANK_UNRESPONSIVE = EventKind.RANK_UNRESPONSIVE.value
    ENGINE_STARTED = EventKind.ENGINE_STARTED.value
    ENGINE_STOPPED = EventKind.ENGINE_STOPPED.value
    WENT_DOWN = "went_down"
    CAME_BACK = "came_back"


# The engine's own events the timeline keeps: every poll asks for the newest HISTORY_EVENTS of the last HISTORY_S.
HISTORY_KINDS = (Happened.RANK_RESTARTED, Happened.RANK_UNRESPONSIVE, Happened.ENGINE_STARTED, Happened.ENGINE_STOPPED)
HISTORY_S = 3600.0
HISTORY_EVENTS = 20
ROW_INCIDENTS = 5  # an engine's row carries its newest five
TIMELINE_SHOWN = 20  # the fleet's timeline, newest first, across its engines


@dataclass(frozen=True)
class Incident:
    """One line of the fleet's timeline: when, which engine, what happened (with the rank, and the engine's event
    number when it is the engine's own event)."""

    time: float
    engine: str
    url: str
    kind: Happened
    text: str
    rank: int | None = wire.field(default=None, omit_none=True)
    seq: int | None = wire.field(default=None, omit_none=True)

    to_wire = wire.writer()
    from_wire = wire.reader()

    @property
    def key(self) -> tuple[Any, ...]:
        """What makes it the same incident when it is read again: the engine's event, or what the fleet saw when."""
        return (self.url, self.seq) if self.seq is not None else (self.url, self.kind, self.time)


def incident_of(engine: str, url: str, e: Event) -> Incident | None:
    """The timeline's line for one of the engine's own events; None for a kind the timeline does not keep."""
    at = (e.time, engine, url)
    if isinstance(e, RankRestarted):
        why = f"{e.reason or 'no reason given'}; restart {e.restarts}"
        return Incident(*at, Happened.RANK_RESTARTED, f"rank {e.rank} restarted ({why})", e.rank, e.seq)
    if isinstance(e, RankUnresponsive):
        return Incident(*at, Happened.RANK_UNRESPONSIVE, f"rank {e.rank} unresponsive: {e.reason}", e.rank, e.seq)
    if isinstance(e, EngineStarted):
        text = f"engine restarted after a {e.previous_stop} stop" if e.restart and e.previous_stop else "engine started"
        return Incident(*at, Happened.ENGINE_STARTED, text, None, e.seq)
    if isinstance(e, EngineStopped):
        return Incident(*at, Happened.ENGINE_STOPPED, f"engine stopped ({e.reason or 'requested'})", None, e.seq)
    return None


_LIFECYCLE = (EventKind.ENGINE_STARTED, EventKind.ENGINE_STOPPED)


def _lifecycle_events(wire_events: Any) -> list[Event]:
    """The engine's starts and stops among the events of its snapshot (their wire form), as types; the others are
    not even parsed, and one this bsr cannot read is left out."""
    out: list[Event] = []
    for raw in wire_events if isinstance(wire_events, list) else ():
        if isinstance(raw, dict) and raw.get("type") in _LIFECYCLE:
            with contextlib.suppress(ValueError):
                out.append(parse_event(raw))
    return out


@dataclass(frozen=True)
class EngineAnswer:
    """What the fleet reads of one engine's snapshot (`GET /snapshot?health=1`)."""

    time: float | None = None
    started_at: float | None = None
    stopping: bool = False  # its snapshot, info or health says it is shutting down, or an engine_stopped event does
    previous_stop: str | None = None  # how its previous run ended, as its newest engine_started event says
    engine_name: str | None = None
    model: str | None = None
    W: int | None = None
    rws_bytes: int | None = None
    budget_bytes: int = 0
    ranks: tuple[RankAnswer, ...] = ()
    tiers: dict[str, tuple[str, ...] | None] = field(default_factory=dict)  # unhealthy tiers' details; None: ok
    injected_tiers: tuple[str, ...] = ()  # unhealthy only because of injected faults (a drill)
    markers: int = 0
    armed_faults: int = 0
    active: int = 0
    recent: tuple[RecentOutcome, ...] = ()
    history: tuple[Event, ...] = ()  # its own events the timeline keeps (HISTORY_KINDS), read from its history
    state_dir: str | None = None  # an embedded engine on this machine: its state directory

    @classmethod
    def of(cls, snap: Snapshot) -> EngineAnswer:
        info = snap.info
        events = _lifecycle_events(snap.events)
        started = [e for e in events if isinstance(e, EngineStarted)]
        # Shutting down: ``stopping: true`` in its snapshot, info or health (keys a host adds, kept in their
        # ``host_fields``), or an `engine_stopped` event among the events it returned. A crash says nothing: that
        # is how the two are told apart.
        health = snap.host_fields.get("health")
        said = (snap.host_fields, info.host_fields, health if isinstance(health, dict) else {})
        said_stopping = any(bool(fields.get("stopping")) for fields in said)
        return cls(
            time=snap.time or None,
            started_at=info.started_at or None,
            stopping=said_stopping or any(isinstance(e, EngineStopped) for e in events),
            previous_stop=(started[-1].previous_stop or None) if started else None,
            engine_name=info.engine,
            model=info.registration.model or None,
            W=info.w,
            rws_bytes=info.rws_bytes,
            budget_bytes=info.budget_bytes,
            ranks=tuple(_rank_answer(r) for r in snap.ranks),
            tiers={name: None if t.ok else t.detail for name, t in snap.tiers.items()},
            injected_tiers=tuple(name for name, t in snap.tiers.items() if not t.ok and t.injected),
            markers=len(snap.markers),
            # Every fault a snapshot lists is armed (the engine lists those that have not run out).
            armed_faults=len(snap.faults),
            active=len(snap.active),
            recent=tuple(
                RecentOutcome(r.outcome is Outcome.FAILED_CLOSED, r.finished or None, r.reason, r.request)
                for r in snap.recent
            ),
        )


def _rank_answer(r: PoolEntry) -> RankAnswer:
    pool = r.pool or {}
    return RankAnswer(
        rank=r.rank,
        alive=r.alive,
        healthy=r.healthy,
        reason=r.reason or "",
        live_bytes=int(pool.get("live_bytes", 0)),
        peak_bytes=int(pool.get("peak_bytes", 0)),
        capacity_bytes=int(pool.get("capacity_bytes", 0)),
        windows_live=int(pool.get("windows_live", 0)),
        waiters=int(pool.get("waiters", 0)),
        restore_bps=r.restore_bps,
        heartbeat_age_s=r.heartbeat_age_s,
        starved=r.state is RankState.STARVED,
    )


# -- polling ------------------------------------------------------------------------------------------------------
Poll = Callable[[Target], EngineAnswer]


def http_poll(timeout_s: float) -> Poll:
    """One snapshot of one engine through the one admin client, with the engine's own token (`credential`), and
    what its history says happened to it lately; each call bounded by ``timeout_s``."""

    def poll(t: Target) -> EngineAnswer:
        from bsr_cli.client import AdminClient

        cred = credential(t)
        with AdminClient(t.url, cred.token, timeout_s=timeout_s) as c:
            try:
                answer = EngineAnswer.of(c.snapshot(health=True, timeout=timeout_s))
            except Unauthorized as e:
                raise Unauthorized(f"{e.message} (token sent: {cred.source})", hint=TOKEN_HINT) from None
            history = _history(c, answer.time or time.time())
        return replace(answer, history=history, state_dir=None if cred.state_dir is None else str(cred.state_dir))

    return poll


def _history(client: Any, now: float) -> tuple[Event, ...]:
    """The engine's own events of HISTORY_KINDS in the last HISTORY_S (the newest HISTORY_EVENTS), from its durable
    store where it keeps one. A host that does not answer them has none: its row stands on its snapshot."""
    try:
        page = client.events(
            after=max(0.0, now - HISTORY_S), kinds=list(HISTORY_KINDS), limit=HISTORY_EVENTS, newest=True
        )
    except EngineError:
        return ()
    return tuple(e for raw in page.events if (e := known_event(raw)) is not None)


def poll_all(
    ts: Sequence[Target], poll: Poll, *, pool: ThreadPoolExecutor | None = None, clock: Callable[[], float] = time.time
) -> list[EngineRow]:
    """Every engine's row, polled concurrently; an engine that fails is a `down` row with the reason."""
    own = pool is None
    ex = pool or ThreadPoolExecutor(max_workers=min(16, len(ts)), thread_name_prefix="bsr-fleet")
    try:
        futures = [ex.submit(_timed, poll, t) for t in ts]
        return order([summarize(t, *f.result(), at=clock()) for t, f in zip(ts, futures, strict=True)])
    finally:
        if own:
            ex.shutdown(wait=False, cancel_futures=True)


def _timed(poll: Poll, t: Target) -> tuple[EngineAnswer | None, BaseException | None, float]:
    t0 = time.monotonic()
    try:
        return poll(t), None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - any failure of one engine is its row, never the fleet's
        return None, e, time.monotonic() - t0


# -- rows ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankRow:
    """One rank's row: its severity (down or unhealthy, pool at B, restores waiting for pool) and its pool."""

    rank: int | None
    severity: Severity = field(metadata=wire.meta(absent=Severity.OK))
    state: str
    reason: str
    live_bytes: int
    peak_bytes: int
    capacity_bytes: int
    budget_bytes: int
    windows_live: int
    restore_bps: float
    heartbeat_age_s: float | None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class LastFailure:
    """The newest restore of an engine that failed closed."""

    request: str
    reason: str
    finished: float

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineRow:
    """One engine's row: identity, severity, what is wrong, and its ranks worst first. An engine that answered has
    its figures; one that did not (``DOWN``) has the error's kind and the exit code it maps to. What the fleet
    remembers of it (`Memory.observe`) comes last."""

    engine: str
    url: str
    polled_at: float
    latency_s: float
    severity: Severity
    problems: tuple[str, ...]
    ranks: tuple[RankRow, ...] = ()
    # An engine that answered.
    started_at: float | None = None
    stopping: bool = False
    previous_stop: str | None = None  # a restarted engine's own word on how its previous run ended
    engine_name: str | None = None
    model: str | None = None
    W: int | None = None
    rws_bytes: int | None = None
    budget_bytes: int = 0
    tiers: dict[str, bool] = field(default_factory=dict)
    markers: int = 0
    faults: int = 0
    active: int = 0
    failed_recent: int = 0
    restore_bps: float = 0.0
    pool_live_bytes: int = 0
    ranks_up: int = 0
    last_failure: LastFailure | None = None
    state_dir: str | None = None  # an embedded engine on this machine: its state directory
    # What happened to it lately (its rank restarts, its stops and starts): newest first.
    incidents: tuple[Incident, ...] = ()
    # An engine that did not answer.
    error: str | None = None
    exit_code: int | None = None
    # What the fleet remembers (Memory.observe).
    last_seen: float | None = None
    restarts: int = 0
    came_back: str | None = None  # how it went away before it came back (a Departure, or "restarted")
    departure: Departure | None = None
    down_since: float | None = None
    departure_text: str | None = None
    down_text: str | None = None

    @property
    def state(self) -> str:
        return self.severity.state

    @property
    def down(self) -> bool:
        return self.severity is Severity.DOWN

    @property
    def clean_stop(self) -> bool | None:
        """Whether a down engine stopped cleanly, when that is known."""
        if self.departure is None or self.departure is Departure.UNKNOWN:
            return None
        return self.departure is Departure.CLEAN

    def to_wire(self) -> wire.JsonObject:
        # Hand-written: which keys a row carries is not a function of its fields but of the engine's state (a down
        # engine's row says its error and exit code, even when null, and none of the figures of one that answered).
        ident: wire.JsonObject = {
            "engine": self.engine,
            "url": self.url,
            "polled_at": self.polled_at,
            "latency_s": self.latency_s,
        }
        ranks: list[wire.JsonValue] = [r.to_wire() for r in self.ranks]
        head: wire.JsonObject = {"severity": self.severity, "state": self.state, "problems": list(self.problems)}
        incidents: wire.JsonObject = {"incidents": [i.to_wire() for i in self.incidents]} if self.incidents else {}
        if self.down:
            out = ident | head | {"ranks": ranks, "error": self.error, "exit_code": self.exit_code}
            if self.departure is not None:
                out |= {"departure": self.departure.value, "down_since": self.down_since}
                out |= {"last_seen": self.last_seen} if self.last_seen is not None else {}
                out |= {"clean_stop": self.clean_stop} if self.clean_stop is not None else {}
                out |= {"departure_text": self.departure_text, "down_text": self.down_text}
            return out | incidents
        out = ident | {"started_at": self.started_at, "stopping": self.stopping}
        out |= {"previous_stop": self.previous_stop} if self.previous_stop is not None else {}
        out |= head | {
            "engine_name": self.engine_name,
            "model": self.model,
            "W": self.W,
            "rws_bytes": self.rws_bytes,
            "budget_bytes": self.budget_bytes,
            "tiers": dict(self.tiers),
            "markers": self.markers,
            "faults": self.faults,
            "active": self.active,
            "failed_recent": self.failed_recent,
            "restore_bps": self.restore_bps,
            "pool_live_bytes": self.pool_live_bytes,
            "ranks_up": self.ranks_up,
            "last_failure": None if self.last_failure is None else self.last_failure.to_wire(),
            "ranks": ranks,
        }
        out |= {"state_dir": self.state_dir} if self.state_dir is not None else {}
        out |= {"last_seen": self.last_seen} if self.last_seen is not None else {}
        out |= {"restarts": self.restarts} if self.restarts else {}
        out |= {"came_back": self.came_back} if self.came_back is not None else {}
        return out | incidents

    # A row as `bsr status --json` prints it and a fleet recording keeps it; what it lacks reads as absent.
    from_wire = wire.reader()


@dataclass(frozen=True)
class FleetView:
    """Every engine's row, worst first, with how many are in each state and the worst state."""

    engines: tuple[EngineRow, ...]

    @property
    def counts(self) -> dict[str, int]:
        return {name: sum(1 for r in self.engines if r.state == name) for name in STATE.values()}

    @property
    def worst(self) -> str:
        return self.engines[0].state if self.engines else "ok"

    @property
    def fleet(self) -> bool:
        """Always true: the key that tells a fleet's JSON from one engine's."""
        return True

    @property
    def timeline(self) -> tuple[Incident, ...]:
        """What happened to its engines lately, newest first (the newest of each engine's row)."""
        every = sorted((i for e in self.engines for i in e.incidents), key=lambda i: -i.time)
        return tuple(every[:TIMELINE_SHOWN])

    to_wire = wire.writer(order=("fleet", "engines", "counts", "worst", "timeline"))

    from_wire = wire.reader()


# -- folding ------------------------------------------------------------------------------------------------------
def summarize(
    t: Target, answer: EngineAnswer | None, error: BaseException | None, latency_s: float, *, at: float
) -> EngineRow:
    """One engine's row: identity, severity, what is wrong, and its ranks worst first."""
    latency = round(latency_s, 4)
    if answer is None:
        return _down(t, at, latency, error)
    budget = answer.budget_bytes
    ranks = [_rank_row(r, budget) for r in answer.ranks]
    now = answer.time or at
    failed = [o for o in answer.recent if o.failed_closed and now - (o.finished or now) <= RECENT_S]
    last_failure = next((o for o in answer.recent if o.failed_closed), None)
    sev, problems = _severity(ranks, answer.tiers, answer.injected_tiers, answer.markers, answer.armed_faults, failed)
    incidents = sorted(
        (i for e in answer.history if (i := incident_of(t.name, t.url, e)) is not None), key=lambda i: -i.time
    )
    restarted = [i for i in incidents if i.kind is Happened.RANK_RESTARTED and now - i.time <= RECENT_S]
    if restarted:  # a rank that restarted lately: the engine serves again, and says why it had to
        problems += [f"{i.text} at {time.strftime('%H:%M:%S', time.localtime(i.time))}" for i in restarted]
        sev = max(sev, Severity.ATTENTION)
    return EngineRow(
        t.name,
        t.url,
        at,
        latency,
        severity=sev,
        problems=tuple(problems),
        started_at=answer.started_at,
        stopping=answer.stopping,
        previous_stop=answer.previous_stop,
        engine_name=answer.engine_name,
        model=answer.model,
        W=answer.W,
        rws_bytes=answer.rws_bytes,
        budget_bytes=budget,
        tiers={n: detail is None for n, detail in answer.tiers.items()},
        markers=answer.markers,
        faults=answer.armed_faults,
        active=answer.active,
        failed_recent=len(failed),
        restore_bps=sum(r.restore_bps for r in ranks),
        pool_live_bytes=max((r.live_bytes for r in ranks), default=0),
        ranks_up=sum(1 for r in ranks if r.severity < UNHEALTHY),
        last_failure=(
            LastFailure(last_failure.request, last_failure.reason or "failed closed", last_failure.finished or now)
            if last_failure
            else None
        ),
        ranks=tuple(sorted(ranks, key=lambda r: (-r.severity, r.rank if r.rank is not None else 0))),
        state_dir=answer.state_dir,
        incidents=tuple(incidents[:ROW_INCIDENTS]),
    )


def _down(t: Target, at: float, latency_s: float, error: BaseException | None) -> EngineRow:
    """The row of an engine that did not answer: the error's kind and message, and the exit code it maps to."""
    kind = error.kind if isinstance(error, BsrError) else "internal"
    msg = error.message if isinstance(error, BsrError) else f"{type(error).__name__}: {error}"
    code = int(error.exit_code) if isinstance(error, BsrError) else int(ExitCode.INTERNAL)
    return EngineRow(t.name, t.url, at, latency_s, Severity.DOWN, (f"{kind}: {msg}",), error=kind, exit_code=code)


def _rank_row(r: RankAnswer, budget: int) -> RankRow:
    """One rank's row: its severity (down or unhealthy, pool at B, restores waiting for pool) and its pool."""
    sev = Severity.OK
    why = ""
    if not r.alive or not r.healthy:
        sev, why = Severity.UNHEALTHY, r.reason or ("down" if not r.alive else "unhealthy")
    elif budget and r.live_bytes >= budget:
        sev, why = Severity.DEGRADED, "pool at budget B"
    elif r.starved:
        sev, why = Severity.ATTENTION, f"starved (the host, not the rank): {r.reason or 'waiting to run'}"
    elif r.waiters:
        sev, why = Severity.ATTENTION, f"{r.waiters} waiting for pool"
    return RankRow(
        rank=r.rank,
        severity=sev,
        state=STATE[sev] if sev else ("up" if r.alive else "down"),
        reason=why,
        live_bytes=r.live_bytes,
        peak_bytes=r.peak_bytes,
        capacity_bytes=r.capacity_bytes,
        budget_bytes=budget,
        windows_live=r.windows_live,
        restore_bps=r.restore_bps,
        heartbeat_age_s=r.heartbeat_age_s,
    )


def _severity(
    ranks: list[RankRow],
    tiers: dict[str, tuple[str, ...] | None],
    injected_tiers: Sequence[str],
    markers: int,
    faults: int,
    failed: list[RecentOutcome],
) -> tuple[Severity, list[str]]:
    """(the engine's severity, what is wrong): its worst rank, unhealthy tiers (degraded), then tiers unhealthy
    only because of injected faults (a drill's), markers, armed faults and recent restores that failed closed
    (attention)."""
    problems: list[str] = []
    sev = max((r.severity for r in ranks), default=Severity.OK)
    for r in ranks:
        if r.severity >= DEGRADED:
            problems.append(f"rank {r.rank}: {r.reason}")
    bad_tiers = {n: detail for n, detail in tiers.items() if detail is not None}
    for n, detail in bad_tiers.items():
        drill = " after an injected fault" if n in injected_tiers else ""
        problems.append(f"tier {n} unhealthy{drill}" + (f" ({'; '.join(detail)})" if detail else ""))
    if set(bad_tiers) - set(injected_tiers):
        sev = max(sev, Severity.DEGRADED)
    if markers:
        problems.append(f"{markers} force-local marker(s)")
    if faults:
        problems.append(f"{faults} fault(s) armed")
    if failed:
        problems.append(f"{len(failed)} recent restore(s) failed closed (last: {failed[0].reason or 'no reason'})")
    if markers or faults or failed or bad_tiers:
        sev = max(sev, Severity.ATTENTION)
    return sev, problems


def order(rows: list[EngineRow]) -> list[EngineRow]:
    """Worst first; among equals, in the order the operator named them (stable)."""
    return sorted(rows, key=lambda r: -int(r.severity))


def fleet_result(rows: list[EngineRow]) -> FleetView:
    return FleetView(tuple(rows))


# -- the one exit rule -------------------------------------------------------------------------------------------
def exit_code(rows: Sequence[EngineRow]) -> int:
    """A fleet exits as its worst engine would on its own with `bsr status`: an engine that does not answer exits
    with its error's code (3 unreachable, 4 timeout, 5 unauthorized, 6 API version mismatch), an unhealthy one with 9,
    anything else 0. Rows are worst first, and down engines in the order named, so the first row decides."""
    if not rows:
        return int(ExitCode.OK)
    worst = rows[0]
    if worst.severity >= DOWN:
        return int(worst.exit_code or ExitCode.ENGINE_UNREACHABLE)
    if worst.severity >= UNHEALTHY:
        return int(ExitCode.SERVER_ERROR)
    return int(ExitCode.OK)


# -- what the fleet remembers ------------------------------------------------------------------------------------
class Departure(StrEnum):
    """How an engine that no longer answers went away, as the fleet saw it."""

    CLEAN = "clean"  # its last answer said it was stopping (a requested shutdown)
    CRASH = "crash"  # nothing listens any more and it never said it was stopping (killed, crashed, or its host gone)
    HUNG = "hung"  # it does not answer within the deadline (frozen, overloaded, or a network in between drops it)
    UNKNOWN = "unknown"  # this fleet never saw it answer: nothing to compare with

    @property
    def describe(self) -> str:
        return {
            Departure.CLEAN: "stopped cleanly",
            Departure.CRASH: "went away without a clean stop",
            Departure.HUNG: "stopped answering (hung)",
            Departure.UNKNOWN: "never seen up",
        }[self]


# Errors that an engine answered with: it refuses this bsr, it has not gone away.
ANSWERED = frozenset({Unauthorized.kind, VersionMismatch.kind, EngineBusy.kind})


@dataclass(frozen=True)
class Seen:
    """One engine as the fleet last saw it."""

    last_seen: float | None = None  # when it last answered
    started_at: float | None = None  # its own start time then (a new one is a restart)
    stopping: bool = False  # its last answer said it was stopping
    down_since: float | None = None  # the first poll it did not answer, since it last did
    departure: str | None = None  # a Departure, once it is down
    restarts: int = 0  # restarts seen by this fleet
    state_dir: str | None = None  # an embedded engine on this machine: where its own record of how it stopped lies


def _stopped_cleanly(state_dir: str | None) -> bool:
    """Whether an embedded engine on this machine recorded a requested shutdown as its last word (its durable
    event store in ``state_dir``): a fleet that polled it too seldom to see it announce the stop still knows."""
    if not state_dir:
        return False
    from bsr_cli.runtime.event_store import stopped_cleanly

    return stopped_cleanly(Path(state_dir)) is True


class Memory:
    """What the fleet remembers of each engine (by URL), and the timeline of what happened to them, kept in
    ``path`` between invocations when given. Losing the file only loses history: it is written whole and
    atomically, and a file that does not parse is ignored."""

    TIMELINE_KEPT = 500

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self.seen: dict[str, Seen] = {}
        self.timeline: list[Incident] = []
        if path is not None:
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                raw = json.loads(path.read_text())
                self.seen = {str(url): Seen(**d) for url, d in (raw.get("engines") or {}).items()}
                self.timeline = [Incident.from_wire(d) for d in raw.get("timeline") or []]
        self._known = {i.key for i in self.timeline}

    @classmethod
    def for_settings(cls, settings: Settings) -> Memory:
        return cls(settings.state_dir / "fleet-seen.json")

    def observe(self, rows: list[EngineRow]) -> list[EngineRow]:
        """Fold one round into the memory; each row gains `last_seen`, and a down row `down_since` and
        `departure` (with `clean_stop`: whether it stopped cleanly, when that is known); each row's incidents
        join the timeline, and the row carries its engine's newest."""
        out = []
        for row in rows:
            at = row.polled_at or self._clock()
            prev = self.seen.get(row.url, Seen())
            now, row = self._up(prev, row, at) if not row.down else self._gone(prev, row, at)
            self.seen[row.url] = now
            self._record(row.incidents)
            out.append(replace(row, incidents=self.incidents_of(row.url)))
        return out

    def incidents_of(self, url: str) -> tuple[Incident, ...]:
        """The engine's newest incidents, newest first."""
        mine = sorted((i for i in self.timeline if i.url == url), key=lambda i: -i.time)
        return tuple(mine[:ROW_INCIDENTS])

    def _up(self, prev: Seen, row: EngineRow, at: float) -> tuple[Seen, EngineRow]:
        started = row.started_at
        restarted = prev.started_at is not None and started is not None and started != prev.started_at
        now = Seen(
            last_seen=at,
            started_at=started,
            stopping=row.stopping,
            restarts=prev.restarts + int(restarted),
            state_dir=row.state_dir or prev.state_dir,
        )
        came_back = None
        if restarted or (prev.down_since is not None and prev.departure):
            came_back = prev.departure or "restarted"
        if prev.down_since is not None:
            self._record(
                [Incident(at, row.engine, row.url, Happened.CAME_BACK, f"answering again (it went: {came_back})")]
            )
        return now, replace(row, last_seen=at, restarts=now.restarts, came_back=came_back)

    def _gone(self, prev: Seen, row: EngineRow, at: float) -> tuple[Seen, EngineRow]:
        if row.error in ANSWERED:  # it is there and refuses this bsr (a token, a version): it did not go anywhere
            return prev, row
        if prev.down_since is None or prev.departure is None:
            now = replace(prev, down_since=at, departure=self._departure(prev, row).value)
            self._record([self._went(row, now)])
        elif prev.departure != Departure.CLEAN and _stopped_cleanly(prev.state_dir):
            # Its own record, read once it was written (it stopped answering before it closed its store).
            now = replace(prev, departure=Departure.CLEAN.value)
            self.timeline = [self._went(row, now) if i.key == self._went(row, prev).key else i for i in self.timeline]
        else:
            now = prev
        return now, self._down_fields(row, now)

    @staticmethod
    def _went(row: EngineRow, s: Seen) -> Incident:
        text = Departure(s.departure or Departure.UNKNOWN).describe
        return Incident(s.down_since or 0.0, row.engine, row.url, Happened.WENT_DOWN, text)

    def _record(self, incidents: Sequence[Incident]) -> None:
        for i in incidents:
            if i.key not in self._known:
                self._known.add(i.key)
                self.timeline.append(i)
        if len(self.timeline) > self.TIMELINE_KEPT:
            self.timeline = sorted(self.timeline, key=lambda i: i.time)[-self.TIMELINE_KEPT :]
            self._known = {i.key for i in self.timeline}

    @staticmethod
    def _departure(prev: Seen, row: EngineRow) -> Departure:
        if prev.last_seen is None:
            return Departure.UNKNOWN
        if prev.stopping or _stopped_cleanly(prev.state_dir):
            return Departure.CLEAN
        if row.error == "timeout":
            return Departure.HUNG
        return Departure.CRASH

    def _down_fields(self, row: EngineRow, s: Seen) -> EngineRow:
        d = Departure(s.departure or Departure.UNKNOWN)
        since = time.strftime("%H:%M:%S", time.localtime(s.down_since or self._clock()))
        last = f", last seen {time.strftime('%H:%M:%S', time.localtime(s.last_seen))}" if s.last_seen else ""
        return replace(
            row,
            departure=d,
            down_since=s.down_since,
            last_seen=s.last_seen,
            departure_text=d.describe,
            down_text=f"{d.describe}: down since {since}{last}",
        )

    def save(self) -> None:
        """Best effort: a fleet view never fails because its memory could not be written."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                seen = {u: asdict(v) for u, v in self.seen.items()}
                json.dump({"engines": seen, "timeline": [i.to_wire() for i in self.timeline]}, f)
            tmp.replace(self.path)
