"""`bsr engine up | down | status`: the embedded engine's services, in a state directory.

The state directory holds everything about one running engine: ``state.json`` (pids, ports, URLs), ``token``
(the admin bearer token, mode 0600), ``engine.json`` (the engine's configuration), ``ready.json`` (written by the
engine once it serves), logs, and the filesystem tier. ``up`` is idempotent (a healthy engine is reported, not
restarted; a half-dead one is cleaned up first) and ``down`` leaves nothing running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bsr_cli.client.local_engine import read_json as _read_json
from bsr_cli.client.local_engine import read_state
from bsr_cli.core import accounting, limits
from bsr_cli.core.registration import Registration
from bsr_cli.engine import netns
from bsr_cli.errors import CapacityError, InvalidInput, ServiceError
from bsr_cli.mooncake import services

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

    def resolved(self) -> dict[str, Any]:
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
        return {
            "w": self.w,
            "pool_bytes": pool,
            "budget_bytes": budget,
            "max_tokens": self.max_tokens,
            "kv_tokens": kv,
            "segment_bytes": segment,
            "faults_enabled": self.faults_enabled,
            "fs_concurrency": self.fs_concurrency,
            "fetch_timeout_s": self.fetch_timeout_s,
            "kv_wait_s": self.kv_wait_s,
            "event_retention_s": self.event_retention_s,
            "event_store_bytes": self.event_store_bytes,
        }


def _check_kv_wait(seconds: float) -> None:
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= MAX_KV_WAIT_S:
        # NaN fails the range test too.
        raise InvalidInput(
            f"{CLI_NAMES['kv_wait_s']} must be a number of seconds in [0, {MAX_KV_WAIT_S:.0f}], got {seconds!r}"
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _processes(st: dict[str, Any]) -> list[tuple[str, int, int | None]]:
    """(name, pid, start ticks) of every process the state file records. The start ticks make a pid that the
    kernel handed to another process after ours died read as dead, and keep `down` from signalling it."""

    def ticks(rec: dict[str, Any]) -> int | None:
        return None if rec.get("start_ticks") is None else int(rec["start_ticks"])

    out = [(name, int(svc["pid"]), ticks(svc)) for name, svc in st.get("services", {}).items()]
    out += [(f"rank{r['rank']}", int(r["pid"]), ticks(r)) for r in st.get("ranks", []) if r.get("pid")]
    return out


def _record(pid: int, **fields: Any) -> dict[str, Any]:
    return {"pid": pid, "start_ticks": services.start_ticks(pid)} | fields


def status(state: Path) -> dict[str, Any]:
    st = read_state(state)
    if st is None:
        return {
            "state_dir": str(state),
            "running": False,
            "healthy": False,
            "processes": [],
            "listening": [],
            "exposed": [],
        }
    found = _processes(st)
    restarts = {f"rank{r['rank']}": int(r.get("restarts") or 0) for r in st.get("ranks", [])}
    procs: list[dict[str, Any]] = []
    for n, p, t in found:
        proc: dict[str, Any] = {"name": n, "pid": p, "alive": services.is_alive(p, t)}
        if restarts.get(n):
            proc["restarts"] = restarts[n]
        procs.append(proc)
    healthy = all(p["alive"] for p in procs) and _http_ok(st["admin_url"] + "/bsr/v1/health")
    listening = services.listening_sockets((n, p) for n, p, t in found if services.is_alive(p, t))
    hosts: dict[str, Any] = {"mode": "local"}
    if st.get("netns"):
        topo = netns.Topology.from_dict(st["netns"])
        hosts = {
            "mode": netns.MODE,
            "namespaces": [topo.netns(n) for n in topo.nodes],
            "link_rate_bps": topo.rate_bps,
            "links": netns.link_states(topo),
        }
    return {
        "state_dir": str(state),
        "running": any(p["alive"] for p in procs),
        "hosts": hosts,
        "healthy": healthy,
        "admin_url": st["admin_url"],
        "processes": procs,
        "started_at": st.get("started_at"),
        "settings": st.get("settings"),
        "registration": st.get("registration_identity"),
        "logs": st.get("logs"),
        "listening": listening,
        "exposed": [d for d in listening if d["exposed"]],
    }


def record_rank(state: Path, rank: int, pid: int, restarts: int) -> None:
    """The engine restarted ``rank`` as ``pid``: record it so `status` and `down` know the new process."""
    with _locked(state):
        st = read_state(state)
        if st is None:
            return
        for rec in st.get("ranks", []):
            if rec.get("rank") == rank:
                rec.update(_record(pid, rank=rank, device=rec.get("device"), restarts=restarts))
        _write_json(state / "state.json", st)


def _options_record(opts: EngineOptions, settings: dict[str, Any]) -> dict[str, Any]:
    """What decides an engine's behaviour, as recorded in state.json: compared when `up` finds one running."""
    return {
        **settings,
        "registration": opts.registration.identity,
        "host": opts.host,
        "port": opts.port,
        "remote": opts.remote,
        "allowed_hosts": sorted(opts.allowed_hosts),
        "open_metrics": opts.open_metrics,
        "hosts": opts.hosts,
        "link_rate_bps": opts.link_rate_bps,
    }


