"""`bsr probe --store`: a real Mooncake store, written in LMCache's key format by the test itself.

These tests cover the command (bitmaps, diagnosis, liveness, log noise) with keys from bsr's own key function;
that LMCache really writes these keys is proven against LMCache itself in tests/plugins/test_lmcache_store_keys.py
(and, under vLLM, tests/vllm/test_store_keys_vllm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bsr_cli.cli.commands.probe_options import PromptFlags, StoreProbeOptions
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.lmcache_keys import (
    lmcache_chunk_hashes,
    lmcache_dtype,
    lmcache_key,
    lmcache_tail_hash,
    parse_lmcache_key,
    parse_tags,
    python_str_hash,
    vllm_seeded_start,
)
from bsr_cli.errors import ExitCode, InvalidInput
from bsr_cli.mooncake import health, services

# Engine tests are marked by the fixtures they use (tests/conftest.py); the pure ones here run anywhere.
pytestmark = [pytest.mark.timeout(120)]


def test_lmcache_hash_is_prefix_chained_and_seed_independent() -> None:
    toks = synthetic_tokens(1000, 3)
    hs = lmcache_chunk_hashes(toks)
    assert len(hs) == 3  # only full chunks
    assert hs[0] == hash((0, tuple(toks[:256]), ()))
    assert hs[1] == hash((hs[0], tuple(toks[256:512]), ()))


def test_str_hash_matches_cpython_under_each_seed() -> None:
    """vLLM's chain start is hash(PYTHONHASHSEED) in a process running with that seed: checked against CPython."""
    for seed in (0, 1, 42, 4294967295):
        code = f"print(hash('{seed}'), hash('é'*9), hash('日本'))"
        env = dict(os.environ, PYTHONHASHSEED=str(seed))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        want = [int(x) for x in out.stdout.split()]
        assert [python_str_hash(str(seed), seed), python_str_hash("é" * 9, seed), python_str_hash("日本", seed)] == want
    assert vllm_seeded_start("0") == python_str_hash("0", 0) != 0


def test_key_names_and_parsing() -> None:
    assert [lmcache_dtype(d) for d in ("fp16", "half", "bf16", "float32", "fp8_e4m3fn", "fp8", "float8_e5m2")] == [
        "half",
        "half",
        "bfloat16",
        "float",
        "fp8_e4m3fn",
        "fp8_e4m3fn",
        "fp8_e5m2",
    ]
    p = parse_lmcache_key("org/m@1@0@-1f3a@bfloat16@user%alice@tier%gold")
    assert p is not None and p.model == "org/m" and p.chunk_hash == "-1f3a"
    assert p.tags == (("user", "alice"), ("tier", "gold")) and p.layer_id is None
    q = parse_lmcache_key("m@x@2@1@ab@half@3")  # a model name with '@', a layerwise key
    assert q is not None and (q.model, q.world_size, q.worker_id, q.dtype, q.layer_id) == ("m@x", 2, 1, "half", 3)
    assert parse_lmcache_key("not-a-key") is None and parse_lmcache_key("m@1@0@ab@float16") is None


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("mc")
    master = services.start_master(d)
    seg = None
    try:
        seg = services.start_segment_holder(d, master, 64 << 20)
        yield master
    finally:
        if seg is not None:
            services.stop(seg)
        services.stop(master)


def _write(master, keys: list[str]) -> None:
    from bsr_cli.runtime.checksum import crc32c
    from bsr_cli.tiers.mooncake import MooncakeTier

    # The test's own setup, not what it checks: a put of ~1,100 objects may take longer than the tier's default
    # 10 s beside other load.
    tier = MooncakeTier(master.rpc_address, master.metadata_url, call_timeout_s=120.0)
    try:
        payload = memoryview(bytearray(4096))
        tier.put(keys, [payload] * len(keys), [crc32c(payload)] * len(keys))
    finally:
        tier.close()


