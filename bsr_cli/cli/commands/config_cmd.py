"""`bsr config show`: every setting with the place it came from."""

from __future__ import annotations

from typing import Any

import typer

from bsr_cli.cli.context import JsonFlag, state

config_app = typer.Typer(
    help="Show resolved settings (flag > BSR_* env > config file > default).", no_args_is_help=True
)


@config_app.command("show")
def config_show(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Every setting, its value and where it came from."""
    st = state(ctx, json_flag)
    data = st.settings.to_dict()
    data["engine_url"] = _engine_in_use(st)

    def render(console: Any, data: dict[str, Any]) -> None:
        from rich.table import Table

        t = Table()
        for col in ("setting", "value", "source"):
            t.add_column(col)
        for k, v in data.items():
            if isinstance(v, dict):
                t.add_row(k, _show(v["value"]), v["source"])
        t.add_row("profiles", ", ".join(data["profiles"]) or "—", "")
        console.print(t)

    st.out.result(data, render)


def _engine_in_use(st: Any) -> dict[str, Any]:
    """The admin URL a command would talk to now, and how it was found (or why there is none)."""
    from bsr_cli.client.admin import resolve_engine
    from bsr_cli.errors import BsrError

    try:
        url, _, how = resolve_engine(st.settings)
    except BsrError as e:
        return {"value": None, "source": e.message}
    return {"value": url, "source": how}


def _show(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
