"""bsr's checksums on LMCache's Mooncake path (lmcache_bsr/integrity.py), against real LMCache 0.5.6 and a real
Mooncake master and segment holder: every object stored through the wrapped connector gets a checksum sidecar bound
to its key and length; a load verifies each object as the object of its key; a flipped byte, another chunk's object
copied under the key with its sidecar, or bytes appended to a stored object is dropped, named and removed, and the
next store writes it again; without the wrapper the corrupted bytes come back (negative control). An object without
a sidecar (stock LMCache) is refused and left in place; one with an older bsr's bytes-only sidecar is refused and
removed, so the next store rewrites it with a bound checksum; both load, unverified, when allowed. `bsr probe
--store` counts the held chunks that carry no checksum of this format.

Run through scripts/test-plugins (a venv with LMCache); skipped elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache")

import torch
from lmcache_bsr import _lmcache as lm
from lmcache_bsr import integrity
from test_lmcache_store_keys import CS, _destroy, _engine, _explain, _probe, _store

from bsr_cli.core.evidence import FailureKind, Outcome, Stage
from bsr_cli.core.integrity import Sidecar, SidecarKind, decode_sidecar, sidecar_key
from bsr_cli.core.keys import CHECKSUM_SIDECAR_SUFFIX, synthetic_tokens
from bsr_cli.mooncake import services
from bsr_cli.runtime.checksum import crc32c

pytestmark = pytest.mark.timeout(240)
CHUNKS = 3


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


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    _destroy(made)


def _fetch(eng: Any, keys: list[str], tokens: list[int]) -> list[Any]:
    """The chunks' memory objects as LMCache's remote backend hands them to a load (verified when wrapped)."""
    cek = [k for _, _, k in lm.chunk_keys(eng, tokens)]
    assert [lm.key_string(k) for k in cek] == keys
    return lm.fetch_window(eng, cek, ["RemoteBackend"] * len(cek))


def _bytes_of(objs: list[Any]) -> list[bytes | None]:
    out = [None if o is None else bytes(o.tensor.contiguous().view(torch.uint8).flatten().numpy()) for o in objs]
    lm.release_objects(objs)
    return out


def _flip(eng: Any, key: str) -> None:
    store = lm.mooncake_store(eng)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    assert store.upsert(key, bytes(data)) == 0


def _setup(
    master: Any, engines: list[Any], model: str, *, wrap: Callable[[Any], Any] | None, seed: int
) -> tuple[Any, list[int], list[str]]:
    eng = _engine(master, model, torch.float16, 1, 0)
    engines.append(eng)
    if wrap is not None:
        wrap(eng)
    tokens = synthetic_tokens(CHUNKS * CS, seed=seed)
    return eng, tokens, _store(eng, tokens)


def _verified(master: Any, engines: list[Any], model: str, seed: int) -> tuple[Any, list[int], list[str], Any]:
    """A prompt stored through bsr's checksum wrapper (refusing unverified chunks): engine, tokens, keys, wrapper."""
    sums: list[Any] = []
    eng, tokens, keys = _setup(
        master, engines, model, wrap=lambda e: sums.append(integrity.install(e, load_unverified=False)), seed=seed
    )
    (cs,) = sums
    assert cs is not None
    return eng, tokens, keys, cs


def _sidecar(eng: Any, key: str) -> Sidecar:
    return decode_sidecar(lm.mooncake_store(eng).get(sidecar_key(key)))


def test_verdicts_judge_the_length_and_the_checksum_bound_to_the_key() -> None:
    bound = Sidecar(SidecarKind.BOUND, crc=5, length=100)
    assert integrity.judge(bound, 100, lambda: 5) == (integrity.Verdict.OK, "")
    assert integrity.judge(bound, 100, lambda: 6) == (integrity.Verdict.MISMATCH, "checksum mismatch")
    assert integrity.judge(bound, 103, lambda: 5)[0] is integrity.Verdict.MISMATCH  # grown: never even hashed
    assert integrity.judge(bound, 103, None)[1] == "wrong length (103 bytes, its checksum is for 100)"
    assert integrity.judge(bound, 100, None)[0] is integrity.Verdict.OK  # not arrived, right length: the transfer
    for kind in (SidecarKind.NONE, SidecarKind.LEGACY):
        assert integrity.judge(Sidecar(kind), 100, lambda: 5)[0] is integrity.Verdict.UNVERIFIED
    assert integrity.sidecar_key("m@1@0@ab@half") == "m@1@0@ab@half" + CHECKSUM_SIDECAR_SUFFIX
    assert integrity.chunk_of(["a", "b", "c"], "c") == 2 and integrity.chunk_of(["a"], "z") is None
    f = integrity.Finding("k", integrity.Verdict.MISMATCH, True, removed=True, detail="checksum mismatch")
    assert f.describe(4) == "checksum mismatch in chunk 4 (tier mooncake, key k); removed from the store"


