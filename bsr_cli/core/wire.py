"""The one codec of bsr's result types: a frozen dataclass written to its JSON form and read back from its fields.

A result type declares its fields and, where the JSON differs from the field, says so in the field's metadata
(``wire.field``): the key it travels under (``name="W"``), that it is left out while None (``omit_none``), what a
reader assumes when an older writer leaves it out (``absent``), or that it holds the keys a host adds
(``extra``: written after the standard keys, read back as every key the type does not name). It then takes the
codec as its two wire methods::

    @dataclass(frozen=True)
    class BlockWait:
        request: str
        waited_s: float
        to_wire = wire.writer()      # -> the JSON object, keys in field order
        from_wire = wire.reader()    # <- any JSON object, tolerant

Writing turns enums into their values, tuples into lists, dict keys into strings, and a nested result into its
own ``to_wire()`` (so a type with a hand-written form still nests). Reading is tolerant, as a client of a newer or
older engine must be: a missing key takes the field's default (or ``absent``, or the empty value of its type: "",
0, 0.0, False, (), {}, None), a null takes the empty value, a number stays the number that was sent, and keys the
type does not name are kept only where a field asks for them (``extra``). A value of the wrong kind for a nested
object, list or map reads as empty; an enum value the type does not know is an error (``ValueError``).

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar, Union

T = TypeVar("T")

_NAME = "wire_name"
_OMIT_NONE = "wire_omit_none"
_ABSENT = "wire_absent"
_EXTRA = "wire_extra"


def field(
    *,
    name: str | None = None,
    omit_none: bool = False,
    absent: Any = dataclasses.MISSING,
    extra: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its wire form described (see the module's docstring)."""
    if extra and default is dataclasses.MISSING and default_factory is dataclasses.MISSING:
        default_factory = dict
    described = meta(name=name, omit_none=omit_none, absent=absent, extra=extra)
    return dataclasses.field(default=default, default_factory=default_factory, metadata=described)


def meta(
    *, name: str | None = None, omit_none: bool = False, absent: Any = dataclasses.MISSING, extra: bool = False
) -> dict[str, Any]:
    """The wire form ``field`` describes, as metadata for a field that has no default:
    ``dataclasses.field(metadata=wire.meta(name="W"))`` (a type checker takes any other call as a default, and
    then refuses the fields without one that follow)."""
    described: dict[str, Any] = {}
    if name is not None:
        described[_NAME] = name
    if omit_none:
        described[_OMIT_NONE] = True
    if absent is not dataclasses.MISSING:
        described[_ABSENT] = absent
    if extra:
        described[_EXTRA] = True
    return described


# -- the plan of a type, worked out once ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Field:
    attr: str
    key: str
    hint: Any
    omit_none: bool
    absent: Any  # dataclasses.MISSING: the field's default, else the empty value of its type
    extra: bool


def _plan(cls: type) -> tuple[_Field, ...]:
    return _plan_of(typing.cast(Hashable, cls))


