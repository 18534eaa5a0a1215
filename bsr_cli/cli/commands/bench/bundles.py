"""`bsr bench plot|validate|schema|show`: the evidence bundles an experiment wrote."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from bsr_cli.cli.commands.bench.common import (
    DEFAULT_OUT,
    OutOpt,
)
from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.errors import InvalidInput

if TYPE_CHECKING:
    from rich.console import Console


def plot(
    ctx: typer.Context,
    out: OutOpt = DEFAULT_OUT,
    to: Annotated[Path | None, typer.Option("--to", help="Directory for the PNGs [default: --output].")] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Redraw the plots from the latest bundle of each experiment in --output."""
    from bsr_cli.bench import bundle as bundles
    from bsr_cli.bench import plots as plotting

    st = state(ctx, json_flag)
    latest = bundles.latest(out)
    found = sorted(latest)
    if not found:
        raise InvalidInput(f"no bundles in {out}", hint="run an experiment first, e.g. `bsr bench sweep --embedded`")
    try:
        made = [str(p) for p in plotting.render_all(out, to, latest)]
    except ImportError as e:
        raise InvalidInput(str(e), hint="install the bench extra: pip install 'bsr[bench]' (matplotlib)") from None
    if not made:
        raise InvalidInput(
            f"nothing to plot in {out}: its bundles ({', '.join(found)}) have no plot",
            hint="plots come from sweep, ladder, wlaw, store and fs-concurrency bundles",
        )
    st.out.result({"plots": made, "bundles": found}, lambda c, d: c.print("\n".join(d["plots"])))


def validate(
    ctx: typer.Context,
    files: Annotated[list[Path], typer.Argument(help="Bundle files.", metavar="BUNDLE")],
    json_flag: JsonFlag = False,
) -> None:
    """Check evidence bundles against the schema (docs/bench-schema.json). Exit 2 when one does not match."""
    from bsr_cli.bench import bundle as bundles

    st = state(ctx, json_flag)
    report = {str(f): bundles.validation_errors(bundles.load(f)) for f in files}

    def render(console: Console, d: dict[str, list[str]]) -> None:
        for f, errs in d.items():
            console.print(f"{f}: " + ("[green]valid[/]" if not errs else "[red]invalid[/]\n  " + "\n  ".join(errs)))

    bad = [f for f, errs in report.items() if errs]
    if bad:
        error = InvalidInput(
            f"{len(bad)} bundle(s) do not match the schema: {', '.join(bad)}",
            hint="each bundle's lines above say which field breaks the schema (`bsr bench schema` prints it)",
        )
        st.out.fail(report, render, error)
    st.out.result(report, render)


def schema(ctx: typer.Context, json_flag: JsonFlag = False) -> None:
    """Print the JSON Schema of evidence bundles."""
    from bsr_cli.bench import bundle as bundles

    state(ctx, json_flag)  # the schema is JSON with or without --json (accepted as on every command)
    typer.echo(bundles.schema_json(), nl=False)


def show(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A bundle file written by a bench experiment.", metavar="BUNDLE")],
    json_flag: JsonFlag = False,
) -> None:
    """Print a bundle's table again (validated against the schema first)."""
    from bsr_cli.bench import bundle as bundles
    from bsr_cli.bench.evidence import BundleFiles, PublishedBundle

    st = state(ctx, json_flag)
    bundle = bundles.read(file)
    from bsr_cli.cli.render.bench import table_for

    st.out.result(PublishedBundle(bundle=bundle, files=BundleFiles(str(file), [])), table_for(bundle.experiment))
