"""Which chunk an object is, on the real embedded engine (two rank processes, a real Mooncake master and segment
holder, the real CLI): another prompt's object of the same shape, put under this prompt's key in Mooncake with its
own trailer, fails the restore closed at verify (exit 10, nothing committed), is named (chunk, key, tier) by the
restore, its events and `bsr explain`, and removed; the next submit writes it again and a restore then commits with
the canonical hash. And KV that passes every checksum but is not the prompt's (a writer that stored the wrong
bytes under the right key, checksummed) ends the request failed with exit 19, never 0: invalidated, marked,
stored nowhere."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(300)

N = 2048  # 8 chunks of 256 tokens


class Store:
    """The engine's Mooncake store through a client of its own: the bsr tier (as a writer would put) and a raw
    Mooncake client (reads and replaces whole objects, trailers and all, as a copy between deployments would)."""

    def __init__(self, state_dir: Any) -> None:
        from mooncake.store import MooncakeDistributedStore

        from bsr_cli.core.registration import Registration
        from bsr_cli.tiers.mooncake import MooncakeTier

        cfg = json.loads((state_dir / "engine.json").read_text())
        self.reg = Registration.from_dict(cfg["registration"])
        mc = cfg["mooncake"]
        self.tier = MooncakeTier(mc["master_address"], mc["metadata_url"])
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.raw = MooncakeDistributedStore()
        rc = self.raw.setup("127.0.0.1", mc["metadata_url"], 0, 64 << 20, "tcp", "", mc["master_address"])
        assert rc == 0, f"Mooncake client setup failed: {rc}"

    def key(self, seed: int, chunk: int, rank: int, group: str) -> str:
        from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens

        return object_key(self.reg, rank, group, chunk_hashes(synthetic_tokens(N, seed), self.reg.chunk_size)[chunk])

    def held(self, key: str) -> bool:
        return bool(self.tier.contains([key], 5.0)[0])

    def close(self) -> None:
        self.tier.close()
        self.raw.close()


@pytest.fixture
def store(engine: Any) -> Iterator[Store]:
    s = Store(engine.state_dir)
    try:
        yield s
    finally:
        s.close()


def test_another_prompts_object_under_this_key_fails_closed_is_named_removed_and_rewritten(
    bsr: Any, engine: Any, store: Store
) -> None:
    mine, theirs = ("--synthetic", str(N), "--seed", "4101"), ("--synthetic", str(N), "--seed", "4102")
    assert bsr("submit", *mine).code == 0 and bsr("submit", *theirs).code == 0
    key = store.key(4101, chunk=3, rank=0, group="full")
    copied = store.raw.get(store.key(4102, chunk=3, rank=0, group="full"))  # their object, trailer and all
    assert len(copied) > 0 and store.raw.upsert(key, copied) == 0

    r = bsr("restore", *mine, "--tier", "mooncake", "--json")
    assert r.code == 10, (r.code, r.out, r.err)
    d = r.report()  # the failed restore's result, carried by the one error object
    assert d["outcome"] == "failed_closed" and d["committed_tokens"] == 0, d
    (fail,) = [f for f in d["failures"] if f["stage"] == "verify"]
    assert (fail["rank"], fail["tier"]) == (0, "mooncake"), fail
    assert fail["reason"] == f"checksum mismatch in chunk 3 group full (tier mooncake, key {key})", fail
    assert d["marker"]["excluded_tiers"] == ["mooncake"]

    # Named in the events and by `bsr explain`, and removed from the store: the chunk is absent, not wrong.
    with engine.client() as c:
        (ev,) = c.events(request=d["request"], kinds=["object_quarantined"]).events
    assert (ev["rank"], ev["tier"], ev["chunk"], ev["group"], ev["key"], ev["file"]) == (
        0,
        "mooncake",
        3,
        "full",
        key,
        "",
    )
    assert ev["reason"].startswith("checksum mismatch (its bytes, or the chunk they belong to): chunk 3 group full")
    assert not store.held(key)
    ex = bsr("explain", *mine, "--json")
    assert ex.code == 0, ex.err
    (q,) = [f for f in ex.json()["findings"] if f["kind"] == "quarantined"]
    assert "chunk 3 group full on rank 0 in tier mooncake" in q["summary"] and f"(key {key})" in q["evidence"][0], q
    st = bsr("status", "--json").json()["tiers"]["mooncake"]
    assert st["quarantined_total"] >= 1 and any(x["key"] == key for x in st["quarantined"]), st

    # The next submit (the marker skips Mooncake: restored from fs) stores the chunk to Mooncake again; a restore
    # from Mooncake then commits every token with the canonical hash.
    s = bsr("submit", *mine, "--json")
    assert s.code == 0 and s.json()["source"] == "fs" and s.json()["hash_ok"] is True, s.out
    assert store.held(key)
    whole = bsr("restore", *mine, "--tier", "mooncake", "--json")
    assert whole.code == 0, whole.out
    assert whole.json()["committed_tokens"] == N and whole.json()["hash_ok"] is True, whole.out


def test_kv_that_passes_every_checksum_but_is_not_the_prompts_never_exits_0(
    bsr: Any, engine: Any, store: Store
) -> None:
    from bsr_cli.runtime.checksum import object_checksum

    prompt = ("--synthetic", str(N), "--seed", "4103")
    assert bsr("submit", *prompt).code == 0
    # A writer that stored another chunk's KV under this key, with a checksum it computed for this key: every
    # check of the object holds; only the output hash can tell.
    key = store.key(4103, chunk=2, rank=1, group="swa")
    wrong = bytearray(store.raw.get(store.key(4103, chunk=5, rank=1, group="swa")))[:-16]  # its payload
    assert store.tier.remove([key]) == [0]
    store.tier.put([key], [memoryview(wrong)], [object_checksum(key, wrong)])

    r = bsr("restore", *prompt, "--tier", "mooncake", "--json")
    assert r.code == 19, (r.code, r.out, r.err)
    d = r.report()  # the invalidated restore's result, carried by the one error object
    assert r.json()["error"] == "output-mismatch" and r.json()["exit_code"] == 19
    assert d["hash_ok"] is False and d["outcome"] == "failed_closed" and d["committed_tokens"] == 0, d
    assert d["restored_tokens"] == N and d["marker"]["excluded_tiers"] == [], d  # the next admission recomputes
    with engine.client() as c:
        (ev,) = c.events(request=d["request"], kinds=["output_mismatch"]).events
    assert ev["external_tokens"] == N and ev["source"] == "mooncake" and ev["marker"] is True, ev
    assert ev["output_hash"] == d["output_hash"] and ev["canonical_hash"] == d["canonical_hash"]
    text = bsr("restore", *prompt, "--tier", "mooncake")
    assert text.code == 19 and "bsr: error: request" in text.err and "differs from the canonical" in text.err
    assert "bsr: hint:" in text.err and "Traceback" not in text.err

    # The marker sends the next admission to local compute: right, and exit 0.
    ok = bsr("submit", *prompt, "--json")
    assert ok.code == 0 and ok.json()["source"] == "recompute" and ok.json()["hash_ok"] is True, ok.out
    # Mooncake still holds the wrong object (its checksum holds): a submit that restores it fails too, stores
    # nothing, and exits 19.
    bad = bsr("submit", *prompt, "--json")
    assert bad.code == 19 and bad.report()["hash_ok"] is False and bad.report()["stored"] == {}, bad.out
