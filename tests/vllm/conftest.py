"""Fixtures of the real-vLLM stage (helpers and the driver runner: vllmstage.py). Everything here is skipped where
vLLM and LMCache are not installed (the main venv); scripts/test-vllm runs it in .venv-vllm."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("lmcache") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from vllmstage import DRIVER, DRIVER_BUDGET_S, Driver, env_for, remove_unmapped_since, vllm_segments

    # pytest-xdist's workers set COLUMNS=80 and LINES=24 in their environment, which every bsr command the stage runs
    # would inherit and wrap its piped output at; the stage runs them as a script would, without (as with -n 0).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)

    _SHM_AT_START: set[Path] = set()

    def pytest_sessionstart(session: pytest.Session) -> None:
        _SHM_AT_START.update(vllm_segments())

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        """A test that starts vLLM may take one driver run's whole budget (vllmstage.DRIVER_BUDGET_S: start-up,
        scenarios and exit, each with its own deadline) before its own steps: its timeout is at least that."""
        floor = DRIVER_BUDGET_S + 120
        for item in items:
            marker = item.get_closest_marker("timeout")
            current = float(marker.args[0]) if marker and marker.args else float(config.getini("timeout") or 0)
            if current < floor:
                item.add_marker(pytest.mark.timeout(floor), append=False)

    def pytest_sessionfinish(session: pytest.Session) -> None:
        """The stage's one sweep of the shared memory its vLLMs left (the workers leave it to this process, which
        runs no vLLM itself and ends after all of them: see vllmstage._remove_unmapped)."""
        if not hasattr(session.config, "workerinput"):
            remove_unmapped_since(_SHM_AT_START)


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("plugin-site")
    di = site / "bsr_plugins-0.1.0.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: bsr-plugins\nVersion: 0.1.0\n")
    (di / "entry_points.txt").write_text("[vllm.general_plugins]\nlmcache_cpu = lmcache_cpu:register\n")
    return site


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    subprocess.run([sys.executable, str(DRIVER), "--make-model", str(path)], check=True, timeout=120, env=env_for({}))
    return path


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-architecture model (biased q/k/v, 4,096 positions), made locally like the Llama one."""
    path = tmp_path_factory.mktemp("model") / "tiny-qwen2"
    cmd = [sys.executable, str(DRIVER), "--make-model", str(path), "qwen2"]
    subprocess.run(cmd, check=True, timeout=120, env=env_for({}))
    return path


@pytest.fixture
def driver_factory(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path) -> Iterator[Any]:
    def make(name: str) -> Driver:
        return Driver(tmp_path_factory.mktemp(name), model_dir, plugin_site)

    yield make
