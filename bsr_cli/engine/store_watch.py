"""The embedded engine's watch on its Mooncake store: a daemon thread that looks at the master every
``INTERVAL_S`` (``bsr_cli.mooncake.segment_watch``) and hands every segment the store lost to the coordinator,
which records it once (a ``segment_lost`` event, counters) and keeps the tier unhealthy (``segment_lost``)."""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

from bsr_cli.engine import netns
from bsr_cli.engine.config import EngineConfig
from bsr_cli.mooncake.segment_watch import SegmentWatch
from bsr_cli.runtime import failure_log
from bsr_cli.runtime.coordinator import Coordinator

INTERVAL_S = 1.0  # a look per second: a segment gone for a second is seen
TIER = "mooncake"


class StoreWatcher:
    """Polls one engine's master until stopped; a look that fails is logged and the next one tried."""

    def __init__(
        self,
        coordinator: Coordinator,
        watch: SegmentWatch,
        log: logging.Logger | None = None,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self.coordinator, self.watch, self.log, self.interval_s = coordinator, watch, log, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bsr-store-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Before the store's services stop: their going is no loss."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def look(self) -> None:
        """One look, its losses handed over (every loss the watch knows: a segment mounted again updates its own)."""
        self.watch.poll()
        if self.watch.losses:
            self.coordinator.record_store_losses(TIER, self.watch.losses)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception as e:  # noqa: BLE001 - a broken look must not end the watch; the next may succeed
                if self.log is not None:
                    failure_log.log_failure(self.log, f"store watch: {e}", component="store-watch")


def _holder_label(state: Path) -> str:
    """The engine's one segment holder, as the losses name it (``segment_holder pid 1234``)."""
    from bsr_cli.engine import supervisor

    record = supervisor.read_record(state)
    holder = record.services.get("segment_holder") if record is not None else None
    return f"segment_holder pid {holder.pid}" if holder is not None else "segment_holder"


def for_engine(
    state: Path, cfg: EngineConfig, coordinator: Coordinator, log: logging.Logger | None
) -> StoreWatcher | None:
    """The watch of an engine with a Mooncake tier whose master has an admin API (None otherwise); looks run in
    the master's network namespace on a multi-host engine."""
    mc = cfg.mooncake
    if mc is None or not mc.admin_url:
        return None
    probe_in = functools.partial(netns.call_in, cfg.hosts.topology.netns(netns.MASTER)) if cfg.hosts else None
    label = _holder_label(state)
    watch = SegmentWatch(mc.admin_url, mc.metadata_url, label=lambda _segment: label, probe_in=probe_in)
    return StoreWatcher(coordinator, watch, log, INTERVAL_S)


__all__ = ["INTERVAL_S", "TIER", "StoreWatcher", "for_engine"]
