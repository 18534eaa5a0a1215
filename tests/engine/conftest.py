"""Fixtures for the engine tests: real Mooncake services on free loopback ports, always torn down."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine.tmpfs import Tmpfs, mount_tmpfs

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


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """A 1 MiB tmpfs of this test's own."""
    fs = mount_tmpfs(tmp_path / "tmpfs", "1m")
    try:
        yield fs
    finally:
        fs.unmount()
