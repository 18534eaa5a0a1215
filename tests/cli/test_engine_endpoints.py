"""`bsr engine endpoints`: every endpoint bsr needs for an engine, in one command.

Against a vLLM instance it is run inside real vLLM by tests/vllm/test_runbook.py; here: the answer built from a
vLLM worker's `info` (the wire dict its admin API serves, vllm_bsr/instance.py), and the command against a real
embedded engine (one admin API for every rank) and against no engine at all."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from bsr_cli.cli.commands.endpoints_cmd import EngineEndpoints, endpoints_of, render
from bsr_cli.core.status import EngineInfo
from bsr_cli.errors import ExitCode

WORKER_INFO: dict[str, Any] = {
    "engine": "vllm-lmcache tp-rank 0",
    "vllm_instance": {
        "tp_size": 2,
        "rank0_url": "http://127.0.0.1:8470",
        "rank_urls": ["http://127.0.0.1:8470", "http://127.0.0.1:8471"],
        "mooncake": {"store": "mooncake://10.0.0.5:50051", "metadata": "http://10.0.0.5:8080/metadata", "admin": None},
        "key_format": {
            "model": "my-org/my model",
            "world_size": 2,
            "dtype": "bf16",
            "chunk_size": 256,
            "hash_seed": "0",
        },
    },
}


def shown(d: EngineEndpoints) -> str:
    console = Console(width=400, record=True)
    render(console, d)
    return console.export_text()


@pytest.mark.timeout(30)
def test_a_vllm_instance_lists_its_ranks_mooncake_and_the_probe_store_line() -> None:
    found = endpoints_of("http://127.0.0.1:8470", "env BSR_TOKEN", EngineInfo.from_wire(WORKER_INFO))
    d = found.to_wire()
    assert d["kind"] == "vllm" and d["rank_urls"] == ["http://127.0.0.1:8470", "http://127.0.0.1:8471"]
    # The model name is quoted for the shell; an unknown master admin is left out of the line, with what to set.
    assert d["probe_store"] == (
        "bsr probe --store mooncake://10.0.0.5:50051 --metadata http://10.0.0.5:8080/metadata "
        "--model 'my-org/my model' --world-size 2 --dtype bf16 --chunk-size 256 --vllm-hash-seed 0 "
        "--tokens-file prompt.json"
    )
    assert "admin" not in d["mooncake"] and "bsr_mooncake_admin" in d["mooncake_admin_hint"]
    text = shown(found)
    assert "rank 1  http://127.0.0.1:8471" in text and "token: accepted (from env BSR_TOKEN)" in text
    assert "bsr status --engine http://127.0.0.1:8470,http://127.0.0.1:8471" in text
    assert "None" not in text and "None" not in str(d)


@pytest.mark.timeout(30)
def test_an_unseeded_vllm_gets_no_hash_seed_flag_and_no_mooncake_no_probe_line() -> None:
    inst = dict(WORKER_INFO["vllm_instance"])
    inst["key_format"] = dict(inst["key_format"], hash_seed=None)
    d = endpoints_of("http://127.0.0.1:8470", "flag", EngineInfo.from_wire({"vllm_instance": inst})).to_wire()
    assert "--vllm-hash-seed" not in d["probe_store"] and "hash_seed" not in d["key_format"]
    found = endpoints_of(
        "http://127.0.0.1:8470", "flag", EngineInfo.from_wire({"vllm_instance": inst | {"mooncake": None}})
    )
    assert "probe_store" not in found.to_wire() and "no `bsr probe --store`" in shown(found)


@pytest.mark.engine
@pytest.mark.timeout(240)
def test_against_the_embedded_engine_one_admin_url_serves_every_rank(bsr, engine) -> None:
    r = bsr("engine", "endpoints", "--json")
    assert r.code == 0, r.err
    d = r.json()
    assert d["kind"] == "bsr" and d["rank_urls"] == [engine.url] and d["token"]["accepted"] is True
    with engine.client() as c:
        ranks = c.info().ranks
    assert ranks == 2 and d["tp_size"] == ranks  # the engine's own rank count (it once said 1 for any engine)
    text = bsr("engine", "endpoints")
    assert text.code == 0 and f"bsr engine at {engine.url}: one admin API serves all 2 rank(s)" in text.out, text.out


@pytest.mark.timeout(60)
def test_no_engine_there_is_one_line_and_exit_3(bsr, monkeypatch: pytest.MonkeyPatch) -> None:
    from bsr_cli.mooncake.services import free_port

    monkeypatch.setenv("BSR_TOKEN", "t")
    r = bsr("--engine", f"http://127.0.0.1:{free_port()}", "engine", "endpoints")
    assert r.code == ExitCode.ENGINE_UNREACHABLE and "cannot reach the engine" in r.err, r.err
    assert "Traceback" not in r.err


@pytest.mark.timeout(30)
def test_a_fault_armed_through_a_vllm_worker_is_that_rank_s_alone() -> None:
    """`bsr inject-fault` says where the fault is armed: a vLLM worker's admin API arms its own TP rank only (inside
    vLLM, tests/vllm/test_runbook.py sees only rank 0's load fail at TP 2); bsr's engine arms every rank or one."""
    from bsr_cli.cli.commands.operate import _fault_scope
    from bsr_cli.core.faults import FaultSpec

    worker = EngineInfo.from_wire({**WORKER_INFO, "worker": {"tp_rank": 1, "window_chunks": 2}})
    assert _fault_scope(worker, FaultSpec(kind="restore-fault")) == "tp-rank 1 (this worker only)"
    engine = EngineInfo.from_wire({"engine": "bsr"})
    assert _fault_scope(engine, FaultSpec(kind="restore-fault")) == "every rank"
    assert _fault_scope(engine, FaultSpec(kind="restore-fault", rank=1)) == "rank 1"
