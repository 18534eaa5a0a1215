"""Checksums in a real deployment: BSRConnector in real vLLM (CPU build) over LMCache and a real Mooncake master.

Flipping bytes of one stored chunk in Mooncake (a real corruption of the stored object, written back through a
Mooncake client) must not reach the model: with bsr's checksums the load fails closed at the verify stage, vLLM
recomputes and generates the real tokens (those of the first run, which computed everything: what vLLM produces
without the connector), and `bsr explain` against the worker's admin names the chunk and the tier. The negative
control runs the same with ``bsr_checksums: false``: the corrupted chunk is loaded and the output changes. The
chunks that run stored carry no checksum, as stock LMCache's: `bsr probe --store` reports them unverified.
The corrupted object is removed on detection, so the request after the recompute loads again, verified.
The checksum is bound to the chunk's key and length: another prompt's chunk copied under this prompt's key with its
own checksum, and an object with bytes appended (which LMCache cannot load at all), each fail the load closed, are
named (chunk, key, tier) and removed; the request the marker sends local stores the chunk again, and the next loads
the whole prefix, verified, generating the cold run's tokens.
One vLLM start-up per configuration; a fresh master per test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllmstage import CHUNK, Driver, chunk_prefix, events_of, lmcache_yaml, vllm_ports

from bsr_cli.mooncake import services

N = 4 * CHUNK + 30
SEED = 7
TOKEN = "vllm-stage-token"
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # Mooncake's transfer endpoint on loopback


@pytest.fixture
def master(tmp_path: Path) -> Iterator[services.ServiceHandle]:
    m = services.start_master(tmp_path / "mooncake")
    try:
        yield m
    finally:
        services.stop(m, timeout=5)


def _run(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: Any, checksums: bool
) -> dict[str, Any]:
    from driver import prompt

    d = Driver(tmp_path_factory.mktemp("bsr-integrity"), model_dir, plugin_site)
    port = vllm_ports()
    url = f"http://127.0.0.1:{port}"
    toks = d.root / "prompt.json"
    toks.write_text(json.dumps(prompt(N, SEED)))
    mc = {"admin": master.admin_url, "metadata": master.metadata_url, "master": master.rpc_address}
    probe = [
        "--json", "probe", "--store", f"mooncake://{master.rpc_address}", "--metadata", master.metadata_url,
        "--master-admin", master.admin_url, "--model", str(model_dir), "--world-size", "1", "--dtype", "fp32",
        "--chunk-size", str(CHUNK), "--vllm-hash-seed", "0", "--tokens-file", str(toks),
    ]  # fmt: skip
    p = {"tokens": N, "seed": SEED}
    res = d.run(
        {
            "connector": "bsr",
            "extra": {
                "bsr_window_chunks": 2,
                "bsr_admin_port": port,
                "bsr_admin_token": TOKEN,
                "bsr_checksums": checksums,
            },
            "scenarios": [
                {"name": "store", **p, "settle_s": 1.0},  # LMCache's puts to Mooncake are asynchronous
                {"name": "load", **p, "after": [{"cli": probe}]},
                {
                    "name": "corrupt",
                    "before": [{"mooncake_corrupt": {**mc, "world": 1, "worker": 0}}],
                    "after": [
                        {"cli": ["--engine", url, "--token", TOKEN, "--json", "explain", "--tokens-file", str(toks)]},
                        {"cli": ["--engine", url, "--token", TOKEN, "explain", "--tokens-file", str(toks)]},
                    ],
                    **p,
                },
                # Sent local by the marker: recomputed, and the chunk (removed as corrupt) stored afresh.
                {"name": "marker", **p, "settle_s": 1.0},
                {"name": "healed", **p},
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", None, master),
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )
    return res


def _load(r: dict[str, Any]) -> dict[str, Any]:
    (ev,) = events_of(r, "bsr_load")
    return ev


@pytest.mark.timeout(420)
def test_flipped_byte_in_mooncake_recomputes_and_explain_names_chunk_and_tier(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: services.ServiceHandle
) -> None:
    res = _run(tmp_path_factory, model_dir, plugin_site, master, checksums=True)
    store, load, corrupt = (res["by_name"][n] for n in ("store", "load", "corrupt"))
    # Stored with checksums, loaded verified: the same tokens as the first run (computed without any reuse).
    ok = _load(load)
    assert ok["ok"] and ok["loaded"] == chunk_prefix(N) and ok["integrity"] is None, ok
    assert load["output"] == store["output"]
    (probe,) = load["after"]
    assert probe["rc"] == 0, probe
    pd = json.loads(probe["stdout"])
    assert pd["committable_chunks"] == N // CHUNK, pd
    assert pd["integrity"]["unverified_chunks"] == 0 and pd["integrity"]["checksummed_chunks"] == N // CHUNK, pd

    (act,) = corrupt["actions"]
    assert act["changed"] and act["sidecars"] == N // CHUNK, act
    bad = act["corrupted"]
    ev = _load(corrupt)
    # The corrupted chunk failed its checksum: the load failed closed, vLLM recomputed, the output is the real one.
    assert not ev["ok"] and ev["loaded"] == 0, ev
    assert ev["integrity"]["key"] == bad and ev["integrity"]["tier"] == "mooncake", ev
    assert ev["integrity"]["verdict"] == "mismatch"
    chunk = ev["integrity"]["chunk"]
    assert isinstance(chunk, int) and 0 <= chunk < N // CHUNK
    assert "ChecksumError: checksum mismatch in chunk" in ev["reason"]
    assert corrupt["output"] == store["output"]

    # `bsr explain` against the worker's admin names the chunk and the tier, blamed at the verify stage.
    js, text = corrupt["after"]
    assert js["rc"] == 0 and text["rc"] == 0, (js, text)
    assert "Traceback" not in js["stderr"] + text["stderr"]
    fails = [f for f in _failures(json.loads(js["stdout"])) if f.get("stage") == "verify"]
    assert fails and fails[0]["tier"] == "mooncake", js["stdout"]
    assert f"checksum mismatch in chunk {chunk} (tier mooncake" in fails[0]["reason"], js["stdout"]
    assert f"checksum mismatch in chunk {chunk}" in text["stdout"] and "mooncake" in text["stdout"], text["stdout"]
    assert "failed_closed (tier)" in text["stdout"], text["stdout"]

    # The corrupted object was removed: the next admission (forced local by the marker) stores the chunk afresh,
    # and the one after loads every chunk, verified.
    marker, healed = res["by_name"]["marker"], res["by_name"]["healed"]
    (lk,) = events_of(marker, "bsr_lookup")
    assert lk["force_local"] and marker["output"] == store["output"]
    again = _load(healed)
    assert again["ok"] and again["loaded"] == chunk_prefix(N) and again["integrity"] is None, again
    assert healed["output"] == store["output"]


@pytest.mark.timeout(420)
def test_negative_control_without_checksums_the_corruption_is_used(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: services.ServiceHandle
) -> None:
    res = _run(tmp_path_factory, model_dir, plugin_site, master, checksums=False)
    store, load, corrupt = (res["by_name"][n] for n in ("store", "load", "corrupt"))
    assert _load(load)["ok"] and load["output"] == store["output"]
    # Stored as stock LMCache stores: no checksum, so the store probe reports every chunk unverified.
    pd = json.loads(load["after"][0]["stdout"])
    assert pd["committable_chunks"] == N // CHUNK
    assert pd["integrity"]["unverified_chunks"] == N // CHUNK and pd["integrity"]["checksummed_chunks"] == 0, pd
    (act,) = corrupt["actions"]
    assert act["changed"] and act["sidecars"] == 0, act
    ev = _load(corrupt)
    assert ev["ok"] and ev["loaded"] == chunk_prefix(N), ev  # the corrupted chunk was loaded...
    assert corrupt["output"] != store["output"]  # ...and changed what the model generated


def _failures(doc: Any) -> list[dict[str, Any]]:
    """Every failure record anywhere in explain's JSON (its layout nests them under the request's story)."""
    out: list[dict[str, Any]] = []
    if isinstance(doc, dict):
        if "stage" in doc and "tier" in doc:
            out.append(doc)
        for v in doc.values():
            out += _failures(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _failures(v)
    return out


# -- which chunk an object is: another prompt's chunk copied here, an object that grew ------------------------------
OTHER_SEED = 8


def _run_identity(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: Any
) -> tuple[dict[str, Any], list[str]]:
    """One vLLM: the prompt stored, another prompt of the same shape stored, then (1) the other prompt's chunk 2
    with its checksum copied under this prompt's chunk 1 key, and (2) bytes appended to this prompt's chunk 2; after
    each, the request that fails closed, the one the marker sends local (it stores the chunk again), and one that
    loads the whole prefix."""
    from driver import prompt, prompt_key

    d = Driver(tmp_path_factory.mktemp("bsr-identity"), model_dir, plugin_site)
    port = vllm_ports()
    url = f"http://127.0.0.1:{port}"
    toks = d.root / "prompt.json"
    toks.write_text(json.dumps(prompt(N, SEED)))
    keys = [prompt_key(str(model_dir), N, SEED, c, CHUNK) for c in range(N // CHUNK)]
    theirs = prompt_key(str(model_dir), N, OTHER_SEED, 2, CHUNK)
    mc = {"metadata": master.metadata_url, "master": master.rpc_address}
    explain = ["--engine", url, "--token", TOKEN, "--json", "explain", "--tokens-file", str(toks)]
    p = {"tokens": N, "seed": SEED}
    res = d.run(
        {
            "connector": "bsr",
            "extra": {"bsr_window_chunks": 2, "bsr_admin_port": port, "bsr_admin_token": TOKEN},
            "scenarios": [
                {"name": "store", **p, "settle_s": 1.0},
                {"name": "other", "tokens": N, "seed": OTHER_SEED, "settle_s": 1.0},
                {"name": "load", **p},
                {
                    "name": "copied",
                    "before": [{"mooncake_copy": {**mc, "src": theirs, "dst": keys[1]}}],
                    "after": [{"cli": explain}],
                    **p,
                },
                {"name": "copied-marker", **p, "settle_s": 1.0},
                {"name": "copied-healed", **p},
                {"name": "grown", "before": [{"mooncake_grow": {**mc, "key": keys[2], "extra": 4096}}], **p},
                {"name": "grown-marker", **p, "settle_s": 1.0},
                {"name": "grown-healed", **p},
            ],
        },
        lmcache=lmcache_yaml(d.root / "lmcache.yaml", None, master),
        env={"MC_TCP_BIND_ADDRESS": "127.0.0.1"},
    )
    return res, keys


def _fails_closed_then_heals(res: dict[str, Any], name: str, key: str, chunk: int) -> dict[str, Any]:
    """The load of ``name`` failed closed at verify naming ``chunk`` and ``key`` (removed), the output is the cold
    run's; the marker's request recomputes; the next loads the whole prefix, verified, with the cold output."""
    cold = res["by_name"]["store"]["output"]
    sc = res["by_name"][name]
    ev = _load(sc)
    assert not ev["ok"] and ev["loaded"] == 0, ev
    integ = ev["integrity"]
    assert (integ["chunk"], integ["key"], integ["tier"], integ["verdict"]) == (chunk, key, "mooncake", "mismatch"), ev
    assert integ["removed"] is True, ev
    assert f"in chunk {chunk} (tier mooncake, key {key}); removed from the store" in ev["reason"], ev
    assert sc["output"] == cold  # vLLM recomputed: the real tokens, not the copied chunk's
    marker, healed = res["by_name"][f"{name}-marker"], res["by_name"][f"{name}-healed"]
    (lk,) = events_of(marker, "bsr_lookup")
    assert lk["force_local"] and marker["output"] == cold
    again = _load(healed)
    assert again["ok"] and again["loaded"] == chunk_prefix(N) and again["integrity"] is None, again
    assert healed["output"] == cold
    return integ


@pytest.mark.timeout(480)
def test_a_copied_chunk_and_a_grown_object_fail_closed_are_named_removed_and_the_prefix_heals(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, plugin_site: Path, master: services.ServiceHandle
) -> None:
    res, keys = _run_identity(tmp_path_factory, model_dir, plugin_site, master)
    load = res["by_name"]["load"]
    assert _load(load)["ok"] and load["output"] == res["by_name"]["store"]["output"]
    assert res["by_name"]["other"]["output"] != load["output"]  # another prompt: other KV, other tokens

    (copy,) = res["by_name"]["copied"]["actions"]
    assert copy["held"] == [1, 1, 1, 1] and copy["rcs"] == [0, 0] and copy["changed"], copy
    integ = _fails_closed_then_heals(res, "copied", keys[1], 1)
    assert integ["detail"] == "checksum mismatch", integ
    (js,) = res["by_name"]["copied"]["after"]
    assert js["rc"] == 0 and "Traceback" not in js["stderr"], js
    fails = [f for f in _failures(json.loads(js["stdout"])) if f.get("stage") == "verify"]
    assert fails and fails[0]["tier"] == "mooncake", js["stdout"]
    assert f"checksum mismatch in chunk 1 (tier mooncake, key {keys[1]})" in fails[0]["reason"], js["stdout"]

    (grow,) = res["by_name"]["grown"]["actions"]
    assert grow["rc"] == 0 and grow["now"] == grow["bytes"] + 4096, grow
    integ = _fails_closed_then_heals(res, "grown", keys[2], 2)
    assert integ["detail"].startswith("wrong length (") and "its checksum is for" in integ["detail"], integ
