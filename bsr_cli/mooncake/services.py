"""Start, probe and stop the real Mooncake services on loopback.

Two services: ``mooncake_master`` (with its embedded HTTP metadata server, so no etcd is needed) and a segment
holder (the wheel's ``mooncake_client``), the process that contributes the memory segment objects live in.
Clients that only read and write (``MooncakeTier``) hold no data themselves.

Services are spawned in their own session so they outlive the CLI that started them; a `ServiceHandle` is plain
data (saved in the engine's state file) and `stop` works from it in a later process. Every wait has a deadline.
Only the standard library is used: the CLI imports this module on its start-up path.

Over 500 lines on purpose: handles, liveness, stop and the two launchers share one rule (a pid counts only with
its start time, and only when it owns the ports it should), which is easiest to check in one place.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bsr_cli.core import wire
from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S, check_client_ttl
from bsr_cli.errors import ServiceError
from bsr_cli.mooncake.health import master_healthy, segments

LOOPBACK = "127.0.0.1"
MASTER_BINARY = "mooncake_master"
SEGMENT_HOLDER_BINARY = "mooncake_client"

_IBVERBS = "libibverbs.so.1"
_IBVERBS_HINT = "install it with `apt-get install -y libibverbs1` (Mooncake loads it even for TCP)"
# No proxy for loopback probes: an http_proxy in the environment would otherwise swallow them.
_POLL_S = 0.05


# --------------------------------------------------------------------------------------------- ports


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it; another process may still take it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct free ports: all sockets are held open together, so the OS cannot hand out one twice."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class MasterPorts:
    rpc: int
    http_metadata: int
    metrics: int

    @classmethod
    def pick(cls) -> MasterPorts:
        rpc, http, metrics = free_ports(3)
        return cls(rpc=rpc, http_metadata=http, metrics=metrics)


# --------------------------------------------------------------------------------------------- handles


@dataclass
class ServiceHandle:
    """A started service. JSON-serialisable (`to_wire` / `from_wire`) so it can live in a state file.

    ``start_ticks`` is the process start time from /proc (clock ticks since boot); `is_alive` and `stop` compare
    it so that a recycled pid is never mistaken for (or killed as) the service."""

    kind: str  # "master" | "segment"
    pid: int
    argv: list[str]
    log_path: str
    ports: dict[str, int]
    urls: dict[str, str]
    info: dict[str, str] = field(default_factory=dict)
    start_ticks: int | None = None
    started_at: float = 0.0

    to_wire = wire.writer()
    from_wire = wire.reader()

    # Convenience accessors (KeyError on a handle of the wrong kind is a programming error).
    @property
    def rpc_address(self) -> str:
        return self.urls["rpc_address"]

    @property
    def metadata_url(self) -> str:
        return self.urls["metadata_url"]

    @property
    def health_url(self) -> str:
        return self.urls["health_url"]

    @property
    def admin_url(self) -> str:
        return self.urls["admin_url"]


# --------------------------------------------------------------------------------------------- binaries


def check_native_deps() -> None:
    """Raise ServiceError when the shared library every Mooncake binary and module needs is missing."""
    try:
        ctypes.CDLL(_IBVERBS)
    except OSError as exc:
        raise ServiceError(f"{_IBVERBS} is missing, so Mooncake cannot load", hint=_IBVERBS_HINT) from exc


def find_binary(name: str) -> Path:
    """Locate a Mooncake binary: the real executable inside the installed ``mooncake`` package first (the venv's
    ``bin/`` entry is a Python wrapper that only exec()s it, costing an interpreter start), then next to
    ``sys.executable``, then on PATH."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(Path(location) / name)
    candidates.append(Path(sys.executable).parent / name)
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            check_native_deps()
            return path
    raise ServiceError(
        f"{name} not found (looked in the mooncake package, {Path(sys.executable).parent} and PATH)",
        hint="install the engine extra: pip install 'bsr[engine]' (mooncake-transfer-engine-non-cuda)",
    )


# --------------------------------------------------------------------------------------------- processes


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        with contextlib.suppress(OSError):
            target = os.readlink(f"{fd_dir}/{name}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _hex_address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (/proc/net/tcp, host byte order words) → ("127.0.0.1", 8080); IPv6 likewise."""
    addr_hex, port_hex = text.split(":")
    raw = bytes.fromhex(addr_hex)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port_hex, 16)


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127.")


