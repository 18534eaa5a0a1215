"""Dataclasses of the wire ↔ JSON-able dicts, driven by their type hints, strict on the way in.

``to_json`` turns a dataclass (nested dataclasses, lists, tuples, dicts, optionals, enums, plain scalars) into plain
data ``json.dumps`` accepts. ``from_json(cls, data)`` builds ``cls`` back and refuses anything that does not fit
its hints (a missing or unknown field, a wrong type) with one ``BadRequest`` line naming the field, so a malformed
job never reaches a rank's restore half-decoded.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar, Union

from bsr_cli.core import wire
from bsr_cli.errors import BadRequest

T = TypeVar("T")

_SKEW_HINT = "the host and the coordinator speak different versions of the rank API: run one bsr version on both"


def to_json(obj: Any) -> wire.JsonValue:
    """Plain JSON-able data for a wire object (dict keys become strings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_json(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return to_json(obj.value)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{type(obj).__name__} is not a wire type")


def from_json(cls: type[T], data: Any, *, what: str | None = None) -> T:
    """``cls`` (a wire dataclass) from plain data; ``BadRequest`` naming the field when it does not fit."""
    return typing.cast(T, _decode(cls, data, what or _label(cls)))


def _label(cls: type) -> str:
    return cls.__name__


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _bad(path: str, expected: str, got: Any) -> BadRequest:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return BadRequest(f"malformed {path}: expected {expected}, got {shown}", hint=_SKEW_HINT)


def _decode(tp: Any, data: Any, path: str) -> Any:
    if tp is Any:
        return data
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _decode_union(args, data, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, data, path)
    if origin in (list, Sequence) or tp in (list, Sequence):
        if not isinstance(data, (list, tuple)):
            raise _bad(path, "a list", data)
        item = args[0] if args else Any
        return [_decode(item, v, f"{path}[{i}]") for i, v in enumerate(data)]
    if origin is tuple:
        return _decode_tuple(args, data, path)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return _decode_mapping(args, data, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            raise _bad(path, f"one of {', '.join(repr(m.value) for m in tp)}", data) from None
    return _decode_scalar(tp, data, path)


def _decode_union(args: tuple[Any, ...], data: Any, path: str) -> Any:
    """The first member of the union (in its order) that `data` fits; null where the union allows None."""
    if data is None and type(None) in args:
        return None
    last: BadRequest | None = None
    for a in args:
        if a is type(None):
            continue
        try:
            return _decode(a, data, path)
        except BadRequest as e:
            last = e
    raise last or _bad(path, "a value", data)


def _decode_dataclass(tp: type, data: Any, path: str) -> Any:
    """A wire dataclass from an object holding each field without a default, and no field it does not have."""
    if not isinstance(data, Mapping):
        raise _bad(path, "an object", data)
    fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadRequest(f"malformed {path}: unknown field(s) {', '.join(map(repr, unknown))}", hint=_SKEW_HINT)
    hints = _hints(tp)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BadRequest(f"malformed {path}: missing field {name!r}", hint=_SKEW_HINT)
            continue
        kwargs[name] = _decode(hints[name], data[name], f"{path}.{name}")
    return tp(**kwargs)


def _decode_tuple(args: tuple[Any, ...], data: Any, path: str) -> tuple[Any, ...]:
    """A tuple from a list: of any length for ``tuple[X, ...]``, else of exactly one item per type."""
    if not isinstance(data, (list, tuple)):
        raise _bad(path, "a list", data)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
    if len(data) != len(args):
        raise _bad(path, f"a list of {len(args)}", data)
    return tuple(_decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))


def _decode_mapping(args: tuple[Any, ...], data: Any, path: str) -> dict[Any, Any]:
    if not isinstance(data, Mapping):
        raise _bad(path, "an object", data)
    kt, vt = args if args else (Any, Any)
    out = {}
    for k, v in data.items():
        key = _decode_key(kt, k, path)
        out[key] = _decode(vt, v, f"{path}[{k!r}]")
    return out


def _decode_scalar(tp: Any, data: Any, path: str) -> Any:
    """A bool, an integer, a number (an integer read as a float), a string or null, each strictly of its JSON
    type (true is not an integer)."""
    if tp is bool:
        if not isinstance(data, bool):
            raise _bad(path, "true or false", data)
        return data
    if tp is int:
        if not isinstance(data, int) or isinstance(data, bool):
            raise _bad(path, "an integer", data)
        return data
    if tp is float:
        if not isinstance(data, (int, float)) or isinstance(data, bool):
            raise _bad(path, "a number", data)
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise _bad(path, "a string", data)
        return data
    if tp is type(None):
        if data is not None:
            raise _bad(path, "null", data)
        return None
    raise TypeError(f"{path}: type {tp!r} has no wire form")


def _decode_key(kt: Any, k: Any, path: str) -> Any:
    if kt is int:
        if isinstance(k, int) and not isinstance(k, bool):
            return k
        if isinstance(k, str) and k.lstrip("-").isdigit():
            return int(k)
        raise _bad(f"{path} key", "an integer", k)
    if kt in (str, Any):
        if not isinstance(k, str) and kt is str:
            raise _bad(f"{path} key", "a string", k)
        return k
    raise TypeError(f"{path}: key type {kt!r} has no wire form")


__all__ = ["from_json", "to_json"]
