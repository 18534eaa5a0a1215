"""docs/runbook-vllm.md, run as written against real vLLM (CPU build) + LMCache + a real Mooncake master.

The page's blocks are read from the markdown and run literally, with only the placeholders its table documents
substituted (the test checks that it substitutes exactly those): vLLM is started with the page's
``--kv-transfer-config`` (and prefix caching off, as the page says); a prompt is stored in Mooncake; the page's
rehearsal block arms a fault and the prompt's next load fails closed at window G2; then the page's four commands
(and, at TP 1, its "more" block) run in one shell, as a user types them, and must each exit 0 and show what the
page says: the instance's endpoints (every rank's admin URL; the printed `bsr probe --store` line equal to the
page's), the scheduler's marker and `bsr explain`'s verdict on the failed prompt. Once at TP 1 and once at TP 2
(rank 0's port answers for the instance; the printed all-ranks `bsr status` line shows both). A wrong command on
the page fails this test.

The `bsr` on PATH is a two-line script running ``python -m bsr_cli`` in the stage's venv: it stands in for the
console script `pip install` makes (bsr is not installed in that venv; the stage puts the checkout on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from driver import prompt
from vllmstage import (
    CHUNK,
    ROOT,
    Driver,
    chunk_prefix,
    consecutive_free_ports,
    doc_blocks,
    doc_commands,
    doc_placeholders,
    events_of,
    lmcache_yaml,
    split_steps,
    step_script,
    substitute,
)

from bsr_cli.core.keys import prompt_hash
from bsr_cli.mooncake import services

RUNBOOK = ROOT / "docs" / "runbook-vllm.md"
N = 5 * CHUNK + 60  # 5 full chunks + a tail LMCache never stores
SEED = 5
TOKEN = "runbook-token"
MAX_COMMANDS_TO_EXPLAIN = 5
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # Mooncake's transfer endpoint on loopback


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.ServiceHandle]:
    m = services.start_master(tmp_path_factory.mktemp("mooncake"))
    try:
        yield m
    finally:
        services.stop(m, timeout=5)


def bsr_on_path(bin_dir: Path) -> Path:
    """A `bsr` command for the shell (see the module docstring)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "bsr"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m bsr_cli "$@"\n')
    exe.chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: Path,
    plugin_site: Path,
    master: services.ServiceHandle,
) -> dict[str, Any]:
    tp = int(request.param)
    d = Driver(tmp_path_factory.mktemp(f"runbook-tp{tp}"), model_dir, plugin_site)
    page = RUNBOOK.read_text()
    port = consecutive_free_ports(tp)  # rank r serves on bsr_admin_port + r
    rank_urls = [f"http://127.0.0.1:{port + r}" for r in range(tp)]
    values = {
        "8470": str(port),
        "change-me": TOKEN,
        "/models/my-model": str(model_dir),
        "10.0.0.5:50051": master.rpc_address,
        "http://10.0.0.5:8080/metadata": master.metadata_url,
        "http://10.0.0.5:9003": master.admin_url,
        "prompt.json": "prompt.json",  # the file the shell's working directory holds
    }
    assert sorted(doc_placeholders(page)) == sorted(values), "substitute exactly the placeholders the page documents"
    page = substitute(page, values)

    (serve,) = doc_blocks(page, "serve")
    m = re.search(r"--kv-transfer-config '(\{.*?\})'", serve, re.S)
    assert m, serve
    ktc = json.loads(m.group(1))
    assert "--no-enable-prefix-caching" in serve and "PYTHONHASHSEED=0" in serve, serve

    steps = [c for b in doc_blocks(page, "step") for c in doc_commands(b)]
    more = [c for b in doc_blocks(page, "more") for c in doc_commands(b)]
    rehearse = [c for b in doc_blocks(page, "rehearse") for c in doc_commands(b)]
    work = d.root / "shell"
    work.mkdir()
    (work / "prompt.json").write_text(json.dumps(prompt(N, SEED)))
    shell = {"cwd": str(work), "env": {"PATH": f"{bsr_on_path(d.root / 'bin')}{os.pathsep}{os.environ['PATH']}"}}
    # The rehearsal runs in the user's shell after step 1 (BSR_ENGINE, BSR_TOKEN), before the prompt is sent again.
    exports = [c for c in steps if c.startswith("export ")]
    p = {"tokens": N, "seed": SEED}
    # At TP 2 the page's probe line (its shape for TP 1) is not this instance's; the line `engine endpoints` prints
    # for all ranks is run instead, as the page says to.
    commands = steps + (more if tp == 1 else [])
    all_ranks = ["--token", TOKEN, "--engine", ",".join(rank_urls), "status"]
    tp_env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {}
    res = d.run(
        {
            # The driver starts vLLM with prefix caching off; the connector and its config are the page's.
            "connector": "bsr",
            "tp": tp,
            "extra": ktc["kv_connector_extra_config"],
            "scenarios": [
                {"name": "store", **p, "settle_s": 1.5},  # LMCache's puts to Mooncake are asynchronous
                {"name": "fault", "before": [{"sh": step_script(exports + rehearse), **shell}], **p},
                {"name": "runbook", "before": [{"sh": step_script(commands), **shell}, {"cli": all_ranks}]},
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", None, master),
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1", **tp_env},
    )
    res |= {
        "tp": tp,
        "rank_urls": rank_urls,
        "ktc": ktc,
        "values": values,
        "rehearsed": split_steps(exports + rehearse, res["by_name"]["fault"]["actions"][0]["stdout"]),
        "steps": split_steps(commands, res["by_name"]["runbook"]["actions"][0]["stdout"]),
        "n_steps": len(steps),
        "doc_probe_line": next(c for c in more if c.startswith("bsr probe --store")),
    }
    return res


PREFIX = chunk_prefix(N)
PREFIX_HASH = prompt_hash(prompt(N, SEED)[:PREFIX])


def output_of(run: dict[str, Any], starts: str) -> str:
    (step,) = [s for s in run["steps"] if s["cmd"].startswith(starts)]
    return str(step["output"])


@pytest.mark.timeout(600)
def test_every_command_on_the_page_runs_as_written(run: dict[str, Any]) -> None:
    ktc = run["ktc"]
    # The page's connector config is what the stage's driver runs besides its extra config.
    assert ktc["kv_connector"] == "BSRConnector" and ktc["kv_connector_module_path"] == "vllm_bsr.connector"
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    for s in run["rehearsed"] + run["steps"]:
        assert s["rc"] == 0 and "Traceback" not in s["output"], s
    assert "window G2" in run["rehearsed"][-1]["output"], run["rehearsed"]


@pytest.mark.timeout(600)
def test_explain_of_the_failed_prompt_within_five_commands(run: dict[str, Any]) -> None:
    # The rehearsal's fault (armed through rank 0, what BSR_ENGINE names) failed rank 0's load at G2.
    failed = [e for e in events_of(run["by_name"]["fault"], "bsr_load") if not e["ok"]]
    assert [(e["rank"], e["failed_window"]) for e in failed] == [(0, 1)], failed
    cmds = [s["cmd"] for s in run["steps"][: run["n_steps"]]]
    assert cmds[-1].startswith("bsr explain --tokens-file"), cmds
    assert len(cmds) <= MAX_COMMANDS_TO_EXPLAIN, cmds
    markers = output_of(run, "bsr markers list")
    assert PREFIX_HASH in markers and "window G2" in markers, markers
    explained = output_of(run, "bsr explain")
    assert "force-local" in explained and "window G2" in explained, explained
    if run["tp"] == 1:
        status = output_of(run, "bsr status")
        assert f"force-local marker prompt {PREFIX_HASH}" in status, status


@pytest.mark.timeout(600)
def test_one_command_prints_every_endpoint_and_the_probe_store_line(run: dict[str, Any]) -> None:
    v = run["values"]
    shown = output_of(run, "bsr engine endpoints")
    for r, url in enumerate(run["rank_urls"]):  # rank 0 is the page's port; rank r serves on port + r
        assert f"rank {r}  {url}" in shown, shown
    assert f"rank {run['tp']}  " not in shown, shown
    assert "token: accepted (from env BSR_TOKEN)" in shown, shown
    for endpoint in ("10.0.0.5:50051", "http://10.0.0.5:8080/metadata", "http://10.0.0.5:9003"):
        assert v[endpoint] in shown, (endpoint, shown)
    # The line it prints for every rank at once works: one row per rank, each answering.
    assert f"every rank at once: bsr status --engine {','.join(run['rank_urls'])}" in shown, shown
    fleet = run["by_name"]["runbook"]["actions"][1]
    assert fleet["rc"] == 0 and all(u.split("//")[1] in fleet["stdout"] for u in run["rank_urls"]), fleet
    if run["tp"] > 1:
        assert f"--world-size {run['tp']} " in shown, shown  # the printed probe line carries the instance's TP
        return
    # The probe line it prints is the page's (placeholders substituted), and that line ran (above) and found the
    # prompt's full chunks in the store.
    assert f"probe the store: {run['doc_probe_line']}" in shown, shown
    probed = output_of(run, "bsr probe --store")
    # (The bitmap also counts the prompt's partial tail as a chunk LMCache never stores: "held 5/6".)
    assert f"committable prefix: {PREFIX} tokens ({PREFIX // CHUNK} chunks)" in probed, probed
