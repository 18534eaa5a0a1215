"""The supervisor's process records: a pid is only "ours" while its start time matches the one recorded; state.json
reads back as any bsr wrote it and is written again byte for byte."""

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


# state.json as `bsr engine up` writes it (keys in this order; a key whose value is unknown is left out), for a
# multi-host engine whose rank 1 was restarted twice.
_SETTINGS = {
    "w": 32,
    "pool_bytes": 1 << 30,
    "budget_bytes": 1 << 28,
    "max_tokens": 131072,
    "kv_tokens": 262144,
    "segment_bytes": 512 << 20,
    "faults_enabled": False,
    "fs_concurrency": 2,
    "fetch_timeout_s": 10.0,
    "kv_wait_s": 60,
    "overload_ceiling_s": 60.0,
    "event_retention_s": 86400.0,
    "event_store_bytes": 64 << 20,
    "store_client_ttl_s": 120,
}
_RECORDED = {
    "services": {
        "mooncake_master": {"pid": 11, "start_ticks": 222, "urls": {"rpc_address": "10.213.0.1:50051"}, "log": "m"},
        "engine": {"pid": 12, "start_ticks": None, "log": "e"},
    },
    "ranks": [
        {"pid": 21, "start_ticks": 300, "rank": 0, "device": "cuda:0"},
        {"pid": 0, "start_ticks": None, "rank": 1, "device": None, "restarts": 2},
    ],
    "started_at": 1764633600.5,
    "netns": {
        "prefix": "bsrx",
        "nodes": ["master", "holder"],
        "links": [["holder", "master", "hm", "mh"]],
        "rate_bps": 8,
    },
    "restored": {"markers": 3, "settings": {"w": 16}, "dropped_faults": 1, "lines": ["restored 3 markers"]},
    "admin_url": "http://127.0.0.1:8470",
    "settings": _SETTINGS,
    "options": _SETTINGS
    | {
        "registration": "reg",
        "host": "127.0.0.1",
        "port": 8470,
        "remote": False,
        "allowed_hosts": ["a.example"],
        "open_metrics": True,
        "hosts": "netns",
        "link_rate_bps": None,
    },
    "registration_identity": "reg",
    "logs": "/state/logs",
}


def test_a_state_file_reads_back_and_is_written_again_byte_for_byte(tmp_path: Path) -> None:
    text = json.dumps(_RECORDED, indent=1)
    (tmp_path / "state.json").write_text(text)
    rec = supervisor.read_record(tmp_path)
    assert rec is not None and rec.netns is not None and rec.options is not None
    assert (
        rec.ranks[1].restarts == 2 and rec.netns.links[0].dev_a == "hm" and rec.options.allowed_hosts == ("a.example",)
    )
    assert json.dumps(rec.to_wire(), indent=1) == text
    # A record still starting (no ranks, no settings yet) keeps its few keys.
    starting = {"services": {}, "ranks": [], "started_at": 1764633600.5, "admin_url": ""}
    assert supervisor.EngineRecord.from_wire(starting).to_wire() == starting


def test_an_older_bsrs_settings_and_options_read_as_absent_the_rest_as_recorded(tmp_path: Path) -> None:
    older = dict(_RECORDED)
    older["settings"] = {k: v for k, v in _SETTINGS.items() if k != "kv_wait_s"}  # before --kv-wait
    older["options"] = {k: v for k, v in _RECORDED["options"].items() if k != "link_rate_bps"}
    (tmp_path / "state.json").write_text(json.dumps(older))
    rec = supervisor.read_record(tmp_path)
    assert rec is not None and rec.settings is None and rec.options is None
    assert rec.admin_url == "http://127.0.0.1:8470" and [p[0] for p in rec.processes()] == [
        "mooncake_master",
        "engine",
        "rank0",
    ]


def test_an_engine_started_before_the_client_ttl_was_recorded_reads_as_running_mooncakes_own(tmp_path: Path) -> None:
    from bsr_cli.core.limits import MOONCAKE_DEFAULT_CLIENT_TTL_S

    older = dict(_RECORDED)
    older["settings"] = {k: v for k, v in _SETTINGS.items() if k != "store_client_ttl_s"}
    older["options"] = {k: v for k, v in _RECORDED["options"].items() if k != "store_client_ttl_s"}
    (tmp_path / "state.json").write_text(json.dumps(older))
    rec = supervisor.read_record(tmp_path)
    assert rec is not None and rec.settings is not None and rec.options is not None
    # Its master ran without --client_ttl: `up` with today's options names that difference, not an unreadable record.
    assert rec.settings.store_client_ttl_s == rec.options.settings.store_client_ttl_s == MOONCAKE_DEFAULT_CLIENT_TTL_S
