"""`bsr status` and `bsr top` against an engine newer than this bsr, which names a tier condition and a stage this bsr
does not know: both still read the engine, show the new reason under its own name, and do not take it for a known
one (an unknown condition is not "ok").

The newer engine is a stand-in: a real HTTP server on loopback answering the admin API's read routes with what the
real embedded engine answered, a tier's condition and a rank's last-fault stage renamed to values no bsr release
has. A newer bsr engine cannot run here (there is none), and the answer around the new values is the real one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from answering_server import AnsweringServer, json_answer

from bsr_cli.tui.app import TopApp
from bsr_cli.tui.source import LiveSource

NEW_CONDITION = "throttled_by_the_store"  # no TierCondition of this bsr
NEW_STAGE = "decompress"  # no Stage of this bsr


def _newer(tiers: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """The real answer's parts as a newer engine would send them: the first tier unhealthy for a new reason, the
    last rank's last fault at a new stage."""
    first = tiers[sorted(tiers)[0]]
    first.update(ok=False, condition=NEW_CONDITION, conditions=[NEW_CONDITION], detail=["rank 0: the store throttles"])
    fault = {"reason": "chunk failed to decompress", "request": "req-9", "at": 1.0, "stage": NEW_STAGE}
    ranks[-1]["last_fault"] = fault


@pytest.fixture
def newer_engine(live_engine: Any) -> Iterator[AnsweringServer]:
    with live_engine.client() as c:
        snap, health, info = c.snapshot(health=True).to_wire(), c.health().to_wire(), c.info().to_wire()
    snap = copy.deepcopy(snap)
    _newer(snap["tiers"], snap["ranks"])
    health = copy.deepcopy(health)
    _newer(health.setdefault("tiers", copy.deepcopy(snap["tiers"])), health["ranks"])
    answers = {"/bsr/v1/snapshot": snap, "/bsr/v1/health": health, "/bsr/v1/info": info}
    engine = AnsweringServer(lambda path: json_answer(answers.get(path)))
    try:
        yield engine
    finally:
        engine.stop()


def test_status_reads_a_newer_engine_and_names_its_new_reason(bsr: Any, newer_engine: AnsweringServer) -> None:
    r = bsr("status", "--engine", newer_engine.url)
    assert r.code == 0, r.err
    assert f"unhealthy ({NEW_CONDITION.replace('_', ' ')})" in r.out and "the store throttles" in r.out, r.out
    assert "internal error" not in r.err and "Traceback" not in r.err
    j = bsr("status", "--engine", newer_engine.url, "--json")
    assert j.code == 0, j.err
    doc = json.loads(j.out)
    tier = next(t for t in doc["tiers"].values() if t["condition"] == NEW_CONDITION)
    assert tier["conditions"] == [NEW_CONDITION] and tier["ok"] is False  # written back as it came
    assert doc["ranks"][-1]["last_fault"]["stage"] == NEW_STAGE


@pytest.mark.timeout(120)
async def test_top_reads_a_newer_engine_and_does_not_take_its_new_reason_for_ok(
    newer_engine: AnsweringServer, wait_until: Any, screen: Callable[[Any], str]
) -> None:
    app = TopApp(LiveSource.for_url(newer_engine.url), interval=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await wait_until(pilot, lambda: app.view is not None or app.failure is not None, "the first poll")
        assert app.failure is None, screen(app)
        assert app.view is not None
        tier = next(t for t in app.view.tiers if "the store throttles" in " ".join(t.detail))
        assert not tier.ok  # shown as the engine said: unhealthy, with its reason
        # On screen once the health pane is laid out to its new content (the frame after the snapshot is drawn).
        await wait_until(pilot, lambda: "the store throttles" in screen(app), "the new reason on screen")
