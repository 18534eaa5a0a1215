"""The memory contract at scale: with B = RWS(W) the measured peak pool bytes equal RWS(W) from a few thousand to
over 500K tokens, on the real stack, with a registration scaled so 524,032 tokens fit this machine quickly."""

from __future__ import annotations

import pytest

from bsr_cli.client import local_engine
from bsr_cli.core import accounting
from bsr_cli.core.evidence import Outcome
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.engine import supervisor

pytestmark = [pytest.mark.engine, pytest.mark.slow]

# 2 KV groups, 64 bytes per token per rank: 16 KiB per chunk, 32 MiB per rank at 524,032 tokens.
SMALL = Registration.from_dict(
    {
        "model": "bsr-scale",
        "tp_size": 2,
        "chunk_size": 256,
        "groups": [{"name": "full", "block_size": 16}, {"name": "swa", "block_size": 64}],
        "tensors": [
            {"name": "layers.0.kv", "dtype": "bf16", "shape": [2, 8], "group": "full"},
            {"name": "layers.1.kv", "dtype": "bf16", "shape": [2, 8], "group": "swa"},
        ],
    }
)
W = 32


@pytest.mark.timeout(600)
def test_peak_is_rws_from_thousands_to_half_a_million_tokens(tmp_path) -> None:
    opts = supervisor.EngineOptions(SMALL, w=W, max_tokens=524_288, segment_bytes=1 << 30)
    rws = accounting.rws_bytes(SMALL, W)
    try:
        supervisor.up(tmp_path, opts)
        url, token = local_engine.connection(tmp_path)
        from bsr_cli.client import AdminClient

        rows = []
        with AdminClient(url, token, timeout_s=300) as c:
            for n in (12_288, 131_072, 524_032):
                warm = c.submit(Prompt.synthetic_of(n, n))
                assert warm.hash_ok is True
                c.reset_peak()
                res = c.restore(Prompt.synthetic_of(n, n), w=W)
                pool = c.pool()
                rows.append((n, res, pool))
    finally:
        supervisor.down(tmp_path)
    for n, res, pool in rows:
        chunks = accounting.chunks_for_tokens(n, 256)
        report = res.report
        assert report is not None and res.hashes is not None
        assert res.outcome is Outcome.COMMITTED and res.committed_tokens == n
        assert report.windows == accounting.num_windows(chunks, W)
        assert res.hashes.hash_ok is True
        assert [r.peak_live_bytes for r in report.ranks] == [rws, rws]
        assert [p.pool["peak_bytes"] for p in pool] == [rws, rws]
        assert report.whole_plan_bytes == chunks * SMALL.bytes_per_chunk  # what W=0 would have staged
    assert rows[-1][1].report.windows == 64  # 2,047 chunks in 64 windows, peak still RWS(32)
