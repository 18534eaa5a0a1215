"""Repair in one pass, on the real embedded engine (two rank processes, the fs tier alone, real files): a prompt
whose fs objects rotted in several windows on both ranks heals after ONE failed restore and ONE store, because the
failed restore also scrubs the rest of the prompt's objects on that tier; without that scrub (the negative control)
it takes one failed restore per damaged window. And `bsr scrub` on demand: clean, damaged, every object."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.timeout(600), pytest.mark.engine]

N = 16_384  # 64 chunks of 256 tokens: 16 windows of W=4
W = 4
# (rank, chunk, group): one damaged object in each of four windows on each rank, eight in all.
DAMAGE = (
    (0, 5, "full"),  # G2
    (0, 22, "swa"),  # G6
    (0, 41, "full"),  # G11
    (0, 58, "swa"),  # G15
    (1, 13, "swa"),  # G4
    (1, 30, "full"),  # G8
    (1, 46, "swa"),  # G12
    (1, 62, "full"),  # G16
)
WINDOWS_PER_RANK = 4


@dataclass
class FsEngine:
    url: str
    token: str
    state_dir: Path

    def client(self) -> Any:
        from bsr_cli.client import AdminClient

        return AdminClient(self.url, self.token, timeout_s=120.0)

    def env(self) -> dict[str, str]:
        return {"BSR_ENGINE": self.url, "BSR_TOKEN": self.token, "BSR_STATE_DIR": str(self.state_dir)}


def _engine(tmp: pytest.TempPathFactory, name: str, scrub_after_failure: bool) -> Iterator[FsEngine]:
    from bsr_cli.client import local_engine
    from bsr_cli.engine import supervisor
    from bsr_cli.loaders import builtin_registration

    state = tmp.mktemp(name)
    opts = supervisor.EngineOptions(
        builtin_registration("demo"),
        w=W,
        max_tokens=N,
        fetch_timeout_s=10.0,
        remote=False,
        scrub_after_failure=scrub_after_failure,
    )
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        yield FsEngine(conn[0], conn[1], state)
    finally:
        supervisor.down(state)


@pytest.fixture(scope="module")
def healing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FsEngine]:
    yield from _engine(tmp_path_factory, "scrub-on", True)


@pytest.fixture(scope="module")
def unhealing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FsEngine]:
    yield from _engine(tmp_path_factory, "scrub-off", False)


def _use(eng: FsEngine, monkeypatch: pytest.MonkeyPatch) -> FsEngine:
    for k, v in eng.env().items():
        monkeypatch.setenv(k, v)
    return eng


def _object_files(
    eng: FsEngine, seed: int, damage: tuple[tuple[int, int, str], ...] = DAMAGE, n: int = N
) -> list[Path]:
    """The files of the objects ``damage`` names ((rank, chunk, group)) of the synthetic prompt of ``n`` tokens."""
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.core.registration import Registration
    from bsr_cli.tiers.fs import FilesystemTier

    cfg = json.loads((eng.state_dir / "engine.json").read_text())
    reg = Registration.from_dict(cfg["registration"])
    hashes = chunk_hashes(synthetic_tokens(n, seed), reg.chunk_size)
    tier = FilesystemTier(cfg["fs_dir"], create=False)
    return [tier.path_for(object_key(reg, rank, group, hashes[chunk])) for rank, chunk, group in damage]


def _rot(paths: list[Path]) -> dict[Path, bytes]:
    """One flipped byte in each object's payload, on disk; the damaged bytes by file."""
    out = {}
    for p in paths:
        data = bytearray(p.read_bytes())
        data[-100] ^= 0xFF
        p.write_bytes(data)
        out[p] = bytes(data)
    return out


def _wait_for_scrubs(eng: FsEngine, request: str, ranks: int) -> list[dict[str, Any]]:
    """The scrubs a failed restore started, once each rank's has ended (a condition with a deadline)."""
    deadline = time.monotonic() + 240
    with eng.client() as c:
        while True:
            ended = c.events(request=request, kinds=["scrub_finished"]).events
            if len(ended) >= ranks:
                return [dict(e) for e in ended]
            assert time.monotonic() < deadline, f"scrubs of {request} did not end: {ended}"
            c.events(since=c.events(limit=1, newest=True).last_seq, wait_s=2.0)  # sleep on the engine's long poll


