"""`bsr probe --store` against keys written by real LMCache 0.5.6 (its own engine and ``store``) into a real
Mooncake master: every dtype LMCache names differently from torch, world sizes 1 and 2, request tags, a partial tail
and holes. Ground truth is LMCache itself (the keys its token database makes, its own ``lookup``) and Mooncake's
``batch_is_exist``, never bsr's key function. (LMCache here is not inside vLLM, so its chain starts at 0; the
vLLM-seeded start is tested under real vLLM in tests/vllm/test_store_keys_vllm.py.)

Run through scripts/test-plugins (a venv with LMCache); skipped elsewhere.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache_bsr import _lmcache as lm

from bsr_cli.cli.main import run
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.mooncake import services

CS = 256
LAYERS, HEADS, HEAD = 2, 2, 16
pytestmark = pytest.mark.timeout(240)


class FillConnector(GPUConnectorInterface):
    """There is no GPU here: "from GPU" fills LMCache's memory object with a byte pattern (stands for a real
    model's KV; the keys, not the bytes, are under test); nothing is ever loaded back."""

    def __init__(self, layers: int = LAYERS, width: int = HEADS * HEAD) -> None:
        self.layers, self.width = layers, width

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.width])

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.view(torch.uint8).fill_(start // CS % 251 + 1)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        raise AssertionError("nothing is retrieved in these tests")

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for o, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(o, s, e)

    def batched_to_gpu(self, *a: Any, **k: Any) -> None:
        raise AssertionError("nothing is retrieved in these tests")


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.ServiceHandle]:
    state = tmp_path_factory.mktemp("mooncake")
    m = services.start_master(state)
    holder = None
    try:
        holder = services.start_segment_holder(state, m, 256 << 20)
        yield m
    finally:
        if holder is not None:
            services.stop(holder, timeout=5)
        services.stop(m, timeout=5)


_N = iter(range(10**6))
_IDS: dict[int, str] = {}  # engine -> its builder instance id


def _engine(
    master: services.ServiceHandle,
    model: str,
    dtype: torch.dtype,
    world_size: int,
    worker_id: int,
    shape: tuple[int, int, int] = (LAYERS, HEADS, HEAD),
) -> Any:
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=CS,
        local_cpu=False,
        max_local_cpu_size=0.05,
        remote_url=f"mooncakestore://{master.rpc_address}/",
        remote_serde="naive",
        blocking_timeout_secs=10,
        extra_config={
            "mooncake_local_hostname": "127.0.0.1",
            "mooncake_metadata_server": master.metadata_url,
            "mooncake_master_server_addr": master.rpc_address,
            "mooncake_protocol": "tcp",
            "mooncake_global_segment_size": 0,
            "mooncake_local_buffer_size": 32 << 20,
            "save_chunk_meta": False,
            "transfer_timeout": 5,
        },
    )
    md = LMCacheMetadata(
        model_name=model,
        world_size=world_size,
        local_world_size=world_size,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=dtype,
        kv_shape=(shape[0], 2, CS, shape[1], shape[2]),
        chunk_size=CS,
    )
    name = f"keys-{next(_N)}"
    eng = LMCacheEngineBuilder.get_or_create(
        name,
        cfg,
        md,
        FillConnector(shape[0], shape[1] * shape[2]),
        broadcast_fn=lambda t, r: None,
        broadcast_object_fn=lambda o, r: o,
    )
    _IDS[id(eng)] = name
    eng.post_init()
    return eng


def _store(eng: Any, tokens: list[int], **kw: Any) -> list[str]:
    """LMCache's own store; returns the key strings LMCache's token database makes for the tokens (the keys it
    stored), once every one of them is visible in Mooncake."""
    eng.store(torch.tensor(tokens, dtype=torch.long), **kw)
    keys = [
        lm.key_string(k)
        for _, _, k in eng.token_database.process_tokens(
            tokens=torch.tensor(tokens, dtype=torch.long), request_configs=kw.get("request_configs")
        )
    ]
    assert lm.wait_remote_visible(eng, keys, 20.0), "LMCache's puts did not land"
    return keys


