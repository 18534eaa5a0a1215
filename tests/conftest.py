"""Shared test isolation: no user config, no colour, a fixed width, a private state directory."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolate(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".state"))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "160")
    for var in (
        "BSR_ENGINE",
        "BSR_TOKEN",
        "BSR_STATE_DIR",
        "BSR_CONFIG",
        "BSR_JSON",
        "BSR_TRACEBACK",
        "BSR_DEBUG",
    ):
        monkeypatch.delenv(var, raising=False)
