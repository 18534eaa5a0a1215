"""`bsr engine up | down | status`: the embedded engine's services, in a state directory.

The state directory holds everything about one running engine: ``state.json`` (pids, ports, URLs), ``token``
(the admin bearer token, mode 0600), ``engine.json`` (the engine's configuration), ``ready.json`` (written by the
engine once it serves), logs, and the filesystem tier. ``up`` is idempotent (a healthy engine is reported, not
restarted; a half-dead one is cleaned up first) and ``down`` leaves nothing running.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import secrets
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from bsr_cli.client.local_engine import read_json as _read_json
from bsr_cli.client.local_engine import read_state
from bsr_cli.core import accounting, limits, wire
from bsr_cli.core.registration import Registration
from bsr_cli.engine import netns
from bsr_cli.engine.config import (
    AdminConfig,
    EngineConfig,
    EngineReady,
    EventRetention,
    MooncakeEndpoints,
    Restored,
    StoreAddresses,
    StoreHosts,
)
from bsr_cli.errors import CapacityError, InvalidInput, ServiceError
from bsr_cli.mooncake import services
from bsr_cli.runtime.coordinator_state import EngineSettings
from bsr_cli.runtime.judge import DEFAULT_OVERLOAD_CEILING_S, MAX_OVERLOAD_CEILING_S

SERVER_START_TIMEOUT_S = 240.0
PRIVATE_UMASK = 0o077
# How `bsr engine up` spells each setting, so a refusal names the flag to change.
CLI_NAMES = {
    "w": "--W",
    "pool_bytes": "--pool",
    "budget_bytes": "--budget",
    "max_tokens": "--max-tokens",
    "kv_tokens": "--kv-tokens",
    "fs_concurrency": "--fs-concurrency",
    "fetch_timeout_s": "--fetch-timeout",
    "kv_wait_s": "--kv-wait",
    "overload_ceiling_s": "--overload-ceiling",
    "store_client_ttl_s": "--store-client-ttl",
}
# The longest a request may wait for destination KV blocks held by running requests (`--kv-wait`).
MAX_KV_WAIT_S = 3600.0


@dataclass
class EngineOptions:
    registration: Registration
    w: int = 32
    pool_bytes: int | None = None
    budget_bytes: int | None = None
    max_tokens: int = 131_072
    kv_tokens: int | None = None
    segment_bytes: int | None = None
    faults_enabled: bool = False
    fs_concurrency: int = 1
    fetch_timeout_s: float = 10.0
    # How long a request waits for destination KV blocks held by running requests before it is refused for
    # capacity (0: refuse at once).
    kv_wait_s: float = 60.0
    # The longest a rank's deadline is stretched while the host starves it (runtime/judge.py).
    overload_ceiling_s: float = DEFAULT_OVERLOAD_CEILING_S
    host: str = "127.0.0.1"
    port: int = 0
    remote: bool = True
    # The admin server's self-defence (see bsr_cli/server/admin.py); None keeps the server's defaults.
    admin_limits: dict[str, float] | None = None
    # Host names the admin API answers to besides loopback names and its bind address (`--allow-host`).
    allowed_hosts: tuple[str, ...] = ()
    # Serve /metrics without the token (`--open-metrics`, for a scraper that cannot send one).
    open_metrics: bool = False
    # The durable event store (state_dir/events.sqlite): events older than this, and the oldest beyond this size,
    # are deleted.
    event_retention_s: float = 7 * 86400.0
    event_store_bytes: int = 512 << 20
    # Where the parts run: "local" (one network namespace, loopback) or "netns" (the master, the segment holder and
    # each rank in a network namespace of their own, joined by veth links: bsr_cli/engine/netns.py).
    hosts: str = "local"
    # A bandwidth cap on every link between those namespaces (bits/s; `tc tbf`), None for none.
    link_rate_bps: int | None = None
    # After a tier failed a restore at fetch or verify, scrub the rest of the prompt's objects on it (background).
    scrub_after_failure: bool = True
    # How long the Mooncake master keeps a silent segment holder before it drops its segment and every object on
    # it (`mooncake_master --client_ttl`; core.limits.DEFAULT_STORE_CLIENT_TTL_S says why this default).
    store_client_ttl_s: int = limits.DEFAULT_STORE_CLIENT_TTL_S

    def resolved(self) -> ResolvedSettings:
        reg = self.registration
        rws = accounting.rws_bytes(reg, self.w) if self.w else reg.bytes_per_chunk
        # Default pool: room for two windows, so a larger budget can overlap fetch and install.
        pool = self.pool_bytes if self.pool_bytes is not None else 2 * rws
        budget = self.budget_bytes if self.budget_bytes is not None else min(rws, pool)
        kv = self.kv_tokens or 2 * self.max_tokens
        limits.check_engine_settings(
            reg,
            w=self.w,
            pool_bytes=pool,
            budget_bytes=budget,
            max_tokens=self.max_tokens,
            kv_tokens=kv,
            fs_concurrency=self.fs_concurrency,
            fetch_timeout_s=self.fetch_timeout_s,
            names=CLI_NAMES,
        )
        _check_kv_wait(self.kv_wait_s)
        _check_overload_ceiling(self.overload_ceiling_s)
        limits.check_client_ttl(self.store_client_ttl_s, CLI_NAMES["store_client_ttl_s"])
        per_rank_prompt = self.max_tokens * reg.bytes_per_token
        segment = self.segment_bytes or max(256 << 20, 2 * per_rank_prompt * reg.tp_size)
        need = reg.tp_size * (kv * reg.bytes_per_token + pool) + (segment if self.remote else 0)
        avail = _mem_available()
        if avail is not None and need > avail:
            from bsr_cli.core.units import format_bytes

            raise CapacityError(
                f"this engine needs about {format_bytes(need)} of memory (destination KV for {kv:,} tokens on "
                f"{reg.tp_size} ranks, pools, the Mooncake segment); {format_bytes(avail)} is available",
                hint="lower --max-tokens / --kv-tokens / --segment / --pool (2·RWS(W) by default, so --W too), "
                "or use a smaller registration",
            )
        return ResolvedSettings(
            w=self.w,
            pool_bytes=pool,
            budget_bytes=budget,
            max_tokens=self.max_tokens,
            kv_tokens=kv,
            segment_bytes=segment,
            faults_enabled=self.faults_enabled,
            fs_concurrency=self.fs_concurrency,
            fetch_timeout_s=self.fetch_timeout_s,
            kv_wait_s=self.kv_wait_s,
            overload_ceiling_s=self.overload_ceiling_s,
            event_retention_s=self.event_retention_s,
            event_store_bytes=self.event_store_bytes,
            store_client_ttl_s=self.store_client_ttl_s,
        )


@dataclass(frozen=True)
class ResolvedSettings:
    """An engine's settings with every default filled in and checked (`EngineOptions.resolved`)."""

    w: int
    pool_bytes: int
    budget_bytes: int
    max_tokens: int
    kv_tokens: int
    segment_bytes: int
    faults_enabled: bool
    fs_concurrency: int
    fetch_timeout_s: float
    kv_wait_s: float
    overload_ceiling_s: float
    event_retention_s: float
    event_store_bytes: int
    store_client_ttl_s: int

    @classmethod
    def from_wire(cls, data: object) -> ResolvedSettings | None:
        """As this bsr records them, values as written; an older bsr's, lacking one, read as absent (None), but for
        what an older bsr ran with without recording it (``_UNRECORDED``)."""
        if not isinstance(data, dict):
            return None
        given = {**_UNRECORDED, **data}
        return _parsed(lambda: cls(**{f.name: given[f.name] for f in fields(cls)}))


