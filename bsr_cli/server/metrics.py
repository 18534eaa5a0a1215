"""The engine's Prometheus metrics, served by prometheus_client from a Collector that reads the runtime at scrape
time: families named and labelled in Prometheus conventions.

Units are in the names (`_bytes`, `_seconds`), counters end in `_total`, and every per-rank, per-tier or per-group
value carries that label (`rank`, `tier`, `group`). Gauges are read from the coordinator at scrape time; counters
are tallied from the engine's event log by an observer attached on the first scrape, which first counts the
events the log still holds (the last 2,000), so a scrape shortly after start sees what happened before it.

    bsr_engine_info{engine,version,model,registration}            1
    bsr_engine_start_time_seconds                                 when the engine started (Unix time)
    bsr_restore_window_chunks                                     W, the default window size in chunks
    bsr_restore_rws_bytes                                         RWS(W) per rank: the bound the pool holds to
    bsr_chunk_bytes{group}                                        c_i: one chunk of one KV group on one rank
    bsr_pool_{live,peak,capacity,budget}_bytes{rank}              the restore pool
    bsr_pool_windows_live{rank}, bsr_pool_waiters{rank}           windows staged, restores waiting for room
    bsr_rank_up{rank}, bsr_rank_healthy{rank}                     process alive; alive, beating, not stuck
    bsr_rank_heartbeat_age_seconds{rank}                          since the rank's last heartbeat
    bsr_tier_healthy{tier}                                        0 when any rank sees it down, a fault is armed
                                                                  on it or it failed recently
    bsr_restores_total{outcome,kind}                              restores ended: committed | failed_closed
                                                                  (kind: the failure taxonomy's, or "none")
    bsr_restore_windows_total{rank}                               windows released
    bsr_restore_bytes_total{rank}                                 bytes installed by released windows
    bsr_tier_fetch_bytes_total{rank,tier}                         bytes fetched from a tier into the pool
    bsr_tier_fetch_seconds_total{rank,tier}                       time spent fetching them (raw tier rate =
                                                                  rate(bytes) / rate(seconds))
    bsr_force_local_markers                                       markers standing now
    bsr_force_local_markers_set_total                             markers set
    bsr_faults_armed                                              injected faults still armed
    bsr_rank_unresponsive_total{rank}                             a rank missed its heartbeat or deadline
    bsr_requests_submitted_total                                  admissions through the API

The names, labels and HELP texts are what docs/monitoring.md, the alert rules and the Grafana dashboard use.
The CLI never imports this module (it reads /metrics as text).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from bsr_cli.core.commit import COMMITTED, FAILED_CLOSED

_LOCK = threading.Lock()


class Counters:
    """Counters tallied from the event log (one per coordinator)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.restores: dict[tuple[str, str], int] = defaultdict(int)
        self.windows: dict[int, int] = defaultdict(int)
        self.bytes: dict[int, int] = defaultdict(int)
        self.fetch_bytes: dict[tuple[int, str], int] = defaultdict(int)
        self.fetch_seconds: dict[tuple[int, str], float] = defaultdict(float)
        self.markers_set = 0
        self.unresponsive: dict[int, int] = defaultdict(int)
        self.submitted = 0
        self._last_seq = 0

    def count(self, ev: dict[str, Any]) -> None:
        with self._lock:
            seq = int(ev.get("seq", 0))
            if seq and seq <= self._last_seq:
                return  # already counted (the backlog and a live event can meet)
            self._last_seq = max(self._last_seq, seq)
            t = ev.get("type")
            if t in ("restore_committed", "restore_failed_closed"):
                outcome = COMMITTED if t == "restore_committed" else FAILED_CLOSED
                self.restores[(outcome, str(ev.get("failure_kind") or "none"))] += 1
            elif t == "window_released":
                r = int(ev.get("rank", -1))
                self.windows[r] += 1
                self.bytes[r] += int(ev.get("bytes", 0))
            elif t == "window_fetched":
                r = int(ev.get("rank", -1))
                tiers = list(ev.get("tiers") or ["unknown"])
                tier = tiers[0] if len(tiers) == 1 else "+".join(sorted(tiers))
                self.fetch_bytes[(r, tier)] += int(ev.get("bytes", 0))
                self.fetch_seconds[(r, tier)] += float(ev.get("seconds", 0.0))
            elif t == "marker_set":
                self.markers_set += 1
            elif t == "rank_unresponsive":
                self.unresponsive[int(ev.get("rank", -1))] += 1
            elif t == "request_admitted":
                self.submitted += 1


