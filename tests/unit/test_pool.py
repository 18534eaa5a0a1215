"""The restore pool: slots, the admission budget B, capacity refusals, peaks, budget changes while waiting."""

from __future__ import annotations

import threading

import pytest

from bsr_cli.errors import CapacityError
from bsr_cli.runtime.pool import RestorePool
from unit.fakes import make_pool


def test_leases_account_exact_live_and_peak_bytes() -> None:
    pool = make_pool(slots=4, slot_bytes=100)
    a = pool.acquire(2, timeout_s=1)
    b = pool.acquire(1, timeout_s=1)
    assert a is not None and b is not None
    s = pool.stats()
    assert (s.live_bytes, s.peak_bytes, s.windows_live) == (300, 300, 2)
    a.release()
    a.release()  # idempotent: a double release must not give slots back twice
    s = pool.stats()
    assert (s.live_bytes, s.peak_bytes, s.windows_live) == (100, 300, 1)
    b.release()
    pool.reset_peak()
    assert pool.stats().peak_bytes == 0


def test_a_window_is_one_contiguous_run_of_slots_again_after_release() -> None:
    pool = make_pool(slots=4, slot_bytes=10)
    with pool.acquire(3, timeout_s=1) as lease:  # type: ignore[union-attr]
        assert lease.slots == [0, 1, 2]
    lease2 = pool.acquire(3, timeout_s=1)
    assert lease2 is not None and lease2.slots == [0, 1, 2]
    assert lease2.slot(1, 4, 6).ptr == pool.base_ptr + 14


def test_budget_bounds_windows_but_not_the_whole_plan_path() -> None:
    pool = make_pool(slots=8, slot_bytes=10, budget_bytes=30)
    with pytest.raises(CapacityError, match="budget B"):
        pool.acquire(4, timeout_s=0.1)
    whole = pool.acquire(6, timeout_s=0.1, bounded=False)  # W=0: bounded by capacity only
    assert whole is not None
    whole.release()
    with pytest.raises(CapacityError, match="pool capacity"):
        pool.acquire(9, timeout_s=0.1, bounded=False)


def test_no_wait_returns_none_and_a_waiter_is_admitted_on_release() -> None:
    pool = make_pool(slots=4, slot_bytes=10, budget_bytes=20)
    held = pool.acquire(2, timeout_s=1)
    assert held is not None
    assert pool.acquire(1, timeout_s=1, wait=False) is None
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(2, timeout_s=10)))
    t.start()
    while pool.stats().waiters == 0:  # the waiter is blocked on the budget, not failed
        threading.Event().wait(0.01)
    held.release()
    t.join(10)
    assert got and got[0] is not None
    assert pool.stats().peak_bytes == 20  # never more than B live


def test_admission_deadline_is_a_capacity_error() -> None:
    pool = make_pool(slots=4, slot_bytes=10, budget_bytes=20)
    held = pool.acquire(2, timeout_s=1)
    with pytest.raises(CapacityError, match="timed out"):
        pool.acquire(1, timeout_s=0.05)
    assert held is not None


def test_a_budget_cut_below_a_waiting_window_fails_it_instead_of_hanging() -> None:
    pool = make_pool(slots=8, slot_bytes=10, budget_bytes=40)
    held = pool.acquire(3, timeout_s=1)
    assert held is not None
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire(3, timeout_s=20)
        except CapacityError as e:
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    while pool.stats().waiters == 0:
        threading.Event().wait(0.01)
    pool.set_budget(20)
    t.join(10)
    assert not t.is_alive()
    assert errors and "budget B" in str(errors[0])


def test_budget_never_exceeds_capacity_and_staging_checks_the_slot() -> None:
    pool = make_pool(slots=2, slot_bytes=10, budget_bytes=10_000)
    assert pool.budget_bytes == 20
    with pytest.raises(ValueError):
        pool.staging(0, 5, 6)


def test_slots_a_tier_may_still_write_stay_out_of_the_pool_until_the_transfer_returns() -> None:
    """A transfer abandoned at its deadline can land later (a cut link that comes back): its slots must not be
    handed to the next window until it has returned, and they count as live (against B) until then."""
    from concurrent.futures import Future

    buf = bytearray(4 * 100)
    pool = RestorePool(0, memoryview(buf), 100, budget_bytes=400)
    lease = pool.acquire(2, timeout_s=1)
    assert lease is not None
    late: Future[None] = Future()
    late.set_running_or_notify_cancel()
    lease.hold_until([late])
    lease.release()
    assert pool.stats().live_bytes == 200, "still writable by the abandoned transfer: not free"
    assert pool.acquire(3, timeout_s=0, wait=False) is None
    late.set_result(None)  # the transfer returned
    assert pool.stats().live_bytes == 0
    again = pool.acquire(4, timeout_s=0, wait=False)
    assert again is not None
    again.release()


def test_a_transfer_that_returned_before_the_release_holds_nothing() -> None:
    from concurrent.futures import Future

    pool = RestorePool(0, memoryview(bytearray(200)), 100)
    lease = pool.acquire(1, timeout_s=1)
    assert lease is not None
    done: Future[None] = Future()
    done.set_result(None)
    lease.hold_until([done])
    lease.release()
    assert pool.stats().live_bytes == 0