# What an engine started by an older bsr ran with, where it recorded nothing: its master had Mooncake's own client
# TTL (so `up` names that difference instead of calling the whole record unreadable).
_UNRECORDED: dict[str, int] = {"store_client_ttl_s": limits.MOONCAKE_DEFAULT_CLIENT_TTL_S}


def _check_kv_wait(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= MAX_KV_WAIT_S:
        # NaN fails the range test too.
        raise InvalidInput(
            f"{CLI_NAMES['kv_wait_s']} must be a number of seconds in [0, {MAX_KV_WAIT_S:.0f}], got {seconds!r}",
            hint="--kv-wait 60 waits a minute for destination KV blocks; 0 refuses at once",
        )


def _check_overload_ceiling(seconds: float) -> None:
    bad = isinstance(seconds, bool) or not isinstance(seconds, int | float)
    if bad or not 1 <= seconds <= MAX_OVERLOAD_CEILING_S:  # NaN fails the range test too
        raise InvalidInput(
            f"{CLI_NAMES['overload_ceiling_s']} must be a number of seconds in [1, {MAX_OVERLOAD_CEILING_S:.0f}], "
            f"got {seconds!r}",
            hint="the longest a rank's deadline may stretch while the host starves it (default "
            f"{DEFAULT_OVERLOAD_CEILING_S:g})",
        )


def _mem_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@contextlib.contextmanager
def _private() -> Iterator[None]:
    """Everything created meanwhile is owner-only (files 0600, directories 0700): prompts' KV, tokens and logs."""
    old = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(old)


def make_private(state: Path) -> None:
    """Take group and other permissions off the state directory and everything under it (older runs included)."""
    for root, dirs, files in os.walk(state):
        for name in [*dirs, *files, ""]:
            path = os.path.join(root, name) if name else root
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                    os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)


