"""Option values converted without pydantic where the conversion is plain.

typer converts every option's value through a pydantic TypeAdapter, built on the option's first use: importing
pydantic and typer's adapters costs about as much as the rest of the CLI's start together, and every command pays
it (the global options are converted before any command runs, `bsr probe --help` included). Nearly all of bsr's
options are a str, an int, a float, a path or a list of them, given a plain value (`--tokens 131072`, a file name,
nothing at all). For those this module gives the value typer's adapter would give, without pydantic: the
conversion typer itself does for a path (its own checks, called with a `Path`) or a choice, `int()`/`float()` for
a plain decimal. Anything else — an unusual spelling (`+5`, `1_000`, ` 7`), a value out of an option's range, a
type not listed here — goes to typer's own adapter, so every value it accepts or refuses, and every message it
refuses with, stays typer's. tests/cli/test_lazy_commands.py checks both give the same for every option.

With a typer that converts values another way (no `typer._coercion`), nothing is installed and typer does it all.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

try:
    from typer._coercion import RuntimeParam, build_runtime_param
    from typer._param_types import coerce_cli_choice, coerce_cli_path
except ImportError:  # pragma: no cover - a typer without pydantic coercion: nothing to spare
    RuntimeParam = None  # type: ignore[assignment,misc]

__all__ = ["PLAIN_TYPES", "install_plain_values", "plain_value"]

PLAIN_TYPES = (str, int, float, Path)
_DECIMAL = re.compile(r"-?[0-9]+(\.[0-9]+)?")
NOT_PLAIN: Any = object()  # plain_value's answer for "ask typer"


def plain_value(annotation: Any, info: Any, descriptor: Any, value: Any, param: Any, ctx: Any) -> Any:
    """The value typer's adapter would give, or NOT_PLAIN when that takes the adapter."""
    if isinstance(value, (list, tuple)) and descriptor.is_list:
        (item_type,) = getattr(annotation, "__args__", (None,))
        items = [_scalar(item_type, info, descriptor, v, param, ctx) for v in value]
        return NOT_PLAIN if any(i is NOT_PLAIN for i in items) else items
    return _scalar(annotation, info, descriptor, value, param, ctx)


def _scalar(annotation: Any, info: Any, descriptor: Any, value: Any, param: Any, ctx: Any) -> Any:
    if info.parser is not None:
        return NOT_PLAIN
    if descriptor.choices is not None:
        try:
            return coerce_cli_choice(value, choices=descriptor.choices, case_sensitive=info.case_sensitive, ctx=ctx)
        except ValueError:
            return NOT_PLAIN  # typer's adapter words the refusal
    if annotation is str:
        return value if type(value) is str else NOT_PLAIN
    if annotation is int:
        number = _int(value)
        return number if number is not NOT_PLAIN and _in_range(number, info) else NOT_PLAIN
    if annotation is float:
        number = _float(value)
        return number if number is not NOT_PLAIN and _in_range(number, info) else NOT_PLAIN
    if annotation is Path and info.path_type is None:
        return _path(value, info, param, ctx)
    return NOT_PLAIN


def _path(value: Any, info: Any, param: Any, ctx: Any) -> Any:
    """typer's own path conversion and checks (exists, readable, ...), given a Path: it needs no adapter then. A
    spelling a Path would change (`./x`, `a//b`, `d/`) is the adapter's: typer's messages quote it as given."""
    if isinstance(value, Path):
        return coerce_cli_path(value, info, path_type=Path, param=param, ctx=ctx)
    if type(value) is str and value and str(Path(value)) == value:
        return coerce_cli_path(Path(value), info, path_type=Path, param=param, ctx=ctx)
    return NOT_PLAIN


def _int(value: Any) -> Any:
    if type(value) is int:
        return value
    if type(value) is str and _DECIMAL.fullmatch(value) and "." not in value:
        number = int(value)
        return number if str(number) == value else NOT_PLAIN  # `007`, `-0`: the adapter's call
    return NOT_PLAIN


def _float(value: Any) -> Any:
    if type(value) is float:
        return value
    if type(value) is str and _DECIMAL.fullmatch(value):
        return float(value)
    return NOT_PLAIN


def _in_range(number: float, info: Any) -> bool:
    """Within the option's min/max (a clamped option is the adapter's: it changes the value)."""
    if info.clamp:
        return info.min is None and info.max is None
    return (info.min is None or number >= info.min) and (info.max is None or number <= info.max)


if RuntimeParam is not None:

    class _PlainFirst(RuntimeParam):  # type: ignore[misc,valid-type]
        """typer's conversion of one option, plain values first; typer's own adapter for the rest, built on first
        need (that is when pydantic is imported)."""

        _descriptor: Any
        _typer_own: Any

        def __init__(self, param: Any) -> None:
            descriptor = param.type_descriptor
            super().__init__(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)
            object.__setattr__(self, "_descriptor", descriptor)
            object.__setattr__(self, "_typer_own", None)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            try:
                got = plain_value(self.annotation, self.parameter_info, self._descriptor, value, param, ctx)
            except TypeError:  # a typer whose path or choice helpers take other arguments: its adapter decides
                got = NOT_PLAIN
            if got is not NOT_PLAIN:
                return got
            if self._typer_own is None:
                object.__setattr__(self, "_typer_own", build_runtime_param(self._descriptor))
            return self._typer_own._coerce_value(value, param=param, ctx=ctx)


def install_plain_values(param: Any) -> None:
    """Have ``param`` (a parsed option or argument of a built command) convert plain values without pydantic."""
    if RuntimeParam is None or getattr(param, "type_descriptor", None) is None:
        return
    if getattr(param, "_runtime_param", "absent") is not None or param.type_descriptor.file_annotation is not None:
        return  # already converting, or a file typer opens: typer's own
    try:
        param._runtime_param = _PlainFirst(param)
    except TypeError:  # a typer whose conversion is built another way: it converts everything itself
        return
