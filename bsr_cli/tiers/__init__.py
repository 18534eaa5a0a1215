"""Concrete tiers implementing `bsr_cli.runtime.tiers.Tier`: `mooncake.MooncakeTier` and `fs.FilesystemTier`.

Import the submodule you need; this package imports nothing so that the filesystem tier does not load Mooncake.
"""