@contextlib.contextmanager
def _locked(state: Path) -> Iterator[None]:
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(state / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- state.json ----------------------------------------------------------------------------------------------------
# The record of a running engine. Its layout (keys, their order, which are absent) stays as it is: an engine started
# by an older bsr is still found, reported and stopped, and a newer one by an older bsr.


@dataclass(frozen=True)
class ServiceRecord:
    """A service process of the engine (the engine process itself, the Mooncake master, the segment holder)."""

    pid: int
    start_ticks: int | None
    urls: dict[str, str] | None = wire.field(omit_none=True, default=None)
    log: str | None = wire.field(omit_none=True, default=None)


@dataclass(frozen=True)
class RankRecord:
    """A rank process; ``restarts`` once the engine has restarted it."""

    pid: int  # 0: a rank recorded before its process started
    start_ticks: int | None
    rank: int
    device: str | None = None
    restarts: int | None = wire.field(omit_none=True, default=None)


@dataclass(frozen=True, kw_only=True)
class RecordedOptions:
    """What decides an engine's behaviour, as recorded in state.json: compared when `up` finds one running."""

    settings: ResolvedSettings = wire.field(flatten=True)  # its keys first, in the options' own object
    registration: str
    host: str
    port: int
    remote: bool
    allowed_hosts: tuple[str, ...]
    open_metrics: bool
    hosts: str
    link_rate_bps: int | None

    @classmethod
    def of(cls, opts: EngineOptions, settings: ResolvedSettings) -> RecordedOptions:
        return cls(
            settings=settings,
            registration=opts.registration.identity,
            host=opts.host,
            port=opts.port,
            remote=opts.remote,
            allowed_hosts=tuple(sorted(opts.allowed_hosts)),
            open_metrics=opts.open_metrics,
            hosts=opts.hosts,
            link_rate_bps=opts.link_rate_bps,
        )

    to_wire = wire.writer()

    @classmethod
    def from_wire(cls, data: object) -> RecordedOptions | None:
        """As this bsr records them; an older bsr's, lacking one, read as absent (None)."""
        settings = ResolvedSettings.from_wire(data)
        if settings is None or not isinstance(data, dict):
            return None
        o = data
        return _parsed(
            lambda: cls(
                settings=settings,
                registration=str(o["registration"]),
                host=str(o["host"]),
                port=int(o["port"]),
                remote=bool(o["remote"]),
                allowed_hosts=tuple(str(h) for h in o["allowed_hosts"]),
                open_metrics=bool(o["open_metrics"]),
                hosts=str(o["hosts"]),
                link_rate_bps=None if o["link_rate_bps"] is None else int(o["link_rate_bps"]),
            )
        )


@dataclass(frozen=True)
class EngineRecord:
    """state.json. ``restored`` and what follows it are absent until the engine serves."""

    services: dict[str, ServiceRecord] = field(default_factory=dict)
    ranks: tuple[RankRecord, ...] = ()
    started_at: float | None = wire.field(omit_none=True, default=None)
    netns: netns.Topology | None = wire.field(omit_none=True, default=None)
    restored: Restored | None = wire.field(omit_none=True, default=None)
    admin_url: str = ""
    # The settings and options as this bsr records them (an older bsr's that differ read as absent).
    settings: ResolvedSettings | None = wire.field(omit_none=True, default=None)
    options: RecordedOptions | None = wire.field(omit_none=True, default=None)
    registration_identity: str | None = wire.field(omit_none=True, default=None)
    logs: str | None = wire.field(omit_none=True, default=None)

    to_wire = wire.writer()
    from_wire = wire.reader()  # a state file as any bsr wrote it; parts it lacks read as absent

    def processes(self) -> list[tuple[str, int, int | None]]:
        """(name, pid, start ticks) of every process recorded. The start ticks make a pid that the kernel handed to
        another process after ours died read as dead, and keep `down` from signalling it."""
        out = [(name, svc.pid, svc.start_ticks) for name, svc in self.services.items()]
        return out + [(f"rank{r.rank}", r.pid, r.start_ticks) for r in self.ranks if r.pid]


T = TypeVar("T")


def _parsed(parse: Callable[[], T]) -> T | None:
    """``parse()``, or None when what it reads is absent or not in the form this bsr records (an older bsr's)."""
    try:
        return parse()
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def read_record(state: Path) -> EngineRecord | None:
    """The engine's state record, or None when no engine was started in ``state``."""
    st = read_state(state)
    return None if st is None else EngineRecord.from_wire(st)


def _write_record(state: Path, record: EngineRecord) -> None:
    _write_json(state / "state.json", record)


def _write_json(path: Path, doc: EngineRecord | EngineConfig) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc.to_wire(), indent=1))
    tmp.replace(path)


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


