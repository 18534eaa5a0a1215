"""The one client of the engine admin API. See `AdminClient` and the exception tree in bsr_cli.errors."""

from bsr_cli.client.admin import AdminClient, resolve_engine

__all__ = ["AdminClient", "resolve_engine"]
