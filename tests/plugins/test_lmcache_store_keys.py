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
import shlex
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
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.mooncake import health, services

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
    **config: Any,
) -> Any:
    cfg = LMCacheEngineConfig.from_defaults(
        **config,
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
        assert d["bitmap"]["rows"][0]["cells"] == truth + "0"  # the tail: not stored (save_unfull_chunk off)
        assert d["prompt_chunks"] == 6 and d["storable_chunks"] == 5 and d["first_break"]["chunk"] == 3
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
                # Stock LMCache (the writers below) stores no checksum: the host refuses such chunks by default
                # (tests/plugins/test_lmcache_integrity.py); this test is about the hash of real KV, so load them.
                "bsr_load_unverified": True,
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
        assert res.report is not None and res.hashes is not None
        assert res.outcome is Outcome.COMMITTED and res.committed_tokens == 4 * CS
        assert res.report.tiers == ("mooncake",) and res.hash_note is not None
        assert res.hashes.hash_ok is None and res.hashes.canonical_hash is None
        wire = res.to_wire()
        assert wire["hash_ok"] is None and wire["hash"] == "not applicable" and wire["canonical_hash"] is None
        assert wire["kv_checksum"] == wire["output_hash"]
        sub = c.submit(real + synthetic_tokens(100, seed=92), w=2)
        assert sub.external_tokens == 4 * CS and sub.hash_note is not None and sub.hash_ok is None
        assert sub.to_wire()["hash"] == "not applicable"
        # KV the host computes and stores itself keeps its canonical check.
        own = synthetic_tokens(3 * CS, seed=93)
        first = c.submit(own, w=2)
        assert first.hash_ok is True and first.hash_note is None and "hash" not in first.to_wire()
        again = c.restore(own, w=2)
        assert again.committed_tokens == 3 * CS and again.hashes is not None and again.hashes.hash_ok is True
        assert again.hash_note is None and "hash" not in again.to_wire()
        # The host's /metrics: the same families as the embedded engine, counted where each thing happens.
        from bsr_cli.server import metrics

        text = metrics.exposition(c)
        assert (
            'bsr_restores_total{injected="false",kind="none",outcome="committed",stage="none"} 3' in text
        )  # two restores, one admission
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


# -- The seven ways `probe --store` / `explain --store` misled (issue #22), each over keys real LMCache wrote ------


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run(list(argv))
    return code, out.getvalue(), err.getvalue()


def _run_next(cmdline: str) -> dict[str, Any]:
    """Run a suggested next command exactly as printed (with --json) and return its result."""
    argv = shlex.split(cmdline)
    assert argv[0] == "bsr", cmdline
    code, out, err = _cli("--json", *argv[1:])
    assert code == 0, (cmdline, err)
    return dict(json.loads(out))


def _options_exist(cmdline: str) -> None:
    """Every option of a suggested command exists on that command (the parser refuses unknown ones before --help)."""
    argv = shlex.split(cmdline.split("  #")[0])
    assert argv[0] == "bsr", cmdline
    code, _, err = _cli(*argv[1:], "--help")
    assert code == 0 and "No such option" not in err, (cmdline, err)


def _readable(eng: Any, keys: list[str]) -> str:
    """Ground truth of what can really be read: Mooncake's own get() of each key (empty when the transfer fails)."""
    store = lm.mooncake_store(eng)
    return "".join("1" if len(store.get(k)) else "0" for k in keys)


def test_liveness_fails_closed_where_the_master_cannot_be_asked(tmp_path: Path) -> None:
    """Finding 1: keys with a tag value the master's /query_key cannot take (a space) were counted live with one of
    two holders killed, and the top-level answer was the master's listing. Now each held key's holders come from one
    batched replica query, a chunk is live only on a holder that answers, and the top-level bitmap is the live one
    (checked against what Mooncake's get() can really read)."""
    master = services.start_master(tmp_path)
    holders = [services.start_segment_holder(tmp_path, master, 64 << 20) for _ in range(2)]
    alive = list(holders)
    eng = _engine(master, "real/live", torch.bfloat16, 1, 0)
    try:
        toks = synthetic_tokens(11 * CS, seed=601)
        tags = {"lmcache.tag.user": "alice smith", "lmcache.tag.note": 'a "b"#c&d'}
        keys = _store(eng, toks, request_configs=tags)
        desc = lm.mooncake_store(eng).batch_get_replica_desc(keys)
        where = [{str(r.get_memory_descriptor().buffer_descriptor.transport_endpoint) for r in desc[k]} for k in keys]
        victim = holders[0]
        on_victim = [i for i, eps in enumerate(where) if eps == {victim.info["segment_name"]}]
        if not on_victim or len(on_victim) == len(keys):
            pytest.skip("Mooncake placed every chunk on one holder")
        services.stop(victim, timeout=5)
        alive.remove(victim)
        args = ("--model", "real/live", "--vllm-hash-seed", "none", "--tag", "user=alice smith", "--tag",
                'note=a "b"#c&d')  # fmt: skip
        d = _probe(master, tmp_path, toks, *args)
        e = _explain(master, tmp_path, toks, *args)
        still_listed = victim.info["segment_name"] in {s.segment_name for s in health.segments(master.admin_url)}
        if len(d["liveness"]["segments"]) < 2 or not still_listed:
            pytest.skip("the master dropped the gone holder (its client TTL ran out) before the probes ended")
        truth = _readable(eng, keys)
        assert truth == "".join("0" if i in on_victim else "1" for i in range(len(keys)))
        assert d["bitmap"]["rows"][0]["cells"] == truth  # the top-level answer is what can be read
        assert d["committable_tokens"] == truth.index("0") * CS == min(on_victim) * CS
        live = d["liveness"]
        assert live["listed"]["rows"]["0"] == "1" * len(keys) and live["listed"]["committable_chunks"] == len(keys)
        assert live["stale_chunks"] == len(on_victim) and live["unknown_chunks"] == 0
        assert live["cells"]["0"] == truth.replace("0", "s")
        assert e["verdict"] == "holder-gone" and not e["reusable"], e["summary"]
        assert f"only {min(on_victim)} chunk(s) can really be read" in e["summary"]
    finally:
        _destroy([eng])
        for h in alive:
            services.stop(h, timeout=5)
        services.stop(master, timeout=5)


def test_explain_names_the_closest_group_by_the_diagnosis_ranking(master, tmp_path: Path) -> None:
    """Finding 2: the same prompt stored as bf16 at world size 1 and as fp16 at world size 2, asked at world size 4
    in bf16: the closest group is world size 1 bf16 (one field differs), as the diagnosis's own evidence ranks it,
    never the group the master happens to list first (nor the one holding more chunks but differing in more)."""
    model = "real/closest"
    same = synthetic_tokens(6 * CS, seed=611)
    more = synthetic_tokens(6 * CS, seed=612)
    bf = _engine(master, model, torch.bfloat16, 1, 0)
    fp = [_engine(master, model, torch.float16, 2, w) for w in (0, 1)]
    try:
        for toks, bf_chunks in ((same, 6), (more, 4)):  # `more`: the fp16 copy holds 6 chunks, the bf16 one 4
            _store(bf, toks[: bf_chunks * CS])
            for e in fp:
                _store(e, toks)
        for toks, held in ((same, 6), (more, 4)):
            d = _explain(master, tmp_path, toks, "--model", model, "--world-size", "4", "--dtype", "bf16")
            assert d["verdict"] == "key-format-mismatch", d["summary"]
            f = d["findings"][0]
            assert "differs in world size)" in f["summary"] and f"holds {held} chunk(s)" in f["summary"], f
            assert f["fix"] == "ask with --world-size 1 (or align the deployment's world size)", f["fix"]
            assert f["evidence"][0].startswith("closest group: world size 1, dtype bfloat16"), f["evidence"]
            again = _run_next(d["next"])
            assert again["verdict"] == ("restorable" if held == 6 else "partial"), again["summary"]
            assert bf.lookup(torch.tensor(toks), search_range=["RemoteBackend"]) == held * CS
    finally:
        _destroy([bf, *fp])


def test_explain_next_command_replaces_flags_and_keeps_endpoints(master, tmp_path: Path) -> None:
    """Finding 3: the suggested command is built from the parsed options with the differing ones replaced (tags
    in LMCache's order, each once) and every endpoint kept (--metadata, --master-admin on this master's non-default
    ports); running it matches."""
    model = "real/nextcmd"
    toks = synthetic_tokens(4 * CS, seed=621)
    eng = _engine(master, model, torch.bfloat16, 1, 0)
    try:
        _store(eng, toks, request_configs={"lmcache.tag.lora": "v1", "lmcache.tag.tenant": "acme"})
        d = _explain(master, tmp_path, toks, "--model", model, "--tag", "tenant=acme", "--tag", "lora=v1")
        assert d["verdict"] == "key-format-mismatch", d["summary"]
        argv = shlex.split(d["next"])
        assert argv[:3] == ["bsr", "explain", "--store"]
        tags = [argv[i + 1] for i, a in enumerate(argv) if a == "--tag"]
        assert tags == ["lora=v1", "tenant=acme"], d["next"]
        for flag, value in (("--metadata", master.metadata_url), ("--master-admin", master.admin_url)):
            assert argv.count(flag) == 1 and argv[argv.index(flag) + 1] == value, d["next"]
        assert all(argv.count(f) == 1 for f in ("--model", "--world-size", "--dtype", "--vllm-hash-seed")), argv
        again = _run_next(d["next"])
        assert again["verdict"] == "restorable", again["summary"]
        assert eng.lookup(torch.tensor(toks), search_range=["RemoteBackend"], request_configs={
            "lmcache.tag.lora": "v1", "lmcache.tag.tenant": "acme"}) == 4 * CS  # fmt: skip
    finally:
        _destroy([eng])


def test_partial_last_chunk_with_save_unfull_chunk(master, tmp_path: Path) -> None:
    """Finding 4: with save_unfull_chunk=True LMCache stores the partial last chunk and its lookup returns the
    whole prompt (3,000 tokens); so does the probe."""
    model = "real/unfull"
    toks = synthetic_tokens(3000, seed=631)
    eng = _engine(master, model, torch.bfloat16, 1, 0, save_unfull_chunk=True)
    try:
        keys = _store(eng, toks)
        assert len(keys) == 12 and _exists(eng, keys) == "1" * 12
        truth = eng.lookup(torch.tensor(toks), search_range=["RemoteBackend"])
        assert truth == 3000
        d = _probe(master, tmp_path, toks, "--model", model)
        assert d["committable_tokens"] == truth and d["committable_chunks"] == 12
        assert d["bitmap"]["rows"][0]["cells"] == "1" * 12 and d["first_break"] is None
        assert d["storable_chunks"] == 12 and d["tail"] == {"tokens": 3000 - 11 * CS, "stored": True}
        e = _explain(master, tmp_path, toks, "--model", model)
        assert e["verdict"] == "restorable" and "(3,000 tokens)" in e["summary"], e["summary"]
    finally:
        _destroy([eng])


def test_tag_values_with_an_at_sign(master, tmp_path: Path) -> None:
    """Finding 5: LMCache writes tag values with '@' verbatim (``user%alice@example.com``): the probe takes them,
    and without --tag `explain` names the tag (not never-stored) in a command that then matches."""
    model = "real/at-tag"
    toks = synthetic_tokens(5 * CS, seed=641)
    eng = _engine(master, model, torch.bfloat16, 1, 0)
    try:
        keys = _store(eng, toks, request_configs={"lmcache.tag.user": "alice@example.com"})
        assert keys[0].endswith("@bfloat16@user%alice@example.com")
        lm.mooncake_store(eng).remove(keys[3], True)
        truth = _exists(eng, keys)
        assert truth == "11101"
        d = _probe(master, tmp_path, toks, "--model", model, "--tag", "user=alice@example.com")
        assert d["bitmap"]["rows"][0]["cells"] == truth and d["key_example"] == keys[0]
        lookup = eng.lookup(torch.tensor(toks), search_range=["RemoteBackend"],
                            request_configs={"lmcache.tag.user": "alice@example.com"})  # fmt: skip
        assert d["committable_tokens"] == lookup == 3 * CS
        e = _explain(master, tmp_path, toks, "--model", model)
        assert e["verdict"] == "key-format-mismatch", e["summary"]
        assert "--tag user=alice@example.com" in e["findings"][0]["fix"]
        assert _run_next(e["next"])["verdict"] == "evicted"
    finally:
        _destroy([eng])


def _with_vllm_start(monkeypatch: pytest.MonkeyPatch, seed: str) -> None:
    """LMCache inside vLLM starts its chain at vLLM's NONE_HASH (hash of the PYTHONHASHSEED string in vLLM's
    process); LMCache's token database reads it from this module global, which vLLM's import sets."""
    from lmcache.v1 import token_database

    from bsr_cli.core.lmcache_keys import vllm_seeded_start

    monkeypatch.setattr(token_database, "NONE_HASH", vllm_seeded_start(seed))


def test_an_unknown_vllm_hash_seed_is_a_key_format_mismatch(master, tmp_path: Path, monkeypatch) -> None:
    """Finding 6: keys stored under a vLLM hash seed outside the auto-detected list are not "never-stored": the
    store holds the prompt under a chain start no candidate gives, which the diagnosis confirms from the keys."""
    model = "real/seed-777"
    toks = synthetic_tokens(5 * CS, seed=651)
    eng = _engine(master, model, torch.bfloat16, 1, 0)
    try:
        _with_vllm_start(monkeypatch, "777")
        keys = _store(eng, toks)
        assert _exists(eng, keys) == "11111"
        e = _explain(master, tmp_path, toks, "--model", model)
        assert e["verdict"] == "key-format-mismatch", e["summary"]
        assert e["summary"].startswith("key-format mismatch (hash seed unknown)"), e["summary"]
        assert "holds 5 chunk(s) of this prompt" in e["summary"]
        assert "--vllm-hash-seed SEED" in e["next"]
        again = _run_next(e["next"].replace("SEED", "777"))
        assert again["verdict"] == "restorable", again["summary"]
        # A prompt the store does not hold stays never-stored.
        other = _explain(master, tmp_path, synthetic_tokens(5 * CS, seed=652), "--model", model)
        assert other["verdict"] == "never-stored", other["summary"]
    finally:
        _destroy([eng])


def test_labels_match_the_engine(master, tmp_path: Path, monkeypatch) -> None:
    """Finding 7: a 3,000-token prompt is 3,000 tokens = 12 chunks, 11 storable (and restorable when those 11 are
    held); the group is `attn` as the engine calls it; two matching hash chains are said; every next command
    `explain --store` suggests uses options its command has."""
    model = "real/labels"
    toks = synthetic_tokens(3000, seed=661)
    eng = _engine(master, model, torch.bfloat16, 1, 0)
    try:
        _store(eng, toks)
        assert eng.lookup(torch.tensor(toks), search_range=["RemoteBackend"]) == 11 * CS
        tf = tmp_path / "labels.json"
        tf.write_text(json.dumps(toks))
        base = ("probe", "--store", f"mooncake://{master.rpc_address}", "--metadata", master.metadata_url,
                "--master-admin", master.admin_url, "--tokens-file", str(tf), "--model", model)  # fmt: skip
        code, text, err = _cli(*base, "--width", "40")
        assert code == 0, err
        assert "prompt 3,000 tokens = 12 chunks" in text and "storable: 11 of 12 chunks (2,816 tokens)" in text, text
        d = _probe(master, tmp_path, toks, "--model", model)
        assert [r["group"] for r in d["bitmap"]["rows"]] == ["attn"]
        assert d["prompt_tokens"] == 3000 and d["prompt_chunks"] == 12 and d["storable_chunks"] == 11
        assert d["committable_tokens"] == 11 * CS and d["first_break"] is None
        e = _explain(master, tmp_path, toks, "--model", model)
        assert e["verdict"] == "restorable" and e["chunks"] == 12 and e["tokens"] == 3000, e["summary"]
        for f in e["findings"]:
            _options_exist(f["next"])

        # The same prompt stored under vLLM's seed-0 and seed-1 starts: both chains match, and the probe says so.
        twice = synthetic_tokens(4 * CS, seed=662)
        for seed in ("0", "1"):
            _with_vllm_start(monkeypatch, seed)
            _store(eng, twice)
        monkeypatch.undo()
        d = _probe(master, tmp_path, twice, "--model", model)
        hs = d["key_format"]["hash_start"]
        assert hs["chains_matched"] == ["vLLM hash seed 0", "vLLM hash seed 1"] and hs["vllm_hash_seed"] == "0", hs
        tf.write_text(json.dumps(twice))
        code, text, err = _cli(*base)
        assert code == 0 and "2 hash chains matched" in text, (text, err)

        # Every verdict's next command uses options that exist: never-stored, partial, evicted, a mismatch.
        gap = synthetic_tokens(4 * CS, seed=663)
        gkeys = _store(eng, gap)
        lm.mooncake_store(eng).remove(gkeys[1], True)
        for prompt, extra in (
            (synthetic_tokens(2 * CS, seed=664), ()),
            (gap, ()),
            (gap[: 2 * CS] + synthetic_tokens(2 * CS, seed=665), ()),
            (toks, ("--dtype", "fp16")),
        ):
            e = _explain(master, tmp_path, prompt, "--model", model, *extra)
            for f in e["findings"]:
                _options_exist(f["next"])
    finally:
        _destroy([eng])
