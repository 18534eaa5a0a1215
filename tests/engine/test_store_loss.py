"""The Mooncake store through a bad minute, on the real embedded engine (a real mooncake_master and segment holder,
two rank processes, the admin API, the CLI in-process):

* a segment holder stopped (SIGSTOP) for 30 s and continued: with bsr's client TTL the master keeps its segment,
  and a restore from Mooncake alone commits the whole prompt with the canonical hash;
* the negative control, Mooncake's own 10 s TTL: the master drops the segment and every object on it; kept as the
  test of the detection: `bsr status`, `bsr events`, `bsr explain` and the metrics name the loss;
* a holder killed: the store is named lost within seconds, long before the master's TTL would drop it.

Every stop is continued in a ``finally``; every wait has a deadline."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.limits import DEFAULT_STORE_CLIENT_TTL_S, MOONCAKE_DEFAULT_CLIENT_TTL_S
from bsr_cli.core.prompt import Prompt
from bsr_cli.loaders import builtin_registration

pytest.importorskip("torch")
pytestmark = pytest.mark.engine

REG = builtin_registration("demo")
N = 2048  # 8 chunks of 256 tokens
OBJECTS = N // REG.chunk_size * REG.tp_size * len(REG.group_names)  # one object per chunk, rank and group
STOP_S = 30.0


@dataclass
class StoreEngine:
    url: str
    token: str
    state: Path

    def client(self) -> Any:
        from bsr_cli.client import AdminClient

        return AdminClient(self.url, self.token)

    def service(self, name: str) -> Any:
        from bsr_cli.engine import supervisor

        record = supervisor.read_record(self.state)
        assert record is not None
        return record.services[name]

    def admin_url(self) -> str:
        urls = self.service("mooncake_master").urls
        assert urls is not None
        return str(urls["admin_url"])

    def mounted(self) -> list[str]:
        from bsr_cli.mooncake.health import segments

        return [s.segment_name for s in segments(self.admin_url(), timeout=30.0) if s.mounted]


def _engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ttl_s: int) -> Iterator[StoreEngine]:
    from bsr_cli.client import local_engine
    from bsr_cli.engine import supervisor

    state = tmp_path / "engine"
    opts = supervisor.EngineOptions(REG, w=4, max_tokens=8192, fetch_timeout_s=5.0, store_client_ttl_s=ttl_s)
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        for k, v in {"BSR_ENGINE": conn[0], "BSR_TOKEN": conn[1], "BSR_STATE_DIR": str(state)}.items():
            monkeypatch.setenv(k, v)
        yield StoreEngine(conn[0], conn[1], state)
    finally:
        supervisor.down(state)


@pytest.fixture
def bsr_ttl_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreEngine]:
    """An engine of its own, its master started with bsr's client TTL."""
    yield from _engine(tmp_path, monkeypatch, DEFAULT_STORE_CLIENT_TTL_S)


@pytest.fixture
def mooncake_ttl_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreEngine]:
    """An engine of its own, its master started with Mooncake's own default TTL (what bsr did before)."""
    yield from _engine(tmp_path, monkeypatch, MOONCAKE_DEFAULT_CLIENT_TTL_S)


def _wait(what: str, check: Callable[[], Any], deadline_s: float = 60.0) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {deadline_s:.0f} s: {what}")


def _stored(bsr: Any, eng: StoreEngine, seed: int, *, keep_fs_copy: bool) -> tuple[tuple[str, ...], dict[str, Any]]:
    """Submit the prompt (computed, then stored in both tiers); its CLI arguments and the submit's answer. Without
    its filesystem copy, Mooncake is the only tier that had it."""
    prompt = ("--synthetic", str(N), "--seed", str(seed))
    stored = bsr("submit", *prompt, "--json")
    assert stored.code == 0, stored.err
    if not keep_fs_copy:
        _drop_fs_copy(eng, seed)
    return prompt, stored.json()


