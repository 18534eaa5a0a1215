"""The embedded engine's main process: TP rank processes, the BSR coordinator and the admin API.

Started by `bsr engine up` (in its own session, so it outlives the CLI) as
``python -m bsr_cli.engine.server STATE_DIR``; reads STATE_DIR/engine.json, writes STATE_DIR/ready.json once the
admin API answers, and shuts everything down on SIGTERM or POST /bsr/v1/shutdown: its ranks and the Mooncake
services started for it. Restarts dead ranks and keeps markers and settings across runs (lifecycle.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bsr_cli.core import limits
from bsr_cli.core.events import Event
from bsr_cli.core.registration import Registration
from bsr_cli.engine import lifecycle, supervisor
from bsr_cli.engine.ranks import ProcessRank
from bsr_cli.runtime.coordinator import Coordinator, EngineSettings
from bsr_cli.runtime.events import EventLog
from bsr_cli.server import admin as admin_server
from bsr_cli.server.admin import AdminServer


def build(cfg: dict[str, Any]) -> tuple[Coordinator, list[ProcessRank], Callable[[int], ProcessRank]]:
    reg = Registration.from_dict(cfg["registration"])
    settings = EngineSettings(**cfg["settings"])
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
    events = EventLog()
    holder: dict[str, Coordinator] = {}

    def on_event(ev: Event) -> None:
        coord = holder.get("c")
        if coord is not None:
            coord.on_rank_event(ev)

    blocks = {g.name: -(-settings.kv_tokens // g.block_size) for g in reg.groups}

    def start_rank(r: int) -> ProcessRank:
        coord = holder.get("c")
        now = coord.settings if coord is not None else settings  # a restarted rank gets today's B and fs load
        rank_cfg = {
            "rank": r,
            "registration": reg.to_dict(),
            "blocks": blocks,
            "pool_bytes": now.pool_bytes,
            "budget_bytes": now.budget_bytes,
            "mooncake": cfg.get("mooncake"),
            "fs_dir": cfg["fs_dir"],
            "fs_concurrency": now.fs_concurrency,
        }
        return ProcessRank(r, rank_cfg, on_event)

    ranks: list[ProcessRank] = []
    try:
        for r in range(reg.tp_size):
            ranks.append(start_rank(r))
    except BaseException:
        for rk in ranks:
            rk.close()
        raise
    coord = Coordinator(reg, ranks, settings, events)
    holder["c"] = coord
    return coord, ranks, start_rank


def main(argv: list[str]) -> int:
    os.umask(0o077)  # logs, state and the filesystem tier's objects (prompts' KV) are owner-only
    state = Path(argv[0])
    cfg = json.loads((state / "engine.json").read_text())
    token = (state / "token").read_text().strip()
    coord, ranks, start_rank = build(cfg)
    base = {k: cfg["settings"].get(k) for k in ("w", "budget_bytes", "fs_concurrency")}
    restored = lifecycle.restore(state, coord, base)
    for line in restored["lines"]:
        print(f"bsr engine: {line}", flush=True)
    keeper = lifecycle.Keeper(state, coord, base)
    keeper.save()
    done = threading.Event()
    limits_cfg = cfg.get("admin") or {}
    admin = AdminServer(
        coord,
        token=token,
        host=cfg.get("host", "127.0.0.1"),
        port=int(cfg.get("port", 0)),
        on_shutdown=done.set,
        max_connections=int(limits_cfg.get("max_connections", admin_server.MAX_CONNECTIONS)),
        request_deadline_s=float(limits_cfg.get("request_deadline_s", admin_server.REQUEST_DEADLINE_S)),
        idle_timeout_s=float(limits_cfg.get("idle_timeout_s", admin_server.IDLE_TIMEOUT_S)),
        head_deadline_s=float(limits_cfg.get("head_deadline_s", admin_server.HEAD_DEADLINE_S)),
        max_anonymous=int(limits_cfg.get("max_anonymous", admin_server.MAX_ANONYMOUS)),
        max_waiting=int(limits_cfg.get("max_waiting", admin_server.MAX_WAITING)),
        max_waiting_per_client=int(limits_cfg.get("max_waiting_per_client", admin_server.MAX_WAITING_PER_CLIENT)),
        allowed_hosts=[str(h) for h in limits_cfg.get("allowed_hosts", ())],
        open_metrics=bool(limits_cfg.get("open_metrics", False)),
    )
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    admin.start()
    ready = {
        "url": admin.url,
        "pid": os.getpid(),
        "ranks": [{"rank": r.rank, "pid": r.pid, **r.info} for r in ranks],
        "started_at": time.time(),
        "restored": restored,
    }
    tmp = state / "ready.json.tmp"
    tmp.write_text(json.dumps(ready, indent=1))
    tmp.replace(state / "ready.json")
    print(f"bsr engine serving {admin.url} with {len(ranks)} ranks", flush=True)

    def recorded(rank: int, pid: int | None, restarts: int) -> None:
        if pid is not None:
            supervisor.record_rank(state, rank, pid, restarts)

    restarter = lifecycle.RankRestarter(coord, start_rank, recorded, lambda line: print(line, flush=True))
    while not done.wait(0.5):
        keeper.save()
        restarter.check()
    keeper.save()
    admin.stop()
    for r in coord.ranks:
        r.close()  # type: ignore[attr-defined]
    stopped = lifecycle.stop_services(state)
    if stopped:
        print(f"bsr engine: stopped {', '.join(stopped)}", flush=True)
    (state / "ready.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