def test_store_probe_shows_which_ranks_hold_which_chunks(bsr, store, tmp_path: Path) -> None:
    toks = synthetic_tokens(5 * 256 + 40, 9)
    hs = lmcache_chunk_hashes(toks)
    # Worker 0 holds all 5 chunks; worker 1 lost chunk 3.
    keys = [lmcache_key("demo/model", 2, 0, h, "bfloat16") for h in hs]
    keys += [lmcache_key("demo/model", 2, 1, h, "bfloat16") for i, h in enumerate(hs) if i != 3]
    _write(store, keys)
    tf = tmp_path / "tokens.json"
    tf.write_text(json.dumps(toks))
    args = [
        "probe",
        "--store",
        f"mooncake://{store.rpc_address}",
        "--metadata",
        store.metadata_url,
        "--master-admin",
        store.admin_url,
        "--model",
        "demo/model",
        "--world-size",
        "2",
        "--tokens-file",
        str(tf),
    ]
    d = bsr(*args, "--json").json()
    rows = {r["rank"]: r["cells"] for r in d["bitmap"]["rows"]}
    # 5 full chunks and a 40-token tail LMCache stores only with save_unfull_chunk (not written here).
    assert rows == {0: "111110", 1: "111010"}
    assert d["prompt_chunks"] == 6 and d["storable_chunks"] == 5 and d["tail"] == {"tokens": 40, "stored": False}
    assert d["committable_chunks"] == 3
    brk = {"chunk": 3, "rank": 1, "group": "attn", "held_by": [], "reason": "missing in every tier"}
    assert d["first_break"] == brk
    text = bsr(*args)
    assert text.code == 0 and "first break" in text.out

    # The same prompt asked with the wrong TP degree: nothing matches, and the store's keys say why.
    wrong = bsr(*[a if a != "2" else "4" for a in args], "--json").json()
    assert wrong["committable_chunks"] == 0
    assert any("world size 2" in c for c in wrong["diagnosis"]["causes"])
    other = bsr(*[a if a != "demo/model" else "other/model" for a in args], "--json").json()
    assert any("no keys for model 'other/model'" in c for c in other["diagnosis"]["causes"])
    tf.write_text(json.dumps(synthetic_tokens(5 * 256, 10)))  # other tokens: other chunk hashes
    seedless = bsr(*args, "--json").json()
    assert any("hash seed" in c for c in seedless["diagnosis"]["causes"])


def test_store_probe_bad_address(bsr, tmp_path: Path) -> None:
    tf = tmp_path / "t.json"
    tf.write_text("[1, 2, 3]")
    r = bsr("probe", "--store", "redis://x", "--model", "m", "--tokens-file", str(tf))
    assert r.code == ExitCode.INVALID_INPUT and "mooncake://HOST:PORT" in r.err
    port = services.free_port()
    r = bsr(
        "--timeout",
        "3",
        "probe",
        "--store",
        f"mooncake://127.0.0.1:{port}",
        "--metadata",
        f"http://127.0.0.1:{port}/metadata",
        "--model",
        "m",
        "--tokens-file",
        str(tf),
    )
    assert r.code == ExitCode.ENGINE_UNREACHABLE and "cannot reach the Mooncake store" in r.err


def _args(store, tf: Path, *extra: str) -> list[str]:
    return [
        "probe",
        "--store",
        f"mooncake://{store.rpc_address}",
        "--metadata",
        store.metadata_url,
        "--master-admin",
        store.admin_url,
        "--tokens-file",
        str(tf),
        *extra,
    ]


