"""`bsr events --trace FILE` against the real embedded engine: the requests it admitted, written in the Mooncake
trace format, so `bsr plan --trace FILE` plans from the engine's own traffic (a shared prefix shows as a hit)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.prompt import Prompt


def test_export_the_engines_requests_as_a_trace_and_plan_from_it(bsr: Any, engine: Any, tmp_path: Path) -> None:
    with engine.client() as c:
        after = c.events(0, limit=1, newest=True).last_seq  # only this test's requests
        first = synthetic_tokens(2048, seed=7301)
        shared = first[:1024] + synthetic_tokens(1024, seed=7302)  # the first two 512-token blocks of ``first``
        other = synthetic_tokens(1536, seed=7303)
        for tokens in (first, shared, other):
            c.submit(Prompt.of_tokens(tokens))
    out = tmp_path / "engine-trace.jsonl"
    r = bsr("events", "--after", str(after), "--trace", str(out), "--json")
    assert r.code == 0, r.err
    assert r.json() == {"trace": str(out), "requests": 3, "skipped": 0}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["input_length"], x["output_length"], len(x["hash_ids"])) for x in lines] == [
        (2048, 0, 4),
        (2048, 0, 4),
        (1536, 0, 3),
    ]
    a, b, o = (x["hash_ids"] for x in lines)
    assert a == [0, 1, 2, 3] and b[:2] == a[:2] and b[2:] == [4, 5] and o == [6, 7, 8]
    assert lines[0]["timestamp"] == 0 and lines[0]["timestamp"] <= lines[1]["timestamp"] <= lines[2]["timestamp"]
    p = bsr("plan", "--trace", str(out), "-r", "demo", "--W", "2", "--bandwidth", "1GB/s", "--json")
    assert p.code == 0, p.err
    plan = p.json()
    assert (plan["requests"], plan["restores"], plan["hit_tokens"]) == (3, 1, 1024)  # the shared prefix hits
