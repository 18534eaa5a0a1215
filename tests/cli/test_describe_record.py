"""`bsr describe --record` over a recording in which the engine restarted: the new engine numbers its events from 1
again, so a recording's events are told apart by the engine's start as well as their sequence number."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.events import RestoreStarted
from bsr_cli.core.status import Snapshot
from bsr_cli.tui.model import Frame
from bsr_cli.tui.source import Recorder

pytestmark = [pytest.mark.timeout(60)]


def test_describe_keeps_the_events_of_both_lives_of_a_restarted_engine(bsr: Any, tmp_path: Path) -> None:
    path = tmp_path / "restart.bsrrec"
    rec = Recorder.open(path)
    # Two lives of one engine (started at 100 and at 200), each recording a restore start as its event 1.
    for started, at in ((100.0, 101.0), (200.0, 201.0)):
        event = RestoreStarted(request="req-7", W=2, windows=2, tokens=1024).to_wire() | {"seq": 1, "time": at}
        snap = {"info": {"started_at": started}, "time": at, "seq": 1, "events": [event]}
        rec.write(Frame(Snapshot.from_wire(snap), at, 0.01))
    rec.close()
    r = bsr("describe", "req-7", "--record", str(path), "--json")
    assert r.code == 0, r.err
    # The first life's event is kept and comes first (keyed by sequence number alone, the second overwrote it).
    assert r.json()["started_at"] == 101.0