# -- `bsr engine status | up | down` ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessState:
    name: str
    pid: int
    alive: bool
    restarts: int = 0  # how often the engine restarted it (a rank)


def _process_wire(p: ProcessState) -> wire.JsonObject:
    out: wire.JsonObject = {"name": p.name, "pid": p.pid, "alive": p.alive}
    return out | ({"restarts": p.restarts} if p.restarts else {})


@dataclass(frozen=True)
class EngineHosts:
    """Where the engine's parts run: all on loopback (no topology), or in network namespaces joined by links."""

    topology: netns.Topology | None = None
    links: tuple[netns.LinkState, ...] = ()


@dataclass(frozen=True)
class EngineStatus:
    """`bsr engine status` (and `up`, which adds how the start went). With no engine recorded in the state
    directory only ``state_dir`` and the empty lists say anything."""

    state_dir: str
    running: bool = False
    healthy: bool = False
    processes: tuple[ProcessState, ...] = ()
    listening: tuple[services.ListeningSocket, ...] = ()
    record: EngineRecord | None = None  # None: no engine recorded
    hosts: EngineHosts = field(default_factory=EngineHosts)
    # From `up`: whether it found the engine already running, the token file and the restored state's lines.
    already_running: bool | None = None
    token_file: str | None = None
    restored: tuple[str, ...] | None = None

    @property
    def exposed(self) -> list[services.ListeningSocket]:
        return [s for s in self.listening if s.exposed]

    @property
    def admin_url(self) -> str:
        return self.record.admin_url if self.record is not None else ""

    def to_wire(self) -> wire.JsonObject:
        procs: list[wire.JsonValue] = [_process_wire(p) for p in self.processes]
        listening: list[wire.JsonValue] = [asdict(s) for s in self.listening]
        exposed: list[wire.JsonValue] = [asdict(s) for s in self.exposed]
        topo = self.hosts.topology
        hosts: wire.JsonObject = (
            {"mode": "local"}
            if topo is None
            else {
                "mode": netns.MODE,
                "namespaces": [topo.netns(n) for n in topo.nodes],
                "link_rate_bps": topo.rate_bps,
                "links": [
                    {"link": lk.link, "state": "up" if lk.up else "down"}
                    | ({"down_at": list(lk.down_at)} if lk.down_at else {})
                    for lk in self.hosts.links
                ],
            }
        )
        rec = self.record
        out: wire.JsonObject
        if rec is None:
            out = {"state_dir": self.state_dir, "running": self.running, "healthy": self.healthy}
            out |= {"processes": procs, "listening": listening, "exposed": exposed}
        else:
            out = {"state_dir": self.state_dir, "running": self.running, "hosts": hosts}
            out |= {"healthy": self.healthy, "admin_url": rec.admin_url, "processes": procs}
            out |= {
                "started_at": rec.started_at,
                "settings": None if rec.settings is None else asdict(rec.settings),
                "registration": rec.registration_identity,
                "logs": rec.logs,
                "listening": listening,
                "exposed": exposed,
            }
        if self.already_running is not None:
            out["already_running"] = self.already_running
        if self.token_file is not None:
            out["token_file"] = self.token_file
        if self.restored is not None:
            out["restored"] = list(self.restored)
        return out