def _hosts_check(opts: EngineOptions) -> None:
    """Refuse a multi-host engine this machine cannot build, before anything starts."""
    if opts.hosts not in ("local", netns.MODE):
        raise InvalidInput(f"unknown --hosts {opts.hosts!r}", hint="use local or netns")
    if opts.hosts == netns.MODE:
        if not opts.remote:
            raise InvalidInput("--hosts netns places the Mooncake services on hosts of their own: drop --no-remote")
        why = netns.unavailable()
        if why:
            raise ServiceError(f"cannot run --hosts netns: {why}")
    elif opts.link_rate_bps is not None:
        raise InvalidInput("--link-rate caps the links between hosts: it needs --hosts netns")


def _differences(running: dict[str, Any] | None, wanted: dict[str, Any]) -> list[str]:
    if running is None:
        return ["the running engine recorded no options (started by an older bsr)"]
    out = []
    for key, want in wanted.items():
        have = running.get(key)
        if key == "port" and want == 0:
            continue  # 0 asks for any free port: whatever it got matches
        if have != want:
            out.append(f"{key} {have!r} → {want!r}")
    return out


def up(state: Path, opts: EngineOptions, *, restart: bool = False) -> dict[str, Any]:
    """Start the engine in ``state``. A healthy engine started with the same options is reported, not restarted;
    one started with different options is refused (it would silently keep its old ones) unless ``restart``."""
    settings = opts.resolved()
    _hosts_check(opts)
    wanted = _options_record(opts, settings)
    with _private(), _locked(state):
        make_private(state)
        current = status(state)
        if current["healthy"]:
            diff = _differences((read_state(state) or {}).get("options"), wanted)
            if not diff:
                return current | {"already_running": True}
            if not restart:
                raise InvalidInput(
                    f"an engine is already running in {state} with other options: {'; '.join(diff)}",
                    hint="add --restart to stop it and start one with these options, or `bsr engine down` first",
                )
        if current["running"] or read_state(state):
            _down_locked(state)
        logs = state / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        token_path = _write_token(state)
        st: dict[str, Any] = {"services": {}, "ranks": [], "started_at": time.time()}
        try:
            mooncake, hosts = _start_store(state, opts, settings, st, logs)
            _write_json(state / "engine.json", _engine_config(state, opts, settings, mooncake, hosts))
            ready = _start_engine_process(state, st, logs)
            st["ranks"] = [_record(r["pid"], rank=r["rank"], device=r.get("device")) for r in ready["ranks"]]
            st["restored"] = ready.get("restored") or {}
            st["admin_url"] = ready["url"]
            st["settings"] = settings
            st["options"] = wanted
            st["registration_identity"] = opts.registration.identity
            st["logs"] = str(logs)
            _write_json(state / "state.json", st)
        except BaseException:
            _write_json(state / "state.json", st | {"admin_url": st.get("admin_url", "")})
            _down_locked(state)
            raise
        return status(state) | {
            "already_running": False,
            "token_file": str(token_path),
            "restored": (ready.get("restored") or {}).get("lines") or [],
        }


def _write_token(state: Path) -> Path:
    """A fresh admin bearer token, owner-only."""
    token_path = state / "token"
    token_path.touch(mode=0o600)
    token_path.chmod(0o600)
    token_path.write_text(secrets.token_urlsafe(32) + "\n")
    return token_path


