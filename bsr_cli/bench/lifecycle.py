"""Embedded engines for the bench: start one sized for an experiment, always stop it, and find its Mooncake
master and filesystem tier."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bsr_cli.client import local_engine
from bsr_cli.core import accounting
from bsr_cli.core.registration import Registration
from bsr_cli.core.units import MiB
from bsr_cli.errors import InvalidInput, ServiceError

if TYPE_CHECKING:
    from bsr_cli.bench.ladder import EngineFactory
    from bsr_cli.client import AdminClient
    from bsr_cli.engine.supervisor import EngineOptions, EngineRecord


# -- embedded engines sized for each experiment -----------------------------------------------------------------


@contextlib.contextmanager
def embedded_engine(state_dir: Path, opts: EngineOptions) -> Iterator[AdminClient]:
    """Start an embedded engine in ``state_dir``, yield a client of it, and always stop it."""
    from bsr_cli.client import AdminClient
    from bsr_cli.engine import supervisor

    try:
        supervisor.up(state_dir, opts)
        conn = local_engine.connection(state_dir)
        if conn is None:
            raise ServiceError(
                f"the embedded engine in {state_dir} recorded no admin URL",
                hint="`bsr engine status` shows what runs there; `bsr engine down` then rerun the benchmark",
            )
        with AdminClient(conn[0], conn[1] or None, timeout_s=120.0) as client:
            yield client
    finally:
        supervisor.down(state_dir)


def embedded_options(experiment: str, reg: Registration, **p: Any) -> EngineOptions:
    """Engine options sized for one experiment on this machine (pool, prompt limit, store capacity)."""
    from bsr_cli.engine.supervisor import EngineOptions

    def per_prompt(n: int) -> int:  # store bytes of one prompt, every rank
        return n * reg.bytes_per_token * reg.tp_size

    headroom = 512 * MiB

    def sized(w: int, n: int, pool: int, segment: int, fetch_timeout_s: float = 60.0) -> EngineOptions:
        # B = RWS(W) in every profile: one live window, the paper's serialized restore.
        return EngineOptions(
            reg,
            w=w,
            pool_bytes=pool,
            budget_bytes=accounting.rws_bytes(reg, w),
            max_tokens=n,
            kv_tokens=n,
            segment_bytes=segment,
            fetch_timeout_s=fetch_timeout_s,
        )

    if experiment == "sweep":
        w, top = int(p["w"]), max(p["prefixes"])
        copies = 2 if p.get("repeat", True) else 1
        # The pool is fixed for the whole block.
        return sized(w, top, 2 * accounting.rws_bytes(reg, w), copies * per_prompt(top) + headroom)
    if experiment == "wlaw":
        top_w, n = max(p["ws"]), int(p["tokens"])
        return sized(top_w, n, accounting.rws_bytes(reg, top_w), per_prompt(n) + headroom)
    if experiment == "fs-concurrency":
        w, n = int(p["w"]), int(p["tokens"])
        return sized(w, n, 2 * accounting.rws_bytes(reg, w), per_prompt(n) + headroom)
    if experiment == "store":
        w, n = int(p["w"]), int(p["tokens"])
        whole = accounting.whole_plan_bytes(reg, accounting.chunks_for_tokens(n, reg.chunk_size))
        return sized(
            w,
            n,
            max(whole, 2 * accounting.rws_bytes(reg, w)),  # the whole-plan path stages the whole prefix at once
            # The prompt, plus the tier's and the raw client's copies of every client's objects at once.
            per_prompt(n) + 2 * reg.tp_size * int(p["raw_bytes"]) + headroom,
            fetch_timeout_s=600.0,  # one whole-plan window holds the entire prefix
        )
    if experiment == "failures":
        n = int(p["tokens"])
        return EngineOptions(reg, w=int(p.get("w") or 32), max_tokens=n, kv_tokens=2 * n, faults_enabled=True)
    raise InvalidInput(
        f"no embedded engine profile for experiment {experiment!r}",
        hint="run the experiment against a running engine (--engine URL) instead of --embedded",
    )


def embedded_ladder_factory(state_dir: Path, reg: Registration, *, max_tokens: int) -> EngineFactory:
    """Restart the embedded engine in ``state_dir`` with each rung as its pool (W=0, B = the pool). The state
    directory, and so the filesystem tier, survives restarts: later rungs restore without re-warming."""
    from bsr_cli.engine.supervisor import EngineOptions

    def factory(pool_bytes: int) -> AbstractContextManager[AdminClient]:
        opts = EngineOptions(
            reg,
            w=0,
            pool_bytes=pool_bytes,
            budget_bytes=pool_bytes,
            max_tokens=max_tokens,
            kv_tokens=max_tokens,
            segment_bytes=max_tokens * reg.bytes_per_token * reg.tp_size + 512 * MiB,
            fetch_timeout_s=600.0,  # the whole plan is one window
        )
        return embedded_engine(state_dir, opts)

    return factory


def _record_serving(state_dir: Path, url: str) -> EngineRecord | None:
    """The state record of the embedded engine in ``state_dir`` when it is the one serving ``url``."""
    from bsr_cli.engine.supervisor import read_record

    record = read_record(state_dir)
    if record is None or record.admin_url.rstrip("/") != url.rstrip("/"):
        return None
    return record


def mooncake_of(state_dir: Path, url: str) -> dict[str, str] | None:
    """The Mooncake master of the embedded engine in ``state_dir`` when it is the one serving ``url``."""
    record = _record_serving(state_dir, url)
    if record is None or record.netns is not None:
        return None  # a multi-host engine's master is in a network namespace of its own: unreachable from here
    master = record.services.get("mooncake_master")
    urls = (master.urls if master else None) or {}
    if not urls.get("rpc_address") or not urls.get("metadata_url"):
        return None
    return {"master_address": urls["rpc_address"], "metadata_url": urls["metadata_url"]}


def link_ceiling_of(state_dir: Path, url: str) -> int | None:
    """The bandwidth cap (bits/s) on every link of the multi-host engine in ``state_dir`` when it serves ``url``
    (`bsr engine up --hosts netns --link-rate`): the ceiling a restore across those links cannot pass."""
    record = _record_serving(state_dir, url)
    return None if record is None or record.netns is None else record.netns.rate_bps


def fs_dir_of(state_dir: Path, url: str) -> Path | None:
    """The filesystem tier directory of the embedded engine in ``state_dir`` when it serves ``url``."""
    if _record_serving(state_dir, url) is None:
        return None
    path = state_dir / "fs-tier"
    return path if path.is_dir() else None
