"""A real Prometheus server on loopback for the tests (Debian's `prometheus` package, installed by scripts/setup):
started from a configuration written into a directory of the test's own, waited for until it is ready, always
stopped."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (scripts/setup does)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(config: str, workdir: Path, *, port: int | None = None) -> Iterator[str]:
    """Prometheus with ``config`` (prometheus.yml, in ``workdir`` beside any rule files the test wrote there) on
    ``port`` (a free one when not given), once it answers /-/ready: its base URL. Stopped on the way out."""
    assert PROMETHEUS is not None
    port = port or free_port()
    (workdir / "prometheus.yml").write_text(config)
    log_path = workdir / "prometheus.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{base}/-/ready", timeout=5).status_code == 200:
                        break
                assert time.monotonic() < deadline, "prometheus not ready within 60 s"
                time.sleep(0.2)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