def _destroy(engines: list[Any]) -> None:
    """Required: LMCache's storage thread is not a daemon (the interpreter would never exit)."""
    for eng in engines:
        LMCacheEngineBuilder.destroy(_IDS.pop(id(eng)))


def _probe(master: services.ServiceHandle, tmp: Path, tokens: list[int], *args: str) -> dict[str, Any]:
    tf = tmp / "tokens.json"
    tf.write_text(json.dumps(tokens))
    out, err = io.StringIO(), io.StringIO()
    argv = ["--json", "probe", "--store", f"mooncake://{master.rpc_address}", "--metadata", master.metadata_url]
    argv += ["--master-admin", master.admin_url, "--tokens-file", str(tf), *args]
    with redirect_stdout(out), redirect_stderr(err):
        code = run(argv)
    assert code == 0, err.getvalue()
    return dict(json.loads(out.getvalue()))


def _exists(eng: Any, keys: list[str]) -> str:
    return "".join("1" if c == 1 else "0" for c in lm.mooncake_store(eng).batch_is_exist(keys))


@pytest.mark.parametrize(
    ("torch_dtype", "flag", "key_name"),
    [
        (torch.float16, "fp16", "half"),
        (torch.float32, "fp32", "float"),
        (torch.bfloat16, "bf16", "bfloat16"),
        (torch.float8_e4m3fn, "fp8_e4m3fn", "fp8_e4m3fn"),
        (torch.float8_e5m2, "fp8_e5m2", "fp8_e5m2"),
    ],
)
def test_every_dtype_world_size_1(master, tmp_path: Path, torch_dtype, flag: str, key_name: str) -> None:
    model = f"real/{key_name}"
    toks = synthetic_tokens(5 * CS + 100, seed=sum(map(ord, flag)))  # the 100-token tail is never stored
    eng = _engine(master, model, torch_dtype, 1, 0)
    try:
        keys = _store(eng, toks)
        assert len(keys) == 5 and all(k.endswith(f"@{key_name}") for k in keys)
        lm.mooncake_store(eng).remove(keys[3], True)  # a hole LMCache's prefix lookup cannot see past
        truth = _exists(eng, keys)
        assert truth == "11101"
        d = _probe(master, tmp_path, toks, "--model", model, "--dtype", flag)
        assert d["bitmap"]["rows"][0]["cells"] == truth
        assert d["committable_tokens"] == eng.lookup(torch.tensor(toks), search_range=["RemoteBackend"]) == 3 * CS
        assert d["key_format"]["hash_start"]["vllm_hash_seed"] is None and d["key_format"]["hash_start"]["detected"]
        assert d["key_example"] == keys[0]
        # The torch spelling works too; the old bsr spelling of the key never matched.
        assert _probe(master, tmp_path, toks, "--model", model, "--dtype", str(torch_dtype))["committable_chunks"] == 3
    finally:
        _destroy([eng])


