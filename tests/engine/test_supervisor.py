"""The supervisor's process records: a pid is only "ours" while its start time matches the one recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bsr_cli.engine import supervisor
from bsr_cli.mooncake import services


def _write_state(state: Path, pid: int, ticks: int | None) -> None:
    record = {
        "admin_url": "http://127.0.0.1:9",
        "ranks": [],
        "services": {"engine": {"pid": pid, "start_ticks": ticks}},
    }
    (state / "state.json").write_text(json.dumps(record))


def test_a_pid_reused_by_another_process_reads_dead_and_is_never_signalled(tmp_path: Path) -> None:
    # Stands in for the process that got the engine's pid after the engine died: same pid, other start time.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ticks = services.start_ticks(other.pid)
        assert ticks is not None
        _write_state(tmp_path, other.pid, ticks + 1)
        st = supervisor.status(tmp_path)
        assert st.processes == (supervisor.ProcessState("engine", other.pid, alive=False),)
        assert st.running is False
        down = supervisor.down(tmp_path)
        assert down.stopped == () and other.poll() is None  # left alone

        # Control: recorded with its true start time, the same process is ours and `down` stops it.
        _write_state(tmp_path, other.pid, ticks)
        assert supervisor.status(tmp_path).processes[0].alive is True
        down = supervisor.down(tmp_path)
        assert [name for name, _pid in down.stopped] == ["engine"]
        assert other.wait(timeout=30) is not None
    finally:
        other.kill()
        other.wait(timeout=30)
