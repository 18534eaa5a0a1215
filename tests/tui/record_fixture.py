"""Re-record tests/tui/data/incident.jsonl.gz from a real embedded engine (then regenerate the pinned layouts).

    .venv/bin/python tests/tui/record_fixture.py
    BSR_REGEN_LAYOUT=1 .venv/bin/python -m pytest tests/tui/test_layout.py

The incident: a restore that commits, a fault injected on rank 1 (twice), a restore that fails closed and leaves a
force-local marker. Polled every 50 ms so the recording holds restores in flight.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from bsr_cli.client import (
    AdminClient,
    local_engine,
)
from bsr_cli.core.faults import FaultRequest
from bsr_cli.core.prompt import Prompt
from bsr_cli.engine import supervisor
from bsr_cli.loaders import builtin_registration
from bsr_cli.tui.source import LiveSource, Recorder

OUT = Path(__file__).parent / "data" / "incident.jsonl.gz"
PROMPT = Prompt.synthetic_of(30000, 7)


def main() -> None:
    state = Path(tempfile.mkdtemp(prefix="bsr-fixture-"))
    opts = supervisor.EngineOptions(
        builtin_registration("demo"), w=4, max_tokens=32_768, faults_enabled=True, fetch_timeout_s=2.0
    )
    supervisor.up(state, opts)
    try:
        conn = local_engine.connection(state)
        assert conn is not None
        url, token = conn
        client = AdminClient(url, token)
        client.submit(PROMPT)  # warm the tiers
        source = LiveSource.for_url(url, token)
        rec = Recorder.open(OUT, source=url)

        def poll_while(work: threading.Thread) -> None:
            work.start()
            while work.is_alive():
                rec.write(source.poll())
                time.sleep(0.05)
            rec.write(source.poll())

        rec.write(source.poll())
        poll_while(threading.Thread(target=lambda: AdminClient(url, token).restore(PROMPT, w=4)))
        client.inject_fault(FaultRequest("restore-fault", rank=1, count=2))
        rec.write(source.poll())
        poll_while(threading.Thread(target=lambda: AdminClient(url, token).restore(PROMPT, w=4)))
        rec.write(source.poll())
        rec.close()
        print(f"recorded {rec.lines - 1} polls to {OUT} ({OUT.stat().st_size:,} bytes)")
    finally:
        supervisor.down(state)


if __name__ == "__main__":
    main()
