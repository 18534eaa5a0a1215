"""A real tmpfs for a full or read-only fs tier in tests (mounting needs root, which CI has)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


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
