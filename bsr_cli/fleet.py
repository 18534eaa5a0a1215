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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bsr_cli.core.commit import FAILED_CLOSED
from bsr_cli.errors import BsrError, InvalidInput
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


def targets(settings: Settings) -> list[Target] | None:
    """The engines `--engine` names, or None when it names at most one (the single-engine commands apply)."""
    names = split_engines(settings.engine)
    out: list[Target] = []
    for name in names:
        out.extend(_resolve(settings, name))
    if len(out) <= 1:
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


# -- polling ------------------------------------------------------------------------------------------------------
Poll = Callable[[Target], dict[str, Any]]


def http_poll(timeout_s: float) -> Poll:
    """One snapshot of one engine through the one admin client, bounded by ``timeout_s``."""

    def poll(t: Target) -> dict[str, Any]:
        from bsr_cli.client import AdminClient

        with AdminClient(t.url, t.token, timeout_s=timeout_s) as c:
            return c.snapshot(health=True, timeout=timeout_s)

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
        kind = error.kind if isinstance(error, BsrError) else "internal"
        msg = error.message if isinstance(error, BsrError) else f"{type(error).__name__}: {error}"
        return row | {"severity": DOWN, "state": "down", "problems": [f"{kind}: {msg}"], "ranks": [], "error": kind}
    info = snap.get("info") or {}
    budget = info.get("budget_bytes") or 0
    ranks = []
    for r in snap.get("ranks") or []:
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
        ranks.append(
            {
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
        )
    problems: list[str] = []
    sev = max((r["severity"] for r in ranks), default=OK)
    for r in ranks:
        if r["severity"] >= DEGRADED:
            problems.append(f"rank {r['rank']}: {r['reason']}")
    bad_tiers = {n: h for n, h in (snap.get("tiers") or {}).items() if not h.get("ok", True)}
    for n, h in bad_tiers.items():
        problems.append(f"tier {n} unhealthy" + (f" ({'; '.join(h.get('detail') or [])})" if h.get("detail") else ""))
    if bad_tiers:
        sev = max(sev, DEGRADED)
    markers = snap.get("markers") or []
    faults = [f for f in snap.get("faults") or [] if not f.get("exhausted")]
    now = float(snap.get("time") or at)
    failed = [
        o
        for o in snap.get("recent") or []
        if o.get("outcome") == FAILED_CLOSED and now - float(o.get("finished") or now) <= RECENT_S
    ]
    if markers:
        problems.append(f"{len(markers)} force-local marker(s)")
    if faults:
        problems.append(f"{len(faults)} fault(s) armed")
    if failed:
        problems.append(f"{len(failed)} recent restore(s) failed closed (last: {failed[0].get('reason') or '?'})")
    if markers or faults or failed:
        sev = max(sev, ATTENTION)
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
        "tiers": {n: bool(h.get("ok", True)) for n, h in (snap.get("tiers") or {}).items()},
        "markers": len(markers),
        "faults": len(faults),
        "active": len(snap.get("active") or []),
        "failed_recent": len(failed),
        "restore_bps": sum(r["restore_bps"] for r in ranks),
        "ranks": sorted(ranks, key=lambda r: (-r["severity"], r["rank"] if r["rank"] is not None else 0)),
    }


def order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worst first; among equals, in the order the operator named them (stable)."""
    return sorted(rows, key=lambda r: -int(r["severity"]))


def fleet_result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {name: sum(1 for r in rows if r["state"] == name) for name in STATE.values()}
    return {"fleet": True, "engines": rows, "counts": counts, "worst": rows[0]["state"] if rows else "ok"}
