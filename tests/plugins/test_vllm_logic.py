"""The vLLM connector's decision logic (plain Python): marker lifecycle, windows, block-id collapse.

The vLLM-facing class is thin and these decisions are tested on their own, fast; tests/vllm runs them inside real
vLLM. The last test imports the real connector against vLLM's base classes when vLLM and LMCache are importable.
"""

from __future__ import annotations

import random

import pytest
from vllm_bsr.logic import (
    LoadResult,
    SchedulerState,
    failed_block_ids,
    load_events,
    load_in_windows,
    load_report,
    prefix_keys,
    window_label,
    windows,
)

from bsr_cli.core.events import RestoreFailed, parse_event
from bsr_cli.core.evidence import Stage
from bsr_cli.core.keys import prompt_hash

CS = 256


def prompt(n_chunks: int, seed: int) -> list[int]:
    """Token ids for ``n_chunks`` whole chunks (distinct seeds give prompts that differ in every chunk)."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CS)]


@pytest.mark.timeout(10)
def test_external_tokens_are_chunk_aligned_past_what_vllm_has() -> None:
    s = SchedulerState(CS)
    assert s.external_tokens("r1", probed_prefix_tokens=4 * CS + 17, num_computed_tokens=CS) == 3 * CS
    assert s.external_tokens("r2", probed_prefix_tokens=CS, num_computed_tokens=2 * CS) == 0


@pytest.mark.timeout(10)
def test_marker_set_on_failure_forces_local_then_clears_on_admission() -> None:
    s = SchedulerState(CS)
    assert s.external_tokens("r1", 8 * CS, 0) == 8 * CS
    s.on_alloc("r1", ([1, 2, 3], [40, 41]), 8 * CS)
    s.on_alloc("r2", ([7], [50]), CS)
    # A worker failed r1's load: any of its blocks in any group marks r1 only.
    assert s.on_load_errors({41}) == ["r1"]
    assert set(s.markers) == {"r1"}
    # Rescheduled: the marker forces local compute (0 external tokens), whatever the store still holds.
    assert s.external_tokens("r1", 8 * CS, 0) == 0
    # Admitted without the external prefix: the marker has served its purpose.
    assert s.on_alloc("r1", ([1, 2, 3], [40, 41]), 0) is True
    assert "r1" not in s.markers
    assert s.external_tokens("r1", 8 * CS, 0) == 8 * CS


@pytest.mark.timeout(10)
def test_marker_outlives_the_failed_request_and_steers_the_next_one_for_its_prompt() -> None:
    """vLLM recomputes a failed load in place and never asks again: the marker must reach the NEXT request for the
    same prompt (another request id), force it local once, and then be gone."""
    p, q = prompt(4, seed=1), prompt(4, seed=2)
    s = SchedulerState(CS)
    assert s.external_tokens("r1", 4 * CS, 0, p) == 4 * CS
    s.on_alloc("r1", ([1, 2],), 4 * CS)
    assert s.on_load_errors([2]) == ["r1"]
    s.on_finished("r1")  # the failed request recomputed and finished
    assert set(s.markers) == {prefix_keys(p, CS, 4)[-1]} and s.blocks == {} and s.external == {} and not s.prefixes
    # Another prompt is not affected.
    assert s.external_tokens("r2", 4 * CS, 0, q) == 4 * CS
    # The next request for the same prompt computes locally, and its admission clears the marker.
    assert s.external_tokens("r3", 4 * CS, 0, p) == 0
    assert s.on_alloc("r3", ([7, 8],), 0) is True
    assert s.markers == {}
    s.on_finished("r3")
    assert s.external_tokens("r4", 4 * CS, 0, p) == 4 * CS
    # An admission with external tokens does not clear a standing marker (that load may fail again).
    s.on_alloc("r4", ([5],), 4 * CS)
    s.on_load_errors([5])
    assert s.on_alloc("r4", ([5],), 4 * CS) is False and len(s.markers) == 1


@pytest.mark.timeout(10)
def test_marker_steers_another_prompt_that_starts_with_the_failed_prefix() -> None:
    """The marker stands for the prefix whose load failed, not for one prompt: a longer prompt sharing it is sent to
    local compute too (its load would fetch the same chunks), one that diverges inside it is not."""
    p = prompt(4, seed=1)
    s = SchedulerState(CS)
    s.external_tokens("r1", 4 * CS, 0, p)
    s.on_alloc("r1", ([1, 2],), 4 * CS)
    s.on_load_errors([1])
    s.on_finished("r1")
    longer = p + prompt(3, seed=3)  # the failed prefix, then more chunks
    diverging = p[: 2 * CS] + prompt(2, seed=4)  # shares only the first two chunks
    assert s.external_tokens("r2", 4 * CS, 0, diverging) == 4 * CS
    assert s.external_tokens("r3", 7 * CS, 0, longer) == 0
    assert s.forced["r3"] == prefix_keys(p, CS, 4)[-1]
    # A request whose probe stops short of the failed prefix's end is not covered (its load fetches fewer chunks;
    # if it fails it is marked on its own).
    assert s.external_tokens("r4", 3 * CS, 0, p) == 3 * CS
    # Without token ids the request id is the only key.
    assert s.external_tokens("r5", 4 * CS, 0) == 4 * CS and s.prefix_key("r5") == "r5"


@pytest.mark.timeout(10)
def test_markers_are_bounded_oldest_first() -> None:
    s = SchedulerState(CS, max_markers=2)
    prompts = [prompt(1, seed=i) for i in range(3)]
    for i, p in enumerate(prompts):
        s.external_tokens(f"r{i}", CS, 0, p)
        s.on_alloc(f"r{i}", ([i],), CS)
        s.on_load_errors([i])
    assert list(s.markers) == [prefix_keys(p, CS, 1)[0] for p in prompts[1:]]


@pytest.mark.timeout(10)
def test_windows_cover_the_external_range() -> None:
    assert windows(0, 5 * CS, CS, 2) == [(0, 2 * CS), (2 * CS, 4 * CS), (4 * CS, 5 * CS)]
    assert windows(CS + 10, 3 * CS, CS, 1) == [(CS, 2 * CS), (2 * CS, 3 * CS)]  # start floored for LMCache's mask
    assert windows(0, 4 * CS, CS, 0) == [(0, 4 * CS)]  # W = 0: the stock whole-plan load
    assert windows(3 * CS, 3 * CS, CS, 2) == []
    with pytest.raises(ValueError):
        windows(0, CS + 1, CS, 2)


@pytest.mark.timeout(10)
def test_failed_window_collapses_every_block_of_every_group() -> None:
    calls: list[tuple[int, int]] = []

    def retrieve(s: int, e: int) -> int:
        calls.append((s, e))
        return (e - s) if s < 2 * CS else (e - s) // 2  # the second window comes back short

    res = load_in_windows(retrieve, windows(0, 4 * CS, CS, 2))
    assert not res.ok and res.failed_window == 1 and res.loaded_tokens == 0
    assert calls == [(0, 2 * CS), (2 * CS, 4 * CS)]
    # Every block in every KV group, not just the blocks of the short window.
    assert failed_block_ids(([0, 1, 2, 3], [100, 101])) == {0, 1, 2, 3, 100, 101}
    assert failed_block_ids({0: [9], 1: [10, 11]}) == {9, 10, 11}


@pytest.mark.timeout(10)
def test_exception_in_a_window_fails_closed() -> None:
    def retrieve(s: int, e: int) -> int:
        raise RuntimeError("mooncake transfer failed")

    res = load_in_windows(retrieve, [(0, CS)])
    assert not res.ok and "mooncake transfer failed" in res.reason
    assert load_in_windows(lambda s, e: e - s, [(0, CS), (CS, 2 * CS)]).loaded_tokens == 2 * CS


@pytest.mark.timeout(10)
def test_published_markers_name_the_prefix_they_stand_for_and_the_forced_admissions() -> None:
    """What the workers' admin API serves of the scheduler: each marker under bsr's prompt hash of its prefix, with
    the prefix's length (a client holding a prompt's tokens can tell whether the marker covers it), and the
    admissions a marker sent to local compute. The marker goes once an admission clears it."""
    p = prompt(4, seed=1) + [5] * 60  # 4 full chunks and a tail
    s = SchedulerState(CS)
    assert s.published() == {"chunk_size": CS, "markers": [], "forced": [], "load_failed": []}
    s.external_tokens("r1", 4 * CS, 0, p)
    s.on_alloc("r1", ([1, 2],), 4 * CS)
    s.on_load_errors([2])
    s.on_finished("r1")
    (m,) = s.published()["markers"]  # type: ignore[misc]
    assert m["prompt"] == prompt_hash(p[: 4 * CS]) and m["prefix_tokens"] == 4 * CS and m["request"] == "r1"
    assert m["force_local"] is True and "load errors" in m["reason"]
    # Whichever TP rank failed, every rank's admin can tell the request's load was thrown away.
    assert [(f["request"], f["prefix_tokens"]) for f in s.published()["load_failed"]] == [("r1", 4 * CS)]  # type: ignore[union-attr]
    assert s.external_tokens("r2", 4 * CS, 0, p) == 0
    s.on_alloc("r2", ([3],), 0)
    pub = s.published()
    assert pub["markers"] == [] and [f["request"] for f in pub["forced"]] == ["r2"]  # type: ignore[union-attr]
    assert pub["forced"][0]["marker"] == m["prompt"]  # type: ignore[index]


@pytest.mark.timeout(10)
def test_windows_read_g1_to_gk_in_text_and_0_based_in_fields() -> None:
    assert [window_label(i) for i in range(3)] == ["G1", "G2", "G3"]
    res = load_in_windows(lambda s, e: 0 if s else e - s, windows(0, 4 * CS, CS, 2))
    assert res.failed_window == 1 and res.reason.endswith("in window G2")


@pytest.mark.timeout(10)
def test_a_failed_load_reports_loaded_0_and_the_recomputed_prefix_with_its_events() -> None:
    """vLLM may still count a failed load's tokens as cached: the report says what happened (nothing loaded, the
    prefix recomputed), and its events are bsr's restore events (0-based windows) so explain/events read them."""
    wins = windows(0, 5 * CS, CS, 2)
    kw = dict(request="q1", prompt="abc", vllm_cached_tokens=0, end_token=5 * CS, wins=wins, w=2, chunk_size=CS)
    kw |= dict(bytes_per_chunk=1000, tiers=["fs"], seconds=0.5)
    bad = LoadResult(False, 0, 1, "RuntimeError: injected restore-fault (fault 1) in window G2")
    r = load_report(windows_run=2, result=bad, fault_kind="restore-fault", **kw)  # type: ignore[arg-type]
    assert (r["advertised_tokens"], r["loaded_tokens"], r["recomputed_tokens"]) == (5 * CS, 0, 5 * CS)
    assert r["outcome"] == "failed_closed" and r["failed_window"] == 1 and r["bytes"] == 2000
    # An injected restore-fault fails the install: the rank is blamed, no tier.
    # The failed window G2 covers chunks [2, 4).
    assert r["failures"] == [
        {
            "rank": 0,
            "window": 1,
            "chunks": [2, 4],
            "stage": "install",
            "kind": "rank",
            "tier": None,
            "reason": bad.reason,
        }
    ]
    evs = load_events(r)
    kinds = ["restore_started", "window_released", "restore_failed", "restore_failed_closed"]
    assert [e["type"] for e in evs] == kinds
    assert evs[1]["window"] == 0 and evs[3]["failures"][0]["window"] == 1 and evs[3]["recomputed_tokens"] == 5 * CS
    # The rank's own failure event, as an embedded rank writes it: what `bsr describe` reads.
    failed = parse_event(evs[2])
    assert isinstance(failed, RestoreFailed) and (failed.window, failed.chunks, failed.stage) == (
        1,
        (2, 4),
        Stage.INSTALL,
    )
    short = LoadResult(False, 0, 2, "loaded 0 of 256 tokens in window G3")
    r = load_report(windows_run=3, result=short, **kw)  # type: ignore[arg-type]
    assert r["failures"][0]["kind"] == "tier" and r["failures"][0]["tier"] == "fs"  # the only tier LMCache has
    good = load_report(windows_run=3, result=LoadResult(True, 5 * CS), **kw)  # type: ignore[arg-type]
    assert (good["loaded_tokens"], good["recomputed_tokens"], good["failures"]) == (5 * CS, 0, [])
    assert [e["type"] for e in load_events(good)][-1] == "restore_committed"
    assert sum(e["bytes"] for e in load_events(good) if e["type"] == "window_released") == 5000


