"""The one window loop (runtime.restore.run_windows) with a host's hooks, the one fault-targeting rule, the one
windowing rule (core.plan.chunk_spans) and the one marker class, as every host uses them."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest

from bsr_cli.core.commit import COMMITTED, FAILED_CLOSED, OUTCOMES
from bsr_cli.core.evidence import Stage
from bsr_cli.core.faults import KINDS, FaultSpec, window_faults
from bsr_cli.core.markers import Marker
from bsr_cli.core.plan import chunk_spans, windows_for
from bsr_cli.errors import CapacityError
from bsr_cli.runtime import failures
from bsr_cli.runtime.restore import RankOutcome, RestoreFailed, run_windows
from unit.fakes import small_registration


@dataclass
class Win:
    """A window of two chunks, as a job's WindowJob carries it."""

    index: int

    @property
    def chunk_start(self) -> int:
        return 2 * self.index

    @property
    def chunk_end(self) -> int:
        return 2 * self.index + 2


class Host:
    """A host whose step is scripted per window: returns bytes, or raises what the test gives it."""

    def __init__(self, script: dict[int, BaseException]) -> None:
        self.script = script
        self.events: list[Any] = []  # typed events (bsr_cli.core.events)
        self.steps: list[int] = []
        self.scrubs = 0
        self.cleanups = 0

    def run(self, n: int, abort: threading.Event | None = None, prepare: Any = None) -> RankOutcome:
        def step(win: Win, out: RankOutcome) -> int:
            self.steps.append(win.index)
            if win.index in self.script:
                raise self.script[win.index]
            return 100

        def scrub() -> None:
            self.scrubs += 1

        def cleanup() -> None:
            self.cleanups += 1

        return run_windows(
            rank=3,
            groups=["full", "swa"],
            request="r",
            windows=[Win(i) for i in range(n)],
            abort=abort or threading.Event(),
            step=step,
            scrub=scrub,
            emit=lambda ev: self.events.append(ev.to_wire()),
            pool_stats=lambda: {"live_bytes": 0},
            prepare=prepare,
            cleanup=cleanup,
        )


def test_every_window_released_in_order_then_ok() -> None:
    h = Host({})
    out = h.run(3)
    assert out.ok and out.windows_done == 3 and out.bytes_restored == 300
    assert out.valid == {"full": True, "swa": True}
    assert [(e["type"], e["window"], e["windows"]) for e in h.events] == [("window_released", i, 3) for i in range(3)]
    assert h.scrubs == 0 and h.cleanups == 1


def test_a_failed_window_stops_the_loop_scrubs_once_and_names_its_groups() -> None:
    h = Host({1: RestoreFailed("checksum mismatch", 1, ["swa"], kind=failures.TIER, stage=Stage.VERIFY, tier="fs")})
    out = h.run(4)
    assert not out.ok and h.steps == [0, 1]
    assert out.valid == {"full": True, "swa": False} and out.failed_window == 1 and out.failed_chunks == (2, 4)
    assert (out.kind, out.tier) == (failures.TIER, "fs")
    assert h.scrubs == 1 and h.cleanups == 1
    assert h.events[-1] == {
        "type": "restore_failed",
        "seq": 0,
        "time": 0.0,
        "request": "r",
        "rank": 3,
        "window": 1,
        "reason": "checksum mismatch",
        "kind": "tier",
        "stage": "verify",
        "tier": "fs",
        "cause": None,
        "chunks": [2, 4],
    }


@pytest.mark.parametrize(
    ("exc", "kind", "reason"),
    [
        (CapacityError("no room"), failures.CAPACITY, "capacity: no room"),
        (OSError("connection reset"), failures.TIER, "transfer error: OSError: connection reset"),
    ],
)
def test_other_failures_are_classified_and_fail_closed(exc: BaseException, kind: str, reason: str) -> None:
    h = Host({0: exc})
    out = h.run(2)
    assert not out.ok and out.kind == kind and out.reason == reason
    assert out.valid == {"full": False, "swa": False} and h.scrubs == 1


def test_an_abort_is_seen_before_the_next_window() -> None:
    abort = threading.Event()
    h = Host({})

    def prepare() -> None:
        abort.set()

    out = h.run(2, abort, prepare)
    assert not out.ok and out.kind == failures.ABORTED and h.steps == [] and h.scrubs == 1


def test_a_failing_prepare_is_failed_closed_too() -> None:
    def prepare() -> None:
        raise RestoreFailed(
            "plan covers 5 tokens; only full chunks can come from LMCache", None, kind=failures.TIER, stage=Stage.FETCH
        )

    h = Host({})
    out = h.run(2, prepare=prepare)
    assert not out.ok and "only full chunks" in out.reason and h.steps == [] and h.scrubs == 1


def test_fault_targeting_is_one_rule_for_every_host() -> None:
    faults = [
        FaultSpec("timeout", group="swa", id=1),
        FaultSpec("timeout", group="full", window=2, id=2),
        FaultSpec("corrupt", rank=1, id=3),
    ]
    assert [f.id for f in window_faults(faults, 0, 0, 0, KINDS)] == [1]
    assert [f.id for f in window_faults(faults, 0, 0, 0, KINDS, "full")] == []  # another group's stall
    assert [f.id for f in window_faults(faults, 0, 2, 0, KINDS, "full")] == [2]
    assert [f.id for f in window_faults(faults, 1, 0, 0, ("corrupt",))] == [3]


def test_chunk_spans_is_the_windowing_rule_of_windows_for() -> None:
    assert chunk_spans(0, 5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_spans(1, 3, 1) == [(1, 2), (2, 3)]
    assert chunk_spans(0, 4, 0) == [(0, 4)]  # W = 0: the whole-plan window
    assert chunk_spans(3, 3, 2) == []
    reg = small_registration()
    assert [(w.chunk_start, w.chunk_end) for w in windows_for(reg, 3, 7, 7 * 16)] == chunk_spans(0, 7, 3)


def test_one_marker_and_one_spelling_of_each_outcome() -> None:
    m = Marker(prompt="p1", excluded={"mooncake"}, reason="tier mooncake failed", request="req-1")
    d = m.to_dict()
    assert d["excluded_tiers"] == ["mooncake"] and d["prompt"] == "p1" and d["request"] == "req-1"
    assert (COMMITTED, FAILED_CLOSED) == ("committed", "failed_closed") and len(set(OUTCOMES)) == 3