def _drop_fs_copy(eng: StoreEngine, seed: int) -> None:
    """Remove the prompt's filesystem copy, so Mooncake is the only tier that had it."""
    from bsr_cli.core.keys import chunk_hashes, object_key, synthetic_tokens
    from bsr_cli.tiers.fs import FilesystemTier

    cfg = json.loads((eng.state / "engine.json").read_text())
    fs = FilesystemTier(cfg["fs_dir"], create=False)
    for h in chunk_hashes(synthetic_tokens(N, seed), REG.chunk_size):
        for rank in range(REG.tp_size):
            for g in REG.group_names:
                fs.path_for(object_key(REG, rank, g, h)).unlink()


def _stop_holder(eng: StoreEngine, while_stopped: Callable[[], None]) -> None:
    """SIGSTOP the segment holder, run ``while_stopped``, and always SIGCONT it."""
    pid = eng.service("segment_holder").pid
    os.kill(pid, signal.SIGSTOP)
    try:
        while_stopped()
    finally:
        os.kill(pid, signal.SIGCONT)


def _mooncake_if_lost(bsr: Any, *, remounted: bool = False) -> dict[str, Any] | None:
    """`bsr status --json`'s mooncake tier once it names a lost segment (mounted again since, if asked)."""
    mc: dict[str, Any] = bsr("status", "--json").json()["tiers"]["mooncake"]
    lost = mc.get("lost_segments") or []
    return mc if lost and (not remounted or lost[-1].get("remounted_at")) else None


def _lost_events(eng: StoreEngine) -> list[dict[str, Any]]:
    with eng.client() as c:
        return list(c.events(kinds=["segment_lost"]).events)


@pytest.mark.timeout(300)
def test_a_holder_stopped_for_30s_keeps_every_object_with_bsrs_client_ttl(
    bsr: Any, bsr_ttl_engine: StoreEngine
) -> None:
    eng, seed = bsr_ttl_engine, 41
    prompt, stored = _stored(bsr, eng, seed, keep_fs_copy=True)
    [segment] = eng.mounted()

    def thirty_seconds() -> None:
        # The master keeps the stopped holder's segment the whole time (it would drop it after 10 s by default).
        end = time.monotonic() + STOP_S
        while time.monotonic() < end:
            assert eng.mounted() == [segment]
            time.sleep(0.5)

    _stop_holder(eng, thirty_seconds)
    with eng.client() as c:
        probe = c.probe(Prompt.synthetic_of(N, seed), exclude_tiers=["fs"])
    assert probe.committable_tokens == N
    restored = bsr("restore", *prompt, "--tier", "mooncake", "--json")
    assert restored.code == 0, restored.out + restored.err
    r = restored.json()
    assert r["outcome"] == "committed" and r["committed_tokens"] == N and r["tiers"] == ["mooncake"]
    assert r["hash_ok"] is True and r["output_hash"] == stored["output_hash"]  # restore == recompute
    status = bsr("status", "--json").json()
    assert status["tiers"]["mooncake"]["ok"] is True and "lost_segments" not in status["tiers"]["mooncake"]
    assert _lost_events(eng) == []