def test_dtype_tags_and_vllm_start(bsr, store, tmp_path: Path) -> None:
    """fp16 keys under LMCache's name, tags, and a vLLM-seeded chain: exact bitmaps with the right flags, and the
    seeded start found by auto-detection; a miss names the closest group and the one flag that fixes it."""
    toks = synthetic_tokens(4 * 256 + 7, 21)
    seeded = lmcache_chunk_hashes(toks, start=vllm_seeded_start("42"))
    keys = [lmcache_key("tag/model", 1, 0, h, "half", (("user", "alice"),)) for i, h in enumerate(seeded) if i != 2]
    _write(store, keys)
    tf = tmp_path / "t.json"
    tf.write_text(json.dumps(toks))
    base = _args(store, tf, "--model", "tag/model", "--dtype", "fp16")
    d = bsr(*base, "--tag", "user=alice", "--json").json()
    assert d["bitmap"]["rows"][0]["cells"] == "11010" and d["committable_chunks"] == 2
    assert d["key_format"]["hash_start"]["vllm_hash_seed"] == "42" and d["key_format"]["hash_start"]["detected"]
    assert d["key_example"].endswith("@half@user%alice")
    # The explicit seed gives the same; the wrong one (and 'none') match nothing.
    assert bsr(*base, "--tag", "user=alice", "--vllm-hash-seed", "42", "--json").json()["committable_chunks"] == 2
    wrong = bsr(*base, "--tag", "user=alice", "--vllm-hash-seed", "none", "--json").json()
    assert wrong["committable_chunks"] == 0
    assert wrong["diagnosis"]["causes"][0].endswith("pass --vllm-hash-seed 42")
    # One flag off each: the diagnosis names that flag.
    for extra, flag in (
        (["--tag", "user=bob"], "--tag user=alice"),
        ([], "--tag user=alice"),
        (["--tag", "user=alice", "--dtype", "bf16"], "--dtype fp16"),
    ):
        miss = bsr(*_args(store, tf, "--model", "tag/model", "--dtype", "fp16"), *extra, "--json").json()
        assert miss["committable_chunks"] == 0
        assert miss["diagnosis"]["causes"][0].endswith(f"pass {flag}"), miss["diagnosis"]
    r = bsr(*base, "--vllm-hash-seed", "random")
    assert r.code == ExitCode.INVALID_INPUT and "PYTHONHASHSEED" in r.err
    r = bsr(*base, "--dtype", "float17")
    assert r.code == ExitCode.INVALID_INPUT and "unknown KV dtype" in r.err


def test_mixed_groups_are_each_diagnosed(bsr, store, tmp_path: Path) -> None:
    toks = synthetic_tokens(3 * 256, 22)
    hs = lmcache_chunk_hashes(toks)
    other = lmcache_chunk_hashes(synthetic_tokens(3 * 256, 23))
    keys = [lmcache_key("mix/model", 2, w, h, "bfloat16") for w in (0, 1) for h in hs]
    keys += [lmcache_key("mix/model", 1, 0, h, "fp8_e4m3fn") for h in other]
    _write(store, keys)
    tf = tmp_path / "t.json"
    tf.write_text(json.dumps(toks))
    d = bsr(*_args(store, tf, "--model", "mix/model", "--dtype", "fp8", "--json")).json()
    diag = d["diagnosis"]
    assert d["committable_chunks"] == 0 and len(diag["groups"]) == 2
    assert "world size 2, dtype bfloat16" in diag["causes"][0]
    assert diag["causes"][0].endswith("pass --world-size 2 and --dtype bf16")
    assert "mixed: 2 groups" in diag["causes"][1]
    fp8 = next(g for g in diag["groups"] if g["dtype"] == "fp8_e4m3fn")
    assert fp8["prompt_chunks_held"] == 0 and fp8["differs_in"] == []
    ok = bsr(*_args(store, tf, "--model", "mix/model", "--world-size", "2", "--json")).json()
    assert ok["committable_chunks"] == 3 and "diagnosis" not in ok