@dataclass(frozen=True)
class ListeningSocket:
    """A TCP socket in LISTEN state and the process holding it; ``exposed`` when bound beyond loopback."""

    process: str
    pid: int
    address: str
    port: int
    exposed: bool


def listening_sockets(processes: Iterable[tuple[str, int]]) -> list[ListeningSocket]:
    """TCP sockets in LISTEN state held by the given (name, pid) processes, read from /proc (Linux only; empty
    elsewhere). ``exposed`` marks those bound beyond loopback (a wildcard address included)."""
    owners: dict[int, tuple[str, int]] = {}
    for name, pid in processes:
        for inode in _socket_inodes(pid):
            owners.setdefault(inode, (name, pid))
    out: list[ListeningSocket] = []
    if not owners:
        return out
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":  # 0A = LISTEN
                continue
            inode = int(f[9])
            if inode not in owners:
                continue
            address, port = _hex_address(f[1])
            name, pid = owners[inode]
            out.append(ListeningSocket(name, pid, address, port, exposed=not _is_loopback(address)))
    return sorted(out, key=lambda s: (s.process, s.port, s.address))


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state first), or None if unreadable."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """The process start time (clock ticks since boot): with the pid, it names one process for good."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None  # field 22: starttime


def _reap(pid: int) -> None:
    """Collect the exit status if `pid` is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def is_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when `start_ticks` is given, is still the same process."""
    if pid <= 0:
        return False
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _proc_stat(pid)
    if fields is None:
        return sys.platform != "linux"  # no /proc: trust kill(0)
    if fields[0] in ("Z", "X"):
        _reap(pid)  # exited between the two checks: collect it now
        return False
    return start_ticks is None or (len(fields) > 19 and int(fields[19]) == start_ticks)


def stop(target: ServiceHandle | int, timeout: float = 10.0, *, start_ticks: int | None = None) -> bool:
    """SIGTERM the service (its whole process group when it leads one), wait up to `timeout`, then SIGKILL.
    Returns True when the process is gone. A pid whose start time no longer matches the handle's (or the given
    `start_ticks`) is left alone: it is another process that reused the pid."""
    if isinstance(target, ServiceHandle):
        pid, ticks = target.pid, target.start_ticks
    else:
        pid, ticks = int(target), start_ticks
    if not is_alive(pid, ticks):
        return True

    def _signal(sig: int) -> None:
        try:
            if os.getpgid(pid) == pid:  # session/group leader (we spawn services with setsid)
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        _signal(sig)
        deadline = time.monotonic() + max(wait_s, 0.0)
        while time.monotonic() < deadline:
            if not is_alive(pid, ticks):
                _reap_exited(pid, 1.0)
                return True
            time.sleep(_POLL_S)
    return not is_alive(pid, ticks)


def _reap_exited(pid: int, timeout: float) -> None:
    """A multi-threaded process shows as a zombie before its last thread is gone and only then can be reaped;
    give our own child that moment so it does not outlive us as <defunct>."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not our child, or already reaped
        if done:
            return
        time.sleep(0.01)


def _spawn(argv: list[str], log_path: Path, env_updates: dict[str, str] | None = None) -> int:
    """Start `argv` detached (new session, stdin from /dev/null, stdout+stderr appended to `log_path`).
    posix_spawn rather than subprocess.Popen: no Popen object to warn about a still-running child on exit."""
    env = dict(os.environ)
    env.update(env_updates or {})
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        return os.posix_spawn(argv[0], argv, env, file_actions=file_actions, setsid=True)
    except OSError as exc:
        raise ServiceError(
            f"could not start {Path(argv[0]).name}: {exc}",
            hint="is Mooncake installed in this environment? ./scripts/setup installs it",
        ) from exc


def _exit_status(pid: int) -> int | None:
    """The exit code if our child `pid` has exited (reaping it), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None if is_alive(pid) else -1
    if done == 0:
        return None
    return os.waitstatus_to_exitcode(status)


def _log_tail(path: Path, offset: int, lines: int = 20) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def _last_error(tail: list[str]) -> str:
    """The most telling log line: the last glog FATAL/ERROR line, else the last line."""
    for line in reversed(tail):
        if line[:1] in ("F", "E") and re.match(r"^[FE]\d{4} ", line):
            return line
        if "error while loading shared libraries" in line:
            return line
    return tail[-1] if tail else "(log is empty)"


