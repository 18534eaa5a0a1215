"""The embedded engine's main process: TP rank processes, the BSR coordinator and the admin API.

Started by `bsr engine up` (in its own session, so it outlives the CLI) as
``python -m bsr_cli.engine.server STATE_DIR``; reads STATE_DIR/engine.json, writes STATE_DIR/ready.json once the
admin API answers, and shuts everything down on SIGTERM or POST /bsr/v1/shutdown: its ranks and the Mooncake
services started for it. Restarts dead ranks and keeps markers and settings across runs (lifecycle.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bsr_cli import __version__
from bsr_cli.core import limits
from bsr_cli.core.events import EngineStarted, EngineStopped, Event, FaultEvent, FaultsCleared
from bsr_cli.core.evidence import EventKind, FaultAct
from bsr_cli.engine import lifecycle, netns, store_watch, supervisor
from bsr_cli.engine.config import EngineConfig, EngineReady, EventRetention, RankConfig, RankLink
from bsr_cli.engine.ranks import ProcessRank
from bsr_cli.runtime import event_store, failure_log
from bsr_cli.runtime.coordinator import Coordinator
from bsr_cli.runtime.events import EventLog
from bsr_cli.server import admin as admin_server
from bsr_cli.server.admin import AdminServer

REQUEST_PREFIX = "req-"
# How long a stopping engine keeps answering after it announced the stop: one poll of `bsr top` (1 s by default).
STOP_ANNOUNCE_S = 1.0  # the coordinator's request ids: req-00001, req-00002, ...


def open_events(state: Path, cfg: EngineConfig, log: logging.Logger | None = None) -> EventLog:
    """The engine's event log over its durable store in ``state`` (retention from engine.json's ``events``), with
    the start recorded as an event: whether an earlier engine wrote here, how it stopped, the faults it lost."""
    retention = cfg.events or EventRetention(event_store.DEFAULT_MAX_AGE_S, event_store.DEFAULT_MAX_BYTES)
    store = event_store.EventStore(
        state / event_store.FILE_NAME,
        max_age_s=float(retention.max_age_s),
        max_bytes=int(retention.max_bytes),
        on_error=(lambda why: failure_log.log_failure(log, why, component="event-store")) if log else None,
    )
    prev = store.previous
    events = EventLog(store=store)
    events.append(
        EngineStarted(
            version=__version__,
            pid=os.getpid(),
            restart=prev.existed,
            previous_stop=("clean" if prev.clean else "crash") if prev.existed else "",
            faults_dropped=_faults_left_armed(store) if prev.existed else 0,
        )
    )
    return events


def _faults_left_armed(store: event_store.EventStore) -> int:
    """Faults the previous engine still had armed (armed faults never survive a restart): what it recorded at a
    clean stop, else what its events say (injected since it started, not cleared, not used up)."""
    recorded = store.previous_meta("armed_faults")
    if store.previous.clean and recorded is not None and recorded.isdigit():
        return int(recorded)
    started = store.query(event_store.Query(kinds=(EventKind.ENGINE_STARTED,), newest=True, limit=1))
    kinds = (EventKind.FAULT_INJECTED, EventKind.FAULT_FIRED, EventKind.FAULTS_CLEARED)
    after = started[0].seq if started else 0
    armed: set[int] = set()
    for ev in store.query(event_store.Query(after_seq=after, kinds=kinds, limit=1_000_000)):
        if isinstance(ev, FaultsCleared):
            armed.clear()
        elif isinstance(ev, FaultEvent) and ev.act is FaultAct.INJECTED:
            armed.add(ev.fault_id)
        elif isinstance(ev, FaultEvent) and ev.count and ev.fired >= ev.count:  # fired, and used up
            armed.discard(ev.fault_id)
    return len(armed)


def _last_request_number(store: event_store.EventStore) -> int:
    """The number in the newest request id the store names (req-00042 -> 42), or what the last clean stop left."""
    newest = store.newest_request(REQUEST_PREFIX) or store.previous_meta("last_request") or ""
    digits = newest.removeprefix(REQUEST_PREFIX)
    return int(digits) if digits.isdigit() else 0


def build(
    cfg: EngineConfig, events: EventLog | None = None, log_dir: Path | None = None
) -> tuple[Coordinator, list[ProcessRank], Callable[[int], ProcessRank]]:
    reg = cfg.registration
    settings = cfg.settings
    # The same bounds `bsr engine up` and POST /settings apply: a hand-edited engine.json cannot start a broken engine.
    limits.check_engine_settings(
        reg,
        w=settings.w,
        pool_bytes=settings.pool_bytes,
        budget_bytes=settings.budget_bytes,
        max_tokens=settings.max_tokens,
        kv_tokens=settings.kv_tokens,
        fs_concurrency=settings.fs_concurrency,
        fetch_timeout_s=settings.fetch_timeout_s,
        window_within_budget=False,  # `bsr engine up` applied the stricter start-up check before writing it
    )
    events = events if events is not None else EventLog()
    holder: dict[str, Coordinator] = {}

    def on_event(ev: Event) -> None:
        coord = holder.get("c")
        if coord is not None:
            coord.on_rank_event(ev)

    blocks = {g.name: -(-settings.kv_tokens // g.block_size) for g in reg.groups}
    hosts = cfg.hosts

    def launch_rank(r: int) -> ProcessRank:
        coord = holder.get("c")
        now = coord.settings if coord is not None else settings  # a restarted rank gets today's B and fs load
        rank_cfg = RankConfig(
            rank=r,
            registration=reg,
            blocks=blocks,
            pool_bytes=now.pool_bytes,
            budget_bytes=now.budget_bytes,
            mooncake=cfg.mooncake,
            fs_dir=cfg.fs_dir,
            fs_concurrency=now.fs_concurrency,
            log_dir=str(log_dir) if log_dir is not None else None,
            scrub_after_failure=now.scrub_after_failure,
        )
        if hosts is not None:
            # A multi-host engine: the rank runs in its own namespace and, when a fetch fails, checks its links.
            topo, node = hosts.topology, netns.rank_node(r)
            rank_cfg = replace(
                rank_cfg,
                netns=topo.netns(node),
                address=topo.address(node),
                links=tuple(
                    RankLink(topo.link(node, peer).name, peer, hosts.endpoint(peer))
                    for peer in (netns.MASTER, netns.HOLDER)
                ),
            )
        return ProcessRank(r, rank_cfg, on_event)

    def start_rank(r: int) -> ProcessRank:
        return launch_rank(r).ready()

    # Every rank's process first, then their hellos: the ranks set up side by side.
    launched: list[ProcessRank] = []
    try:
        for r in range(reg.tp_size):
            launched.append(launch_rank(r))
        ranks = [rk.ready() for rk in launched]
    except BaseException:
        for rk in launched:
            rk.close()
        raise
    coord = Coordinator(reg, ranks, settings, events)
    if events.store is not None:
        coord.continue_request_ids(_last_request_number(events.store))
    holder["c"] = coord
    return coord, ranks, start_rank


def main(argv: list[str]) -> int:
    os.umask(0o077)  # logs, state and the filesystem tier's objects (prompts' KV) are owner-only
    state = Path(argv[0])
    cfg = EngineConfig.from_wire(json.loads((state / "engine.json").read_text()))
    token = (state / "token").read_text().strip()
    log = failure_log.open_log(state / "logs" / "bsr-engine.log", "engine")
    events = open_events(state, cfg, log)
    # Every failure the engine records is also a JSON line in logs/bsr-engine.log (the rank processes log theirs).
    events.observe(lambda ev: failure_log.log_failure_event(log, ev))
    try:
        coord, ranks, start_rank = build(cfg, events, state / "logs")
    except BaseException:
        events.append(EngineStopped(reason="start-up failed"))
        events.close()
        raise
    base = lifecycle.KeptSettings(cfg.settings.w, cfg.settings.budget_bytes, cfg.settings.fs_concurrency)
    restored = lifecycle.restore(state, coord, base)
    for line in restored.lines:
        print(f"bsr engine: {line}", flush=True)
    keeper = lifecycle.Keeper(state, coord, base)
    keeper.save()
    done = threading.Event()
    admin = _admin_server(cfg, coord, token, on_shutdown=done.set)
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    admin.start()
    watcher = store_watch.for_engine(state, cfg, coord, log)
    if watcher is not None:
        watcher.start()
    _write_ready(state, EngineReady(admin.url, os.getpid(), tuple(r.info for r in ranks), time.time(), restored))
    print(f"bsr engine serving {admin.url} with {len(ranks)} ranks", flush=True)

    def recorded(rank: int, pid: int | None, restarts: int) -> None:
        if pid is not None:
            supervisor.record_rank(state, rank, pid, restarts)

    restarter = lifecycle.RankRestarter(coord, start_rank, recorded, lambda line: print(line, flush=True))
    while not done.wait(0.5):
        keeper.save()
        restarter.check()
        coord.settle_settings()
    if watcher is not None:
        watcher.stop()  # before the store's services stop: their going is no loss
    keeper.save()
    # Say it before going: a monitor polling this engine sees the clean stop (an `engine_stopped` event) while the
    # admin API still answers, which is how a fleet tells a requested shutdown from a crash.
    _announce_stop(events, coord)
    time.sleep(STOP_ANNOUNCE_S)  # not synchronisation: the time a poller gets to see the announcement
    admin.stop()
    _stop_ranks_and_services(state, cfg, coord)
    events.close()
    failure_log.close_log(log)
    (state / "ready.json").unlink(missing_ok=True)
    return 0


def _admin_server(cfg: EngineConfig, coord: Coordinator, token: str, on_shutdown: Callable[[], None]) -> AdminServer:
    """The admin API over ``coord``, with engine.json's limits where it sets them (else the server's defaults)."""
    limit = cfg.admin.limit
    return AdminServer(
        coord,
        token=token,
        host=cfg.host,
        port=cfg.port,
        on_shutdown=on_shutdown,
        max_connections=int(limit("max_connections", admin_server.MAX_CONNECTIONS)),
        request_deadline_s=float(limit("request_deadline_s", admin_server.REQUEST_DEADLINE_S)),
        idle_timeout_s=float(limit("idle_timeout_s", admin_server.IDLE_TIMEOUT_S)),
        head_deadline_s=float(limit("head_deadline_s", admin_server.HEAD_DEADLINE_S)),
        max_anonymous=int(limit("max_anonymous", admin_server.MAX_ANONYMOUS)),
        max_waiting=int(limit("max_waiting", admin_server.MAX_WAITING)),
        max_waiting_per_client=int(limit("max_waiting_per_client", admin_server.MAX_WAITING_PER_CLIENT)),
        max_queued=int(limit("max_queued", admin_server.MAX_QUEUED)),
        allowed_hosts=list(cfg.admin.allowed_hosts),
        open_metrics=cfg.admin.open_metrics,
    )


def _write_ready(state: Path, ready: EngineReady) -> None:
    """Write ready.json whole (through a temporary file and a rename): a reader never sees half of it."""
    tmp = state / "ready.json.tmp"
    tmp.write_text(json.dumps(ready.to_wire(), indent=1))
    tmp.replace(state / "ready.json")


def _announce_stop(events: EventLog, coord: Coordinator) -> None:
    """Record the clean stop: in the store, the faults still armed and the last request id (the next engine reads
    them); in the log, the `engine_stopped` event."""
    if events.store is not None:
        last = f"{REQUEST_PREFIX}{_last_request_number(events.store):05d}"
        events.store.set_meta(armed_faults=str(len(coord.list_faults())), last_request=last)
    events.append(EngineStopped(reason="shutdown"))


def _stop_ranks_and_services(state: Path, cfg: EngineConfig, coord: Coordinator) -> None:
    """Close the rank processes, then stop the Mooncake services started for the engine and remove its network
    namespaces, saying what went."""
    for r in coord.ranks:
        r.close()  # type: ignore[attr-defined]
    stopped = lifecycle.stop_services(state)
    if stopped:
        print(f"bsr engine: stopped {', '.join(stopped)}", flush=True)
    if cfg.hosts is not None:
        removed = netns.destroy(cfg.hosts.topology.prefix)
        print(f"bsr engine: removed network namespaces {', '.join(removed) or 'none'}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
