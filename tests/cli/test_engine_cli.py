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