def status(state: Path) -> EngineStatus:
    rec = read_record(state)
    if rec is None:
        return EngineStatus(str(state))
    found = rec.processes()
    restarts = {f"rank{r.rank}": r.restarts or 0 for r in rec.ranks}
    procs = tuple(ProcessState(n, p, services.is_alive(p, t), restarts.get(n, 0)) for n, p, t in found)
    healthy = all(p.alive for p in procs) and _http_ok(rec.admin_url + "/bsr/v1/health")
    listening = services.listening_sockets((n, p) for n, p, t in found if services.is_alive(p, t))
    hosts = EngineHosts()
    if rec.netns is not None:
        hosts = EngineHosts(rec.netns, tuple(netns.link_states(rec.netns)))
    return EngineStatus(
        str(state),
        running=any(p.alive for p in procs),
        healthy=healthy,
        processes=procs,
        listening=tuple(listening),
        record=rec,
        hosts=hosts,
    )


def record_rank(state: Path, rank: int, pid: int, restarts: int) -> None:
    """The engine restarted ``rank`` as ``pid``: record it so `status` and `down` know the new process."""
    with _locked(state):
        rec = read_record(state)
        if rec is None:
            return
        ranks = tuple(
            RankRecord(pid, services.start_ticks(pid), rank, r.device, restarts) if r.rank == rank else r
            for r in rec.ranks
        )
        _write_record(state, replace(rec, ranks=ranks))


def _hosts_check(opts: EngineOptions) -> None:
    """Refuse a multi-host engine this machine cannot build, before anything starts."""
    if opts.hosts not in ("local", netns.MODE):
        raise InvalidInput(f"unknown --hosts {opts.hosts!r}", hint="use local or netns")
    if opts.hosts == netns.MODE:
        if not opts.remote:
            raise InvalidInput(
                "--hosts netns places the Mooncake services on hosts of their own: drop --no-remote",
                hint="drop --no-remote: with --hosts netns the Mooncake services are the remote tier",
            )
        why = netns.unavailable()
        if why:
            raise ServiceError(
                f"cannot run --hosts netns: {why}",
                hint="run without --hosts netns, or on a host that allows network namespaces (root or CAP_NET_ADMIN)",
            )
    elif opts.link_rate_bps is not None:
        raise InvalidInput(
            "--link-rate caps the links between hosts: it needs --hosts netns",
            hint="add --hosts netns, or drop --link-rate",
        )


def _differences(running: RecordedOptions | None, wanted: RecordedOptions) -> list[str]:
    if running is None:
        return ["the running engine recorded no options (started by an older bsr)"]
    have_all = running.to_wire()
    out = []
    for key, want in wanted.to_wire().items():
        have = have_all.get(key)
        if key == "port" and want == 0:
            continue  # 0 asks for any free port: whatever it got matches
        if have != want:
            out.append(f"{key} {have!r} → {want!r}")
    return out


def up(state: Path, opts: EngineOptions, *, restart: bool = False) -> EngineStatus:
    """Start the engine in ``state``. A healthy engine started with the same options is reported, not restarted;
    one started with different options is refused (it would silently keep its old ones) unless ``restart``."""
    settings = opts.resolved()
    _hosts_check(opts)
    wanted = RecordedOptions.of(opts, settings)
    with _private(), _locked(state):
        make_private(state)
        current = status(state)
        if current.healthy:
            diff = _differences(current.record.options if current.record else None, wanted)
            if not diff:
                return replace(current, already_running=True)
            if not restart:
                raise InvalidInput(
                    f"an engine is already running in {state} with other options: {'; '.join(diff)}",
                    hint="add --restart to stop it and start one with these options, or `bsr engine down` first",
                )
        if current.running or read_state(state):
            _down_locked(state)
        logs = state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        token_path = _write_token(state)
        rec = EngineRecord(started_at=time.time())
        starting = _Starting(state, rec)
        try:
            mooncake, hosts = _start_store(state, opts, settings, starting, logs)
            _write_json(state / "engine.json", _engine_config(state, opts, settings, mooncake, hosts))
            ready = _start_engine_process(state, starting, logs)
            restored = ready.restored or Restored()
            starting.record = replace(
                starting.record,
                ranks=tuple(RankRecord(r.pid, services.start_ticks(r.pid), r.rank, r.device) for r in ready.ranks),
                restored=restored,
                admin_url=ready.url,
                settings=settings,
                options=wanted,
                registration_identity=opts.registration.identity,
                logs=str(logs),
            )
            _write_record(state, starting.record)
        except BaseException:
            _write_record(state, starting.record)
            _down_locked(state)
            raise
        return replace(status(state), already_running=False, token_file=str(token_path), restored=restored.lines)