def test_flipped_byte_in_a_stored_object_is_dropped_and_named(master, engines, tmp_path: Path) -> None:
    eng, tokens, keys, cs = _verified(master, engines, "integrity/flip", seed=11)
    # Every stored object has its checksum beside it in the same store.
    store = lm.mooncake_store(eng)
    assert store.batch_is_exist([integrity.sidecar_key(k) for k in keys]) == [1] * CHUNKS
    assert all(_sidecar(eng, k).kind is SidecarKind.BOUND for k in keys)
    clean = _bytes_of(_fetch(eng, keys, tokens))
    assert all(b is not None for b in clean) and cs.take() == []

    _flip(eng, keys[1])
    got = _bytes_of(_fetch(eng, keys, tokens))
    assert got[0] == clean[0] and got[1] is None and got[2] == clean[2]
    (f,) = cs.take()
    assert f.key == keys[1] and f.verdict is integrity.Verdict.MISMATCH and f.dropped and f.tier == "mooncake"
    assert cs.counts[integrity.Verdict.MISMATCH] == 1
    # The corrupted object and its checksum are gone, so a store of the chunk writes both afresh.
    assert f.removed and store.batch_is_exist([keys[1], integrity.sidecar_key(keys[1])]) == [0, 0]
    assert _store(eng, tokens) == keys
    assert store.batch_is_exist([integrity.sidecar_key(k) for k in keys]) == [1] * CHUNKS
    assert _bytes_of(_fetch(eng, keys, tokens)) == clean and cs.take() == []

    # The store probe: every held chunk carries a checksum.
    d = _probe(master, tmp_path, tokens, "--model", "integrity/flip", "--dtype", "fp16")
    assert d["integrity"]["checksummed_chunks"] == CHUNKS and d["integrity"]["unverified_chunks"] == 0
    e = _explain(master, tmp_path, tokens, "--model", "integrity/flip", "--dtype", "fp16")
    assert not [f for f in e["findings"] if f["kind"] == "unverified"]


def test_negative_control_without_checksums_the_flipped_byte_is_loaded(master, engines) -> None:
    eng, tokens, keys = _setup(master, engines, "integrity/none", wrap=None, seed=12)
    clean = _bytes_of(_fetch(eng, keys, tokens))
    _flip(eng, keys[1])
    got = _bytes_of(_fetch(eng, keys, tokens))
    assert got[1] is not None and got[1] != clean[1]  # LMCache alone hands the corrupted bytes on


def test_chunks_without_a_checksum_are_unverified(master, engines, tmp_path: Path) -> None:
    # Stored by stock LMCache (no wrapper): no sidecars.
    eng, tokens, keys = _setup(master, engines, "integrity/stock", wrap=None, seed=13)
    store = lm.mooncake_store(eng)
    assert store.batch_is_exist([integrity.sidecar_key(k) for k in keys]) == [0] * CHUNKS
    d = _probe(master, tmp_path, tokens, "--model", "integrity/stock", "--dtype", "fp16")
    assert d["integrity"]["unverified_chunks"] == CHUNKS and d["integrity"]["checksummed_chunks"] == 0
    assert d["integrity"]["unverified"] == [{"rank": 0, "chunk": i} for i in range(CHUNKS)]
    # `bsr explain --store` lists them (information: the verdict stays what the bitmap says).
    e = _explain(master, tmp_path, tokens, "--model", "integrity/stock", "--dtype", "fp16")
    (u,) = [f for f in e["findings"] if f["kind"] == "unverified"]
    assert u["summary"].startswith(f"{CHUNKS} held chunk(s) carry no checksum") and e["verdict"] == "restorable"
    assert u["evidence"][0] == "rank 0 chunk 0: no checksum"

    # Refused by default...
    cs = integrity.install(eng, load_unverified=False)
    assert cs is not None
    assert _bytes_of(_fetch(eng, keys, tokens)) == [None] * CHUNKS
    found = cs.take()
    assert [f.key for f in found] == keys
    assert all(f.verdict is integrity.Verdict.UNVERIFIED and f.dropped for f in found)
    assert all(f.detail == "no checksum (stored without bsr, e.g. by stock LMCache)" for f in found)
    # ...and left in the store (they may be a stock deployment's): a store through bsr finds them held and adds no
    # checksum, so they stay unverified until evicted or removed.
    assert not any(f.removed for f in found) and store.batch_is_exist(keys) == [1] * CHUNKS
    assert _store(eng, tokens) == keys
    assert store.batch_is_exist([integrity.sidecar_key(k) for k in keys]) == [0] * CHUNKS
    # Loaded (and still reported) when the operator allows it.
    integrity.install(eng, load_unverified=True)
    assert all(b is not None for b in _bytes_of(_fetch(eng, keys, tokens)))
    assert [f.dropped for f in cs.take()] == [False] * CHUNKS