def _startup_error(what: str, why: str, log_path: Path, offset: int) -> ServiceError:
    tail = _log_tail(log_path, offset)
    last = _last_error(tail)
    hint = f"see {log_path}"
    if _IBVERBS in last:
        hint = _IBVERBS_HINT
    err = ServiceError(f"{what} {why}: {last}", hint=hint)
    err.log_tail = tail  # type: ignore[attr-defined]
    return err


def _listening_ports(pid: int) -> set[int] | None:
    """TCP ports `pid` listens on (from /proc), or None where /proc cannot tell. Used to be sure a healthy port
    belongs to *our* process and not to another service that happened to grab it."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    except OSError:
        return None
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _owns_ports(pid: int, ports: Iterable[int]) -> bool:
    listening = _listening_ports(pid)
    return listening is None or set(ports) <= listening


# --------------------------------------------------------------------------------------------- services

# Where a service runs on another (network) host than the caller: ``host`` is the address it binds and advertises,
# ``exec_prefix`` the argv that runs it there (e.g. `ip netns exec NAME`), and ``probe_in`` runs the caller's health
# probes from a place that reaches it (e.g. a thread inside that network namespace). Defaults: loopback, here.
ProbeIn = Callable[[Callable[[], Any]], Any]


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


def _master_ready(ports: MasterPorts, pid: int, host: str = LOOPBACK, probe_in: ProbeIn = _here) -> bool:
    if not probe_in(lambda: master_healthy(f"http://{host}:{ports.http_metadata}/health", timeout=0.5)):
        return False
    if not probe_in(lambda: master_healthy(f"http://{host}:{ports.metrics}/health", timeout=0.5)):
        return False  # the admin server (and the RPC service) come up ~1 s after the metadata server
    return _owns_ports(pid, (ports.rpc, ports.http_metadata, ports.metrics))


def start_master(
    state_dir: str | os.PathLike[str],
    ports: MasterPorts | None = None,
    *,
    deadline_s: float = 20.0,
    extra_args: Iterable[str] = (),
    attempts: int = 3,
    host: str = LOOPBACK,
    exec_prefix: Sequence[str] = (),
    probe_in: ProbeIn = _here,
    client_ttl_s: int = DEFAULT_STORE_CLIENT_TTL_S,
) -> ServiceHandle:
    """Start ``mooncake_master`` on loopback with its HTTP metadata server and wait until it is healthy.

    ``client_ttl_s`` is how long the master keeps a silent client before it unmounts its segment (see
    ``core.limits.DEFAULT_STORE_CLIENT_TTL_S``). With ``ports=None`` free ports are picked, and a start that dies
    at once (a port taken in between) is retried on new ports up to `attempts` times. Note: this Mooncake version
    binds the metadata HTTP port on 0.0.0.0 even with a 127.0.0.1 host; the RPC and admin ports honour 127.0.0.1.
    Raises
    ServiceError (with the log tail in ``.log_tail``)."""
    check_client_ttl(client_ttl_s)
    binary = find_binary(MASTER_BINARY)
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    last_error: ServiceError | None = None
    for attempt in range(max(attempts, 1) if ports is None else 1):
        p = ports or MasterPorts.pick()
        log_path = state / f"mooncake_master-{p.rpc}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [*exec_prefix, *_master_args(binary, p, host, client_ttl_s), *extra_args]
        started = time.time()
        pid = _spawn(argv, log_path)
        ticks = start_ticks(pid)
        last_error = _wait_for_master(pid, p, host, probe_in, deadline_s, log_path, offset)
        if last_error is None:
            return ServiceHandle(
                kind="master",
                pid=pid,
                argv=argv,
                log_path=str(log_path),
                ports={"rpc": p.rpc, "http_metadata": p.http_metadata, "metrics": p.metrics},
                urls={
                    "rpc_address": f"{host}:{p.rpc}",
                    "metadata_url": f"http://{host}:{p.http_metadata}/metadata",
                    "health_url": f"http://{host}:{p.http_metadata}/health",
                    "admin_url": f"http://{host}:{p.metrics}",
                },
                info={"client_ttl_s": str(client_ttl_s)},
                start_ticks=ticks,
                started_at=started,
            )
        if attempt + 1 < attempts:
            time.sleep(0.1 * (attempt + 1))
    assert last_error is not None
    raise last_error


def _master_args(binary: Path, p: MasterPorts, host: str, client_ttl_s: int) -> list[str]:
    """``mooncake_master``'s command line: its RPC, HTTP metadata and metrics (admin) servers on `host`."""
    return [
        str(binary),
        f"--rpc_address={host}",
        f"--rpc_port={p.rpc}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={p.http_metadata}",
        f"--metrics_host={host}",
        f"--metrics_port={p.metrics}",
        f"--client_ttl={client_ttl_s}",
        "--logtostderr",
    ]


