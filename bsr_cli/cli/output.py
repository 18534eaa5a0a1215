"""The one output layer: stdout is data, stderr is diagnostics.

Commands build a result (a typed result with ``to_wire()``, or plain JSON data) and hand it here with a renderer.
With ``--json`` the result is printed as JSON and the renderer is never called (rich is not even imported); otherwise
the renderer draws rich tables to stdout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:
    from rich.console import Console

    from bsr_cli.errors import BsrError


PIPE_WIDTH = 1000  # wide enough that no table row of bsr's wraps when stdout is not a terminal
PANEL_PIPE_WIDTH = 120  # panels (`bsr pool --once`) fill their width, so piped they get a page width instead


class Output:
    # Set once any command printed its result: the error boundary then adds no second JSON document to stdout.
    result_written = False
    # --json or BSR_JSON on this command line (known before parsing, for eager options such as --version).
    json_requested = False

    def __init__(self, *, json_mode: bool, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._console: Console | None = None
        self._err_console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            # Piped output (grep, logs, tickets) is never hard-wrapped: rich's 80-column fallback would break lines
            # mid-row, so tables take the width their content needs. COLUMNS still wins when set.
            width = None if self._stdout.isatty() or os.environ.get("COLUMNS") else PIPE_WIDTH
            # highlight=False: rich's automatic highlighter colours arbitrary digit groups in plain text.
            self._console = Console(
                file=self._stdout,
                no_color=bool(os.environ.get("NO_COLOR")),
                soft_wrap=False,
                width=width,
                highlight=False,
            )
        return self._console

    @property
    def err_console(self) -> Console:
        if self._err_console is None:
            from rich.console import Console

            self._err_console = Console(
                file=self._stderr, no_color=bool(os.environ.get("NO_COLOR")), soft_wrap=True, highlight=False
            )
        return self._err_console

    @property
    def layout_width(self) -> int | None:
        """The width for renderables that fill their width (panels): the terminal's, else COLUMNS, else 120."""
        return None if self._stdout.isatty() or os.environ.get("COLUMNS") else PANEL_PIPE_WIDTH

    @property
    def interactive(self) -> bool:
        """True when a person watches stdout (progress displays only make sense then)."""
        return not self.json_mode and self._stdout.isatty()

    def result(self, data: Any, render: Callable[[Console, Any], None] | None = None) -> None:
        Output.result_written = True
        if self.json_mode or render is None:
            self._stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
            self._stdout.flush()
        else:
            render(self.console, data)

    def fail(self, data: Any, render: Callable[[Console, Any], None] | None, error: BsrError) -> NoReturn:
        """A result that comes with an error (a restore that failed closed or was refused, a drill that found a
        violation): drawn before the error's line, or, with --json, carried by the one error object as ``report``
        (stdout holds exactly one JSON document)."""
        if self.json_mode:
            error.report = json.loads(json.dumps(data, default=_json_default))
        else:
            self.result(data, render)
        raise error

    def note(self, message: str) -> None:
        """A diagnostic for people (stderr); silent in --json mode so scripts see only data."""
        if not self.json_mode:
            self.err_console.print(message, highlight=False)

    def warn(self, message: str) -> None:
        """One line on stderr in every mode (--json too): something went wrong beside a result that stands."""
        self._stderr.write(f"bsr: warning: {message}\n")
        self._stderr.flush()

    def error(self, message: str, hint: str | None = None) -> None:
        self._stderr.write(f"bsr: error: {message}\n")
        if hint:
            self._stderr.write(f"bsr: hint: {hint}\n")
        self._stderr.flush()


def _json_default(o: Any) -> Any:
    if hasattr(o, "to_wire"):  # a typed result: its wire form is its JSON
        return o.to_wire()
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)