class _Starting:
    """The record of an engine being started, written after each part starts so a failed start stops it."""

    def __init__(self, state: Path, record: EngineRecord) -> None:
        self.state, self.record = state, record

    def add(self, **changes: Any) -> None:
        self.record = replace(self.record, **changes)
        _write_record(self.state, self.record)

    def add_service(self, name: str, service: ServiceRecord) -> None:
        self.add(services=self.record.services | {name: service})


def _write_token(state: Path) -> Path:
    """A fresh admin bearer token, owner-only."""
    token_path = state / "token"
    token_path.touch(mode=0o600)
    token_path.chmod(0o600)
    token_path.write_text(secrets.token_urlsafe(32) + "\n")
    return token_path


def _in_place(fn: Callable[[], Any]) -> Any:
    return fn()


@dataclass(frozen=True)
class _Placement:
    """Where a Mooncake service runs: its address, and how to start and probe it there (a multi-host engine's
    service in its own network namespace; by default here, on loopback)."""

    host: str = services.LOOPBACK
    exec_prefix: tuple[str, ...] = ()
    probe_in: services.ProbeIn = _in_place


def _start_store(
    state: Path, opts: EngineOptions, settings: ResolvedSettings, starting: _Starting, logs: Path
) -> tuple[MooncakeEndpoints | None, StoreHosts | None]:
    """The network namespaces (with --hosts netns), then the Mooncake master and segment holder (unless
    --no-remote), each recorded as it starts so a failed start stops it. Returns the engine's Mooncake endpoints and,
    with --hosts netns, its hosts."""
    placed = {netns.MASTER: _Placement(), netns.HOLDER: _Placement()}
    topo: netns.Topology | None = None
    if opts.hosts == netns.MODE:
        topo = netns.Topology.plan(netns.prefix_for(state), opts.registration.tp_size, opts.link_rate_bps)
        starting.add(netns=topo)  # recorded first: `down` removes it even if the start fails below
        netns.create(topo)
        for node in (netns.MASTER, netns.HOLDER):
            ns = topo.netns(node)
            placed[node] = _Placement(
                topo.address(node), tuple(netns.exec_argv(ns)), functools.partial(netns.call_in, ns)
            )
    if not opts.remote:
        return None, None
    pm, ph = placed[netns.MASTER], placed[netns.HOLDER]
    master = services.start_master(
        logs,
        host=pm.host,
        exec_prefix=pm.exec_prefix,
        probe_in=pm.probe_in,
        client_ttl_s=settings.store_client_ttl_s,
    )
    starting.add_service(
        "mooncake_master", ServiceRecord(master.pid, services.start_ticks(master.pid), master.urls, master.log_path)
    )
    seg = services.start_segment_holder(
        logs, master, settings.segment_bytes, host=ph.host, exec_prefix=ph.exec_prefix, probe_in=ph.probe_in
    )
    starting.add_service(
        "segment_holder", ServiceRecord(seg.pid, services.start_ticks(seg.pid), seg.urls, seg.log_path)
    )
    mooncake = MooncakeEndpoints(master.rpc_address, master.metadata_url, master.health_url, master.admin_url)
    hosts = None
    if topo is not None:
        hosts = StoreHosts(topo, StoreAddresses(master.rpc_address, f"{ph.host}:{seg.ports['service']}"))
    return mooncake, hosts


