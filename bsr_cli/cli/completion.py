"""Value completion for options whose values are a known set (fault kinds, tiers, dtypes, registrations, engine
profiles), attached to every command that takes them by option name, so one table serves every command."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIERS = ("mooncake", "fs")


def _fault_kinds() -> tuple[str, ...]:
    from bsr_cli.core.faults import KINDS  # pure module: dataclasses and the error tree only

    return KINDS


def _dtypes() -> tuple[str, ...]:
    from bsr_cli.core.units import DTYPE_BYTES

    return tuple(DTYPE_BYTES)


def _registrations() -> tuple[str, ...]:
    from bsr_cli.loaders import BUILTIN_REGISTRATIONS

    return tuple(BUILTIN_REGISTRATIONS)


def _profiles() -> tuple[str, ...]:
    """Engine profile names from the config file, read without loading the settings machinery."""
    import tomllib

    from bsr_cli.settings import default_config_path

    path = Path(os.environ.get("BSR_CONFIG") or default_config_path())
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return ()
    profiles = data.get("profiles")
    return tuple(profiles) if isinstance(profiles, dict) else ()


# option name → the values it takes
VALUES: dict[str, Callable[[], tuple[str, ...]]] = {
    "--kind": _fault_kinds,
    "--tier": lambda: TIERS,
    "--exclude-tier": lambda: TIERS,
    "--dtype": _dtypes,
    "--registration": _registrations,
    "--engine": _profiles,
    "-e": _profiles,
}


def completer_for(opts: list[str]) -> Callable[[Any, Any, str], list[str]] | None:
    source = next((VALUES[o] for o in opts if o in VALUES), None)
    if source is None:
        return None

    def complete(ctx: Any, param: Any, incomplete: str) -> list[str]:
        return [v for v in source() if v.startswith(incomplete)]

    return complete
