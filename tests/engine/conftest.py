"""Fixtures for the engine tests: real Mooncake services on free loopback ports, always torn down."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bsr_cli.mooncake import services
from bsr_cli.mooncake.services import ServiceHandle

# Every service any engine test starts, so the session can prove at the end that none survived.
_STARTED: list[ServiceHandle] = []


class MooncakeStack:
    """A master plus one segment holder, started by `bsr_cli.mooncake.services`."""

    def __init__(self, state_dir: Path, segment_bytes: int) -> None:
        self.master = services.start_master(state_dir)
        _STARTED.append(self.master)
        try:
            self.holder = services.start_segment_holder(state_dir, self.master, segment_bytes)
        except BaseException:
            services.stop(self.master, timeout=5)
            raise
        _STARTED.append(self.holder)

    def stop(self) -> None:
        # Holder first: it would otherwise spend its shutdown retrying the gone master.
        services.stop(self.holder, timeout=5)
        services.stop(self.master, timeout=5)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_running() -> Iterator[None]:
    yield
    alive = [h for h in _STARTED if services.is_alive(h.pid, h.start_ticks)]
    for h in alive:
        services.stop(h, timeout=2)
    # Independent check through the process table: no mooncake process carrying one of our ports survives.
    leftovers = []
    for h in _STARTED:
        port = h.ports.get("rpc") or h.ports.get("service")
        flag = "--rpc_port" if h.kind == "master" else "--port"
        out = subprocess.run(["pgrep", "-fa", f"mooncake.*{flag}={port}( |$)"], capture_output=True, text=True)
        leftovers += [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert not alive, f"services still alive after the tests: {[h.pid for h in alive]}"
    assert not leftovers, f"mooncake processes left running: {leftovers}"


@pytest.fixture(scope="module")
def mooncake_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeStack]:
    pytest.importorskip("mooncake.store")
    stack = MooncakeStack(tmp_path_factory.mktemp("mooncake"), segment_bytes=512 << 20)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[MooncakeStack]:
    """A stack of its own, for tests that kill or freeze the master."""
    pytest.importorskip("mooncake.store")
    stack = MooncakeStack(tmp_path / "mooncake", segment_bytes=64 << 20)
    try:
        yield stack
    finally:
        stack.stop()


class Tmpfs:
    """A real tmpfs mounted at ``path`` (root only): fill it to make every write fail with ENOSPC, or remount it
    read-only for EROFS. Unmounted by the fixture that made it, whatever the test did."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        opts = f"size={size},mode=0700"
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, timeout=30)

    def fill(self) -> None:
        """Write zeros until the filesystem refuses: every later write, however small, fails with ENOSPC."""
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 16, 1):  # big blocks, then the last partial page
                try:
                    while True:
                        os.write(fd, bytes(size))
                except OSError:
                    pass
        finally:
            os.close(fd)

    def unfill(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)

    def remount(self, mode: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{mode}", str(self.path)], check=True, timeout=30)

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(self.path)], timeout=30)  # something still holds it: detach it


def mount_tmpfs(path: Path, size: str) -> Tmpfs:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs (CI runs as root): a full or read-only fs tier is made with one")
    try:
        return Tmpfs(path, size)
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}): a full or read-only fs tier is made with one")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """A 1 MiB tmpfs of this test's own."""
    fs = mount_tmpfs(tmp_path / "tmpfs", "1m")
    try:
        yield fs
    finally:
        fs.unmount()