@functools.cache
def _plan_of(key: Hashable) -> tuple[_Field, ...]:
    cls = typing.cast(type, key)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        absent: Any = f.metadata.get(_ABSENT, dataclasses.MISSING)
        factory: Any = f.default_factory
        if absent is dataclasses.MISSING and f.default is not dataclasses.MISSING:
            absent = f.default
        elif absent is dataclasses.MISSING and factory is not dataclasses.MISSING:
            absent = _Factory(factory)
        out.append(
            _Field(
                attr=f.name,
                key=f.metadata.get(_NAME, f.name),
                hint=hints[f.name],
                omit_none=bool(f.metadata.get(_OMIT_NONE)),
                absent=absent,
                extra=bool(f.metadata.get(_EXTRA)),
            )
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Factory:
    make: Callable[[], Any]


def _known(cls: type) -> frozenset[str]:
    return frozenset(f.key for f in _plan(cls) if not f.extra)


# -- writing ----------------------------------------------------------------------------------------------------
def write(obj: Any) -> dict[str, Any]:
    """The JSON object of a result dataclass: its fields in order under their wire names, host keys last."""
    out: dict[str, Any] = {}
    extra: Mapping[str, Any] = {}
    for f in _plan(type(obj)):
        value = getattr(obj, f.attr)
        if f.extra:
            extra = value or {}
        elif not (f.omit_none and value is None):
            out[f.key] = value_to_wire(value)
    out.update(extra)
    return out


def value_to_wire(value: Any) -> Any:
    """Plain JSON data for one value (a nested result writes itself)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    to_wire = getattr(value, "to_wire", None)
    if callable(to_wire):
        return to_wire()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return write(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        return [value_to_wire(v) for v in value]
    if isinstance(value, Mapping):
        return {_key_to_wire(k): value_to_wire(v) for k, v in value.items()}
    return value


def _key_to_wire(key: Any) -> str:
    return str(key.value) if isinstance(key, enum.Enum) else str(key)


# -- reading ----------------------------------------------------------------------------------------------------
def read(cls: type[T], data: Any) -> T:
    """``cls`` from a JSON object, tolerant of missing, null and unknown keys (see the module's docstring)."""
    d: Mapping[str, Any] = data if isinstance(data, Mapping) else {}
    kwargs: dict[str, Any] = {}
    for f in _plan(cls):
        if f.extra:
            known = _known(cls)
            kwargs[f.attr] = {k: v for k, v in d.items() if k not in known}
        elif f.key in d:
            kwargs[f.attr] = value_from_wire(f.hint, d[f.key])
        elif isinstance(f.absent, _Factory):
            kwargs[f.attr] = f.absent.make()
        elif f.absent is not dataclasses.MISSING:
            kwargs[f.attr] = f.absent
        else:
            kwargs[f.attr] = _empty(f.hint)
    return cls(**kwargs)


def value_from_wire(hint: Any, value: Any) -> Any:
    """One value read as ``hint`` says (tolerant: a null or a value of the wrong kind reads as empty)."""
    if hint is Any or hint is object:
        return value
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None if len(members) < len(typing.get_args(hint)) else _empty(members[0])
        for a in members:  # a value already of one of the types stays as sent
            if isinstance(a, type) and not typing.get_args(a) and isinstance(value, a) and a is not bool:
                return value
        return value_from_wire(members[0], value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        from_wire = getattr(hint, "from_wire", None)
        source = value if isinstance(value, Mapping) else {}
        return from_wire(source) if callable(from_wire) else read(hint, source)
    if origin in (tuple, list) or hint in (tuple, list):
        items: Sequence[Any] = value if isinstance(value, (list, tuple)) else ()
        item_hints = typing.get_args(hint)
        item = item_hints[0] if item_hints else Any
        values = [value_from_wire(item, v) for v in items]
        return values if origin is list or hint is list else tuple(values)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            return {}
        kt, vt = typing.get_args(hint) or (Any, Any)
        return {value_from_wire(kt, k): value_from_wire(vt, v) for k, v in value.items()}
    if hint is bool:
        return bool(value)
    if hint is int:
        return int(value or 0)
    if hint is float:
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else float(value or 0.0)
    if hint is str:
        return "" if value is None else str(value)
    return value


def _empty(hint: Any) -> Any:
    """What a reader assumes for a field an older writer left out."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        return None if type(None) in args else _empty(args[0])
    if origin in (tuple,) or hint is tuple:
        return ()
    if origin in (list,) or hint is list:
        return []
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return {}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return value_from_wire(hint, {})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        raise ValueError(f"no {hint.__name__} given")
    return {bool: False, int: 0, float: 0.0, str: ""}.get(hint)


# -- the two wire methods a result type takes -------------------------------------------------------------------
class writer:
    """``to_wire = wire.writer()``: the type's ``to_wire()`` is ``write(self)``."""

    def __get__(self, obj: object, owner: type[Any]) -> Callable[[], dict[str, Any]]:
        return functools.partial(write, obj)


class reader:
    """``from_wire = wire.reader()``: the type's ``from_wire(data)`` is ``read(cls, data)``."""

    def __get__(self, obj: object, owner: type[T]) -> Callable[[Any], T]:
        return functools.partial(read, owner)


__all__ = ["field", "meta", "read", "reader", "value_from_wire", "value_to_wire", "write", "writer"]
