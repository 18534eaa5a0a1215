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
addresses, or a Prometheus server's active scrape targets. `Memory` is what the fleet remembers of each engine
between polls (and between invocations, in a small file under the state directory): when it last answered, and, once
it stops answering, since when and how it went away (`Departure`). `exit_code` is the one rule for a fleet's exit
status (docs/fleet.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from bsr_cli.core.evidence import EventKind, Outcome
from bsr_cli.errors import BsrError, EngineUnreachable, ExitCode, InvalidInput
from bsr_cli.settings import Settings

# Severity, worst first.
DOWN = 4  # the engine did not answer
UNHEALTHY = 3  # a rank is down, stopped or failing its heartbeat: the engine cannot serve
DEGRADED = 2  # a tier is unhealthy or a rank's pool is at the admission budget
ATTENTION = 1  # force-local markers, armed faults, recent failed-closed restores
OK = 0
RECENT_S = 300.0  # a failed-closed restore counts against its engine for five minutes
STATE = {DOWN: "down", UNHEALTHY: "unhealthy", DEGRADED: "degraded", ATTENTION: "attention", OK: "ok"}


@dataclass(frozen=True)
class Target:
    name: str  # what the operator typed (a URL or a profile name, with an index when a profile lists several)
    url: str
    token: str | None


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
        raise InvalidInput(f"engine {dupes[0]} is named twice in --engine")
    return out


def _resolve(settings: Settings, name: str) -> list[Target]:
    if name in settings.profiles:
        prof = settings.profiles[name]
        token = settings.token or prof.get("token")
        many = prof.get("urls")
        if many is not None:
            if not isinstance(many, list) or not all(isinstance(u, str) for u in many):
                raise InvalidInput(f"profile {name!r}: urls must be a list of URLs or profile names")
            found: list[Target] = []
            for i, u in enumerate(many):
                if u in settings.profiles and u != name:
                    found.extend(_resolve(settings, u))
                elif u.startswith(("http://", "https://")):
                    found.append(Target(f"{name}[{i}]", u.rstrip("/"), token))
                else:
                    raise InvalidInput(f"profile {name!r}: {u!r} is neither a URL nor a profile")
            return found
        url = str(prof.get("url", ""))
        if not url:
            raise InvalidInput(f"profile {name!r} has no url")
        return [Target(name, url.rstrip("/"), token)]
    if not name.startswith(("http://", "https://")):
        raise InvalidInput(
            f"--engine {name!r} is neither a URL nor a profile",
            hint=f"profiles in {settings.config_path}: {', '.join(settings.profiles) or 'none'}",
        )
    return [Target(name, name.rstrip("/"), settings.token)]


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
    job), ``dns://NAME:PORT`` (one engine per address of NAME), or a file (``file:PATH`` or a path) with one URL or
    profile name per line (``#`` starts a comment). Nothing found is an error: an empty fleet is never "all ok"."""
    token = settings.token if settings is not None else None
    if spec.startswith("prometheus://"):
        found = _from_prometheus(spec, token, timeout_s=settings.timeout_s if settings else timeout_s)
    elif spec.startswith("dns://"):
        found = _from_dns(spec, token, resolver)
    else:
        found = _from_file(Path(spec.removeprefix("file:")).expanduser(), settings)
    if not found:
        raise InvalidInput(f"--engines-from {spec}: no engine found")
    return found


def _from_dns(spec: str, token: str | None, resolver: Resolver) -> list[Target]:
    u = urlsplit(spec)
    if not u.hostname or not u.port:
        raise InvalidInput(f"--engines-from {spec}: give dns://NAME:PORT (the admin port every address serves)")
    scheme = (parse_qs(u.query).get("scheme") or ["http"])[0]
    out = []
    for addr in resolver(u.hostname, u.port):
        host = f"[{addr}]" if ":" in addr else addr
        out.append(Target(f"{u.hostname}/{addr}", f"{scheme}://{host}:{u.port}", token))
    return out


def _from_file(path: Path, settings: Settings | None) -> list[Target]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise InvalidInput(f"--engines-from {path}: {e.strerror or e}") from None
    out: list[Target] = []
    for n, line in enumerate(lines, 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if settings is None:
            if not name.startswith(("http://", "https://")):
                raise InvalidInput(f"{path}:{n}: {name!r} is not a URL")
            out.append(Target(name, name.rstrip("/"), None))
            continue
        try:
            out.extend(_resolve(settings, name))
        except InvalidInput as e:
            raise InvalidInput(f"{path}:{n}: {e.message}", hint=e.hint) from None
    return out


def _from_prometheus(spec: str, token: str | None, *, timeout_s: float) -> list[Target]:
    """A Prometheus server's active targets (its /api/v1/targets), those of ``job`` when given: each target's
    scrape URL with its /metrics path dropped is an engine's admin URL (the admin API serves /metrics itself)."""
    import httpx

    u = urlsplit(spec)
    if not u.hostname or not u.port:
        raise InvalidInput(f"--engines-from {spec}: give prometheus://HOST:PORT?job=JOB")
    query = parse_qs(u.query)
    job = query["job"][0] if query.get("job") else None
    scheme = (query.get("scheme") or ["http"])[0]
    api = f"{scheme}://{u.hostname}:{u.port}/api/v1/targets"
    try:
        r = httpx.get(api, params={"state": "active"}, timeout=timeout_s)
        r.raise_for_status()
        data = r.json()
    except httpx.HTTPStatusError as e:
        raise EngineUnreachable(f"Prometheus at {api} answered {e.response.status_code}") from None
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
        out.append(Target(str(labels.get("instance") or scrape.netloc), f"{scrape.scheme}://{scrape.netloc}", token))
    if not out:
        raise InvalidInput(
            f"Prometheus at {u.hostname}:{u.port} has no active target" + (f" in job {job!r}" if job else ""),
            hint=f"its jobs: {', '.join(j for j in jobs if j) or 'none'}",
        )
    return sorted(out, key=lambda t: t.name)


# -- polling ------------------------------------------------------------------------------------------------------
Poll = Callable[[Target], dict[str, Any]]


def http_poll(timeout_s: float) -> Poll:
    """One snapshot of one engine through the one admin client, bounded by ``timeout_s``."""

    def poll(t: Target) -> dict[str, Any]:
        from bsr_cli.client import AdminClient

        with AdminClient(t.url, t.token, timeout_s=timeout_s) as c:
            return c.snapshot(health=True, timeout=timeout_s).to_wire()

    return poll


def poll_all(
    ts: Sequence[Target], poll: Poll, *, pool: ThreadPoolExecutor | None = None, clock: Callable[[], float] = time.time
) -> list[dict[str, Any]]:
    """Every engine's row, polled concurrently; an engine that fails is a `down` row with the reason."""
    own = pool is None
    ex = pool or ThreadPoolExecutor(max_workers=min(16, len(ts)), thread_name_prefix="bsr-fleet")
    try:
        futures = [ex.submit(_timed, poll, t) for t in ts]
        return order([summarize(t, *f.result(), at=clock()) for t, f in zip(ts, futures, strict=True)])
    finally:
        if own:
            ex.shutdown(wait=False, cancel_futures=True)


def _timed(poll: Poll, t: Target) -> tuple[dict[str, Any] | None, BaseException | None, float]:
    t0 = time.monotonic()
    try:
        return poll(t), None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - any failure of one engine is its row, never the fleet's
        return None, e, time.monotonic() - t0


# -- folding ------------------------------------------------------------------------------------------------------
def summarize(
    t: Target, snap: dict[str, Any] | None, error: BaseException | None, latency_s: float, *, at: float
) -> dict[str, Any]:
    """One engine's row: identity, severity, what is wrong, and its ranks worst first."""
    row: dict[str, Any] = {"engine": t.name, "url": t.url, "polled_at": at, "latency_s": round(latency_s, 4)}
    if snap is None:
        return row | _down(error)
    info = snap.get("info") or {}
    row["started_at"] = info.get("started_at")
    row["stopping"] = announces_stop(snap)
    # A restarted engine's own word on how its previous run ended ("clean" or "crash", in its engine_started event):
    # what no poller can see from outside, once the engine is back.
    started = [e for e in snap.get("events") or [] if isinstance(e, dict) and e.get("type") == EventKind.ENGINE_STARTED]
    if started and started[-1].get("previous_stop"):
        row["previous_stop"] = str(started[-1]["previous_stop"])
    budget = info.get("budget_bytes") or 0
    ranks = [_rank_row(r, budget) for r in snap.get("ranks") or []]
    tiers = snap.get("tiers") or {}
    markers = snap.get("markers") or []
    faults = [f for f in snap.get("faults") or [] if not f.get("exhausted")]
    now = float(snap.get("time") or at)
    failed = [
        o
        for o in snap.get("recent") or []
        if o.get("outcome") == Outcome.FAILED_CLOSED and now - float(o.get("finished") or now) <= RECENT_S
    ]
    last_failure = next((o for o in snap.get("recent") or [] if o.get("outcome") == Outcome.FAILED_CLOSED), None)
    sev, problems = _severity(ranks, tiers, markers, faults, failed)
    reg = info.get("registration") or {}
    return row | {
        "severity": sev,
        "state": STATE[sev],
        "problems": problems,
        "engine_name": info.get("engine"),
        "model": reg.get("model"),
        "W": info.get("W"),
        "rws_bytes": info.get("rws_bytes"),
        "budget_bytes": budget,
        "tiers": {n: bool(h.get("ok", True)) for n, h in tiers.items()},
        "markers": len(markers),
        "faults": len(faults),
        "active": len(snap.get("active") or []),
        "failed_recent": len(failed),
        "restore_bps": sum(r["restore_bps"] for r in ranks),
        "pool_live_bytes": max((r["live_bytes"] for r in ranks), default=0),
        "ranks_up": sum(1 for r in ranks if r["severity"] < UNHEALTHY),
        "last_failure": (
            {
                "request": str(last_failure.get("request") or ""),
                "reason": str(last_failure.get("reason") or "failed closed"),
                "finished": float(last_failure.get("finished") or now),
            }
            if last_failure
            else None
        ),
        "ranks": sorted(ranks, key=lambda r: (-r["severity"], r["rank"] if r["rank"] is not None else 0)),
    }


def _down(error: BaseException | None) -> dict[str, Any]:
    """The row of an engine that did not answer: the error's kind and message, and the exit code it maps to."""
    kind = error.kind if isinstance(error, BsrError) else "internal"
    msg = error.message if isinstance(error, BsrError) else f"{type(error).__name__}: {error}"
    code = int(error.exit_code) if isinstance(error, BsrError) else int(ExitCode.INTERNAL)
    return {
        "severity": DOWN,
        "state": "down",
        "problems": [f"{kind}: {msg}"],
        "ranks": [],
        "error": kind,
        "exit_code": code,
    }


def _rank_row(r: dict[str, Any], budget: int) -> dict[str, Any]:
    """One rank's row: its severity (down or unhealthy, pool at B, restores waiting for pool) and its pool."""
    p = r.get("pool") or {}
    live = int(p.get("live_bytes", 0))
    healthy = bool(r.get("healthy", r.get("alive", False)))
    alive = bool(r.get("alive", False))
    sev = OK
    why = ""
    if not alive or not healthy:
        sev, why = UNHEALTHY, str(r.get("reason") or ("down" if not alive else "unhealthy"))
    elif budget and live >= budget:
        sev, why = DEGRADED, "pool at budget B"
    elif int(p.get("waiters", 0)):
        sev, why = ATTENTION, f"{p.get('waiters')} waiting for pool"
    return {
        "rank": r.get("rank"),
        "severity": sev,
        "state": STATE[sev] if sev else ("up" if alive else "down"),
        "reason": why,
        "live_bytes": live,
        "peak_bytes": int(p.get("peak_bytes", 0)),
        "capacity_bytes": int(p.get("capacity_bytes", 0)),
        "budget_bytes": budget,
        "windows_live": int(p.get("windows_live", 0)),
        "restore_bps": float(r.get("restore_bps", 0.0)),
        "heartbeat_age_s": r.get("heartbeat_age_s"),
    }


def _severity(
    ranks: list[dict[str, Any]],
    tiers: dict[str, Any],
    markers: list[Any],
    faults: list[Any],
    failed: list[dict[str, Any]],
) -> tuple[int, list[str]]:
    """(the engine's severity, what is wrong): its worst rank, unhealthy tiers (degraded), then markers, armed
    faults and recent restores that failed closed (attention)."""
    problems: list[str] = []
    sev = max((r["severity"] for r in ranks), default=OK)
    for r in ranks:
        if r["severity"] >= DEGRADED:
            problems.append(f"rank {r['rank']}: {r['reason']}")
    bad_tiers = {n: h for n, h in tiers.items() if not h.get("ok", True)}
    for n, h in bad_tiers.items():
        problems.append(f"tier {n} unhealthy" + (f" ({'; '.join(h.get('detail') or [])})" if h.get("detail") else ""))
    if bad_tiers:
        sev = max(sev, DEGRADED)
    if markers:
        problems.append(f"{len(markers)} force-local marker(s)")
    if faults:
        problems.append(f"{len(faults)} fault(s) armed")
    if failed:
        problems.append(
            f"{len(failed)} recent restore(s) failed closed (last: {failed[0].get('reason') or 'no reason'})"
        )
    if markers or faults or failed:
        sev = max(sev, ATTENTION)
    return sev, problems


def order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worst first; among equals, in the order the operator named them (stable)."""
    return sorted(rows, key=lambda r: -int(r["severity"]))


def fleet_result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {name: sum(1 for r in rows if r["state"] == name) for name in STATE.values()}
    return {"fleet": True, "engines": rows, "counts": counts, "worst": rows[0]["state"] if rows else "ok"}


def announces_stop(snap: dict[str, Any]) -> bool:
    """Whether an engine's answer says it is shutting down: ``stopping: true`` in its snapshot, info or health, or an
    `engine_stopped` event in the events it returned. A crash says nothing: that is how the two are told apart."""
    info = snap.get("info") or {}
    health = snap.get("health") or {}
    if any(bool(d.get("stopping")) for d in (snap, info, health) if isinstance(d, dict)):
        return True
    return any(isinstance(e, dict) and e.get("type") == EventKind.ENGINE_STOPPED for e in snap.get("events") or [])


# -- the one exit rule -------------------------------------------------------------------------------------------
def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """A fleet exits as its worst engine would on its own with `bsr status`: an engine that does not answer exits
    with its error's code (3 unreachable, 4 timeout, 5 unauthorized, 6 API version mismatch), an unhealthy one with 9,
    anything else 0. Rows are worst first, and down engines in the order named, so the first row decides."""
    if not rows:
        return int(ExitCode.OK)
    worst = rows[0]
    if worst["severity"] >= DOWN:
        return int(worst.get("exit_code") or ExitCode.ENGINE_UNREACHABLE)
    if worst["severity"] >= UNHEALTHY:
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


@dataclass(frozen=True)
class Seen:
    """One engine as the fleet last saw it."""

    last_seen: float | None = None  # when it last answered
    started_at: float | None = None  # its own start time then (a new one is a restart)
    stopping: bool = False  # its last answer said it was stopping
    down_since: float | None = None  # the first poll it did not answer, since it last did
    departure: str | None = None  # a Departure, once it is down
    restarts: int = 0  # restarts seen by this fleet


class Memory:
    """What the fleet remembers of each engine (by URL), kept in ``path`` between invocations when given. Losing
    the file only loses history: it is written whole and atomically, and a file that does not parse is ignored."""

    def __init__(self, path: Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self.seen: dict[str, Seen] = {}
        if path is not None:
            with contextlib.suppress(OSError, ValueError, TypeError):
                raw = json.loads(path.read_text())
                self.seen = {str(url): Seen(**d) for url, d in (raw.get("engines") or {}).items()}

    @classmethod
    def for_settings(cls, settings: Settings) -> Memory:
        return cls(settings.state_dir / "fleet-seen.json")

    def observe(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Fold one round into the memory; each row gains `last_seen`, and a down row `down_since` and
        `departure` (with `clean_stop`: whether it stopped cleanly, when that is known)."""
        out = []
        for row in rows:
            url, at = row["url"], float(row.get("polled_at") or self._clock())
            prev = self.seen.get(url, Seen())
            if row["state"] != "down":
                started = row.get("started_at")
                restarted = prev.started_at is not None and started is not None and started != prev.started_at
                now = Seen(
                    last_seen=at,
                    started_at=started,
                    stopping=bool(row.get("stopping")),
                    restarts=prev.restarts + int(restarted),
                )
                row = row | {"last_seen": at}
                if now.restarts:
                    row = row | {"restarts": now.restarts}
                if restarted or (prev.down_since is not None and prev.departure):
                    row = row | {"came_back": prev.departure or "restarted"}
            else:
                if prev.down_since is not None and prev.departure is not None:
                    now = prev
                else:
                    now = replace(prev, down_since=at, departure=self._departure(prev, row).value)
                row = row | self._down_fields(now)
            self.seen[url] = now
            out.append(row)
        return out

    @staticmethod
    def _departure(prev: Seen, row: dict[str, Any]) -> Departure:
        if prev.last_seen is None:
            return Departure.UNKNOWN
        if prev.stopping:
            return Departure.CLEAN
        if row.get("error") == "timeout":
            return Departure.HUNG
        return Departure.CRASH

    def _down_fields(self, s: Seen) -> dict[str, Any]:
        d = Departure(s.departure or Departure.UNKNOWN)
        fields: dict[str, Any] = {"departure": d.value, "down_since": s.down_since}
        if s.last_seen is not None:
            fields["last_seen"] = s.last_seen
        if d is not Departure.UNKNOWN:
            fields["clean_stop"] = d is Departure.CLEAN
        since = time.strftime("%H:%M:%S", time.localtime(s.down_since or self._clock()))
        last = f", last seen {time.strftime('%H:%M:%S', time.localtime(s.last_seen))}" if s.last_seen else ""
        fields["departure_text"] = d.describe
        fields["down_text"] = f"{d.describe}: down since {since}{last}"
        return fields

    def save(self) -> None:
        """Best effort: a fleet view never fails because its memory could not be written."""
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"engines": {u: asdict(v) for u, v in self.seen.items()}}, f)
            tmp.replace(self.path)