@pytest.mark.timeout(180)
@pytest.mark.engine
def test_liveness_and_quiet_mooncake_logs(tmp_path: Path) -> None:
    """A killed segment holder: the master still lists its keys, the probe says the holders are gone. Mooncake's
    own log lines stay off stderr unless --verbose (a subprocess: glog writes to the file descriptor)."""
    master = services.start_master(tmp_path)
    seg = services.start_segment_holder(tmp_path, master, 32 << 20)
    try:
        toks = synthetic_tokens(2 * 256, 31)
        _write(master, [lmcache_key("live/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks)])
        tf = tmp_path / "t.json"
        tf.write_text(json.dumps(toks))
        cmd = [sys.executable, "-m", "bsr_cli", *_args(master, tf, "--model", "live/model", "--vllm-hash-seed", "none")]

        def probe(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=60)

        up = probe("--json")
        d = json.loads(up.stdout)
        assert d["committable_chunks"] == 2 and d["liveness"]["segments_alive"] == 1
        assert d["liveness"]["stale_chunks"] == 0 and d["liveness"]["live_committable_chunks"] == 2
        assert up.stderr == "", up.stderr
        loud = probe("--verbose")
        assert loud.returncode == 0 and "InitGoogleLogging" in loud.stderr, loud.stderr
        services.stop(seg)
        seg = None
        gone = probe("--json")
        g = json.loads(gone.stdout)
        listed = health.segments(master.admin_url)
        if not listed:  # the master's client TTL ran out already: nothing held, nothing stale
            pytest.skip("the master dropped the dead holder before the probe ran")
        assert g["liveness"]["listed"]["committable_chunks"] == 2  # "held" per the master's metadata
        assert g["liveness"]["segments_alive"] == 0 and g["liveness"]["stale_chunks"] == 2
        assert g["liveness"]["live_committable_chunks"] == 0
        assert g["committable_chunks"] == 0 and g["bitmap"]["rows"][0]["cells"] == "00"  # the answer is the live one
        text = probe()
        assert "holder(s) alive" in text.stdout and "gone" in text.stdout and text.stderr == ""
    finally:
        if seg is not None:
            services.stop(seg)
        services.stop(master)


@pytest.mark.timeout(180)
@pytest.mark.engine
def test_liveness_names_the_chunks_on_a_gone_holder(bsr, tmp_path: Path) -> None:
    """Two holders, one killed: exactly the keys whose replica sat on it are reported stale (ground truth: the
    master's own replica listing, read before the kill)."""
    import urllib.request

    master = services.start_master(tmp_path)
    segs = [services.start_segment_holder(tmp_path, master, 32 << 20) for _ in range(2)]
    alive = list(segs)
    try:
        toks = synthetic_tokens(16 * 256, 41)
        keys = [lmcache_key("two/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks)]
        _write(master, keys)
        where = []
        for k in keys:
            url = f"{master.admin_url}/query_key?key={k}"  # the master reads it verbatim
            doc = json.loads(urllib.request.urlopen(url, timeout=30).read())
            where.append({r["transport_endpoint_"] for r in doc["data"]})
        victim = segs[0]
        name = victim.info["segment_name"]
        on_victim = [i for i, eps in enumerate(where) if eps == {name}]
        if not on_victim or len(on_victim) == len(keys):
            pytest.skip("Mooncake placed every object on one holder")
        services.stop(victim)
        alive.remove(victim)
        tf = tmp_path / "t.json"
        tf.write_text(json.dumps(toks))
        d = bsr(*_args(master, tf, "--model", "two/model", "--vllm-hash-seed", "none", "--json")).json()
        if len(d["liveness"]["segments"]) < 2:
            pytest.skip("the master dropped the dead holder before the probe ran")
        assert d["liveness"]["listed"]["committable_chunks"] == 16  # the master's metadata still lists every key
        assert d["committable_chunks"] == min(on_victim)  # the top-level answer is the live one
        live = d["liveness"]
        assert live["segments_alive"] == 1 and live["stale_chunks"] == len(on_victim)
        assert live["live_rows"]["0"] == "".join("0" if i in on_victim else "1" for i in range(16))
        assert live["live_committable_chunks"] == min(on_victim)
    finally:
        for s in alive:
            services.stop(s)
        services.stop(master)


def test_tags_with_at_signs_and_the_partial_tail() -> None:
    """LMCache writes tag values verbatim, '@' included; a key with such a value parses back to the same tags. A
    value that would read back as another tag ('x%y' after an '@') is refused."""
    assert parse_tags(["user=alice@example.com", "lmcache.tag.t=a@b@"]) == (
        ("user", "alice@example.com"),
        ("t", "a@b@"),
    )
    key = lmcache_key("org/m", 1, 0, -0x1F3A, "bfloat16", (("user", "alice@example.com"), ("t", "x")))
    assert key == "org/m@1@0@-1f3a@bfloat16@user%alice@example.com@t%x"
    p = parse_lmcache_key(key)
    assert p is not None and p.tags == (("user", "alice@example.com"), ("t", "x")) and p.model == "org/m"
    for bad in ("user=a@b%c", "us@er=x", "u%=x", "novalue"):
        with pytest.raises(InvalidInput):
            parse_tags([bad])
    toks = synthetic_tokens(3000, 5)
    full = lmcache_chunk_hashes(toks)
    assert len(full) == 11 and lmcache_chunk_hashes(toks, limit=3) == full[:3]
    assert lmcache_tail_hash(toks, 256, full[-1]) == hash((full[-1], tuple(toks[2816:]), ()))
    assert lmcache_tail_hash(toks[:2816], 256, full[-1]) is None


def test_next_command_replaces_options_and_keeps_endpoints() -> None:
    opts = StoreProbeOptions(
        "mooncake://10.0.0.5:50051",
        model="org/m",
        world_size=4,
        metadata="http://10.0.0.5:18080/metadata",
        admin="http://10.0.0.5:19003",
        dtype="bf16",
        tags=("tenant=acme", "lora=v1"),
        chunk_size=128,
    )
    prompt = PromptFlags(tokens_file=Path("/tmp/my prompt.json"))
    cmd = opts.command("explain", prompt, {"world_size": 1, "tags": ["lora=v1", "tenant=acme"]})
    assert cmd == (
        "bsr explain --store mooncake://10.0.0.5:50051 --metadata http://10.0.0.5:18080/metadata --master-admin "
        "http://10.0.0.5:19003 --model org/m --world-size 1 --dtype bf16 --tag lora=v1 --tag tenant=acme "
        "--vllm-hash-seed auto --chunk-size 128 --tokens-file '/tmp/my prompt.json'"
    )
    with pytest.raises(ValueError, match="not of `bsr restore`"):
        opts.command("restore", prompt)
    with pytest.raises(ValueError, match="not a key-format field"):
        opts.command("probe", prompt, {"model": "x"})


def test_store_probe_imports_only_what_it_needs(store, tmp_path: Path) -> None:
    """The store probe's path (options, the Mooncake client, liveness, JSON output) imports no renderer, no engine
    runtime or tier stack, no HTTP client library, no torch and no pydantic (its options are plain values): a probe
    is typed during an incident."""
    toks = synthetic_tokens(2 * 256, 51)
    _write(store, [lmcache_key("imports/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks)])
    tf = tmp_path / "t.json"
    tf.write_text(json.dumps(toks))
    argv = ["--json", *_args(store, tf, "--model", "imports/model")]
    code = (
        "import io, contextlib, json, sys\n"
        "from bsr_cli.cli.main import run\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        f"    assert run({argv!r}) == 0\n"
        "assert json.loads(buf.getvalue())['committable_chunks'] == 2\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    heavy = {"rich", "torch", "httpx", "numpy", "textual", "yaml", "pydantic"}
    ours = ("bsr_cli.runtime", "bsr_cli.tiers", "bsr_cli.api", "bsr_cli.client", "bsr_cli.engine", "bsr_cli.server")
    assert not {m.split(".")[0] for m in loaded} & heavy, {m.split(".")[0] for m in loaded} & heavy
    assert not [m for m in loaded if m.startswith(ours)], [m for m in loaded if m.startswith(ours)]
    assert "mooncake.store" in loaded


def test_store_probe_process_keeps_its_exit_code(store, tmp_path: Path) -> None:
    """`bsr` ends a store probe without the Mooncake client's slow teardown; its output and exit code stay whole:
    a result, and a failure found after the client connected (a bad token file)."""
    toks = synthetic_tokens(3 * 256, 52)
    _write(store, [lmcache_key("exit/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks)])
    tf = tmp_path / "t.json"
    tf.write_text(json.dumps(toks))
    cmd = [sys.executable, "-m", "bsr_cli", "--json", *_args(store, tf, "--model", "exit/model")]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["committable_chunks"] == 3, ok.stderr
    tf.write_text("[1, 2, -3]")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == ExitCode.INVALID_INPUT and "token ids must be in" in bad.stderr, bad.stderr
    assert json.loads(bad.stdout)["exit_code"] == ExitCode.INVALID_INPUT


@pytest.mark.timeout(240)
@pytest.mark.engine
def test_liveness_has_no_query_cap(bsr, tmp_path: Path) -> None:
    """More held chunks than the old per-key replica lookups covered (1,024), one of two holders killed: every
    chunk on the gone holder is stale, none is counted live (ground truth: the master's own per-key listing, read
    before the kill)."""
    import urllib.request

    master = services.start_master(tmp_path)
    segs = [services.start_segment_holder(tmp_path, master, 32 << 20) for _ in range(2)]
    alive = list(segs)
    try:
        cs, n = 16, 1100
        toks = synthetic_tokens(n * cs, 61)
        keys = [lmcache_key("cap/model", 1, 0, h, "bfloat16") for h in lmcache_chunk_hashes(toks, cs)]
        _write(master, keys)
        where = []
        for k in keys:
            doc = json.loads(urllib.request.urlopen(f"{master.admin_url}/query_key?key={k}", timeout=30).read())
            where.append({r["transport_endpoint_"] for r in doc["data"]})
        victim = segs[0]
        on_victim = {i for i, eps in enumerate(where) if eps == {victim.info["segment_name"]}}
        if not [i for i in on_victim if i >= 1024] or len(on_victim) == n:
            pytest.skip("Mooncake placed no chunk past the 1,024th on the victim")
        services.stop(victim)
        alive.remove(victim)
        tf = tmp_path / "t.json"
        tf.write_text(json.dumps(toks))
        args = _args(master, tf, "--model", "cap/model", "--vllm-hash-seed", "none", "--chunk-size", str(cs))
        d = bsr(*args, "--json").json()
        if len(d["liveness"]["segments"]) < 2:
            pytest.skip("the master dropped the dead holder before the probe ran")
        truth = "".join("0" if i in on_victim else "1" for i in range(n))
        assert d["liveness"]["live_rows"]["0"] == truth == d["bitmap"]["rows"][0]["cells"]
        assert d["liveness"]["stale_chunks"] == len(on_victim) and d["liveness"]["unknown_chunks"] == 0
        assert d["committable_chunks"] == min(on_victim)
    finally:
        for s in alive:
            services.stop(s)
        services.stop(master)


def test_unknown_liveness_is_never_counted() -> None:
    """A listed chunk whose replicas the master did not name, or whose holder could not be checked, is unknown: it
    is reported as such and ends the live prefix like a missing chunk (unknown is not yes)."""
    from bsr_cli.core.store_match import Holders, ListedSegment, liveness
    from bsr_cli.core.store_probe import HolderState

    holders = Holders([ListedSegment("h1", "h1", 1), ListedSegment("h2", "")], None)
    holders.alive.update({"h1": True, "h2": False})  # h3: not checked (unknown)
    rows = [["k0", "k1", "k2", "k3", "k4", "k5"]]
    listed = {0: [True, True, True, True, True, False]}
    replicas = {"k0": ["h1"], "k1": ["h2", "h1"], "k2": ["h3"], "k4": ["h2"]}  # k3: not named by the master
    live = liveness(holders, rows, listed, replicas, 256)
    assert live.cells == ("11uus0",)
    wire = live.to_wire()
    assert live.live_committable_chunks == 2 and wire["live_rows"]["0"] == "110000"
    assert (wire["live_chunks"], live.stale_chunks, live.unknown_chunks) == (2, 1, 2)
    assert wire["listed"] == {"rows": {"0": "111110"}, "committable_chunks": 5}
    states = {s.name: s.state for s in live.segments}
    assert states == {"h1": HolderState.ALIVE, "h2": HolderState.GONE, "h3": HolderState.UNKNOWN}
