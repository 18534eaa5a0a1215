"""The one render layer: how results look to a person, for the CLI and the TUI alike.

- `planning`: `rws`, `plan` and `registration` tables;
- `ops`: probe strips, restore progress, status, drill, store probe, fleet and explain;
- `bench`: the `bsr bench` tables.

The colours come from the one palette, `bsr_cli.tui.palette` (the TUI's panels draw with it too).

Byte counts are written by one formatter, `bsr_cli.core.units.format_bytes`, everywhere (here, in the TUI's panels
and in the bench plots). The modules that draw import rich; none is imported with --json, where commands print
their data and nothing else.
"""
