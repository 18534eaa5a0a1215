"""The engine's self-description types: each reads its wire form back and writes it again unchanged (keys, their
order, which are present), and keeps what a host or a newer engine adds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bsr_cli.core.evidence import FailureKind, Outcome, Stage, TierCondition
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.status import (
    EngineInfo,
    FaultListing,
    Health,
    MarkerView,
    PoolEntry,
    RankTierStatus,
    RecentRestore,
    Snapshot,
)

pytestmark = pytest.mark.timeout(30)

INFO: dict[str, Any] = {
    "api": "v1",
    "version": "0.9.0",
    "engine": None,
    "started_at": 1700000000.5,
    "ranks": 2,
    "registration": {"identity": "abc", "model": "m", "tensors": 4, "bytes_per_chunk": 1024, "groups": ["full"]},
    "chunk_size": 256,
    "tiers": ["mooncake", "fs"],
    "W": 2,
    "rws_bytes": 2048,
    "pool_bytes": 1 << 20,
    "budget_bytes": 1 << 19,
    "max_tokens": 8192,
    "kv_tokens": 16384,
    "fetch_timeout_s": 5,
    "faults_enabled": True,
    "fs_concurrency": 4,
    "tokenizer": None,
}
LAST_FAULT = {"reason": "rank 1 failed at install", "request": "r-3", "at": 1700000001.0, "stage": "install"}
RANK_OK = {
    "rank": 0,
    "healthy": True,
    "alive": True,
    "heartbeat_age_s": 0.12,
    "reason": None,
    "last_fault": None,
    "state": "live",
}
RANK_BAD = {
    "rank": 1,
    "healthy": False,
    "alive": True,
    "heartbeat_age_s": 9.5,
    "reason": "no heartbeat for 9.5s",
    "last_fault": LAST_FAULT,
    "state": "hung",
}
QUARANTINED = {"key": "k", "file": "/q/k.bin", "reason": "checksum", "at": 1700000002.0, "bytes": 1024}
TIER_BAD = {
    "ok": False,
    "detail": ["rank0: read-only", "fault #3 remote-unavailable armed"],
    "conditions": ["read_only", "fault_armed"],
    "quarantined": [QUARANTINED],
    "quarantined_total": 1,
    "condition": "read_only",
}
TIER_OK = {"ok": True, "detail": [], "conditions": [], "quarantined": [], "quarantined_total": 0, "condition": "ok"}
HEALTH = {
    "ok": False,
    "ranks_alive": [True, True],
    "ranks": [RANK_OK, RANK_BAD],
    "unhealthy_ranks": [1],
    "starved_ranks": [],
    "tiers": {"mooncake": TIER_BAD, "fs": TIER_OK},
    "degraded_tiers": ["mooncake"],
    "api": "v1",
}
POOL = {
    "rank": 0,
    "alive": True,
    "healthy": True,
    "reason": None,
    "heartbeat_age_s": 0.12,
    "last_fault": None,
    "pool": {"live_bytes": 10, "peak_bytes": 20, "budget_bytes": 5, "waiters": 1, "draining": True},
    "tiers": {"fs": {"ok": True, "detail": "", "condition": "ok", "quarantined": [], "quarantined_total": 0}},
    "tp_rank": 3,
    "restore_bps": 1.5,
    "state": "live",
}
SILENT = {
    "rank": 1,
    "alive": False,
    "healthy": False,
    "reason": "no answer to stats within 5s",
    "heartbeat_age_s": 9.5,
    "last_fault": LAST_FAULT,
    "error": "no answer to stats within 5s",
    "restore_bps": 0.0,
    "state": "dead",
}
FAULT = {
    "id": 3,
    "kind": "remote-unavailable",
    "rank": None,
    "window": 1,
    "group": None,
    "count": 1,
    "fired": 0,
    "expires_at": 1700003600.0,
}
MARKER = {"prompt": "p1", "excluded_tiers": ["mooncake"], "reason": "tier failed", "request": "r-3", "set_at": 1.0}
SNAPSHOT = {
    "time": 1700000003.0,
    "info": INFO,
    "ranks": [POOL, SILENT],
    "active": [
        {
            "request": "r-4",
            "W": 2,
            "windows": 3,
            "tokens": 768,
            "tiers": ["fs"],
            "started": 1700000002.5,
            "done": {"0": 1, "1": 0},
            "bytes": {"0": 2048, "1": 0},
        }
    ],
    "recent": [{"request": "r-3", "outcome": "failed_closed", "anything": "as recorded"}],
    "admission": {
        "budget_bytes": 5,
        "live_bytes": 10,
        "queued": 1,
        "waiting_for_blocks": 1,
        "kv_wait_s": 30.0,
        "blocks_waiting": [{"request": "r-5", "tokens": 512, "blocks": {"full": 2}, "since": 1.0, "waited_s": 0.25}],
    },
    "tiers": {"mooncake": TIER_BAD},
    "events": [{"seq": 7, "kind": "restore_started", "request": "r-4"}],
    "seq": 7,
    "markers": [MARKER],
    "faults": [FAULT],
}


def _same(wire: dict[str, Any], again: dict[str, Any]) -> None:
    assert json.dumps(again) == json.dumps(wire)  # the same keys, in the same order, with the same values


@pytest.mark.parametrize(
    ("cls", "wire"),
    [
        (EngineInfo, INFO),
        (Health, HEALTH),
        (PoolEntry, POOL),
        (PoolEntry, SILENT),
        (MarkerView, MARKER),
        (FaultListing, {"enabled": True, "faults": [FAULT]}),
        (Snapshot, SNAPSHOT),
    ],
)
def test_the_wire_form_reads_back_and_writes_again_unchanged(cls: Any, wire: dict[str, Any]) -> None:
    _same(wire, cls.from_wire(wire).to_wire())


def test_what_a_host_adds_is_kept_after_the_standard_fields() -> None:
    info = INFO | {"serves_restores": False, "worker": {"tp_rank": 1}}
    marker = MARKER | {"prefix_tokens": None, "force_local": True}
    snap = SNAPSHOT | {"info": info, "markers": [marker], "scheduler": {"published": True}}
    _same(snap, Snapshot.from_wire(snap).to_wire())
    assert EngineInfo.from_wire(info).host_fields == {"serves_restores": False, "worker": {"tp_rank": 1}}


def test_the_types_carry_the_closed_sets_and_derive_the_summaries() -> None:
    health = Health.from_wire(HEALTH)
    assert health.ranks[1].last_fault is not None and health.ranks[1].last_fault.stage is Stage.INSTALL
    assert health.tiers["mooncake"].conditions == (TierCondition.READ_ONLY, TierCondition.FAULT_ARMED)
    assert (health.ok, health.unhealthy_ranks, health.degraded_tiers) == (False, [1], ["mooncake"])
    snap = Snapshot.from_wire(SNAPSHOT)
    assert snap.active[0].done == {0: 1, 1: 0} and snap.info.w == 2 and snap.faults[0].window == 1


def test_a_reader_assumes_what_an_older_engine_meant_by_the_keys_it_left_out() -> None:
    entry = PoolEntry.from_wire({"rank": 2})  # an entry that does not say is healthy, but not known to run
    assert (entry.alive, entry.healthy, entry.pool, entry.tiers, entry.restore_bps) == (False, True, None, None, 0.0)
    rank = Health.from_wire({"ranks": [{"rank": 1}]}).ranks[0]  # a rank's health that does not say is good
    assert (rank.alive, rank.healthy, rank.last_fault) == (True, True, None)
    # A tier that names no condition: its first condition, else ok; a rank's: ok or unavailable, as its ok says.
    tiers = Health.from_wire({"tiers": {"fs": {"conditions": ["full", "read_only"]}, "mooncake": {"ok": True}}}).tiers
    assert (tiers["fs"].condition, tiers["mooncake"].condition) == (TierCondition.FULL, TierCondition.OK)
    seen = PoolEntry.from_wire({"rank": 0, "tiers": {"fs": {"ok": False}, "mooncake": {"ok": True, "condition": None}}})
    assert seen.tiers == {
        "fs": RankTierStatus(ok=False, detail="", condition=TierCondition.UNAVAILABLE),
        "mooncake": RankTierStatus(ok=True, detail="", condition=TierCondition.OK),
    }
    assert json.dumps(EngineInfo.from_wire({}).to_wire()["fetch_timeout_s"]) == "0"  # as the reader always had it
    assert FaultSpec.from_wire({"kind": "timeout"}) == FaultSpec("timeout", count=1)


def test_a_fault_lists_its_id_first_and_reads_back_as_it_was_armed() -> None:
    fault = FaultSpec("corrupt", rank=1, group="swa", count=0, id=4, fired=2, expires_at=1700003600.5)
    assert list(fault.to_wire()) == ["id", "kind", "rank", "window", "group", "count", "fired", "expires_at"]
    assert FaultSpec.from_wire(json.loads(json.dumps(fault.to_wire()))) == fault


def test_draining_marks_a_pool_above_its_budget_only() -> None:
    entry = PoolEntry.from_wire(POOL | {"pool": {"live_bytes": 10, "budget_bytes": 5}})
    assert entry.with_draining().to_wire()["pool"] == {"live_bytes": 10, "budget_bytes": 5, "draining": True}
    within = PoolEntry.from_wire(POOL | {"pool": {"live_bytes": 5, "budget_bytes": 5}})
    assert within.with_draining().to_wire()["pool"]["draining"] is False
    assert PoolEntry.from_wire(SILENT).with_draining().to_wire() == SILENT


def test_a_fault_request_sends_only_what_was_given_window_zero_included() -> None:
    from bsr_cli.core.faults import FaultRequest

    assert json.dumps(FaultRequest("restore-fault", rank=1).to_wire()) == json.dumps(
        {"kind": "restore-fault", "rank": 1, "count": 1}
    )
    assert FaultRequest("timeout", window=0, count=0, ttl_s=60).to_wire() == {
        "kind": "timeout",
        "window": 0,  # G1: a real window, not "none given"
        "count": 0,
        "ttl_s": 60,
    }


def test_a_recent_restore_the_engine_records_is_written_in_field_order() -> None:
    entry = RecentRestore(
        request="r-1",
        outcome=Outcome.FAILED_CLOSED,
        tokens=4096,
        w=4,
        tiers=("mooncake", "fs"),
        seconds=0.5,
        finished=1700000000.25,
        reason="tier fs: read failed",
        failure_kind=FailureKind.TIER,
        failure_stage=Stage.FETCH,
    )
    assert json.dumps(entry.to_wire()) == json.dumps(
        {
            "request": "r-1",
            "outcome": "failed_closed",
            "tokens": 4096,
            "W": 4,
            "tiers": ["mooncake", "fs"],
            "seconds": 0.5,
            "finished": 1700000000.25,
            "reason": "tier fs: read failed",
            "failure_kind": "tier",
            "failure_stage": "fetch",
        }
    )


def test_a_hosts_recent_restore_is_written_back_with_its_keys_in_its_order() -> None:
    # A vLLM worker's load: keys of its own between the standard ones, no failure_stage, a null failed_window.
    load = {
        "request": "q1",
        "prompt": "p-abc",
        "prefix_tokens": 1024,
        "outcome": "committed",
        "tokens": 1024,
        "loaded_tokens": 1024,
        "failed_window": None,
        "W": 2,
        "tiers": ["mooncake"],
        "seconds": 1,
        "finished": 1700000000.5,
        "reason": "",
        "failure_kind": None,
        "tp_rank": 1,
    }
    entry = RecentRestore.from_wire(load)
    assert (entry.request, entry.outcome, entry.w, entry.tiers) == ("q1", Outcome.COMMITTED, 2, ("mooncake",))
    assert entry.host_fields == {"prompt": "p-abc", "prefix_tokens": 1024, "loaded_tokens": 1024,
                                 "failed_window": None, "tp_rank": 1}  # fmt: skip
    assert json.dumps(entry.to_wire()) == json.dumps(load)
    snap = Snapshot.from_wire(SNAPSHOT | {"recent": [load]})
    assert json.dumps(snap.to_wire()["recent"]) == json.dumps([load])


def test_a_recent_restore_with_an_outcome_this_bsr_does_not_know_reads_as_unknown_and_is_kept() -> None:
    """A newer engine's outcome (or failure kind) must not make the whole snapshot unreadable: the entry reads as
    unknown (None) and is written back as it came."""
    from bsr_cli.core.status import RecentRestore, Snapshot

    sent = {"request": "r1", "outcome": "from_a_newer_engine", "tokens": 5, "W": 4, "failure_kind": ["odd"]}
    snap = Snapshot.from_wire({"recent": [sent, {"request": "r2", "outcome": "committed"}]})
    first, second = snap.recent
    assert first.outcome is None and first.failure_kind is None and second.outcome is Outcome.COMMITTED
    assert json.dumps(first.to_wire()) == json.dumps(sent)
    assert RecentRestore.from_wire({"request": "r3", "outcome": None}).outcome is None


def test_a_tier_condition_or_stage_a_newer_engine_adds_reads_as_sent_and_is_no_known_one() -> None:
    """One new reason from a newer engine must not make the whole health or snapshot unreadable: it reads under its
    own name, is written back as it came, and is taken for no member (not ``ok``; a stage that blames no tier)."""
    new_tier = TIER_BAD | {"conditions": ["throttled", "read_only"], "condition": "throttled"}
    new_fault = LAST_FAULT | {"stage": "decompress"}
    rank_tier: dict[str, Any] = {"ok": False, "detail": "throttled", "condition": "throttled"}
    rank_tier |= {"quarantined": [], "quarantined_total": 0}
    sent = SNAPSHOT | {
        "tiers": {"mooncake": new_tier},
        "ranks": [POOL | {"tiers": {"fs": rank_tier}}, SILENT | {"last_fault": new_fault}],
    }
    snap = Snapshot.from_wire(sent)
    tier = snap.tiers["mooncake"]
    assert tier.condition == "throttled" and tier.conditions == ("throttled", TierCondition.READ_ONLY)
    assert tier.condition not in list(TierCondition) and tier.condition != TierCondition.OK
    assert snap.ranks[0].tiers is not None and snap.ranks[0].tiers["fs"].condition == "throttled"
    stage = snap.ranks[1].last_fault.stage if snap.ranks[1].last_fault else None
    assert stage == "decompress" and stage not in list(Stage) and not stage.blames_tier
    assert json.dumps(snap.to_wire()["tiers"]) == json.dumps({"mooncake": new_tier})
    assert snap.to_wire()["ranks"][1]["last_fault"] == new_fault
    health = Health.from_wire(HEALTH | {"tiers": {"mooncake": new_tier, "fs": TIER_OK}})
    assert health.tiers["mooncake"].condition == "throttled" and health.tiers["fs"].condition is TierCondition.OK
    not_names: tuple[Any, ...] = ("", 3, ["x"])
    for not_a_reason in not_names:  # what is not a name at all is still refused
        with pytest.raises(ValueError):
            TierCondition(not_a_reason)
        with pytest.raises(ValueError):
            Stage(not_a_reason)