@pytest.mark.timeout(10)
def test_a_checksum_failure_blames_the_tier_at_verify_and_names_the_chunk() -> None:
    wins = windows(0, 4 * CS, CS, 2)
    kw = dict(request="q2", prompt="abc", vllm_cached_tokens=0, end_token=4 * CS, wins=wins, w=2, chunk_size=CS)
    kw |= dict(bytes_per_chunk=1000, tiers=["mooncake"], seconds=0.1)
    bad = LoadResult(False, 0, 1, "ChecksumError: checksum mismatch in chunk 3 (tier mooncake, key k3)")
    seen = {"chunk": 3, "tier": "mooncake", "key": "k3", "verdict": "mismatch"}
    r = load_report(windows_run=2, result=bad, integrity=seen, **kw)  # type: ignore[arg-type]
    (f,) = r["failures"]
    assert (f["stage"], f["kind"], f["tier"], f["chunk"], f["key"]) == ("verify", "tier", "mooncake", 3, "k3")
    assert r["outcome"] == "failed_closed" and r["recomputed_tokens"] == 4 * CS
    # Without the finding the same short window is a fetch failure (what LMCache alone can tell).
    plain = load_report(windows_run=2, result=bad, **kw)  # type: ignore[arg-type]
    assert plain["failures"][0]["stage"] == "fetch" and "chunk" not in plain["failures"][0]
    ok = load_report(windows_run=2, result=LoadResult(True, 4 * CS), unverified_chunks=2, **kw)  # type: ignore[arg-type]
    assert ok["unverified_chunks"] == 2 and ok["failures"] == []


