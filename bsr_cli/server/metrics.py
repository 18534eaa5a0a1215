"""The engine's Prometheus metrics, served by prometheus_client: the coordinator's counters (a registry of its own,
incremented where each thing happens, from the coordinator's start: ``bsr_cli.runtime.metrics``) and gauges read
from the coordinator at scrape time, named and labelled in Prometheus conventions.

Units are in the names (`_bytes`, `_seconds`), counters end in `_total`, and every per-rank, per-tier or per-group
value carries that label (`rank`, `tier`, `group`).

    bsr_engine_info{engine,version,model,registration}            1
    bsr_engine_start_time_seconds                                 when the engine started (Unix time)
    bsr_restore_window_chunks                                     W, the default window size in chunks
    bsr_restore_rws_bytes                                         RWS(W) per rank: the bound the pool holds to
    bsr_chunk_bytes{group}                                        c_i: one chunk of one KV group on one rank
    bsr_pool_{live,peak,capacity,budget}_bytes{rank}              the restore pool
    bsr_pool_windows_live{rank}, bsr_pool_waiters{rank}           windows staged, restores waiting for room
    bsr_rank_up{rank}, bsr_rank_healthy{rank}                     process alive; alive, beating, not stuck
    bsr_rank_heartbeat_age_seconds{rank}                          since the rank's last heartbeat
    bsr_rank_starved{rank}                                        1 while the host keeps the rank from running
                                                                  (waiting to run: its deadlines stretch)
    bsr_tier_healthy{tier,injected}                               0 when any rank sees it down or cannot write
                                                                  it, it failed recently, or its store lost a
                                                                  segment (an armed fault alone changes
                                                                  nothing); injected="true" when injected
                                                                  faults caused every reason (a drill; never a
                                                                  lost segment: no fault loses one)
    bsr_tier_condition{tier,condition,injected}                   1 per reason it is unhealthy now (full,
                                                                  read_only, directory_gone, not_writable,
                                                                  unavailable, restore_failed, segment_lost)
    bsr_tier_quarantined_objects{tier}                            damaged objects set apart under quarantine/
    bsr_objects_quarantined_total{tier}                           objects quarantined since the engine started
    bsr_restores_total{outcome,kind,stage,injected}               restores ended: committed | failed_closed |
                                                                  refused | aborted | nothing_to_restore (kind:
                                                                  the failure taxonomy's; stage: where it failed;
                                                                  "none" when there is none; injected: "true"
                                                                  when an injected fault fired in it)
    bsr_restore_windows_total{rank}                               windows released (each counted as the
                                                                  coordinator receives it)
    bsr_restore_bytes_total{rank}                                 bytes installed by released windows
    bsr_tier_fetch_bytes_total{rank,tier}                         bytes fetched from a tier into the pool
    bsr_tier_fetch_seconds_total{rank,tier}                       time spent fetching them (raw tier rate =
                                                                  rate(bytes) / rate(seconds))
    bsr_force_local_markers                                       markers standing now
    bsr_force_local_markers_set_total{injected}                   markers set (injected: by a drill's failure)
    bsr_faults_armed                                              injected faults still armed
    bsr_rank_unresponsive_total{rank}                             a rank missed its heartbeat or deadline
                                                                  through its own fault (dead, stopped, hung)
    bsr_rank_starved_total{rank}                                  a rank's deadline was stretched because the
                                                                  host starved it
    bsr_store_segments_lost_total{tier,cause}                     segments the store lost with their objects
    bsr_store_objects_lost_total{tier}                            the objects on them (where the master said)
    bsr_requests_submitted_total                                  requests submitted for admission

prometheus_client also exposes a ``_created`` sample per counter series (when it started counting).
``injected`` is "true" on what an injected fault caused (a drill) and "false" otherwise: the shipped alert rules
(docs/monitoring/bsr-alerts.yml) page only on ``injected!="true"``.
The names, labels and HELP texts are what docs/monitoring.md, the alert rules and the Grafana dashboard use.
The CLI never imports this module (it reads /metrics as text).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from bsr_cli.core.evidence import RankState
from bsr_cli.runtime.metrics import injected_label

if TYPE_CHECKING:
    from bsr_cli.core.status import PoolEntry, TierHealth
    from bsr_cli.runtime.coordinator import Coordinator

Labels = dict[str, str | int | None]  # a sample's label values (each written as text)


def _family(kind: str, name: str, help_: str, samples: Sequence[tuple[Labels, float]]) -> Metric:
    labels = list(samples[0][0]) if samples else []
    fam: Metric = (
        CounterMetricFamily(name, help_, labels=labels)
        if kind == "counter"
        else GaugeMetricFamily(name, help_, labels=labels)
    )
    for lbl, value in samples:
        fam.add_metric([str(lbl[k]) for k in labels], float(value))  # type: ignore[attr-defined]
    return fam


def _pool_value(rank: PoolEntry, key: str) -> int:
    return int((rank.pool or {}).get(key, 0))


class RuntimeCollector(Collector):
    """Every bsr family, read from one coordinator when Prometheus scrapes."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def describe(self) -> list[Metric]:
        return []  # the families depend on the engine's ranks and tiers: nothing to register up front

    def collect(self) -> Iterator[Metric]:
        c = self.coordinator
        yield from self._engine()
        yield from self._pools(c.pool(health=True))
        yield from self._tiers(c.health().tiers)
        yield _family("gauge", "bsr_force_local_markers", "Force-local markers standing now", [({}, len(c.markers))])
        yield _family(
            "gauge",
            "bsr_faults_armed",
            "Injected faults still armed",
            [({}, sum(1 for f in c.faults if not f.exhausted()))],
        )

    def _engine(self) -> Iterator[Metric]:
        """Who the engine is, since when, and the window it restores in."""
        from bsr_cli.core import accounting

        c = self.coordinator
        s, reg, info = c.settings, c.reg, c.info()
        identity: Labels = {"engine": info.engine, "version": info.version, "model": reg.model}
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

    @staticmethod
    def _pools(ranks: list[PoolEntry]) -> Iterator[Metric]:
        """Each rank's restore pool, and whether the rank runs and is healthy."""
        for key, help_ in (
            ("live_bytes", "Restore-pool bytes staged now"),
            ("peak_bytes", "Highest restore-pool bytes staged since start or the last reset"),
            ("capacity_bytes", "Restore-pool capacity"),
            ("budget_bytes", "Admission budget B"),
        ):
            yield _family("gauge", f"bsr_pool_{key}", help_, [({"rank": r.rank}, _pool_value(r, key)) for r in ranks])
        yield _family(
            "gauge",
            "bsr_pool_windows_live",
            "Restore windows staged in the pool now",
            [({"rank": r.rank}, _pool_value(r, "windows_live")) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_pool_waiters",
            "Restores waiting for room in the pool",
            [({"rank": r.rank}, _pool_value(r, "waiters")) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_up",
            "1 when the rank process runs",
            [({"rank": r.rank}, r.alive) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_healthy",
            "1 when the rank runs, beats and has no call stuck past its deadline",
            [({"rank": r.rank}, r.healthy) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_starved",
            "1 while the host keeps the rank from running (its deadlines stretch; it is not blamed)",
            [({"rank": r.rank}, r.state is RankState.STARVED) for r in ranks],
        )
        yield _family(
            "gauge",
            "bsr_rank_heartbeat_age_seconds",
            "Seconds since the rank's last heartbeat",
            [({"rank": r.rank}, r.heartbeat_age_s) for r in ranks if r.heartbeat_age_s is not None],
        )

    @staticmethod
    def _tiers(tier_health: dict[str, TierHealth]) -> Iterator[Metric]:
        """Each tier's health, the reasons it is unhealthy, and the objects it set apart."""
        tiers = sorted(tier_health.items())
        yield _family(
            "gauge",
            "bsr_tier_healthy",
            "1 when every rank reaches and can write the tier and it has not failed recently; injected=true when "
            "only injected faults made it unhealthy (a drill)",
            [({"tier": t, "injected": injected_label(h.injected)}, h.ok) for t, h in tiers],
        )
        yield _family(
            "gauge",
            "bsr_tier_condition",
            "1 for each reason a tier is unhealthy now (the reason /health and bsr status give)",
            [
                ({"tier": t, "condition": cond, "injected": injected_label(h.injected)}, 1)
                for t, h in tiers
                for cond in h.conditions
            ],
        )
        yield _family(
            "gauge",
            "bsr_tier_quarantined_objects",
            "Damaged objects a tier holds set apart in its quarantine directory (summed over ranks)",
            [({"tier": t}, h.quarantined_total) for t, h in tiers],
        )


class _Counters(Collector):
    """The coordinator's own counter registry (``bsr_cli.runtime.metrics``), served beside the gauges."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.coordinator.counters.registry.collect()


class Exposition:
    """A registry holding the gauges (RuntimeCollector) and the coordinator's counters: ``text()`` is what
    /metrics answers."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RuntimeCollector(coordinator))
        self.registry.register(_Counters(coordinator))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def exposition(coordinator: Coordinator) -> str:
    """The Prometheus text format (0.0.4) for one engine, read now (a host without an admin server uses this)."""
    return Exposition(coordinator).text()
