"""`bsr config show`: every setting with the place it came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core import wire
from bsr_cli.settings import Settings, SourcedValue

config_app = typer.Typer(
    help="Show resolved settings (flag > BSR_* env > config file > default).", no_args_is_help=True
)


@dataclass(frozen=True)
class ConfigView:
    """`bsr config show`: every setting with its source, the profiles, and the engine a command would use now."""

    settings: Settings
    engine_url: SourcedValue

    def rows(self) -> dict[str, SourcedValue]:
        return self.settings.sourced() | {"engine_url": self.engine_url}

    def to_wire(self) -> wire.JsonObject:
        values: wire.JsonObject = {k: asdict(v) for k, v in self.settings.sourced().items()}
        profiles: list[wire.JsonValue] = [*sorted(self.settings.profiles)]
        return values | {"profiles": profiles, "engine_url": asdict(self.engine_url)}


@config_app.command("show")
def config_show(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Every setting, its value and where it came from."""
    st = state(ctx, json_flag)
    view = ConfigView(st.settings, _engine_in_use(st))

    def render(console: Any, data: ConfigView) -> None:
        from rich.table import Table

        t = Table()
        for col in ("setting", "value", "source"):
            t.add_column(col)
        for k, v in data.rows().items():
            t.add_row(k, _show(v.value), v.source)
        t.add_row("profiles", ", ".join(sorted(data.settings.profiles)) or "—", "")
        console.print(t)

    st.out.result(view, render)


def _engine_in_use(st: Any) -> SourcedValue:
    """The admin URL a command would talk to now, and how it was found (or why there is none)."""
    from bsr_cli.client.admin import resolve_engine
    from bsr_cli.errors import BsrError

    try:
        url, _, how = resolve_engine(st.settings)
    except BsrError as e:
        return SourcedValue(None, e.message)
    return SourcedValue(url, how)


def _show(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
