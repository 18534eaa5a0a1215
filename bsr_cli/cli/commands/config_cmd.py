"""`bsr config show`: every setting with the place it came from."""

from __future__ import annotations

from typing import Any

import typer

from bsr_cli.cli.app import JsonFlag, app, state

config_app = typer.Typer(
    help="Show resolved settings (flag > BSR_* env > config file > default).", no_args_is_help=True
)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Every setting, its value and where it came from."""
    st = state(ctx, json_flag)

    def render(console: Any, data: dict[str, Any]) -> None:
        from rich.table import Table

        t = Table()
        for col in ("setting", "value", "source"):
            t.add_column(col)
        for k, v in data.items():
            if isinstance(v, dict):
                t.add_row(k, str(v["value"]), v["source"])
        t.add_row("profiles", ", ".join(data["profiles"]) or "—", "")
        console.print(t)

    st.out.result(st.settings.to_dict(), render)
