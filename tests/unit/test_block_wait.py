"""Destination KV blocks short: a request waits for them (FIFO, up to kv_wait_s) as a serving scheduler keeps it
waiting, instead of being refused at once; only what can never fit is refused at once, and one still waiting at
its deadline is refused for capacity. Synchronised on the queue's own state (``await_blocks_waiting``) and on the
holder's events, never on sleeps."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from bsr_cli.core.events import RequestAdmitted, RestoreEnded
from bsr_cli.core.evidence import CapacityCause, FailureKind, Outcome
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.errors import CapacityError, RestoreAborted
from bsr_cli.tui.model import Frame, fold
from unit.fixtures import KV_HOLDER, KV_TOKENS, FakeEngine, hold_blocks

WAITER = synthetic_tokens(2000, seed=2)  # needs 500: more than the 274 left


def _submit_in_thread(eng: FakeEngine, tokens: list[int], name: str, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            out[name] = eng.coordinator.submit(tokens, request=name)
        except Exception as e:  # noqa: BLE001 - the test inspects what the request ended with
            out[name] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _gauge(eng: FakeEngine) -> float:
    return eng.coordinator.counters.value("bsr_requests_waiting_for_blocks")


def _gave_up(eng: FakeEngine) -> float:
    return eng.coordinator.counters.value("bsr_requests_gave_up_waiting_for_blocks_total")


def test_a_request_waits_for_blocks_held_by_another_and_proceeds_when_they_free(kv_engine: FakeEngine) -> None:
    coord = kv_engine.coordinator
    holder, held = hold_blocks(kv_engine)
    out: dict[str, Any] = {}
    waiter = _submit_in_thread(kv_engine, WAITER, "req-waiter", out)
    assert coord.await_blocks_waiting(1, 10), "the request did not wait for the blocks"
    # Visible where an operator looks: the snapshot (`bsr status`, `bsr top`) and the gauge.
    adm = coord.snapshot(health=False).admission
    assert adm.waiting_for_blocks == 1 and adm.blocks_waiting[0].request == "req-waiter"
    assert adm.blocks_waiting[0].blocks == {"full": 500, "swa": 250}
    assert _gauge(kv_engine) == 1
    view = fold(None, Frame(coord.snapshot(health=False), received_at=0.0, latency_s=0.0))  # what `bsr top` draws
    assert view.admission.waiting_for_blocks == 1
    # FIFO: a small request that would fit the free blocks now still queues behind the first in line.
    small = _submit_in_thread(kv_engine, synthetic_tokens(100, seed=3), "req-small", out)
    assert coord.await_blocks_waiting(2, 10)
    assert [w.request for w in coord.blocks_waiting()] == ["req-waiter", "req-small"]
    kv_engine.ranks[0].release.set()  # the holder finishes and frees its blocks
    for t in (holder, waiter, small):
        t.join(20)
    assert held["res"].computed_tokens == len(KV_HOLDER)
    assert out["req-waiter"].computed_tokens == len(WAITER) and out["req-waiter"].hash_ok is True
    assert out["req-small"].hash_ok is True
    admitted = {e.request: e for e in kv_engine.events.recent(200) if isinstance(e, RequestAdmitted)}
    assert admitted["req-waiter"].queued_s > 0 and admitted["req-holder"].queued_s == 0
    assert _gauge(kv_engine) == 0 and _gave_up(kv_engine) == 0 and coord.blocks_waiting() == []


def test_a_request_that_can_never_fit_is_refused_at_once(kv_engine: FakeEngine) -> None:
    too_big = synthetic_tokens(KV_TOKENS + 4, seed=4)  # within max_tokens, more blocks than the group has at all
    kv_engine.coordinator.settings.max_tokens = 2 * KV_TOKENS
    with pytest.raises(CapacityError) as e:
        kv_engine.coordinator.submit(too_big, request="req-huge")
    assert "can never fit" in e.value.message and "--kv-tokens" in (e.value.hint or "")
    assert _gauge(kv_engine) == 0 and _gave_up(kv_engine) == 0  # it never queued
    refused = [e for e in kv_engine.events.recent(50) if (isinstance(e, RestoreEnded) and e.outcome is Outcome.REFUSED)]
    assert refused and refused[-1].request == "req-huge"
    assert refused[-1].failures[0].cause == CapacityCause.NO_DESTINATION_BLOCKS


@pytest.mark.parametrize("kv_engine", [{"kv_wait_s": 0.2}], indirect=True)
def test_a_request_still_waiting_at_its_deadline_is_refused_for_capacity(kv_engine: FakeEngine) -> None:
    holder, _ = hold_blocks(kv_engine)  # holds its blocks until released, far past the 0.2 s deadline
    try:
        with pytest.raises(CapacityError) as e:
            kv_engine.coordinator.submit(WAITER, request="req-late")
    finally:
        kv_engine.ranks[0].release.set()
        holder.join(20)
    assert "500 blocks needed, 274 free of 1024 after waiting 0.2s" in e.value.message
    assert "--kv-tokens" in (e.value.hint or "") and "--kv-wait" in (e.value.hint or "")
    assert e.value.retry_after_s == 5  # it may fit later: when to try again
    assert _gave_up(kv_engine) == 1 and _gauge(kv_engine) == 0
    assert (
        kv_engine.coordinator.counters.value(
            "bsr_restores_total",
            {"outcome": Outcome.REFUSED, "kind": FailureKind.CAPACITY, "stage": "admission", "injected": "false"},
        )
        == 1
    )
    recent = kv_engine.coordinator.snapshot(health=False).recent
    assert any(r.request == "req-late" and r.outcome is Outcome.REFUSED for r in recent)


def test_an_abort_ends_a_request_waiting_for_blocks(kv_engine: FakeEngine) -> None:
    holder, _ = hold_blocks(kv_engine)
    out: dict[str, Any] = {}
    waiter = _submit_in_thread(kv_engine, WAITER, "req-waiter", out)
    try:
        assert kv_engine.coordinator.await_blocks_waiting(1, 10)
        assert kv_engine.coordinator.abort("req-waiter") is True
        waiter.join(10)
    finally:
        kv_engine.ranks[0].release.set()
        holder.join(20)
    assert isinstance(out["req-waiter"], RestoreAborted)
    assert kv_engine.coordinator.blocks_waiting() == [] and _gave_up(kv_engine) == 0
