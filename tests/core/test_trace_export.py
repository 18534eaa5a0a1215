"""The engine's own requests as a trace: block ids from chained chunk hashes, and the records `bsr plan` reads."""

from __future__ import annotations

import json
from pathlib import Path

from bsr_cli.core.keys import chunk_hashes, synthetic_tokens
from bsr_cli.core.trace import SeenRequest, block_ids, prefix_hits, trace_records
from bsr_cli.loaders import load_trace


def _ids(tokens: list[int], chunk: int) -> tuple[str, ...]:
    return block_ids(chunk_hashes(tokens, chunk), len(tokens), chunk)


def test_block_ids_are_equal_exactly_as_far_as_the_prefix_is_shared() -> None:
    a = synthetic_tokens(2000, seed=1)
    b = a[:1024] + synthetic_tokens(976, seed=2)
    for chunk in (256, 512):
        ia, ib = _ids(a, chunk), _ids(b, chunk)
        assert len(ia) == len(ib) == 4  # the last block partial
        assert ia[:2] == ib[:2] and ia[2] != ib[2] and ia[3] != ib[3]
    # Chunks longer than a block: two blocks of one chunk still get different ids.
    ids = _ids(a, 1024)
    assert len(set(ids)) == len(ids)


def test_records_remap_ids_in_arrival_order_and_plan_reads_them(tmp_path: Path) -> None:
    a = synthetic_tokens(1536, seed=3)
    seen = [
        SeenRequest(100.5, 1536, _ids(a, 256)),
        SeenRequest(100.0, 1024, _ids(a[:1024], 256)),  # arrived first
    ]
    recs = [r.to_wire() for r in trace_records(seen)]
    assert recs == [
        {"timestamp": 0, "input_length": 1024, "output_length": 0, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1536, "output_length": 0, "hash_ids": [0, 1, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    trace = load_trace(path)
    assert prefix_hits(trace).blocks == (0, 2)


def test_admitted_events_become_requests_arriving_when_they_began_to_wait() -> None:
    from bsr_cli.core import events as ev
    from bsr_cli.core.trace import seen_requests

    ids = ("a", "b")
    held = [
        ev.RequestAdmitted(time=105.0, request="r1", tokens=1024, queued_s=4.5, block_ids=ids),
        ev.RequestAdmitted(time=106.0, request="r2", tokens=512),  # an older engine: no block ids
        ev.RestoreStarted(time=107.0, request="r3", prompt="p"),
    ]
    seen, skipped = seen_requests(held)
    assert seen == [SeenRequest(100.5, 1024, ids)] and skipped == 2
