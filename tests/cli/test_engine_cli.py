"""`bsr engine` refusals that need no running engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from bsr_cli.errors import ExitCode


@pytest.mark.timeout(60)
def test_up_refuses_an_engine_that_cannot_fit_in_memory(bsr, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    # The paper's registration: 16 MB per chunk per rank; 1M tokens of KV on 2 ranks is far beyond this machine.
    r = bsr("engine", "up", "-r", "paper-mtp-off", "--max-tokens", "1048576")
    assert r.code == ExitCode.CAPACITY, r.err
    assert "needs about" in r.err and "lower --max-tokens" in r.err
    assert not (tmp_path / "state.json").exists()  # nothing was started


@pytest.mark.timeout(60)
def test_up_rejects_a_budget_below_one_window(bsr, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    r = bsr("engine", "up", "--W", "32", "--budget", "1MiB")
    assert r.code == ExitCode.INVALID_INPUT and "below RWS(W=32)" in r.err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--fetch-timeout", "nan"], "--fetch-timeout must be a number of seconds"),
        (["--fetch-timeout", "-1"], "--fetch-timeout must be a number of seconds"),
        (["--fetch-timeout", "inf"], "--fetch-timeout must be a number of seconds"),
        (["--fs-concurrency", "6000000000"], "--fs-concurrency must be at most 256"),
        (["--budget", "1"], "below one chunk slot"),
        (["--W", "0", "--budget", "1"], "below one chunk slot"),
        (["--budget", "1000TiB"], "exceeds the pool"),
        (["--max-tokens", "4096", "--kv-tokens", "1024"], "--kv-tokens must be at least --max-tokens"),
        (["--kv-wait", "-1"], "--kv-wait must be a number of seconds in [0, 3600]"),
        (["--kv-wait", "nan"], "--kv-wait must be a number of seconds in [0, 3600]"),
        (["--kv-wait", "3601"], "--kv-wait must be a number of seconds in [0, 3600]"),
        (["--overload-ceiling", "0.5"], "--overload-ceiling must be a number of seconds in [1, 3600]"),
        (["--overload-ceiling", "nan"], "--overload-ceiling must be a number of seconds in [1, 3600]"),
        (["--store-client-ttl", "0"], "--store-client-ttl must be whole seconds in [1, 86400], got 0"),
        (["--store-client-ttl", "1.5s"], "--store-client-ttl must be whole seconds in [1, 86400]"),
        (["--store-client-ttl", "2d"], "--store-client-ttl must be whole seconds in [1, 86400], got 172800"),
        (["--store-client-ttl", "forever"], "'forever' is not a duration"),
    ],
)
@pytest.mark.timeout(60)
def test_up_refuses_absurd_settings(bsr, tmp_path: Path, monkeypatch, args: list[str], needle: str) -> None:
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    try:
        r = bsr("engine", "up", *args)
        assert r.code == ExitCode.INVALID_INPUT, r.err
        assert needle in r.err and r.err.count("\n") <= 2  # one line (and a hint at most), no stack
        assert not (tmp_path / "state.json").exists()  # nothing was started
    finally:
        bsr("engine", "down")  # should a broken build accept these, leave nothing running


@pytest.mark.timeout(60)
def test_up_with_an_absurd_window_is_a_capacity_refusal(bsr, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    try:
        r = bsr("engine", "up", "--W", "900000000000000000000000000000")
        assert r.code == ExitCode.CAPACITY and "--W" in r.err, r.err
        r = bsr("engine", "up", "--W", "900000000000000000000000000000", "--pool", "64MiB")
        assert r.code == ExitCode.INVALID_INPUT and "--W 900,000,000,000,000,000,000,000,000,000 needs" in r.err, r.err
        assert not (tmp_path / "state.json").exists()
    finally:
        bsr("engine", "down")


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_up_with_other_options_refuses_then_restarts(bsr, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    base = ["engine", "up", "--no-remote", "--max-tokens", "2048", "--W", "2", "--json"]
    try:
        first = bsr(*base)
        assert first.code == 0, first.err
        assert bsr(*base).json()["already_running"] is True
        other = bsr(*base[:-3], "--W", "4", "--json")
        assert other.code == ExitCode.INVALID_INPUT and "other options: w 2 → 4" in other.err, other.err
        assert "--restart" in other.err
        restarted = bsr(*base[:-3], "--W", "4", "--restart", "--json")
        assert restarted.code == 0, restarted.err
        out = restarted.json()
        assert out["already_running"] is False and out["settings"]["w"] == 4
        assert out["admin_url"] != first.json()["admin_url"] or out["started_at"] != first.json()["started_at"]
    finally:
        bsr("engine", "down")


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_kv_wait_and_the_overload_ceiling_reach_the_running_engine(bsr, tmp_path: Path, monkeypatch) -> None:
    """`--kv-wait` is the engine's kv_wait_s and `--overload-ceiling` its overload_ceiling_s: the running engine
    reports them, and another value is another engine."""
    pytest.importorskip("torch")
    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    base = ["engine", "up", "--no-remote", "--max-tokens", "2048", "--W", "2", "--overload-ceiling", "15"]
    try:
        up = bsr(*base, "--kv-wait", "7.5", "--json")
        assert up.code == 0, up.err
        assert up.json()["settings"]["kv_wait_s"] == 7.5 and up.json()["settings"]["overload_ceiling_s"] == 15
        status = bsr("status", "--json")
        assert status.code == 0, status.err
        assert status.report()["admission"]["kv_wait_s"] == 7.5
        shown = bsr("settings", "show", "--json")
        assert shown.code == 0 and shown.json()["settings"]["overload_ceiling_s"] == 15, shown.out
        other = bsr(*base, "--json")  # the default, 60 s, differs from the running engine's
        assert other.code == ExitCode.INVALID_INPUT and "kv_wait_s 7.5 → 60.0" in other.err, other.err
    finally:
        bsr("engine", "down")


def test_the_store_client_ttl_comes_from_the_flag_the_environment_or_the_config_file(tmp_path: Path) -> None:
    from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S
    from bsr_cli.errors import InvalidInput
    from bsr_cli.settings import SettingFlags, load_settings

    cfg = tmp_path / "config.toml"
    cfg.write_text('store_client_ttl = "5m"\n')
    s = load_settings(SettingFlags(config=str(cfg)), environ={})
    assert s.store_client_ttl_s == 300 and s.sources["store_client_ttl_s"].startswith("config")
    s = load_settings(SettingFlags(config=str(cfg)), environ={"BSR_STORE_CLIENT_TTL": "90"})
    assert s.store_client_ttl_s == 90 and s.sources["store_client_ttl_s"] == "env BSR_STORE_CLIENT_TTL"
    assert load_settings(SettingFlags(), environ={}).store_client_ttl_s == DEFAULT_STORE_CLIENT_TTL_S
    cfg.write_text("store_client_ttl = 0\n")
    with pytest.raises(InvalidInput, match="bad value for store_client_ttl_s"):
        load_settings(SettingFlags(config=str(cfg)), environ={})


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_the_store_client_ttl_reaches_the_master_and_another_is_another_engine(
    bsr, tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("torch")
    from bsr_cli.engine import supervisor

    monkeypatch.setenv("BSR_STATE_DIR", str(tmp_path))
    base = ["engine", "up", "--max-tokens", "2048", "--W", "2"]
    try:
        up = bsr(*base, "--store-client-ttl", "45s", "--json")
        assert up.code == 0, up.err
        assert up.json()["settings"]["store_client_ttl_s"] == 45
        record = supervisor.read_record(tmp_path)
        assert record is not None
        master = record.services["mooncake_master"].pid
        argv = Path(f"/proc/{master}/cmdline").read_bytes().split(b"\0")
        assert b"--client_ttl=45" in argv, argv
        assert "store client TTL 45 s" in bsr("engine", "status").out
        other = bsr(*base, "--json")  # the default, 120 s, differs from the running engine's
        assert other.code == ExitCode.INVALID_INPUT and "store_client_ttl_s 45 → 120" in other.err, other.err
    finally:
        bsr("engine", "down")
