"""The rank ops every host serves alike (bsr_cli.runtime.rank_host), declared once: the destination-KV ops reach the
host's KV through the one dispatcher, an abort reaches a restore whether it comes before the job or during it and
is dropped once the run ends, and the hosts built here (the embedded engine's rank, the unit fake) take these ops
from that one declaration instead of writing them again. The LMCache rank's check runs in the LMCache stage
(tests/plugins/test_lmcache_rank_host.py)."""

from __future__ import annotations

import pytest

from bsr_cli.api.ranks import (
    REQUESTS,
    CanonicalHashRequest,
    InvalidateRequest,
    OutputHashRequest,
    PrefillRequest,
    UnsupportedOp,
    UnsupportedOps,
    dispatch,
)
from bsr_cli.engine.worker import Rank
from bsr_cli.runtime.kv_ops import KVOps
from bsr_cli.runtime.rank_host import AbortSignals, RankHost
from unit.fakes import FakeDestination, FakeRankOps, small_registration

# The ops RankHost declares for every host.
SHARED = ("prefill", "output_hash", "canonical_hash", "invalidate", "abort")


class KVOnlyHost(RankHost, UnsupportedOps):
    """A host that serves nothing of its own: every op it answers comes from RankHost."""

    host_name = "a host of the shared ops only"

    def __init__(self) -> None:
        self.kv = FakeDestination(small_registration(), rank=0)
        self.kv_ops = KVOps(self.kv)
        self.aborts = AbortSignals()


def test_the_kv_ops_reach_the_hosts_kv_through_the_one_dispatcher() -> None:
    host = KVOnlyHost()
    reg = host.kv.reg
    hashes = ["a1", "b2"]
    n_tokens = 2 * reg.chunk_size
    blocks = {g: list(range(-(-n_tokens // reg.group(g).block_size))) for g in reg.group_names}
    computed = dispatch(host, PrefillRequest(hashes=hashes, n_tokens=n_tokens, first_chunk=0, block_tables=blocks))
    assert computed.computed_tokens == n_tokens
    canonical = dispatch(host, CanonicalHashRequest(hashes=hashes, n_tokens=n_tokens)).groups
    written = dispatch(host, OutputHashRequest(block_tables=blocks, n_tokens=n_tokens)).groups
    assert written == canonical and set(written) == set(reg.group_names)  # the prefilled KV is the canonical KV
    dispatch(host, InvalidateRequest(block_tables=blocks))
    assert host.kv.invalidated == [blocks]
    assert dispatch(host, OutputHashRequest(block_tables=blocks, n_tokens=n_tokens)).groups != canonical
    # The host's own ops it does not serve are refused by name, as before.
    with pytest.raises(UnsupportedOp, match="op 'stats' is not supported by a host of the shared ops only"):
        dispatch(host, REQUESTS["stats"]())


def test_an_abort_reaches_a_restore_before_its_job_or_during_it_and_is_dropped_after() -> None:
    host = KVOnlyHost()
    host.abort("req-early")  # before the job reached this rank
    with host.aborts.held("req-early") as early:
        assert early.is_set()  # the restore ends at once
    with host.aborts.held("req-early") as again:
        assert not again.is_set()  # the abort ended that run, not a later one of the same id
    with host.aborts.held("req-late") as late:
        assert not late.is_set()
        host.abort("req-late")
        assert late.is_set()
        host.abort("req-other")
    with host.aborts.held("req-other") as other:
        assert other.is_set()  # another request's abort is kept for its own job


@pytest.mark.parametrize("host", [Rank, FakeRankOps], ids=lambda h: h.__name__)
def test_every_host_takes_the_shared_ops_from_the_one_declaration(host: type[RankHost]) -> None:
    assert issubclass(host, RankHost)
    written_again = [name for name in SHARED if getattr(host, name) is not getattr(RankHost, name)]
    assert written_again == []