def test_damage_in_several_windows_heals_after_one_failed_restore_and_one_store(
    bsr: Any, healing: FsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = _use(healing, monkeypatch)
    prompt = ("--synthetic", str(N), "--seed", "41")
    assert bsr("submit", *prompt).code == 0
    paths = _object_files(eng, 41)
    damaged = _rot(paths)

    first = bsr("restore", *prompt, "--tier", "fs", "--json")
    assert first.code == 10, first.out
    failed = first.report()  # the failed restore's result, carried by the one error object
    request = failed["request"]
    # Each rank failed at its first damaged window, G2 on rank 0 and G4 on rank 1, naming its chunks.
    assert sorted((f["rank"], f["window"], tuple(f["chunks"])) for f in failed["failures"]) == [
        (0, 1, (4, 8)),
        (1, 3, (12, 16)),
    ], failed["failures"]

    scrubs = _wait_for_scrubs(eng, request, ranks=2)
    assert {(s["rank"], s["state"]) for s in scrubs} == {(0, "complete"), (1, "complete")}, scrubs
    # The failed windows' re-read set two objects apart; the scrubs found the other six, on objects the restore
    # never read.
    assert sum(s["damaged"] for s in scrubs) == sum(s["quarantined"] for s in scrubs) == 6, scrubs
    with eng.client() as c:
        found = c.events(request=request, kinds=["object_quarantined"]).events
    assert sorted((e["rank"], e["chunk"], e["group"]) for e in found) == sorted(DAMAGE)
    assert not any(p.exists() for p in paths)
    quarantine = eng.state_dir / "fs-tier" / "quarantine"
    assert sorted(q.read_bytes() for q in quarantine.glob("*.bsr")) == sorted(damaged.values())

    status = bsr("status", "--json")
    fs = status.json()["tiers"]["fs"]
    assert fs["quarantined_total"] == len(DAMAGE)
    assert {(s["rank"], s["request"], s["state"]) for s in fs["scrubs"]} >= {
        (0, request, "complete"),
        (1, request, "complete"),
    }, fs["scrubs"]
    text = bsr("status").out
    assert f"of prompt {failed['prompt']} on rank 0 (after {request} failed)" in text and "complete" in text, text

    # ONE store rewrites every damaged object; the whole prompt then restores from fs.
    assert bsr("submit", *prompt).code == 0
    assert all(p.exists() and p.read_bytes() != damaged[p] for p in paths)
    whole = bsr("restore", *prompt, "--tier", "fs", "--json")
    assert whole.code == 0 and whole.json()["committed_tokens"] == N and whole.json()["hash_ok"], whole.out


def test_without_the_scrub_each_damaged_window_costs_a_failed_restore(
    bsr: Any, unhealing: FsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: the same damage on an engine that only re-reads the failed window takes one failed
    restore (and one store) per damaged window of a rank before the prompt restores whole."""
    eng = _use(unhealing, monkeypatch)
    prompt = ("--synthetic", str(N), "--seed", "42")
    assert bsr("submit", *prompt).code == 0
    paths = _object_files(eng, 42)
    _rot(paths)
    failed_at: list[list[int]] = []
    for _ in range(WINDOWS_PER_RANK + 1):
        r = bsr("restore", *prompt, "--tier", "fs", "--json")
        if r.code == 0:
            break
        assert r.code == 10, r.out
        failed_at.append(sorted(f["window"] for f in r.report()["failures"]))
        with eng.client() as c:
            assert not c.events(request=r.report()["request"], kinds=["scrub_started"]).events
        assert bsr("submit", *prompt).code == 0
    # Each failed restore met the next damaged window of each rank: one the restore before it never read.
    assert failed_at == [[1, 3], [5, 7], [10, 11], [14, 15]], failed_at
    assert r.code == 0 and r.json()["committed_tokens"] == N


SMALL = 2048  # 8 chunks: 16 objects per rank


def test_bsr_scrub_says_clean_then_finds_and_sets_apart_the_damage(
    bsr: Any, healing: FsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _use(healing, monkeypatch)
    prompt = ("--synthetic", str(SMALL), "--seed", "44")
    assert bsr("submit", *prompt).code == 0
    clean = bsr("scrub", "--tier", "fs", *prompt, "--json")
    assert clean.code == 0, clean.out + clean.err
    d = clean.json()
    assert (d["checked"], d["damaged"], d["complete"], d["scope"]) == (32, 0, True, "prompt"), d
    assert [r["state"] for r in d["ranks"]] == ["complete", "complete"]
    assert "clean" in bsr("scrub", "--tier", "fs", *prompt).out

    paths = _object_files(healing, 44, ((0, 2, "full"), (1, 6, "swa")), SMALL)
    damaged = _rot(paths)
    found = bsr("scrub", "--tier", "fs", *prompt, "--json")
    assert found.code == 20, found.out + found.err  # damaged objects found (the negative control of the above)
    d = found.report()
    assert (d["checked"], d["damaged"], len(d["quarantined"])) == (32, 2, 2), d
    assert {q["file"] for q in d["quarantined"]} == {
        str(p)
        for p in (healing.state_dir / "fs-tier" / "quarantine").glob("*.bsr")
        if p.read_bytes() in damaged.values()
    }
    assert not any(p.exists() for p in paths)
    err = json.loads(found.out)  # one JSON document on stdout: the error, carrying the report
    assert err["error"] == "damaged-objects" and err["exit_code"] == 20 and err["report"]["tier"] == "fs"
    again = bsr("scrub", "--tier", "fs", *prompt)
    assert again.code == 0 and "2 not held" in again.out  # set apart: the tier no longer holds them

    # Every object of the tier, split between the two ranks; a limit cuts it short (exit 21).
    _rot(_object_files(healing, 44, ((0, 5, "full"),), SMALL))
    whole = bsr("scrub", "--tier", "fs", "--all", "--json")
    assert whole.code == 20 and whole.report()["scope"] == "all" and whole.report()["damaged"] == 1, whole.out
    cut = bsr("scrub", "--tier", "fs", "--all", "--max-objects", "1")
    assert cut.code == 21 and "stopped at its limit of 1 objects" in cut.err, cut.err
    for bad in (("--tier", "fs"), ("--tier", "fs", "--all", *prompt), ("--tier", "mooncake", "--all")):
        r = bsr("scrub", *bad)
        assert r.code == 2 and r.err.startswith("bsr: error:") and "bsr: hint:" in r.err, (bad, r.err)


def test_a_marker_has_one_id_in_markers_status_explain_events_and_describe(
    bsr: Any, healing: FsEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bsr_cli.core.keys import prompt_hash, synthetic_tokens

    _use(healing, monkeypatch)
    prompt = ("--synthetic", str(SMALL), "--seed", "45")
    key = prompt_hash(synthetic_tokens(SMALL, 45))
    assert bsr("submit", *prompt).code == 0
    _rot(_object_files(healing, 45, ((1, 3, "full"),), SMALL))  # G1 of W=4 is chunks 0-3
    r = bsr("restore", *prompt, "--tier", "fs", "--json")
    assert r.code == 10
    request = r.report()["request"]
    _wait_for_scrubs(healing, request, ranks=1)  # rank 1's restore failed: it scrubs the rest of the prompt
    listed = bsr("markers", "list", "--json").json()["markers"]
    assert [m["prompt"] for m in listed if m["request"] == request] == [key], listed
    assert key in bsr("markers", "list").out
    assert [m["prompt"] for m in bsr("status", "--json").json()["markers"] if m["request"] == request] == [key]
    assert f"force-local marker prompt {key}" in bsr("status").out
    ex = bsr("explain", *prompt, "--json").json()
    assert ex["verdict"] == "force-local-marker" and ex["marker"] == key
    assert any(e.startswith(f"marker: prompt {key} ") for f in ex["findings"] for e in f["evidence"]), ex
    assert bsr("explain", request, "--json").json()["marker"] == key
    other = bsr("explain", "--synthetic", str(SMALL), "--seed", "46", "--json").json()  # the negative control
    assert "marker" not in other and other["verdict"] != "force-local-marker"
    with healing.client() as c:
        (set_ev,) = c.events(request=request, kinds=["marker_set"]).events
    assert set_ev["prompt"] == key
    d = bsr("describe", request, "--json").json()
    assert d["prompt"] == key and d["marker"]["prompt"] == key and d["marker"]["excluded_tiers"] == ["fs"]
    (f,) = d["failures"]
    assert (f["rank"], f["label"], f["chunks"], f["tier"], f["stage"]) == (1, "G1", [0, 4], "fs", "verify"), f
    assert "checksum mismatch in chunk 3 group full" in f["reason"]
    text = bsr("describe", request).out
    assert "rank 1 failed at window G1 (chunks 0-3) (tier fs, stage verify" in text, text
    assert f"force-local marker prompt {key} excludes fs" in text and "scrubbed the prompt on tier fs" in text, text
    with healing.client() as c:
        c.clear_markers()