def _wait_for_master(
    pid: int, p: MasterPorts, host: str, probe_in: ProbeIn, deadline_s: float, log_path: Path, offset: int
) -> ServiceError | None:
    """Wait for the master just started as `pid` to be healthy on its ports: None once it is, the error to retry
    on when it exited during start-up (a port taken in between). One still unhealthy at the deadline is stopped
    and its error raised."""
    deadline = time.monotonic() + deadline_s
    while True:
        code = _exit_status(pid)
        if code is not None:
            return _startup_error("mooncake_master", f"exited with code {code} during start-up", log_path, offset)
        if _master_ready(p, pid, host, probe_in):
            return None
        if time.monotonic() >= deadline:
            stop(pid, timeout=2.0)
            raise _startup_error("mooncake_master", f"did not become healthy within {deadline_s:g} s", log_path, offset)
        time.sleep(_POLL_S)


_CLIENT_ID = re.compile(r"client_id=(\S+)")


def start_segment_holder(
    state_dir: str | os.PathLike[str],
    master: ServiceHandle,
    segment_bytes: int,
    *,
    port: int | None = None,
    protocol: str = "tcp",
    deadline_s: float = 20.0,
    host: str = LOOPBACK,
    exec_prefix: Sequence[str] = (),
    probe_in: ProbeIn = _here,
) -> ServiceHandle:
    """Start the wheel's ``mooncake_client`` as a standalone segment holder contributing `segment_bytes` to the
    store, and wait until the master lists its segment (matched by client id) as mounted."""
    if segment_bytes <= 0:
        raise ServiceError(
            f"segment size must be positive, got {segment_bytes}", hint="give a positive --segment-bytes, e.g. 4GiB"
        )
    binary = find_binary(SEGMENT_HOLDER_BINARY)
    state = Path(state_dir)
    state.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_path = state / f"mooncake_client-{port}.log"
    offset = log_path.stat().st_size if log_path.exists() else 0
    argv = [
        *exec_prefix,
        str(binary),
        f"--host={host}",
        f"--global_segment_size={segment_bytes}",
        f"--port={port}",
        f"--master_server_address={master.rpc_address}",
        f"--metadata_server={master.metadata_url}",
        f"--protocol={protocol}",
        "--logtostderr",
    ]
    started = time.time()
    # Advertise the transfer endpoint on `host` (it would otherwise pick the first NIC's address).
    pid = _spawn(argv, log_path, {"MC_TCP_BIND_ADDRESS": host})
    ticks = start_ticks(pid)
    deadline = time.monotonic() + deadline_s
    client_id: str | None = None
    while True:
        code = _exit_status(pid)
        if code is not None:
            raise _startup_error("mooncake_client", f"exited with code {code} during start-up", log_path, offset)
        if client_id is None:
            match = _CLIENT_ID.search("\n".join(_log_tail(log_path, offset, lines=200)))
            client_id = match.group(1) if match else None
        if client_id is not None:
            with contextlib.suppress(ServiceError):
                for seg in probe_in(lambda: segments(master.admin_url, timeout=0.5)):
                    if seg.client_id == client_id and seg.mounted:
                        return ServiceHandle(
                            kind="segment",
                            pid=pid,
                            argv=argv,
                            log_path=str(log_path),
                            ports={"service": port},
                            urls={
                                "master_rpc_address": master.rpc_address,
                                "metadata_url": master.metadata_url,
                            },
                            info={
                                "segment_name": seg.segment_name,
                                "client_id": client_id,
                                "segment_bytes": str(segment_bytes if seg.size_bytes is None else seg.size_bytes),
                            },
                            start_ticks=ticks,
                            started_at=started,
                        )
        if time.monotonic() >= deadline:
            stop(pid, timeout=2.0)
            raise _startup_error(
                "mooncake_client", f"did not mount its segment within {deadline_s:g} s", log_path, offset
            )
        time.sleep(_POLL_S)