@pytest.mark.timeout(10)
def test_explain_against_a_worker_reads_full_chunks_and_suggests_only_what_it_serves() -> None:
    """A vLLM worker serves no restores, submits, settings changes or marker clearing: every suggested next command
    is one it serves; the tail that does not fill a chunk is said to be always computed, not blamed on a store."""
    from bsr_cli.core.bitmap import HitBitmap
    from bsr_cli.core.explain import FindingKind, explain_engine
    from bsr_cli.core.status import EngineInfo, Health, MarkerView
    from bsr_cli.loaders import builtin_registration

    reg = builtin_registration("demo")
    cs = reg.chunk_size
    rows = [{"rank": r, "group": g, "cells": "1111"} for r in range(2) for g in reg.group_names]
    bitmap = {"tokens": 4 * cs, "chunk_size": cs, "tiers": ["fs"], "ranks": 2, "groups": list(reg.group_names)}
    info = {"W": 2, "budget_bytes": 4 * reg.bytes_per_chunk, "pool_bytes": 8 * reg.bytes_per_chunk, "engine": "w"}
    kw: dict = dict(prompt="p", prompt_flags="--tokens-file t.json", registration=reg, n_tokens=4 * cs + 9)
    kw |= dict(health=Health(ranks=(), tiers={}), faults=[], w=None, last_restore=None)
    marker = {"prompt": "p", "excluded_tiers": ["fs"], "reason": "load failed", "request": "q1"}
    for served in (True, False):
        inf = EngineInfo.from_wire(info | ({} if served else {"serves_restores": False}))
        d = explain_engine(bitmap=HitBitmap.from_dict(bitmap | {"rows": rows}), info=inf, markers=[], **kw)
        assert d.verdict is FindingKind.RESTORABLE and any("last 9 token(s)" in e for e in d.findings[0].evidence)
        assert d.next.startswith("bsr restore") if served else d.next == "bsr status"
        holes = [x | {"cells": "1100"} for x in rows]
        d = explain_engine(bitmap=HitBitmap.from_dict(bitmap | {"rows": holes}), info=inf, markers=[], **kw)
        assert d.verdict is FindingKind.PARTIAL
        assert d.next.startswith("bsr submit") if served else d.next == "bsr probe --tokens-file t.json"
        d = explain_engine(
            bitmap=HitBitmap.from_dict(bitmap | {"rows": rows}), info=inf, markers=[MarkerView.from_wire(marker)], **kw
        )
        assert d.verdict is FindingKind.FORCE_LOCAL_MARKER
        assert d.next.startswith("bsr markers clear") if served else d.next == "bsr markers list"


