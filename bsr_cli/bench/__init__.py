"""`bsr bench`: the paper's evaluation, reproducible against any engine that serves the admin API.

``experiments`` runs the measurements and returns JSON evidence bundles, ``bundle`` validates them against the
documented schema (docs/bench-schema.json), ``plots`` draws them (PNG with the optional ``bench`` extra, plus
compact terminal charts). Nothing here is imported when the CLI starts.
"""
