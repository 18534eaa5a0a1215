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
    root = None
    try:
        root = build_command()
        if os.environ.get("_BSR_COMPLETE", "").startswith("complete_"):
            from bsr_cli.cli.fastcomplete import write_index

            write_index(root)  # the next TAB answers from it without starting the framework
        result = root.main(args=args, prog_name="bsr", standalone_mode=False)
        return int(result) if isinstance(result, int) else 0
    except BsrError as e:
        e.hint = e.hint or _fallback_hint(e, args, root)
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
        code = getattr(e, "exit_code", None)
        if callable(getattr(e, "format_message", None)) and isinstance(code, int):  # the argument parser's errors
            return _parser_error(e, code, args, root)
        _report(f"internal error: {type(e).__name__}: {e}", "rerun with --traceback and report it", args, e)
        return int(ExitCode.INTERNAL)


def _parser_error(e: Exception, code: int, args: Sequence[str], root: object) -> int:
    """A usage error found by the argument parser, in bsr's one format: `bsr: error: <one line>`, a hint naming the
    command's help, exit 2 (and the JSON error object with --json). A bare group (`bsr`, `bsr engine`) shows its
    help instead: that is the answer to "what can I type here", not a mistake."""
    from bsr_cli.cli.output import Output

    ctx = getattr(e, "ctx", None)
    path = getattr(ctx, "command_path", None) or _command_path(root, args)
    hint = f"see `{path} --help`"
    code = int(ExitCode.INVALID_INPUT) if code in (1, 2) else code  # 1: a file option the parser could not open
    if type(e).__name__ == "NoArgsIsHelpError":
        e.show(file=sys.stderr)  # type: ignore[attr-defined]
        message = f"`{path}` needs a command"
    else:
        message = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())  # type: ignore[attr-defined]
        _report(message, hint, args, e)
    if _json_mode(args) and not Output.result_written:
        import json

        doc = {"error": "usage", "message": message, "hint": hint, "exit_code": code}
        sys.stdout.write(json.dumps(doc) + "\n")
    return code


def _fallback_hint(e: BsrError, args: Sequence[str], root: object) -> str:
    """A hint for an error raised without one (every error of bsr's own carries one; a host's may not)."""
    from bsr_cli.errors import InvalidInput

    if isinstance(e, InvalidInput):
        return f"see `{_command_path(root, args)} --help`"
    return "`bsr status` shows the engine's state; --traceback shows where this came from"


def _command_path(root: object, args: Sequence[str]) -> str:
    """`bsr engine up` for the command words of `args` (for errors the parser raises without its context)."""
    from bsr_cli.cli.global_options import GLOBAL_OPTIONS

    words = ["bsr"]
    commands = getattr(root, "commands", None) or {}
    i = 0
    while i < len(args):
        tok = args[i]
        if tok.startswith("-"):  # global options stand before the command (hoist_global_options put them there)
            i += 2 if GLOBAL_OPTIONS.get(tok) else 1
            continue
        if tok not in commands:
            break
        words.append(tok)
        commands = getattr(commands[tok], "commands", None) or {}
        i += 1
    return " ".join(words)


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
