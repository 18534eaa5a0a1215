"""The embedded engine: real tiers (Mooncake store, filesystem) and the local services they need."""