def counters_for(coordinator: Any) -> Counters:
    """The coordinator's counters, attached to its event log on first use (with the events it still holds)."""
    with _LOCK:
        c: Counters | None = getattr(coordinator, "_bsr_metrics", None)
        if c is None:
            c = Counters()
            backlog = coordinator.events.observe(c.count)
            for ev in backlog:
                c.count(ev)
            coordinator._bsr_metrics = c
    return c


def _family(kind: str, name: str, help_: str, samples: Sequence[tuple[dict[str, Any], float]]) -> Metric:
    labels = list(samples[0][0]) if samples else []
    fam: Metric = (
        CounterMetricFamily(name, help_, labels=labels)
        if kind == "counter"
        else GaugeMetricFamily(name, help_, labels=labels)
    )
    for lbl, value in samples:
        fam.add_metric([str(lbl[k]) for k in labels], float(value))  # type: ignore[attr-defined]
    return fam


class RuntimeCollector(Collector):
    """Every bsr family, read from one coordinator when Prometheus scrapes."""

    def __init__(self, coordinator: Any, submitted: Callable[[], int] | None = None) -> None:
        self.coordinator = coordinator
        self.submitted = submitted

    def describe(self) -> list[Metric]:
        return []  # the families depend on the engine's ranks and tiers: nothing to register up front

    def collect(self) -> Iterator[Metric]:
        from bsr_cli.core import accounting
        from bsr_cli.runtime import failures

        c = self.coordinator
        cnt = counters_for(c)
        s = c.settings
        reg = c.reg
        info = c.info()
        ranks = c.pool(health=True)
        health = c.health()
        identity = {"engine": info.get("engine"), "version": info.get("version"), "model": reg.model}
        yield _family(
            "gauge", "bsr_engine_info", "Engine identity (always 1)", [(identity | {"registration": reg.identity}, 1)]
        )
        yield _family(
            "gauge", "bsr_engine_start_time_seconds", "When the engine started (Unix time)", [({}, c.started_at)]
        )
        yield _family("gauge", "bsr_restore_window_chunks", "Default restore window W in chunks", [({}, int(s.w))])
        yield _family(
            "gauge",
            "bsr_restore_rws_bytes",
            "RWS(W): the restore working set per rank at the default W",
            [({}, accounting.rws_bytes(reg, s.w) if s.w else 0)],
        )
        yield _family(
            "gauge",
            "bsr_chunk_bytes",
            "Bytes of one chunk of one KV group on one rank (c_i)",
            [({"group": g}, reg.group_bytes_per_chunk(g)) for g in reg.group_names],
        )
        for key, help_ in (
            ("live_bytes", "Restore-pool bytes staged now"),
            ("peak_bytes", "Highest restore-pool bytes staged since start or the last reset"),
            ("capacity_bytes", "Restore-pool capacity"),
            ("budget_bytes", "Admission budget B"),
        ):
            yield _family(
                "gauge",
                f"bsr_pool_{key}",
                help_,
                [({"rank": r["rank"]}, int((r.get("pool") or {}).get(key, 0))) for r in ranks],
            )
        yield _family(
            "gauge",
            "bsr_pool_windows_live",
            "Restore windows staged in the pool now",
            [({"rank": r["rank"]}, int((r.get("pool") or {}).get("windows_live", 0))) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_pool_waiters",
            "Restores waiting for room in the pool",
            [({"rank": r["rank"]}, int((r.get("pool") or {}).get("waiters", 0))) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_up",
            "1 when the rank process runs",
            [({"rank": r["rank"]}, bool(r["alive"])) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_healthy",
            "1 when the rank runs, beats and has no call stuck past its deadline",
            [({"rank": r["rank"]}, bool(r.get("healthy", r["alive"]))) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_heartbeat_age_seconds",
            "Seconds since the rank's last heartbeat",
            [({"rank": r["rank"]}, float(r["heartbeat_age_s"])) for r in ranks if r.get("heartbeat_age_s") is not None],
        )
        yield _family(
            "gauge",
            "bsr_tier_healthy",
            "1 when every rank reaches the tier, no fault is armed on it and it has not failed recently",
            [({"tier": t}, bool(h.get("ok", True))) for t, h in sorted((health.get("tiers") or {}).items())],
        )
        with cnt._lock:
            restores = dict(cnt.restores)
            windows, nbytes = dict(cnt.windows), dict(cnt.bytes)
            fb, fs = dict(cnt.fetch_bytes), dict(cnt.fetch_seconds)
            markers_set, unresponsive, subs = cnt.markers_set, dict(cnt.unresponsive), cnt.submitted
        # Every series exists from the start at 0, so increase() sees a restore's first failure of a kind.
        restores.setdefault((COMMITTED, "none"), 0)
        for kind in failures.KINDS:
            restores.setdefault((FAILED_CLOSED, kind), 0)
        yield _family(
            "counter",
            "bsr_restores_total",
            "Restores ended, by outcome and failure kind",
            [({"outcome": o, "kind": k}, n) for (o, k), n in sorted(restores.items())],
        )
        rank_ids = [int(r["rank"]) for r in ranks]
        yield _family(
            "counter",
            "bsr_restore_windows_total",
            "Restore windows released",
            [({"rank": r}, windows.get(r, 0)) for r in rank_ids],
        )
        yield _family(
            "counter",
            "bsr_restore_bytes_total",
            "Bytes installed by released restore windows",
            [({"rank": r}, nbytes.get(r, 0)) for r in rank_ids],
        )
        tiers = list(s.tiers)
        yield _family(
            "counter",
            "bsr_tier_fetch_bytes_total",
            "Bytes fetched from a tier into the restore pool",
            [({"rank": r, "tier": t}, fb.get((r, t), 0)) for r in rank_ids for t in tiers]
            + [({"rank": r, "tier": t}, n) for (r, t), n in sorted(fb.items()) if t not in tiers],
        )
        yield _family(
            "counter",
            "bsr_tier_fetch_seconds_total",
            "Seconds spent fetching from a tier into the restore pool",
            [({"rank": r, "tier": t}, fs.get((r, t), 0.0)) for r in rank_ids for t in tiers]
            + [({"rank": r, "tier": t}, n) for (r, t), n in sorted(fs.items()) if t not in tiers],
        )
        yield _family("gauge", "bsr_force_local_markers", "Force-local markers standing now", [({}, len(c.markers))])
        yield _family("counter", "bsr_force_local_markers_set_total", "Force-local markers set", [({}, markers_set)])
        yield _family(
            "gauge",
            "bsr_faults_armed",
            "Injected faults still armed",
            [({}, sum(1 for f in c.faults if not f.exhausted()))],
        )
        yield _family(
            "counter",
            "bsr_rank_unresponsive_total",
            "Times a rank missed its heartbeat or a deadline",
            [({"rank": r}, unresponsive.get(r, 0)) for r in rank_ids],
        )
        submitted = subs if self.submitted is None else self.submitted()
        yield _family(
            "counter", "bsr_requests_submitted_total", "Requests admitted through the admin API", [({}, submitted)]
        )


class Exposition:
    """A registry holding one RuntimeCollector: ``text()`` is what /metrics answers."""

    def __init__(self, coordinator: Any, submitted: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(coordinator, submitted))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def exposition(coordinator: Any) -> str:
    """The Prometheus text format (0.0.4) for one engine, read now (a host without an admin server uses this)."""
    return Exposition(coordinator).text()
