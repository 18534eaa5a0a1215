"""The wire types between the coordinator and a TP rank: plain data, no I/O.

``bsr_cli.api.ranks`` holds one request and one result dataclass per rank op, the ``RankOps`` protocol every rank
host implements (the embedded engine's rank process, the LMCache plugin's rank, the vLLM worker admin) and the
typed ``UnsupportedOp`` refusal; ``bsr_cli.api.pipe``, above it, the embedded engine's call/reply envelopes around
them. ``bsr_cli.api.codec`` turns any of them into JSON-able dicts and back, refusing malformed input with one clear
line.
"""

from bsr_cli.api import ranks
from bsr_cli.api.codec import from_json, to_json
from bsr_cli.api.ranks import *  # noqa: F403 - the package offers every name of the contract (ranks.__all__)

__all__ = [*ranks.__all__, "from_json", "to_json"]
