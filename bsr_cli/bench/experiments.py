"""The index of the bench's experiments: one module each, re-exported here under the names callers use.

- `evidence`: the bundle envelope, rows, checks and targets every experiment writes (`Run`), and the shared
  restore measurement;
- `sweep` (the paper's E1), `wlaw` (the W law), `fs_concurrency`, `store`, `failures`, `ladder`: one experiment
  each, a ``run_*`` function over the admin API returning its evidence bundle;
- `probes`: the machine beneath bsr (disk read rate, page-cache eviction, memcpy/checksum ceiling, raw Mooncake
  clients), measured beside the experiments;
- `lifecycle`: embedded engines sized for each experiment (`embedded_options`), started and always stopped.

A new experiment gets its own module beside these, a ``bsr bench`` subcommand (cli/commands/bench/), and, when it
runs on an embedded engine, a profile in `lifecycle.embedded_options`.
"""

from __future__ import annotations

from bsr_cli.bench.evidence import (
    BUNDLE_SCHEMA,
    OnRow,
    Row,
    Run,
    completed,
    machine_info,
    new_run_id,
    new_salt,
    now,
    registration_identity,
    target,
)
from bsr_cli.bench.failures import run_failures
from bsr_cli.bench.fs_concurrency import run_fs_concurrency
from bsr_cli.bench.ladder import LADDER_PREFIXES, SCALED_LADDER, EngineFactory, run_ladder
from bsr_cli.bench.lifecycle import (
    embedded_engine,
    embedded_ladder_factory,
    embedded_options,
    fs_dir_of,
    link_ceiling_of,
    mooncake_of,
)
from bsr_cli.bench.store import run_store
from bsr_cli.bench.sweep import E1_PREFIXES, run_sweep
from bsr_cli.bench.wlaw import W_LAW, run_wlaw

__all__ = [
    "BUNDLE_SCHEMA",
    "E1_PREFIXES",
    "LADDER_PREFIXES",
    "SCALED_LADDER",
    "W_LAW",
    "EngineFactory",
    "OnRow",
    "Row",
    "Run",
    "completed",
    "embedded_engine",
    "embedded_ladder_factory",
    "embedded_options",
    "fs_dir_of",
    "link_ceiling_of",
    "machine_info",
    "mooncake_of",
    "new_run_id",
    "new_salt",
    "now",
    "registration_identity",
    "run_failures",
    "run_fs_concurrency",
    "run_ladder",
    "run_store",
    "run_sweep",
    "run_wlaw",
    "target",
]