def test_world_size_2_per_worker_holes_and_tags(master, tmp_path: Path) -> None:
    model = "real/tp2"
    toks = synthetic_tokens(6 * CS, seed=77)
    tagged = {"lmcache.tag.user": "alice", "lmcache.tag.tenant": "t1"}
    engs = [_engine(master, model, torch.float16, 2, w) for w in (0, 1)]
    try:
        keys = [_store(e, toks) for e in engs]
        tkeys = [_store(e, toks, request_configs=tagged) for e in engs]
        assert tkeys[0][0].endswith("@half@user%alice@tenant%t1")
        lm.mooncake_store(engs[1]).remove(keys[1][2], True)
        lm.mooncake_store(engs[0]).remove(tkeys[0][4], True)
        truth = [_exists(engs[0], keys[w]) for w in (0, 1)]
        ttruth = [_exists(engs[0], tkeys[w]) for w in (0, 1)]
        assert truth == ["111111", "110111"] and ttruth == ["111101", "111111"]

        d = _probe(master, tmp_path, toks, "--model", model, "--world-size", "2", "--dtype", "fp16")
        assert [r["cells"] for r in d["bitmap"]["rows"]] == truth
        assert d["committable_chunks"] == 2 and d["first_break"]["rank"] == 1 and d["first_break"]["chunk"] == 2
        assert engs[1].lookup(torch.tensor(toks), search_range=["RemoteBackend"]) == 2 * CS
        t = _probe(master, tmp_path, toks, "--model", model, "--world-size", "2", "--dtype", "fp16", "--tag",
                   "user=alice", "--tag", "tenant=t1")  # fmt: skip
        assert [r["cells"] for r in t["bitmap"]["rows"]] == ttruth and t["committable_chunks"] == 4
        lookup = engs[0].lookup(torch.tensor(toks), search_range=["RemoteBackend"], request_configs=tagged)
        assert lookup == 4 * CS

        # A shared prefix: another prompt with the same first 3 chunks hits exactly those.
        other = toks[: 3 * CS] + synthetic_tokens(2 * CS, seed=78)
        s = _probe(master, tmp_path, other, "--model", model, "--world-size", "2", "--dtype", "fp16")
        assert [r["cells"] for r in s["bitmap"]["rows"]] == ["11100", "11000"]

        # The wrong TP degree, dtype or tag set: nothing matches, and the diagnosis names the group and the flag.
        for args, flag in (
            (["--world-size", "1", "--dtype", "fp16"], "--world-size 2"),
            (["--world-size", "2", "--dtype", "bf16"], "--dtype fp16"),
        ):
            miss = _probe(master, tmp_path, toks, "--model", model, *args)
            assert miss["committable_chunks"] == 0
            assert miss["diagnosis"]["causes"][0].endswith(f"pass {flag}"), miss["diagnosis"]["causes"]
            assert any("mixed: 2 groups" in c for c in miss["diagnosis"]["causes"])
        wrong_tag = _probe(master, tmp_path, toks, "--model", model, "--world-size", "2", "--dtype", "fp16", "--tag",
                           "user=bob")  # fmt: skip
        cause = wrong_tag["diagnosis"]["causes"][0]
        assert wrong_tag["committable_chunks"] == 0 and "--tag" in cause, cause
        flags = [g["flags"] for g in wrong_tag["diagnosis"]["groups"]]
        assert ["--tag user=alice --tag tenant=t1"] in flags and ["drop --tag"] in flags, flags
    finally:
        _destroy(engs)


def test_host_restore_of_real_lmcache_data_reports_hash_not_applicable(master, tmp_path: Path) -> None:
    """The LMCache host restoring KV that LMCache stored from a real model (here: a byte pattern no synthetic model
    computes) reports `hash: not applicable` with a bytes checksum, never a false mismatch; KV the host computed
    itself is still compared with its canonical hash."""
    from lmcache_bsr.host import LMCacheHost

    layers, heads, head = 4, 2, 64
    cfg = {
        "model": {"name": "real/hosted", "layers": layers, "kv_heads": heads, "head_size": head, "tp_size": 2},
        "lmcache": {
            "local_cpu": False,
            "max_local_cpu_size": 0.0625,
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 1.0,
            "blocking_timeout_secs": 10,
            "remote_url": f"mooncakestore://{master.rpc_address}/",
            "remote_serde": "naive",
            "extra_config": {
                "mooncake_local_hostname": "127.0.0.1",
                "mooncake_metadata_server": master.metadata_url,
                "mooncake_master_server_addr": master.rpc_address,
                "mooncake_protocol": "tcp",
                "mooncake_global_segment_size": 0,
                "mooncake_local_buffer_size": 64 << 20,
                "save_chunk_meta": False,
                "transfer_timeout": 5,
            },
        },
        "settings": {"w": 2, "tiers": ["mooncake", "fs"], "kv_tokens": 8192, "fetch_timeout_s": 10.0},
    }
    real = synthetic_tokens(4 * CS, seed=91)
    writers = [_engine(master, "real/hosted", torch.bfloat16, 2, w, (layers, heads, head)) for w in (0, 1)]
    try:
        for e in writers:
            _store(e, real)
    finally:
        _destroy(writers)
    host = LMCacheHost(cfg)
    try:
        c = host.coordinator
        res = c.restore(real, w=2)
        assert res["outcome"] == "committed" and res["committed_tokens"] == 4 * CS and res["tiers"] == ["mooncake"]
        assert res["hash_ok"] is None and res["hash"] == "not applicable" and res["canonical_hash"] is None
        assert res["kv_checksum"] == res["output_hash"]
        sub = c.submit(real + synthetic_tokens(100, seed=92), w=2)
        assert sub["external_tokens"] == 4 * CS and sub["hash"] == "not applicable" and sub["hash_ok"] is None
        # KV the host computes and stores itself keeps its canonical check.
        own = synthetic_tokens(3 * CS, seed=93)
        first = c.submit(own, w=2)
        assert first["hash_ok"] is True and "hash" not in first
        again = c.restore(own, w=2)
        assert again["committed_tokens"] == 3 * CS and again["hash_ok"] is True and "hash" not in again
        # The host's /metrics: the same families as the embedded engine, counted from its own event log.
        from bsr_cli.server import metrics

        text = metrics.exposition(c)
        assert 'bsr_restores_total{kind="none",outcome="committed"} 3' in text  # two restores and one admission
        assert re.search(r'^bsr_tier_fetch_bytes_total\{rank="1",tier="mooncake"\} [1-9]', text, re.M), text
        assert 'bsr_rank_healthy{rank="0"} 1' in text
    finally:
        host.close()


