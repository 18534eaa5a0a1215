"""The entry point and the one error boundary.

Every failure becomes one line on stderr (``bsr: error: ...``, optionally ``bsr: hint: ...``) and the exit code of
its class (bsr_cli.errors.ExitCode); the stack is shown only with ``--traceback`` or ``BSR_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys
import traceback as tb
from collections.abc import Sequence

from bsr_cli.errors import BsrError, ExitCode


def _wants_traceback(argv: Sequence[str]) -> bool:
    if "--traceback" in argv:
        return True
    return any(os.environ.get(k, "").lower() in {"1", "true", "yes", "on"} for k in ("BSR_TRACEBACK", "BSR_DEBUG"))


def _json_mode(argv: Sequence[str]) -> bool:
    return "--json" in argv or os.environ.get("BSR_JSON", "").lower() in {"1", "true", "yes", "on"}


def run(argv: Sequence[str] | None = None) -> int:
    from bsr_cli.cli.app import build_command
    from bsr_cli.cli.global_options import hoist_global_options
    from bsr_cli.cli.output import Output

    args = hoist_global_options(list(sys.argv[1:] if argv is None else argv))
    Output.result_written = False
    Output.json_requested = _json_mode(args)
    try:
        root = build_command()
        if os.environ.get("_BSR_COMPLETE", "").startswith("complete_"):
            from bsr_cli.cli.fastcomplete import write_index

            write_index(root)  # the next TAB answers from it without starting the framework
        result = root.main(args=args, prog_name="bsr", standalone_mode=False)
        return int(result) if isinstance(result, int) else 0
    except BsrError as e:
        _report(e.message, e.hint, args, e)
        from bsr_cli.cli.output import Output

        if _json_mode(args) and not Output.result_written:
            import json

            sys.stdout.write(json.dumps(e.to_dict()) + "\n")
        return int(e.exit_code)
    except KeyboardInterrupt as e:
        _report("interrupted", None, args, e)
        return int(ExitCode.INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the boundary: everything ends as one line and an exit code
        if type(e).__name__ == "Abort":  # the parser's Ctrl-C / EOF at a prompt
            _report("interrupted", None, args, e)
            return int(ExitCode.INTERRUPTED)
        show = getattr(e, "show", None)
        code = getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):  # usage errors raised by the argument parser
            show(file=sys.stderr)
            code = int(ExitCode.INVALID_INPUT) if code == 2 else code
            if _json_mode(args) and not Output.result_written:
                import json

                fmt = getattr(e, "format_message", None)
                message = fmt() if callable(fmt) else str(e)
                doc = {"error": "usage", "message": message, "hint": "see `bsr COMMAND --help`", "exit_code": code}
                sys.stdout.write(json.dumps(doc) + "\n")
            return code
        _report(f"internal error: {type(e).__name__}: {e}", "rerun with --traceback and report it", args, e)
        return int(ExitCode.INTERNAL)


def _report(message: str, hint: str | None, argv: Sequence[str], exc: BaseException) -> None:
    if _wants_traceback(argv):
        tb.print_exception(exc, file=sys.stderr)
    sys.stderr.write(f"bsr: error: {message}\n")
    if hint:
        sys.stderr.write(f"bsr: hint: {hint}\n")
    sys.stderr.flush()


def main() -> None:
    if os.environ.get("_BSR_COMPLETE") == "complete_bash":
        from bsr_cli.cli.fastcomplete import complete_bash

        if complete_bash():
            return
    from bsr_cli.cli import process_exit

    process_exit.enable()
    process_exit.finish(run())
