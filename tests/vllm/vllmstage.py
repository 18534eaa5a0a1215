"""Helpers of the real-vLLM stage (tests/vllm).

The real-vLLM stage: vLLM's CPU build with LMCache 0.5.6 and bsr's plugins, in real processes.

Run by scripts/test-vllm (its own venv, .venv-vllm); everything here skips where vLLM is not installed (the main
venv). Each test configuration runs tests/vllm/driver.py once in a subprocess (one vLLM start-up, several
scenarios) with its own temp dirs (VLLM_RPC_BASE_PATH, TMPDIR, LMCache's disk tier, bsr's event file) and hard
deadlines, one per phase: vLLM's start-up (up to STARTUP_TIMEOUT_S: it took 40 s alone and 154 s beside the main
suite), the scenarios from then on (DRIVER_TIMEOUT_S), and vLLM's exit after the result (EXIT_GRACE_S). The
driver's whole process group is killed when one runs out, and always at the end.

The lmcache_cpu plugin reaches vLLM's processes through vLLM's general-plugin entry point; bsr's plugins are not an
installed distribution in that venv, so the session writes the entry point's metadata (what ``pip install
./plugins`` would register) into a temp dir on the drivers' PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

# The lines driver.py prints: when vLLM is up, as each scenario starts, and its result.
from driver import READY_PREFIX, RESULT_PREFIX, SCENARIO_PREFIX

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
CHUNK = 128  # LMCache chunk: two vLLM blocks of 64
BLOCK = 64
STARTUP_TIMEOUT_S = float(os.environ.get("BSR_VLLM_STARTUP_TIMEOUT_S", "600"))
DRIVER_TIMEOUT_S = float(os.environ.get("BSR_VLLM_DRIVER_TIMEOUT_S", "240"))  # the scenarios, from vLLM up
EXIT_GRACE_S = 60.0  # vLLM's shutdown after the result line
# What one driver run may take in all: the stage's per-test timeout for a test that runs one (conftest.py).
DRIVER_BUDGET_S = STARTUP_TIMEOUT_S + DRIVER_TIMEOUT_S + EXIT_GRACE_S + 60


# Ports for the servers vLLM starts (bsr's admin API in each worker, `vllm serve`'s HTTP) are bound only once vLLM
# is up, tens of seconds after the test picks them. A port the kernel hands out (a bind to port 0) can meanwhile be
# handed to any other process asking for one, such as the other xdist worker's vLLM (its torch store, its Mooncake
# client): the worker's bind then fails (it logs "admin API for rank N not started") and the CLI talks to a listener
# that never answers. So the stage names its ports below the kernel's ephemeral range, where nobody is given a port
# without naming it, each xdist worker in a slice of its own, and checks that they are free when it picks them.
_PORT_FLOOR = 20000
_PORT_SLICE = 2000
_next_port: int | None = None  # this process's next candidate (one xdist worker per process)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(base: int, count: int) -> bool:
    import socket

    held: list[socket.socket] = []
    try:
        for port in range(base, base + count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in held:
            s.close()


def vllm_ports(count: int = 1) -> int:
    """A base port such that base .. base + count - 1 are free now (the BSR connector serves its admin API of TP
    rank r on ``bsr_admin_port + r``), from this xdist worker's slice below the ephemeral range (see above); never
    the same port twice in one session."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = _PORT_FLOOR + index * _PORT_SLICE
    high = low + _PORT_SLICE
    if high > _ephemeral_floor():
        raise RuntimeError(f"no port slice below the ephemeral range for xdist worker {worker}")
    global _next_port
    base = _next_port if _next_port is not None else low + os.getpid() % (_PORT_SLICE // 2)
    while base + count <= high:
        if _bindable(base, count):
            _next_port = base + count
            return base
        base += 1
    raise RuntimeError(f"no {count} consecutive free ports in {low}-{high - 1} on loopback")


def admin_port_failures(log: str) -> list[str]:
    """The lines where a worker could not start bsr's admin API (its port taken): the CLI would reach another
    listener, so a run that logs one is not the run the test meant."""
    return [ln for ln in log.splitlines() if "admin API for rank" in ln and "not started" in ln]


def chunk_prefix(tokens: int) -> int:
    """What LMCache stores of a prompt: its full chunks."""
    return tokens // CHUNK * CHUNK


def env_for(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
            "LMCACHE_TRACK_USAGE": "false",
            "LMCACHE_LOG_LEVEL": "INFO",  # LMCache's "Stored/Retrieved N tokens" lines, in the driver's log
            "PYTHONHASHSEED": "0",  # LMCache's chunk hashes must agree across vLLM's processes
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env


def lmcache_yaml(path: Path, disk: Path | None, master: Any = None) -> Path:
    lines = [f"chunk_size: {CHUNK}", "local_cpu: false", "max_local_cpu_size: 0.1", "blocking_timeout_secs: 10"]
    if disk is not None:
        lines += [f'local_disk: "file://{disk}/"', "max_local_disk_size: 0.2"]
    if master is not None:
        lines += [
            f'remote_url: "mooncakestore://{master.rpc_address}/"',
            'remote_serde: "naive"',
            "extra_config:",
            '  mooncake_local_hostname: "127.0.0.1"',
            f'  mooncake_metadata_server: "{master.metadata_url}"',
            f'  mooncake_master_server_addr: "{master.rpc_address}"',
            '  mooncake_protocol: "tcp"',
            "  mooncake_global_segment_size: 67108864",
            "  mooncake_local_buffer_size: 33554432",
            "  save_chunk_meta: false",
            "  transfer_timeout: 5",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


class Driver:
    """One driver run's inputs and, after ``run()``, its result, events and log."""

    def __init__(self, root: Path, model: Path, site: Path) -> None:
        self.root = root
        self.model = model
        self.site = site
        for d in ("rpc", "tmp", "disk"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.disk = root / "disk"
        self.events = root / "events.jsonl"
        self.log = root / "driver.log"

    def run(
        self, config: dict[str, Any], *, lmcache: Path, env: dict[str, str] | None = None, with_entry_point: bool = True
    ) -> dict[str, Any]:
        cfg = {"model": str(self.model), "block_size": BLOCK, **config}
        cfg_path = self.root / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        e = env_for(
            {
                "LMCACHE_CONFIG_FILE": str(lmcache),
                "VLLM_RPC_BASE_PATH": str(self.root / "rpc"),
                "TMPDIR": str(self.root / "tmp"),
                "BSR_VLLM_EVENTS": str(self.events),
                **(env or {}),
            }
        )
        if with_entry_point:
            e["PYTHONPATH"] = os.pathsep.join([str(self.site), e["PYTHONPATH"]])
        shm_before = vllm_segments()
        with self.log.open("wb") as logf:
            p = subprocess.Popen(
                [sys.executable, str(DRIVER), str(cfg_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=e,
                cwd=self.root,
                start_new_session=True,
            )
            run = _DriverRun(p, logf)
            try:
                if run.wait_for(READY_PREFIX, STARTUP_TIMEOUT_S) and run.wait_for(RESULT_PREFIX, DRIVER_TIMEOUT_S):
                    run.wait_for(_EXITED, EXIT_GRACE_S)
            finally:
                seen = run.snapshot()  # before the kill below, which ends the driver if it has not exited
                _kill_group(p)
                run.close()
                _remove_unmapped(vllm_segments() - shm_before)
        text = self.log.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
        if not lines:
            phase = "vLLM's start-up" if READY_PREFIX not in seen else "the scenarios"
            ended = f"rc {p.returncode}" if _EXITED in seen else f"killed at the deadline of {phase}"
            raise AssertionError(f"vLLM driver failed ({ended}); {failure_report(text)}")
        if _EXITED not in seen or p.returncode != 0:
            # The scenarios ran and their result is complete: what failed is vLLM's (or LMCache's) shutdown after it
            # (seen: LMCache's ZMQ offload server asserting as it closed, the engine core force-killed). Said, not
            # failed: the tests judge the result.
            warnings.warn(
                f"vLLM's exit after its result: {'rc ' + str(p.returncode) if _EXITED in seen else 'killed'}",
                stacklevel=2,
            )
        failed_admin = admin_port_failures(text)
        if failed_admin:
            raise AssertionError("a vLLM worker did not serve bsr's admin API:\n" + "\n".join(failed_admin))
        out: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
        out["by_name"] = {r["name"]: r for r in out["results"]}
        out["log"] = text
        return out


# What names a vLLM failure's cause, which the last lines of the log (the engine's shutdown) do not show: the
# scenario it was in, a worker's death and its exit code (vLLM: "Worker proc ... died unexpectedly (exit code: N)",
# "WorkerProc failed", "WorkerProc was terminated"), errors, and the tracebacks logged before the death.
_CAUSE_MARKERS = ("died unexpectedly", "WorkerProc", "Killed", "Segmentation fault", " ERROR ", "ERROR:", "Error:")


def failure_report(text: str, *, tail_lines: int = 40, traceback_lines: int = 30) -> str:
    lines = text.splitlines()
    scenarios = [ln[len(SCENARIO_PREFIX) :] for ln in lines if ln.startswith(SCENARIO_PREFIX)]
    causes = [ln for ln in lines if any(m in ln for m in _CAUSE_MARKERS)][:30]
    death = next((i for i, ln in enumerate(lines) if "died unexpectedly" in ln), len(lines))
    starts = [i for i, ln in enumerate(lines[:death]) if ln.lstrip().startswith("Traceback")][-3:]
    tracebacks = ["\n".join(lines[i : i + traceback_lines]) for i in starts]
    parts = [
        f"in scenario {scenarios[-1] if scenarios else '(none started: vLLM did not come up)'}",
        "cause lines:\n" + ("\n".join(causes) or "(none)"),
        "last tracebacks before a worker died (or the end):\n" + ("\n--\n".join(tracebacks) or "(none)"),
        "log tail:\n" + "\n".join(lines[-tail_lines:]),
    ]
    return "\n".join(parts)


SHM = Path("/dev/shm")
# vLLM's shared-memory segments: its CPU TP group's (vllm_dist_*) and its message queues' ring buffers
# (multiprocessing.shared_memory's default names, psm_*: 160-240 MiB each, left behind by a killed vLLM).
SHM_PATTERNS = ("vllm_dist_*", "psm_*")


def vllm_segments() -> set[Path]:
    return {p for pattern in SHM_PATTERNS for p in SHM.glob(pattern)}


def _remove_unmapped(paths: set[Path]) -> None:
    """vLLM leaves its shared-memory segments in /dev/shm when its processes are not shut down cleanly. Remove
    those that appeared during this run and that no live process maps (so never another vLLM's).

    Not in a pytest-xdist worker: there another worker's vLLM may have created a segment it has not mapped yet, so
    the stage's controller sweeps once, at the end, when no vLLM runs (conftest.py's pytest_sessionfinish)."""
    if not paths or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    mapped = ""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped += maps.read_text()
    for p in paths:
        if p.name not in mapped:
            with contextlib.suppress(OSError):
                p.unlink()


def remove_unmapped_since(before: set[Path]) -> None:
    """The sweep of ``_remove_unmapped`` over every segment that appeared since ``before``, in any worker."""
    _remove_unmapped(vllm_segments() - before)


_EXITED = "exited"  # the driver process ended (vLLM's processes may still be shutting down)


class _DriverRun:
    """The driver's output, copied to its log as it comes; what has been seen so far (the ready and result lines,
    the driver's exit), each waited for with a deadline and without polling."""

    def __init__(self, p: subprocess.Popen[bytes], logf: Any) -> None:
        self.p = p
        self.logf = logf
        self.seen: set[str] = set()
        self.cond = threading.Condition()
        self.threads = [
            threading.Thread(target=self._copy, daemon=True, name="driver-log"),
            threading.Thread(target=self._wait, daemon=True, name="driver-exit"),
        ]
        for t in self.threads:
            t.start()

    def _mark(self, what: str) -> None:
        with self.cond:
            self.seen.add(what)
            self.cond.notify_all()

    def _copy(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.logf.write(line)
            self.logf.flush()
            for prefix in (READY_PREFIX, RESULT_PREFIX):
                if line.startswith(prefix.encode()):
                    self._mark(prefix)

    def _wait(self) -> None:
        self.p.wait()
        self._mark(_EXITED)

    def snapshot(self) -> set[str]:
        with self.cond:
            return set(self.seen)

    def wait_for(self, what: str, timeout: float) -> bool:
        """True once ``what`` was seen; False at the deadline or when the driver exited without it."""
        with self.cond:
            self.cond.wait_for(lambda: what in self.seen or _EXITED in self.seen, timeout)
            return what in self.seen

    def close(self) -> None:
        """After the group was killed: the last of the output into the log (the pipe ends with the group)."""
        for t in self.threads:
            t.join(timeout=30)
        # A process that left the group could still hold the pipe: closing it under the reading thread would block
        # on the reader's lock, so then the pipe is left to that daemon thread.
        if self.p.stdout is not None and not any(t.is_alive() for t in self.threads):
            self.p.stdout.close()


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """The driver and everything vLLM started under it (EngineCore, workers)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=30)


def events_of(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in result.get("events", []) if e["event"] == kind]