def _engine_config(
    state: Path,
    opts: EngineOptions,
    settings: ResolvedSettings,
    mooncake: MooncakeEndpoints | None,
    hosts: StoreHosts | None,
) -> EngineConfig:
    """engine.json: everything the engine process (bsr_cli.engine.server) is built from."""
    return EngineConfig(
        registration=opts.registration,
        settings=EngineSettings(
            w=settings.w,
            pool_bytes=settings.pool_bytes,
            budget_bytes=settings.budget_bytes,
            max_tokens=settings.max_tokens,
            kv_tokens=settings.kv_tokens,
            faults_enabled=settings.faults_enabled,
            fs_concurrency=settings.fs_concurrency,
            fetch_timeout_s=settings.fetch_timeout_s,
            kv_wait_s=settings.kv_wait_s,
            overload_ceiling_s=settings.overload_ceiling_s,
            tiers=("mooncake", "fs") if opts.remote else ("fs",),
            scrub_after_failure=opts.scrub_after_failure,
        ),
        mooncake=mooncake,
        hosts=hosts,
        fs_dir=str(state / "fs-tier"),
        host=opts.host,
        port=opts.port,
        admin=AdminConfig(dict(opts.admin_limits or {}), tuple(sorted(opts.allowed_hosts)), opts.open_metrics),
        events=EventRetention(settings.event_retention_s, settings.event_store_bytes),
    )


def _start_engine_process(state: Path, starting: _Starting, logs: Path) -> EngineReady:
    """Start the engine process in a session of its own (it outlives the CLI) and wait until it serves."""
    (state / "ready.json").unlink(missing_ok=True)
    log_path = logs / "engine.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bsr_cli.engine.server", str(state)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            umask=PRIVATE_UMASK,
        )
    starting.add_service("engine", ServiceRecord(proc.pid, services.start_ticks(proc.pid), log=str(log_path)))
    return _wait_ready(state, proc, log_path)


def _wait_ready(state: Path, proc: subprocess.Popen[bytes], log_path: Path) -> EngineReady:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
            raise ServiceError(
                f"the engine exited during start-up (code {code}): {tail[0] if tail else 'no output'}",
                hint=f"see {log_path}",
            )
        written = _read_json(state / "ready.json")
        ready = EngineReady.from_wire(written) if written else None
        if ready is not None and _http_ok(ready.url + "/bsr/v1/health"):
            return ready
        time.sleep(0.2)
    raise ServiceError(f"the engine did not come up within {SERVER_START_TIMEOUT_S:.0f}s", hint=f"see {log_path}")


@dataclass(frozen=True)
class StoppedEngine:
    """`bsr engine down`: what it stopped, and the network namespaces it removed."""

    state_dir: str
    stopped: tuple[tuple[str, int], ...] = ()  # (name, pid)
    removed_netns: tuple[str, ...] = ()

    @property
    def was_running(self) -> bool:
        return bool(self.stopped)

    def to_wire(self) -> wire.JsonObject:
        out: wire.JsonObject = {
            "state_dir": self.state_dir,
            "stopped": [{"name": n, "pid": p} for n, p in self.stopped],
            "was_running": self.was_running,
        }
        return out | ({"removed_netns": list(self.removed_netns)} if self.removed_netns else {})


def down(state: Path) -> StoppedEngine:
    with _locked(state):
        return _down_locked(state)


def _down_locked(state: Path) -> StoppedEngine:
    rec = read_record(state)
    if rec is None:
        removed = netns.destroy(netns.prefix_for(state))  # left by a run that crashed before it recorded them
        return StoppedEngine(str(state), removed_netns=tuple(removed))
    stopped = []
    # Engine first (it stops its ranks), then any rank left behind, then the store's segment holder and master.
    order = ["engine", "rank", "segment_holder", "mooncake_master"]
    found = sorted(rec.processes(), key=lambda p: next((i for i, o in enumerate(order) if p[0].startswith(o)), 9))
    for name, pid, ticks in found:
        if services.is_alive(pid, ticks):
            services.stop(pid, timeout=15.0, start_ticks=ticks)
            stopped.append((name, pid))
    left = [n for n, p, t in found if services.is_alive(p, t)]
    if left:
        raise ServiceError(
            f"could not stop: {', '.join(left)}",
            hint="stop them by pid (`bsr engine status` lists them), then rerun `bsr engine down`",
        )
    # Then the namespaces, veths and qdiscs of a multi-host engine (this engine's prefix only; a crashed run's too).
    removed = netns.destroy(netns.prefix_for(state))
    for name in ("state.json", "ready.json", "engine.json", "token"):
        (state / name).unlink(missing_ok=True)
    return StoppedEngine(str(state), tuple(stopped), tuple(removed))


__all__ = [
    "EngineOptions",
    "EngineRecord",
    "EngineStatus",
    "ResolvedSettings",
    "StoppedEngine",
    "down",
    "read_record",
    "record_rank",
    "status",
    "up",
]
