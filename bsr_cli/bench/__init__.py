"""`bsr bench`: the paper's evaluation, reproducible against any engine that serves the admin API.

One module per experiment (``sweep``, ``wlaw``, ``fs_concurrency``, ``store``, ``failures``, ``ladder``, ``peer``)
runs its measurements and returns a JSON evidence bundle written through ``evidence``; ``probes`` measures the
machine beneath bsr (disk, memcpy, raw Mooncake), ``lifecycle`` starts embedded engines sized for an experiment,
and ``experiments`` indexes them all. ``bundle`` validates bundles against the
documented schema (docs/bench-schema.json), ``plots`` draws them (PNG with the optional ``bench`` extra, plus
compact terminal charts). Nothing here is imported when the CLI starts.
"""