def test_an_older_bsrs_bytes_only_checksum_is_unverified_refused_removed_and_rewritten(
    master, engines, tmp_path: Path
) -> None:
    # As an older bsr stored them: each object with a 4-byte CRC32C of its bytes alone beside it.
    eng, tokens, keys = _setup(master, engines, "integrity/older", wrap=None, seed=16)
    clean = _bytes_of(_fetch(eng, keys, tokens))
    store = lm.mooncake_store(eng)
    for k, b in zip(keys, clean, strict=True):
        assert b is not None and store.upsert(sidecar_key(k), crc32c(b).to_bytes(4, "big")) == 0
    assert all(_sidecar(eng, k).kind is SidecarKind.LEGACY for k in keys)
    d = _probe(master, tmp_path, tokens, "--model", "integrity/older", "--dtype", "fp16")
    assert d["integrity"]["unverified_chunks"] == CHUNKS and d["integrity"]["checksummed_chunks"] == 0, d

    # Allowed, they load unverified and stay as they are: bsr never upgrades a checksum it could not verify.
    cs = integrity.install(eng, load_unverified=True)
    assert cs is not None
    assert _bytes_of(_fetch(eng, keys, tokens)) == clean
    found = cs.take()
    assert [(f.verdict, f.dropped, f.removed) for f in found] == [(integrity.Verdict.UNVERIFIED, False, False)] * 3
    assert found[0].detail == "an older bsr's checksum (of the bytes alone, not bound to the chunk)"
    assert all(_sidecar(eng, k).kind is SidecarKind.LEGACY for k in keys)
    # Refused (the default), they are removed with their sidecars, so the next store writes them with a checksum
    # bound to their key; they then load verified.
    integrity.install(eng, load_unverified=False)
    assert _bytes_of(_fetch(eng, keys, tokens)) == [None] * CHUNKS
    found = cs.take()
    assert [(f.key, f.dropped, f.removed) for f in found] == [(k, True, True) for k in keys]
    assert store.batch_is_exist(keys + [sidecar_key(k) for k in keys]) == [0] * (2 * CHUNKS)
    assert _store(eng, tokens) == keys
    assert all(_sidecar(eng, k).kind is SidecarKind.BOUND for k in keys)
    assert _bytes_of(_fetch(eng, keys, tokens)) == clean and cs.take() == []


def _copy(eng: Any, src: str, dst: str) -> None:
    """``src``'s object and its checksum sidecar written under ``dst``'s key, byte for byte (what a copy between
    deployments, a writer with the wrong key or a key collision leaves)."""
    store = lm.mooncake_store(eng)
    for a, b in ((src, dst), (sidecar_key(src), sidecar_key(dst))):
        assert store.upsert(b, store.get(a)) == 0


def test_another_prompts_chunk_copied_with_its_checksum_is_dropped_named_and_removed(master, engines) -> None:
    eng, tokens, keys, cs = _verified(master, engines, "integrity/copy", seed=14)
    other = synthetic_tokens(CHUNKS * CS, seed=15)  # another prompt, the same shape
    other_keys = _store(eng, other)
    clean, theirs = _bytes_of(_fetch(eng, keys, tokens)), _bytes_of(_fetch(eng, other_keys, other))
    assert theirs[2] != clean[1] and cs.take() == []  # (the fill depends on the chunk's position only)

    _copy(eng, other_keys[2], keys[1])  # their chunk 2, with its own (correct) checksum, under our chunk 1's key
    got = _bytes_of(_fetch(eng, keys, tokens))
    assert got[0] == clean[0] and got[1] is None and got[2] == clean[2]  # never loaded as ours
    (f,) = cs.take()
    assert (f.key, f.verdict, f.detail, f.dropped, f.removed) == (
        keys[1], integrity.Verdict.MISMATCH, "checksum mismatch", True, True
    )  # fmt: skip
    store = lm.mooncake_store(eng)
    assert store.batch_is_exist([keys[1], sidecar_key(keys[1])]) == [0, 0]
    assert _bytes_of(_fetch(eng, other_keys, other)) == theirs  # theirs is untouched
    # The next store writes our chunk afresh; it then loads, verified.
    assert _store(eng, tokens) == keys
    assert _bytes_of(_fetch(eng, keys, tokens)) == clean and cs.take() == []


