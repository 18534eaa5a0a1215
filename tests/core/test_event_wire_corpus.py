"""The events' wire form stays the bytes bsr has always written, whatever their types become: every event of a corpus
that bsr wrote is read and written again, and gives the same bytes.

The corpus (data/event_wire_corpus.jsonl, one case a line: where it came from, the event as it was sent, and the
bytes bsr wrote for it, as the event store and the admin API write them) holds the distinct shapes of every event
the fast lane's runtime wrote, the events of the `bsr top` recording under tests/tui (an older engine's: keys in
another order, failures without their kind), restore endings of every outcome and failure kind with every optional
part (a host verdict's load figures, the admission pass), and an older and a newer writer's restore endings (keys
left out, keys added).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bsr_cli.core.events import parse_event
from bsr_cli.core.evidence import EventKind, FailureKind
from bsr_cli.tui.model import parse_wire

pytestmark = pytest.mark.fast

CORPUS = Path(__file__).parent / "data" / "event_wire_corpus.jsonl"


def _cases() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


def _written(wire: dict[str, Any]) -> str:
    return json.dumps(wire, separators=(",", ":"), default=str)  # as the event store writes a row


@pytest.mark.parametrize(
    "case", _cases(), ids=lambda c: f"{c['sent'].get('type')}-{c['sent'].get('seq')}-{c['source'].split('/')[-1]}"
)
def test_an_event_read_and_written_again_gives_the_bytes_bsr_wrote(case: dict[str, Any]) -> None:
    typed = parse_wire(case["sent"])
    assert typed is not None, case
    assert _written(typed.to_wire()) == case["written"]
    # What was written reads back as the same event, with the strict reader every arriving event goes through.
    assert parse_event(json.loads(case["written"])) == typed


def test_the_corpus_holds_every_way_a_restore_ends() -> None:
    kinds = {json.loads(c["written"])["type"] for c in _cases()}
    endings = (EventKind.RESTORE_COMMITTED, EventKind.RESTORE_FAILED_CLOSED, EventKind.RESTORE_REFUSED)
    assert {k.value for k in (*endings, EventKind.RESTORE_ABORTED)} <= kinds
    written = [c["written"] for c in _cases()]
    assert any('"chunks":[' in w for w in written) and any('"injected":true' in w for w in written)
    assert any('"load":{' in w for w in written) and any('"pass":2' in w for w in written)
    failure_kinds = {f["kind"] for w in written for f in json.loads(w).get("failures", ())}
    assert failure_kinds == {k.value for k in FailureKind}
