"""Ending the `bsr` process without the interpreter's teardown when a native client would make that teardown slow.

Mooncake's store client joins its threads when it is closed, and again at process exit when it never was (its
static objects): about 1 s either way, longer than the whole store probe. A command done with such a client hands
it to `leave_open` instead of closing it; `bsr`'s entry point (`main`) then flushes stdout and stderr and ends the
process with `os._exit`. Code that calls `bsr_cli.cli.main.run` in-process (tests, embedding) never enabled this,
so there `leave_open` refuses and the caller closes the client as usual."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

_enabled = False
_left_open: list[object] = []


def enable() -> None:
    """Called by the entry point only: this process ends through `finish`."""
    global _enabled
    _enabled = True


def leave_open(client: object) -> bool:
    """Keep `client` open until the process ends; False (close it yourself) unless the entry point enabled this."""
    if not _enabled:
        return False
    _left_open.append(client)
    return True


def finish(code: int) -> NoReturn:
    """End the process with `code`: without teardown when a client was left open, else as usual."""
    if _left_open:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be written anyway
                stream.flush()
        os._exit(code)
    sys.exit(code)
