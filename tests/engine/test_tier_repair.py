"""A damaged fs tier on the real embedded engine (two rank processes, the fs tier alone): a full or read-only
directory (a real tmpfs, filled or remounted read-only) is unhealthy in /health, `bsr status` and the metrics with
its reason, and `bsr submit` says that the store failed; an object whose bytes rot on disk fails its restore closed,
is quarantined (kept under the tier's quarantine/), named by `bsr status` and `bsr explain`, no longer fails the
next restore, and is rewritten by the next submit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine.tmpfs import Tmpfs, mount_tmpfs
from own_engine import own_engine

from bsr_cli.core.evidence import TierCondition

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

N = 2048  # 8 chunks of 256 tokens


@dataclass
class FsEngine:
    url: str
    token: str
    state_dir: Path
    tmpfs: Tmpfs

    def client(self) -> Any:
        from bsr_cli.client import AdminClient

        return AdminClient(self.url, self.token)

    def env(self) -> dict[str, str]:
        return {"BSR_ENGINE": self.url, "BSR_TOKEN": self.token, "BSR_STATE_DIR": str(self.state_dir)}


@pytest.fixture(scope="module")
def fs_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FsEngine]:
    """An embedded engine without Mooncake whose fs tier directory is a 64 MiB tmpfs of its own."""
    state = tmp_path_factory.mktemp("fs-engine")
    tmpfs = mount_tmpfs(state / "fs-tier", "64m")
    try:
        settings = dict(max_tokens=8192, fetch_timeout_s=5.0, remote=False, faults_enabled=False)
        with own_engine(state, **settings) as eng:
            yield FsEngine(eng.url, eng.token, state, tmpfs)
    finally:
        tmpfs.unmount()


@pytest.fixture
def eng(fs_engine: FsEngine, monkeypatch: pytest.MonkeyPatch) -> FsEngine:
    for k, v in fs_engine.env().items():
        monkeypatch.setenv(k, v)
    with fs_engine.client() as c:
        c.clear_markers()
    return fs_engine


def _object_file(eng: FsEngine, seed: int, chunk: int, rank: int, group: str) -> Path:
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.core.registration import Registration
    from bsr_cli.tiers.fs import FilesystemTier

    cfg = json.loads((eng.state_dir / "engine.json").read_text())
    reg = Registration.from_dict(cfg["registration"])
    h = chunk_hashes(synthetic_tokens(N, seed), reg.chunk_size)[chunk]
    return FilesystemTier(cfg["fs_dir"], create=False).path_for(object_key(reg, rank, group, h))


def test_a_corrupt_object_is_quarantined_named_and_rewritten(bsr: Any, eng: FsEngine) -> None:
    prompt = ("--synthetic", str(N), "--seed", "31")
    assert bsr("submit", *prompt).code == 0
    path = _object_file(eng, 31, chunk=3, rank=0, group="full")
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF  # one flipped byte of the payload, on disk
    path.write_bytes(damaged)

    r = bsr("restore", *prompt, "--json")
    assert r.code != 0
    first = r.report()
    fails = first["failures"]
    assert any(f["stage"] == "verify" and f["tier"] == "fs" and "chunk 3" in f["reason"] for f in fails), fails
    assert not path.exists()
    quarantine = list((eng.state_dir / "fs-tier" / "quarantine").glob("*.bsr"))
    assert [p.read_bytes() for p in quarantine] == [bytes(damaged)]  # kept byte for byte, for the bundle

    with eng.client() as c:
        events = c.events(request=first["request"], kinds=["object_quarantined"]).events
    assert [(e["rank"], e["tier"], e["chunk"], e["group"]) for e in events] == [(0, "fs", 3, "full")]

    st = bsr("status", "--json")
    assert st.code == 0
    fs = st.report()["tiers"]["fs"]
    assert fs["quarantined_total"] == 1
    assert (
        "checksum mismatch (its bytes, or the chunk they belong to): chunk 3 group full on rank 0"
        in (fs["quarantined"][0]["reason"])
    )
    text = bsr("status")
    assert "tier fs: 1 damaged object(s) quarantined" in text.out and "chunk 3 group full" in text.out

    ex = bsr("explain", *prompt, "--json")
    assert ex.code == 0
    found = [f for f in ex.json()["findings"] if f["kind"] == "quarantined"]
    assert found and "chunk 3 group full on rank 0 in tier fs" in found[0]["summary"], ex.json()["findings"]

    # The next fs restore of the prompt does not fail on that chunk again: the tier no longer holds it.
    again = bsr("restore", *prompt, "--json")
    assert again.code == 0, again.out
    assert again.report()["committed_tokens"] == 3 * 256

    # The next submit computes the chunk and stores it again; then the whole prompt restores from fs.
    assert bsr("submit", *prompt).code == 0
    assert path.exists()
    whole = bsr("restore", *prompt, "--json")
    assert whole.code == 0 and whole.report()["committed_tokens"] == N, whole.out


def test_a_full_fs_tier_is_unhealthy_and_submit_says_the_store_failed(bsr: Any, eng: FsEngine) -> None:
    eng.tmpfs.fill()
    try:
        r = bsr("submit", "--synthetic", str(N), "--seed", "32", "--json")
        assert r.code == 0, r.err  # the request was served: its KV is computed
        assert "bsr: warning: storing to tier fs failed on rank0" in r.err and "(ENOSPC)" in r.err, r.err
        request = r.json()["request"]
        # `status` asks every rank and waits for the answers; /health (and /metrics) wait at most 0.5 s and
        # otherwise use the freshest answer of the last 30 s, which this makes the one after the failed store.
        text = bsr("status")
        assert "tier fs: unhealthy (full)" in text.out, text.out
        with eng.client() as c:
            events = c.events(request=request, kinds=["store_failed"]).events
            health = c.health()
            metrics = c.metrics()
        assert {e["rank"] for e in events} == {0, 1} and all(e["tier"] == "fs" for e in events)
        fs = health.tiers["fs"]
        assert not fs.ok and TierCondition.FULL in fs.conditions, fs
        assert any("No space left on device (ENOSPC)" in d for d in fs.detail)
        assert "fs" in health.degraded_tiers
        assert 'bsr_tier_healthy{injected="false",tier="fs"} 0.0' in metrics
        assert 'bsr_tier_condition{condition="full",injected="false",tier="fs"} 1.0' in metrics
    finally:
        eng.tmpfs.unfill()


def test_a_read_only_fs_tier_is_unhealthy_with_its_reason(bsr: Any, eng: FsEngine) -> None:
    eng.tmpfs.remount("ro")
    try:
        r = bsr("submit", "--synthetic", str(N), "--seed", "33")
        assert r.code == 0 and "(EROFS)" in r.err, r.err
        st = bsr("status", "--json")
        fs = st.report()["tiers"]["fs"]
        assert not fs["ok"] and fs["condition"] == "read_only" and "read_only" in fs["conditions"], fs
    finally:
        eng.tmpfs.remount("rw")


def test_a_quarantined_fs_chunk_is_rewritten_from_mooncake(bsr: Any, engine: Any) -> None:
    """On the shared engine (Mooncake and fs): the damaged fs chunk is set apart by an fs-only restore, the next
    submit restores the prompt from Mooncake (a good source) and stores the chunk to fs again, and an fs-only
    restore then commits the whole prompt with the canonical hash."""
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.core.registration import Registration
    from bsr_cli.tiers.fs import FilesystemTier

    prompt = ("--synthetic", str(N), "--seed", "34")
    assert bsr("submit", *prompt).code == 0
    cfg = json.loads((engine.state_dir / "engine.json").read_text())
    reg = Registration.from_dict(cfg["registration"])
    h = chunk_hashes(synthetic_tokens(N, 34), reg.chunk_size)[2]
    path = FilesystemTier(cfg["fs_dir"], create=False).path_for(object_key(reg, 1, "swa", h))
    damaged = bytearray(path.read_bytes())
    damaged[-7] ^= 0x01
    path.write_bytes(damaged)

    r = bsr("restore", *prompt, "--tier", "fs", "--json")
    assert r.code != 0 and any(f["tier"] == "fs" and f["stage"] == "verify" for f in r.report()["failures"])
    assert not path.exists()

    s = bsr("submit", *prompt, "--json")
    assert s.code == 0 and s.json()["external_tokens"] == N and s.json()["source"] == "mooncake", s.out
    assert path.exists() and path.read_bytes() != bytes(damaged)
    whole = bsr("restore", *prompt, "--tier", "fs", "--json")
    assert whole.code == 0 and whole.report()["committed_tokens"] == N and whole.report()["hash_ok"], whole.out
