"""The LMCache rank takes the rank ops every host serves alike from their one declaration (bsr_cli.runtime.rank_host):
the destination-KV ops as they are, and the abort with B's waiters woken besides. Run through scripts/test-plugins
(a venv with LMCache); skipped elsewhere."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache")

from lmcache_bsr.rank import LMCacheRank

from bsr_cli.runtime.rank_host import RankHost


def test_the_lmcache_rank_takes_the_shared_ops_from_the_one_declaration() -> None:
    assert issubclass(LMCacheRank, RankHost)
    kv_ops = ("prefill", "output_hash", "canonical_hash", "invalidate")
    assert [name for name in kv_ops if getattr(LMCacheRank, name) is not getattr(RankHost, name)] == []
