"""`bsr probe --store`: a real Mooncake store, written in LMCache's key format by the test itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_key
from bsr_cli.engine import services
from bsr_cli.errors import ExitCode

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def test_lmcache_hash_is_prefix_chained_and_seed_independent() -> None:
    toks = synthetic_tokens(1000, 3)
    hs = lmcache_chunk_hashes(toks)
    assert len(hs) == 3  # only full chunks
    assert hs[0] == hash((0, tuple(toks[:256]), ()))
    assert hs[1] == hash((hs[0], tuple(toks[256:512]), ()))


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
    from bsr_cli.engine.tiers.mooncake import MooncakeTier
    from bsr_cli.runtime.checksum import crc32c

    tier = MooncakeTier(master.rpc_address, master.metadata_url)
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
    assert rows == {0: "11111", 1: "11101"}
    assert d["committable_chunks"] == 3
    assert d["first_break"] == {"chunk": 3, "rank": 1, "group": "kv", "held_by": [], "reason": "missing in every tier"}
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