def _start_store(
    state: Path, opts: EngineOptions, settings: dict[str, Any], st: dict[str, Any], logs: Path
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The network namespaces (with --hosts netns), then the Mooncake master and segment holder (unless
    --no-remote), each recorded in ``st`` as it starts so a failed start stops it. Returns the engine's Mooncake
    endpoints and, with --hosts netns, its hosts."""
    placed: dict[str, dict[str, Any]] = {"master": {}, "holder": {}}
    if opts.hosts == netns.MODE:
        topo = netns.Topology.plan(netns.prefix_for(state), opts.registration.tp_size, opts.link_rate_bps)
        st["netns"] = topo.to_dict()  # recorded first: `down` removes it even if the start fails below
        _write_json(state / "state.json", st | {"admin_url": ""})
        netns.create(topo)
        for node in (netns.MASTER, netns.HOLDER):
            ns = topo.netns(node)
            placed[node] = {
                "host": topo.address(node),
                "exec_prefix": netns.exec_argv(ns),
                "probe_in": lambda fn, ns=ns: netns.call_in(ns, fn),
            }
    if not opts.remote:
        return None, None
    master = services.start_master(logs, **placed["master"])
    st["services"]["mooncake_master"] = _record(master.pid, urls=master.urls, log=master.log_path)
    _write_json(state / "state.json", st | {"admin_url": ""})
    seg = services.start_segment_holder(logs, master, settings["segment_bytes"], **placed["holder"])
    st["services"]["segment_holder"] = _record(seg.pid, urls=seg.urls, log=seg.log_path)
    mooncake = {
        "master_address": master.rpc_address,
        "metadata_url": master.metadata_url,
        "health_url": master.health_url,
        "admin_url": master.admin_url,
    }
    hosts = None
    if "netns" in st:
        holder = f"{placed['holder']['host']}:{seg.ports['service']}"
        hosts = {"topology": st["netns"], "endpoints": {"master": master.rpc_address, "holder": holder}}
    return mooncake, hosts


# The resolved settings the engine process runs with (engine.json's "settings": the runtime's EngineSettings).
_ENGINE_SETTINGS = (
    "w",
    "pool_bytes",
    "budget_bytes",
    "max_tokens",
    "kv_tokens",
    "faults_enabled",
    "fs_concurrency",
    "fetch_timeout_s",
    "kv_wait_s",
)


def _engine_config(
    state: Path,
    opts: EngineOptions,
    settings: dict[str, Any],
    mooncake: dict[str, Any] | None,
    hosts: dict[str, Any] | None,
) -> dict[str, Any]:
    """engine.json: everything the engine process (bsr_cli.engine.server) is built from."""
    return {
        "registration": opts.registration.to_dict(),
        "settings": {k: settings[k] for k in _ENGINE_SETTINGS}
        | {"tiers": ("mooncake", "fs") if opts.remote else ("fs",)},
        "mooncake": mooncake,
        "hosts": hosts,
        "fs_dir": str(state / "fs-tier"),
        "host": opts.host,
        "port": opts.port,
        "admin": (opts.admin_limits or {})
        | {"allowed_hosts": sorted(opts.allowed_hosts), "open_metrics": opts.open_metrics},
        "events": {"max_age_s": settings["event_retention_s"], "max_bytes": settings["event_store_bytes"]},
    }


def _start_engine_process(state: Path, st: dict[str, Any], logs: Path) -> dict[str, Any]:
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
    st["services"]["engine"] = _record(proc.pid, log=str(log_path))
    _write_json(state / "state.json", st | {"admin_url": ""})
    return _wait_ready(state, proc, log_path)


def _wait_ready(state: Path, proc: subprocess.Popen[bytes], log_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
            raise ServiceError(
                f"the engine exited during start-up (code {code}): {tail[0] if tail else 'no output'}",
                hint=f"see {log_path}",
            )
        ready = _read_json(state / "ready.json")
        if ready and _http_ok(ready["url"] + "/bsr/v1/health"):
            return ready
        time.sleep(0.2)
    raise ServiceError(f"the engine did not come up within {SERVER_START_TIMEOUT_S:.0f}s", hint=f"see {log_path}")


def down(state: Path) -> dict[str, Any]:
    with _locked(state):
        return _down_locked(state)


def _down_locked(state: Path) -> dict[str, Any]:
    st = read_state(state)
    if st is None:
        removed = netns.destroy(netns.prefix_for(state))  # left by a run that crashed before it recorded them
        return {"state_dir": str(state), "stopped": [], "was_running": False} | (
            {"removed_netns": removed} if removed else {}
        )
    stopped = []
    # Engine first (it stops its ranks), then any rank left behind, then the store's segment holder and master.
    order = ["engine", "rank", "segment_holder", "mooncake_master"]
    found = sorted(_processes(st), key=lambda p: next((i for i, o in enumerate(order) if p[0].startswith(o)), 9))
    for name, pid, ticks in found:
        if services.is_alive(pid, ticks):
            services.stop(pid, timeout=15.0, start_ticks=ticks)
            stopped.append({"name": name, "pid": pid})
    left = [n for n, p, t in found if services.is_alive(p, t)]
    if left:
        raise ServiceError(f"could not stop: {', '.join(left)}")
    # Then the namespaces, veths and qdiscs of a multi-host engine (this engine's prefix only; a crashed run's too).
    removed = netns.destroy(netns.prefix_for(state))
    for name in ("state.json", "ready.json", "engine.json", "token"):
        (state / name).unlink(missing_ok=True)
    out = {"state_dir": str(state), "stopped": stopped, "was_running": bool(stopped)}
    return out | ({"removed_netns": removed} if removed else {})


__all__ = ["EngineOptions", "down", "record_rank", "status", "up"]