@pytest.mark.timeout(300)
def test_with_mooncakes_10s_ttl_the_stop_loses_the_store_and_bsr_names_the_loss(
    bsr: Any, mooncake_ttl_engine: StoreEngine
) -> None:
    eng = mooncake_ttl_engine
    prompt, _ = _stored(bsr, eng, 43, keep_fs_copy=False)
    [segment] = eng.mounted()
    holder = eng.service("segment_holder").pid

    def until_dropped() -> None:
        _wait("the master drops the stopped holder's segment", lambda: eng.mounted() == [])
        end = time.monotonic() + STOP_S - MOONCAKE_DEFAULT_CLIENT_TTL_S  # the rest of the 30 s stop
        while time.monotonic() < end:
            time.sleep(0.5)

    _stop_holder(eng, until_dropped)
    _wait("the holder mounts its segment again, empty", lambda: eng.mounted() == [segment])
    # The objects are gone: a restore from Mooncake finds nothing to restore.
    # (Not a success: under --json the result comes inside the one error document, as its report.)
    restored = bsr("restore", *prompt, "--tier", "mooncake", "--json")
    assert restored.code != 0 and restored.json()["report"]["outcome"] == "nothing_to_restore", restored.out

    # Named, once, as the event: whose segment, how, and every object stored on it.
    [lost] = _wait("a segment_lost event", lambda: _lost_events(eng))
    assert (lost["tier"], lost["segment"], lost["cause"]) == ("mooncake", segment, "unmounted")
    assert lost["objects_lost"] == OBJECTS and lost["bytes_lost"] > 0
    assert lost["holder"] == f"segment_holder pid {holder}"
    # In `bsr status`, text and --json alike (once the watch's next look has seen the segment mounted again).
    mc = _wait("status names the loss, mounted again", lambda: _mooncake_if_lost(bsr, remounted=True))
    assert mc["ok"] is False and mc["condition"] == "segment_lost"
    assert mc["lost_segments"][0]["objects_lost"] == OBJECTS
    text = bsr("status").out
    assert "tier mooncake: unhealthy (segment lost)" in text
    assert f"the store dropped holder {segment} (segment_holder pid {holder})'s segment at" in text
    assert f"{OBJECTS} objects" in text and "mounted again, empty, at" in text
    # In `bsr events` (text).
    assert f"STORE LOST (mooncake): the store dropped holder {segment}" in bsr("events").out
    # In `bsr explain`: the loss is why the prompt is gone.
    ex = bsr("explain", *prompt, "--json").json()
    assert ex["verdict"] == "segment-lost" and f"{OBJECTS} objects" in ex["summary"], ex
    assert "segment-lost" in bsr("explain", *prompt).out
    # In the metrics.
    with eng.client() as c:
        metrics = c.metrics()
    assert 'bsr_store_segments_lost_total{cause="unmounted",tier="mooncake"} 1.0' in metrics
    assert f'bsr_store_objects_lost_total{{tier="mooncake"}} {float(OBJECTS)}' in metrics
    assert 'bsr_tier_condition{condition="segment_lost",injected="false",tier="mooncake"} 1.0' in metrics


@pytest.mark.timeout(240)
def test_a_killed_holder_is_named_lost_long_before_the_masters_ttl(bsr: Any, bsr_ttl_engine: StoreEngine) -> None:
    eng = bsr_ttl_engine
    prompt, _ = _stored(bsr, eng, 47, keep_fs_copy=False)
    [segment] = eng.mounted()
    os.kill(eng.service("segment_holder").pid, signal.SIGKILL)
    killed = time.monotonic()

    [lost] = _wait("a segment_lost event", lambda: _lost_events(eng), deadline_s=DEFAULT_STORE_CLIENT_TTL_S / 2)
    assert time.monotonic() - killed < DEFAULT_STORE_CLIENT_TTL_S / 2
    assert eng.mounted() == [segment]  # the master still lists the dead holder's segment (until its TTL)
    assert (lost["segment"], lost["cause"], lost["objects_lost"]) == (segment, "holder_gone", OBJECTS)
    mc = bsr("status", "--json").json()["tiers"]["mooncake"]
    assert mc["condition"] == "segment_lost" and mc["lost_segments"][0]["cause"] == "holder_gone"
    assert f"the store lost holder {segment}" in bsr("status").out
    # The probe still calls the chunks held (the master lists them): explain names the dead holder instead.
    ex = bsr("explain", *prompt, "--json").json()
    assert ex["verdict"] == "segment-lost" and "its holder process is gone" in ex["summary"], ex
    # A restore from Mooncake fails closed at fetch; explaining the request names the loss as well.
    r = bsr("restore", *prompt, "--tier", "mooncake", "--json")
    failed = r.json()["report"]
    assert r.code != 0 and failed["outcome"] == "failed_closed", r.out
    why = bsr("explain", failed["request"], "--json").json()
    assert why["verdict"] == "restore-failed-tier" and f"the store lost holder {segment}" in why["summary"], why
