"""Settings every rank applies, all or nothing: a change a rank fails leaves no rank changed (the ranks that took it
are put back), a change while a rank is down is refused before any rank is asked, a rank that did not confirm is out
of step (and unhealthy) until it holds the engine's value again, and a restarted rank takes the engine's values
before it serves."""

from __future__ import annotations

import threading

import pytest

from bsr_cli.api.ranks import UnsupportedOp
from bsr_cli.errors import RankRestarting
from bsr_cli.runtime.coordinator import RankUnresponsive
from unit.fakes import FakeRankOps, InProcessRank, RestartSchedule
from unit.fixtures import FakeEngine, build_engine


def _budgets(eng: FakeEngine) -> list[int]:
    return [r.ops.pool.budget_bytes for r in eng.ranks]


def _until(cond, what: str, limit_s: float = 10.0) -> None:
    pause = threading.Event()
    for _ in range(int(limit_s / 0.02)):
        if cond():
            return
        pause.wait(0.02)
    assert cond(), what


def test_a_change_one_setting_of_fails_puts_back_the_setting_every_rank_took(fake_engine: FakeEngine) -> None:
    """The fake ranks refuse set_fs_concurrency (they have no filesystem tier): B, sent first, is put back on every
    rank and the engine reports what the ranks hold."""
    c = fake_engine.coordinator
    before = c.settings.budget_bytes
    slot = fake_engine.reg.bytes_per_chunk
    with pytest.raises(UnsupportedOp) as e:
        c.update_settings(budget_bytes=2 * slot, fs_concurrency=4)
    assert "budget_bytes, fs_concurrency not changed" in e.value.message
    assert f"rank 0 was put back to budget_bytes {before}" in e.value.message
    assert _budgets(fake_engine) == [before, before] and c.settings.budget_bytes == before
    assert [(entry.pool or {}).get("budget_bytes") for entry in c.pool()] == [before, before]
    assert all(h.healthy for h in c.rank_health())


def test_a_rank_that_does_not_answer_a_change_is_out_of_step_until_it_holds_the_engines_value() -> None:
    eng = build_engine(call_timeout_s=1.0)
    try:
        c = eng.coordinator
        before, slot = c.settings.budget_bytes, eng.reg.bytes_per_chunk
        eng.ranks[1].hang.add("set_budget")
        with pytest.raises(RankUnresponsive) as e:
            c.set_budget(2 * slot)
        assert "rank 0 was put back to budget_bytes" in e.value.message
        assert f"rank 1 may hold budget_bytes {2 * slot} until it confirms {before}" in e.value.message
        assert eng.ranks[0].ops.pool.budget_bytes == before and c.settings.budget_bytes == before
        assert not c.rank_health()[1].healthy and "settings may differ" in (c.rank_health()[1].reason or "")
        # The rank answers late: it applies the change it was sent, then the engine's value again.
        eng.ranks[1].hang.clear()
        eng.ranks[1].release.set()
        _until(lambda: eng.ranks[1].ops.pool.budget_bytes == 2 * slot, "the late change never landed")

        def settled() -> bool:
            c.settle_settings()
            return _budgets(eng) == [before, before] and c.rank_health()[1].healthy

        _until(settled, f"rank 1 was not put back in step: {_budgets(eng)}")
        c.set_budget(3 * slot)  # a rank in step takes changes again
        assert _budgets(eng) == [3 * slot, 3 * slot] == [c.settings.budget_bytes] * 2
    finally:
        for r in eng.ranks:
            r.close()


def test_a_change_while_a_rank_is_down_is_refused_before_any_rank_is_asked(fake_engine: FakeEngine) -> None:
    c = fake_engine.coordinator
    c.restart_ranks_with(RestartSchedule(0.2))
    before = c.settings.budget_bytes
    fake_engine.ranks[1].dead = True
    with pytest.raises(RankRestarting) as e:
        c.update_settings(budget_bytes=2 * fake_engine.reg.bytes_per_chunk)
    assert e.value.rank == 1 and e.value.retry_after_s == 1 and "no settings were changed" in e.value.message
    assert "set_budget" not in fake_engine.ranks[0].calls
    assert _budgets(fake_engine)[0] == before == c.settings.budget_bytes
    c.update_settings(w=1)  # the default W is the engine's alone: no rank is asked
    assert c.settings.w == 1


def test_a_change_that_meets_a_rank_just_killed_is_refused_as_restarting_not_as_a_server_error(
    fake_engine: FakeEngine,
) -> None:
    """A rank SIGKILLed a moment ago: its pipe breaks under the send before its process is reported gone. The
    change is put back on the rank that took it and answered as the rank restarting (503, retry), never a 500."""
    c = fake_engine.coordinator
    c.restart_ranks_with(RestartSchedule(0.2))
    before = c.settings.budget_bytes
    fake_engine.ranks[1].dying = True
    assert fake_engine.ranks[1].alive()
    with pytest.raises(RankRestarting) as e:
        c.update_settings(budget_bytes=2 * fake_engine.reg.bytes_per_chunk)
    assert e.value.rank == 1 and "its pipe closed" in e.value.message
    assert f"rank 0 was put back to budget_bytes {before}" in e.value.message
    assert _budgets(fake_engine)[0] == before == c.settings.budget_bytes
    # Negative control: a rank that is alive and fails the call for its own reason is not called restarting.
    fake_engine.ranks[1].dying = False
    with pytest.raises(UnsupportedOp):
        c.update_settings(fs_concurrency=4)


def test_a_restarted_rank_takes_the_engines_settings_before_it_serves(fake_engine: FakeEngine) -> None:
    c = fake_engine.coordinator
    slot = fake_engine.reg.bytes_per_chunk
    c.set_budget(3 * slot)
    old = fake_engine.ranks[1]
    old.dead = True
    # Built with the budget it had at the start (as a rank process started from an older config would be).
    new = InProcessRank(FakeRankOps(fake_engine.reg, 1, fake_engine.tiers, 8, None, c.on_rank_event))
    try:
        assert new.ops.pool.budget_bytes != 3 * slot
        c.replace_rank(1, new)
        assert c.ranks[1] is new and new.ops.pool.budget_bytes == 3 * slot
        assert new.calls[0] == "set_budget"  # before any other call reached it
    finally:
        new.close()