def test_an_object_with_bytes_appended_is_named_and_removed_instead_of_failing_for_ever(master, engines) -> None:
    eng, tokens, keys, cs = _verified(master, engines, "integrity/grown", seed=17)
    clean = _bytes_of(_fetch(eng, keys, tokens))
    store = lm.mooncake_store(eng)
    stored = store.get(keys[2])
    assert store.upsert(keys[2], stored + bytes(4096)) == 0  # grown by 4 KiB
    got = _bytes_of(_fetch(eng, keys, tokens))
    assert got[:2] == clean[:2] and got[2] is None  # LMCache's get cannot load it at all...
    (f,) = cs.take()  # ...and bsr names it, and removes it with its checksum
    assert (f.key, f.verdict, f.dropped, f.removed) == (keys[2], integrity.Verdict.MISMATCH, True, True)
    assert f.detail.startswith("wrong length (") and "its checksum is for" in f.detail, f.detail
    assert store.batch_is_exist([keys[2], sidecar_key(keys[2])]) == [0, 0]
    assert _store(eng, tokens) == keys
    assert _bytes_of(_fetch(eng, keys, tokens)) == clean and cs.take() == []


# -- the LMCache host (python -m lmcache_bsr): the same checksums under bsr's own windowed restore ---------------
@pytest.fixture(scope="module")
def host(master: services.ServiceHandle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from lmcache_bsr.host import LMCacheHost
    from test_lmcache_host import host_config

    h = LMCacheHost(host_config(master, tmp_path_factory.mktemp("disk")))
    try:
        yield h
    finally:
        h.close()


@pytest.mark.timeout(180)
def test_host_restore_fails_closed_at_verify_naming_the_chunk_and_tier(host: Any) -> None:
    from test_lmcache_host import CHUNKS as HOST_CHUNKS
    from test_lmcache_host import W, _stored_prompt

    c = host.coordinator
    toks = _stored_prompt(host, seed=21, n_tokens=HOST_CHUNKS * CS)
    ok = c.restore(toks, w=W, exclude=["fs"])
    assert ok.outcome is Outcome.COMMITTED, ok
    # Rank 1's stored chunk 5 gets a flipped byte in Mooncake.
    _flip(host.rank(1).engine, lm.key_string(host.rank(1).keys(toks)[5]))
    res = c.restore(toks, w=W, exclude=["fs"])
    assert res.report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    (f,) = res.report.failures
    assert (f.rank, f.stage, f.tier) == (1, Stage.VERIFY, "mooncake"), f
    key = lm.key_string(host.rank(1).keys(toks)[5])
    assert f.reason == f"checksum mismatch in chunk 5 (tier mooncake, key {key}); removed from the store"
    assert res.report.failure_kind is FailureKind.TIER and res.report.blamed_tiers == ("mooncake",)


@pytest.mark.timeout(180)
def test_host_refuses_a_chunk_without_a_checksum_by_default(host: Any) -> None:
    from test_lmcache_host import CHUNKS as HOST_CHUNKS
    from test_lmcache_host import W, _stored_prompt

    toks = _stored_prompt(host, seed=22, n_tokens=HOST_CHUNKS * CS)
    # Chunk 3 of rank 0 as stock LMCache would have stored it: the object without bsr's checksum.
    key = lm.key_string(host.rank(0).keys(toks)[3])
    assert lm.mooncake_store(host.rank(0).engine).remove(integrity.sidecar_key(key), True) == 0
    res = host.coordinator.restore(toks, w=W, exclude=["fs"])
    assert res.report is not None
    assert res.outcome is Outcome.FAILED_CLOSED and res.committed_tokens == 0
    (f,) = res.report.failures
    assert (f.rank, f.stage, f.tier) == (0, Stage.VERIFY, "mooncake"), f
    assert f.reason == f"no checksum (stored without bsr, e.g. by stock LMCache) in chunk 3 (tier mooncake, key {key})"
