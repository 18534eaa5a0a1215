"""The coordinator's counters: prometheus_client ``Counter``s in a registry of its own, incremented where the thing
happens (a restore ends, the coordinator receives a rank's ``window_released``, a marker is set, ...), from the
moment the coordinator exists. Nothing is tallied from the event log afterwards, so nothing is lost when events
arrive out of order or the log drops old ones.

One registry per coordinator (never prometheus_client's global one): several engines, or a test's several
coordinators, in one process each count their own. ``bsr_cli.server.metrics`` serves this registry beside the
gauges it reads at scrape time.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from bsr_cli.core.evidence import FailureKind, Outcome, SegmentLossCause, Stage

NONE = "none"  # the label value of "no failure kind" / "no stage" (a committed restore)
# The ``injected`` label: "true" on what an injected fault caused (a drill), which the shipped alerts never page on.
INJECTED, NOT_INJECTED = "true", "false"
# The stages each failure kind is recorded at (NONE: a rank that stopped answering, an abort between windows): their
# series exist from the start at 0, so increase() sees the first failure of each.
STAGES_OF: dict[FailureKind, tuple[str, ...]] = {
    FailureKind.CAPACITY: (Stage.ADMISSION.value,),
    FailureKind.TIER: (Stage.FETCH.value, Stage.VERIFY.value),
    FailureKind.RANK: (Stage.INSTALL.value, Stage.SYNCHRONIZE.value, Stage.COMMIT.value, Stage.PROBE.value, NONE),
    FailureKind.ABORTED: (NONE, Stage.FETCH.value),
    # none: the coordinator named the host (a rank starved past the overload ceiling); fetch: a rank's own deadline
    FailureKind.HOST_OVERLOADED: (NONE, Stage.FETCH.value),
}


class RuntimeCounters:
    """Every counter of one coordinator. Series a dashboard expects are created at 0 up front, so ``increase()``
    sees the first failure of a kind."""

    def __init__(self, ranks: Sequence[int], tiers: Sequence[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.restores = Counter(
            "bsr_restores",
            "Restores ended, by outcome, failure kind, the stage the failure happened at, and whether an injected "
            "fault fired in it",
            ["outcome", "kind", "stage", "injected"],
            registry=r,
        )
        self.windows = Counter("bsr_restore_windows", "Restore windows released", ["rank"], registry=r)
        self.bytes = Counter("bsr_restore_bytes", "Bytes installed by released restore windows", ["rank"], registry=r)
        self.fetch_bytes = Counter(
            "bsr_tier_fetch_bytes", "Bytes fetched from a tier into the restore pool", ["rank", "tier"], registry=r
        )
        self.fetch_seconds = Counter(
            "bsr_tier_fetch_seconds",
            "Seconds spent fetching from a tier into the restore pool",
            ["rank", "tier"],
            registry=r,
        )
        self.markers_set = Counter(
            "bsr_force_local_markers_set",
            "Force-local markers set, and whether an injected fault failed the restore that set them",
            ["injected"],
            registry=r,
        )
        self.unresponsive = Counter(
            "bsr_rank_unresponsive", "Times a rank missed its heartbeat or a deadline", ["rank"], registry=r
        )
        self.starved = Counter(
            "bsr_rank_starved",
            "Times a rank's deadline was stretched because the host starved it (it waited to run)",
            ["rank"],
            registry=r,
        )
        self.submitted = Counter("bsr_requests_submitted", "Requests submitted for admission", registry=r)
        # Destination KV blocks short: a request waits for them (FIFO, up to kv_wait_s) instead of being refused.
        self.block_waiting = Gauge(
            "bsr_requests_waiting_for_blocks", "Requests waiting now for destination KV blocks", registry=r
        )
        self.block_wait_gave_up = Counter(
            "bsr_requests_gave_up_waiting_for_blocks",
            "Requests refused after waiting their whole kv_wait_s for destination KV blocks",
            registry=r,
        )
        self.quarantined = Counter(
            "bsr_objects_quarantined",
            "Stored objects a rank found damaged on a tier (checksum mismatch) and moved aside",
            ["tier"],
            registry=r,
        )
        # The store's watch: segments the store lost (each named once) and the objects on them.
        self.segments_lost = Counter(
            "bsr_store_segments_lost",
            "Segments the store lost with every object on them (by how: holder_gone, unmounted, remounted_empty)",
            ["tier", "cause"],
            registry=r,
        )
        self.objects_lost = Counter(
            "bsr_store_objects_lost",
            "Objects on the segments the store lost (where the master said how many)",
            ["tier"],
            registry=r,
        )
        self._create_zero_series(ranks, tiers)

    def _create_zero_series(self, ranks: Sequence[int], tiers: Sequence[str]) -> None:
        """Create at 0 every series a dashboard expects: each restore ending a failure kind is recorded at, and
        each rank's and tier's."""
        self.restores.labels(Outcome.COMMITTED.value, NONE, NONE, NOT_INJECTED)
        self.restores.labels(Outcome.NOTHING_TO_RESTORE.value, NONE, NONE, NOT_INJECTED)
        for kind, stages in STAGES_OF.items():
            for stage in stages:
                self.restores.labels(kind.outcome.value, kind.value, stage, NOT_INJECTED)
        self.markers_set.labels(NOT_INJECTED)
        for rank in ranks:
            self.windows.labels(str(rank))
            self.bytes.labels(str(rank))
            self.unresponsive.labels(str(rank))
            self.starved.labels(str(rank))
            for tier in tiers:
                self.quarantined.labels(tier)
                self.fetch_bytes.labels(str(rank), tier)
                self.fetch_seconds.labels(str(rank), tier)
        for tier in tiers:
            self.objects_lost.labels(tier)
            for cause in SegmentLossCause:
                self.segments_lost.labels(tier, cause.value)

    def restore_ended(
        self, outcome: Outcome, kind: FailureKind | None, stage: Stage | None, injected: bool = False
    ) -> None:
        self.restores.labels(
            outcome.value, kind.value if kind else NONE, stage.value if stage else NONE, injected_label(injected)
        ).inc()

    def marker_set(self, injected: bool = False) -> None:
        self.markers_set.labels(injected_label(injected)).inc()

    def window_released(self, rank: int, nbytes: int) -> None:
        self.windows.labels(str(rank)).inc()
        self.bytes.labels(str(rank)).inc(nbytes)

    def window_fetched(self, rank: int, tiers: Sequence[str], nbytes: int, seconds: float) -> None:
        tier = tiers[0] if len(tiers) == 1 else "+".join(sorted(tiers)) or "unknown"
        self.fetch_bytes.labels(str(rank), tier).inc(nbytes)
        self.fetch_seconds.labels(str(rank), tier).inc(max(0.0, seconds))

    def object_quarantined(self, tier: str) -> None:
        self.quarantined.labels(tier).inc()

    def segment_lost(self, tier: str, cause: SegmentLossCause, objects: int | None) -> None:
        self.segments_lost.labels(tier, cause.value).inc()
        self.objects_lost.labels(tier).inc(objects or 0)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's value now (0 when the series does not exist): for tests and the CLI's own checks."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got


def injected_label(injected: bool) -> str:
    """The ``injected`` label's value."""
    return INJECTED if injected else NOT_INJECTED


__all__ = ["INJECTED", "NONE", "NOT_INJECTED", "STAGES_OF", "RuntimeCounters", "injected_label"]