@pytest.mark.timeout(10)
def test_a_worker_marker_keeps_its_own_id_in_explain_and_describe_names_the_failed_window() -> None:
    """A vLLM worker's marker stands for a prefix of the prompt, under that prefix's hash: explain names it by that
    id (as `markers list` does), not by the whole prompt's hash; describe of the failed load names the window G2,
    its chunks, the stage and the marker, from the load's events alone."""
    import dataclasses

    from bsr_cli.core.bitmap import HitBitmap
    from bsr_cli.core.events import MarkerSet, stamped
    from bsr_cli.core.explain import FindingKind, explain_engine
    from bsr_cli.core.status import EngineInfo, Health, MarkerView
    from bsr_cli.core.timeline import timeline
    from bsr_cli.loaders import builtin_registration

    reg = builtin_registration("demo")
    cs = reg.chunk_size
    rows = [{"rank": r, "group": g, "cells": "1111"} for r in range(2) for g in reg.group_names]
    bitmap = {"tokens": 4 * cs, "chunk_size": cs, "tiers": ["fs"], "ranks": 2, "groups": list(reg.group_names)}
    info = {"W": 2, "budget_bytes": 4 * reg.bytes_per_chunk, "pool_bytes": 8 * reg.bytes_per_chunk, "engine": "w"}
    marker = {"prompt": "prefix-hash", "excluded_tiers": ["fs"], "reason": "load failed", "request": "q1"}
    kw: dict = dict(prompt="whole-hash", prompt_flags="--tokens-file t.json", registration=reg, n_tokens=4 * cs + 9)
    kw |= dict(health=Health(ranks=(), tiers={}), faults=[], w=None, last_restore=None)
    kw |= dict(
        bitmap=HitBitmap.from_dict(bitmap | {"rows": rows}),
        info=EngineInfo.from_wire(info | {"serves_restores": False}),
    )
    view = MarkerView.from_wire(marker | {"prefix_tokens": 4 * cs})
    d = explain_engine(markers=[view], covering={"prefix-hash"}, **kw)
    assert (
        d.verdict is FindingKind.FORCE_LOCAL_MARKER and d.marker == "prefix-hash" and d.to_wire()["marker"] == d.marker
    )
    shown = d.findings[0].evidence[0]
    assert shown.startswith("marker: prompt prefix-hash ") and f"first {4 * cs:,} tokens" in shown, shown
    assert "whole-hash" not in " ".join(d.findings[0].evidence)
    # The negative control: a marker that covers no prefix of this prompt is not this prompt's.
    assert explain_engine(markers=[view], **kw).marker is None

    wins = windows(0, 5 * CS, CS, 2)
    report = load_report(
        request="q1",
        prompt="prefix-hash",
        vllm_cached_tokens=0,
        end_token=5 * CS,
        wins=wins,
        windows_run=2,
        result=LoadResult(False, 0, 1, "ChecksumError: checksum mismatch in chunk 3"),
        w=2,
        chunk_size=CS,
        bytes_per_chunk=1000,
        tiers=["mooncake"],
        integrity={"chunk": 3, "tier": "mooncake", "key": "k", "verdict": "mismatch"},
    )
    evs = [stamped(parse_event(e), i + 1, 100.0 + i) for i, e in enumerate(load_events(report))]
    evs.append(stamped(MarkerSet(prompt="prefix-hash", request="q1", excluded_tiers=("mooncake",)), 9, 109.0))
    t = timeline("q1", evs)
    ((f,),) = [t.failures]
    assert (f.where(), f.why()) == ("window G2 (chunks 2-3)", "tier mooncake, stage verify"), t.failures
    assert t.prompt == "prefix-hash" and t.marker is not None and t.marker.prompt == "prefix-hash"
    # An older worker wrote no restore_failed event: the restore's end still names the failed window.
    older = timeline("q1", [e for e in evs if not isinstance(e, RestoreFailed)])
    assert [x.where() for x in older.failures] == ["window G2 (chunks 2-3)"]
    # Without its marker event, the marker standing for the request is found by its request id.
    bare = timeline("q1", [e for e in evs if not isinstance(e, MarkerSet)], [dataclasses.replace(view)])
    assert bare.marker is not None and bare.marker.prompt == "prefix-hash"


@pytest.mark.timeout(120)
def test_connector_subclasses_vllms_real_base_classes() -> None:
    pytest.importorskip("lmcache")
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from vllm_bsr.connector import BSRConnector

    assert issubclass(BSRConnector, base.KVConnectorBase_V1)
    for name in (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "start_load_kv",
        "get_block_ids_with_load_errors",
    ):
        assert callable(getattr(base.KVConnectorBase_V1, name)), name
