"""`bsr top`: the live restore-pool monitor.

snapshot  raw engine snapshot -> immutable View (pure), and the rich renderers every output path shares
source    where snapshots come from: live polling, a recorder, a replay of a recording
app       the Textual app (imported only by `bsr top`; nothing else here imports textual)
"""