def _explain(master: services.ServiceHandle, tmp: Path, tokens: list[int], *args: str) -> dict[str, Any]:
    tf = tmp / "explain-tokens.json"
    tf.write_text(json.dumps(tokens))
    out, err = io.StringIO(), io.StringIO()
    argv = ["--json", "explain", "--store", f"mooncake://{master.rpc_address}", "--metadata", master.metadata_url]
    argv += ["--master-admin", master.admin_url, "--tokens-file", str(tf), *args]
    with redirect_stdout(out), redirect_stderr(err):
        code = run(argv)
    assert code == 0, err.getvalue()
    return dict(json.loads(out.getvalue()))


def test_explain_on_a_store_real_lmcache_wrote(master, tmp_path: Path) -> None:
    """`bsr explain --store` on keys real LMCache wrote at TP=2 in fp16: restorable with the deployment's flags; a
    key-format mismatch naming the flag for the wrong dtype or world size; an evicted middle chunk; TP-rank skew."""
    model = "real/explain"
    toks = synthetic_tokens(6 * CS, seed=501)
    gap = synthetic_tokens(6 * CS, seed=502)
    skew = synthetic_tokens(6 * CS, seed=503)
    engs = [_engine(master, model, torch.float16, 2, w) for w in (0, 1)]
    try:
        keys = {name: [_store(e, t) for e in engs] for name, t in (("toks", toks), ("gap", gap), ("skew", skew))}
        for w in (0, 1):
            lm.mooncake_store(engs[w]).remove(keys["gap"][w][2], True)  # evicted on every worker
        lm.mooncake_store(engs[1]).remove(keys["skew"][1][4], True)  # lost on worker 1 only
        flags = ("--model", model, "--world-size", "2", "--dtype", "fp16", "--vllm-hash-seed", "none")
        ok = _explain(master, tmp_path, toks, *flags)
        assert ok["verdict"] == "restorable" and ok["reusable"]
        assert engs[0].lookup(torch.tensor(toks), search_range=["RemoteBackend"]) == 6 * CS
        for args, flag in (
            (["--world-size", "2", "--dtype", "bf16"], "--dtype fp16"),
            (["--world-size", "1", "--dtype", "fp16"], "--world-size 2"),
        ):
            d = _explain(master, tmp_path, toks, "--model", model, "--vllm-hash-seed", "none", *args)
            assert d["verdict"] == "key-format-mismatch", d["summary"]
            assert flag in d["findings"][0]["fix"] and flag in d["next"]
        d = _explain(master, tmp_path, gap, *flags)
        assert d["verdict"] == "evicted", d["summary"]
        assert "chunk 2 is missing in every tier while 3 later chunk(s) are held" in d["summary"]
        assert engs[0].lookup(torch.tensor(gap), search_range=["RemoteBackend"]) == 2 * CS
        d = _explain(master, tmp_path, skew, *flags)
        assert d["verdict"] == "rank-skew", d["summary"]
        assert "breaks at chunk 4 on rank 1 group attn only" in d["summary"]
    finally:
        _destroy(engs)
