"""`bsr top`: the live restore-pool monitor.

model     raw engine snapshot -> immutable View (pure data, no rich)
panels    the rich renderers every output path shares
source    where snapshots come from: live polling, a recorder, a replay of a recording
palette   the colours every drawing uses, the CLI's tables too (pure data)
app       the Textual app (imported only by `bsr top`; nothing else here imports textual)
"""
