"""The one codec of bsr's result types: a frozen dataclass written to its JSON form and read back from its fields.

A result type declares its fields and, where the JSON differs from the field, says so in the field's metadata
(``wire.field``, or ``dataclasses.field(metadata=wire.meta(...))`` for a field without a default):

- ``name="W"``: the key it travels under;
- ``omit_none`` / ``omit_empty``: left out while None / while None, "", an empty list or map;
- ``omit_false``: a flag left out while False (said only when set; a reader takes its absence as False);
- ``absent``: what a reader assumes when an older writer leaves the key out;
- ``flatten``: a nested result whose keys sit inline in the parent's object at the field's place (read back from
  it; an optional part reads as None when none of its keys came);
- ``extra``: the keys a host adds (written after the standard keys, read back as every key the type does not name);
- ``skip``: not on the wire at all (read back as its default);
- ``none_as=""``: None travels as that value (written so, and read back as None);
- ``absent_from=f``: what a reader assumes when the key is missing or null, worked out from the whole object
  (``f(d)``: an older writer's answer implies it from its other keys);
- ``shape=T``: a value kept as JSON (an event as the engine sent it) has the wire form of ``T`` (its schema's type).

It then takes the codec as its two wire methods::

    @dataclass(frozen=True)
    class BlockWait:
        request: str
        waited_s: float
        to_wire = wire.writer()      # -> the JSON object, keys in field order
        from_wire = wire.reader()    # <- any JSON object, tolerant

Keys that are not fields (an ``ok`` derived from the ranks) are named by the writer: ``wire.writer(computed=("ok",
"ranks_alive"))`` writes those attributes after the fields, or, with ``order=`` (attribute names, fields and
computed ones), in the order given; a reader passes them over.

Writing turns enums into their values, tuples into lists, sets into sorted lists, dict keys into strings, and a
nested result into its own ``to_wire()`` (or ``to_dict()``, the older name some core types carry; so a type with a
hand-written form still nests, and is read back with its ``from_wire``/``from_dict``). Reading is tolerant, as a
client of a newer or older engine must be: a missing key takes the field's default (or ``absent``, or the empty
value of its type: "", 0, 0.0, False, (), {}, None), a null takes the empty value, a number stays the number that
was sent, and keys the type does not name are kept only where a field asks for them (``extra``). A value of the
wrong kind for a nested object, list or map reads as empty, and an item of a list of objects that is not an object
is passed over; an enum value the type does not know is an error (``ValueError``), unless the enum itself keeps
such values (``core.evidence``: a stage, a tier condition a newer engine adds).

The JSON Schema of what a writer emits comes from the same declaration (``Schemas``): keys by wire name, those
always written ``required``, nested results by reference to their own schema. A type whose JSON is written by hand
declares its schema beside its writer (``wire_schema``, a classmethod given the ``Schemas`` it adds to).

Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import types
import typing
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar, Union

T = TypeVar("T")

_NAME = "wire_name"
_OMIT_NONE = "wire_omit_none"
_ABSENT = "wire_absent"
_EXTRA = "wire_extra"
_OMIT_EMPTY = "wire_omit_empty"
_OMIT_FALSE = "wire_omit_false"
_FLATTEN = "wire_flatten"
_SKIP = "wire_skip"
_NONE_AS = "wire_none_as"
_ABSENT_FROM = "wire_absent_from"
_SHAPE = "wire_shape"


def field(
    *,
    name: str | None = None,
    omit_none: bool = False,
    omit_empty: bool = False,
    omit_false: bool = False,
    flatten: bool = False,
    skip: bool = False,
    none_as: Any = dataclasses.MISSING,
    absent: Any = dataclasses.MISSING,
    absent_from: Callable[[Mapping[str, Any]], Any] | None = None,
    extra: bool = False,
    shape: Any = None,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its wire form described (see the module's docstring)."""
    if extra and default is dataclasses.MISSING and default_factory is dataclasses.MISSING:
        default_factory = dict
    described = meta(
        name=name,
        omit_none=omit_none,
        omit_empty=omit_empty,
        omit_false=omit_false,
        flatten=flatten,
        skip=skip,
        none_as=none_as,
        absent=absent,
        absent_from=absent_from,
        extra=extra,
        shape=shape,
    )
    return dataclasses.field(default=default, default_factory=default_factory, metadata=described)


def meta(
    *,
    name: str | None = None,
    omit_none: bool = False,
    omit_empty: bool = False,
    omit_false: bool = False,
    flatten: bool = False,
    skip: bool = False,
    none_as: Any = dataclasses.MISSING,
    absent: Any = dataclasses.MISSING,
    absent_from: Callable[[Mapping[str, Any]], Any] | None = None,
    extra: bool = False,
    shape: Any = None,
) -> dict[str, Any]:
    """The wire form ``field`` describes, as metadata for a field that has no default:
    ``dataclasses.field(metadata=wire.meta(name="W"))`` (a type checker takes any other call as a default, and
    then refuses the fields without one that follow)."""
    described: dict[str, Any] = {}
    if name is not None:
        described[_NAME] = name
    if omit_none:
        described[_OMIT_NONE] = True
    if omit_empty:
        described[_OMIT_EMPTY] = True
    if omit_false:
        described[_OMIT_FALSE] = True
    if flatten:
        described[_FLATTEN] = True
    if skip:
        described[_SKIP] = True
    if none_as is not dataclasses.MISSING:
        described[_NONE_AS] = none_as
    if absent_from is not None:
        described[_ABSENT_FROM] = absent_from
    if absent is not dataclasses.MISSING:
        described[_ABSENT] = absent
    if extra:
        described[_EXTRA] = True
    if shape is not None:
        described[_SHAPE] = shape
    return described


# -- the plan of a type, worked out once ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Field:
    attr: str
    key: str
    hint: Any
    omit_none: bool
    omit_empty: bool
    flatten: bool
    absent: Any  # dataclasses.MISSING: the field's default, else the empty value of its type
    extra: bool
    none_as: Any = dataclasses.MISSING  # what None travels as
    absent_from: Callable[[Mapping[str, Any]], Any] | None = None
    omit_false: bool = False
    shape: Any = None  # the type whose wire form a value kept as JSON has (its schema's type)


def _plan(cls: type) -> tuple[_Field, ...]:
    return _plan_of(typing.cast(Hashable, cls))


@functools.cache
def _plan_of(key: Hashable) -> tuple[_Field, ...]:
    cls = typing.cast(type, key)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get(_SKIP):  # skip: not on the wire (read back as its default)
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
                omit_empty=bool(f.metadata.get(_OMIT_EMPTY)),
                flatten=bool(f.metadata.get(_FLATTEN)),
                absent=absent,
                extra=bool(f.metadata.get(_EXTRA)),
                none_as=f.metadata.get(_NONE_AS, dataclasses.MISSING),
                absent_from=f.metadata.get(_ABSENT_FROM),
                omit_false=bool(f.metadata.get(_OMIT_FALSE)),
                shape=f.metadata.get(_SHAPE),
            )
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Factory:
    make: Callable[[], Any]


def _known(cls: type) -> frozenset[str]:
    return _known_of(typing.cast(Hashable, cls))


@functools.cache
def _known_of(key: Hashable) -> frozenset[str]:
    """The keys a type's JSON names (its fields', its flattened parts', its computed ones): not a host's. Worked
    out once per type (every read of a type with host keys or flattened parts asks)."""
    cls = typing.cast(type, key)
    keys: set[str] = {*_computed(cls), *_layout(cls).lead}
    for f in _plan(cls):
        if f.flatten:
            keys |= _known(_flat_type(f.hint))
        elif not f.extra:
            keys.add(f.key)
    return frozenset(keys)


def keys(cls: type) -> dict[str, str]:
    """The fields a type writes under another key than their name: wire key -> field name."""
    return {f.key: f.attr for f in _plan(cls) if f.key != f.attr and not f.extra}


def _flat_type(hint: Any) -> type:
    members = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return typing.cast(type, members[0])


def _layout(cls: type) -> writer:
    """The writer a type took (what it computes, in which order); a plain one when it took none."""
    found = cls.__dict__.get("to_wire")
    return found if isinstance(found, writer) else _PLAIN


def _computed(cls: type) -> tuple[str, ...]:
    """The attributes a type's writer writes that are not fields."""
    layout, fields = _layout(cls), {f.attr for f in _plan(cls)}
    return (*layout.computed, *(n for n in layout.order if n not in fields and n not in layout.computed))


def _false(f: _Field, value: Any) -> bool:
    return f.omit_false and value is False


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, tuple, list, dict, set, frozenset)) and not value)


# -- writing ----------------------------------------------------------------------------------------------------
def write(obj: Any) -> dict[str, Any]:
    """The JSON object of a result dataclass: its fields in order under their wire names (with what its writer
    computes), host keys last."""
    layout = _layout(type(obj))
    names, fields = _write_plan(typing.cast(Hashable, type(obj)))
    out: dict[str, Any] = {key: value_to_wire(getattr(obj, attr)) for key, attr in layout.lead.items()}
    extra: Mapping[str, Any] = {}
    for name in names:
        f = fields.get(name)
        value = getattr(obj, name)
        if f is None:  # computed
            out[name] = value_to_wire(value)
        elif f.extra:
            extra = value or {}
        elif f.flatten:
            if value is not None:
                out.update(value_to_wire(value))
        elif value is None and f.none_as is not dataclasses.MISSING:
            out[f.key] = f.none_as
        elif not ((f.omit_none and value is None) or (f.omit_empty and _is_empty(value)) or _false(f, value)):
            out[f.key] = value_to_wire(value)
    out.update(extra)
    return out


@functools.cache
def _write_plan(key: Hashable) -> tuple[tuple[str, ...], dict[str, _Field]]:
    """The attributes a type writes, in order, and its fields by name: worked out (and the order checked) once per
    type, not on every write (events are written on the restore path)."""
    cls = typing.cast(type, key)
    layout = _layout(cls)
    fields = {f.attr: f for f in _plan(cls)}
    if layout.order:
        left_out = [n for n in (*fields, *layout.computed) if n not in layout.order]
        if left_out:  # a field the order forgets would silently vanish from the JSON
            raise TypeError(f"{cls.__name__}: the writer's order leaves out {', '.join(left_out)}")
    return layout.order or (*fields, *layout.computed), fields


def value_to_wire(value: Any) -> Any:
    """Plain JSON data for one value (a nested result writes itself)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    to_wire = getattr(value, "to_wire", None) or getattr(value, "to_dict", None)  # to_dict: a core type's older name
    if callable(to_wire):
        return to_wire()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return write(value)
    if isinstance(value, (set, frozenset)):  # no order of its own: written sorted, so the JSON is stable
        return sorted(value_to_wire(v) for v in value)
    if isinstance(value, (tuple, list)):
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
        elif f.flatten:
            part = _flat_type(f.hint)
            present = f.hint is part or any(k in d for k in _known(part))  # an optional part: there if its keys are
            kwargs[f.attr] = value_from_wire(part, d) if present else None
        elif f.none_as is not dataclasses.MISSING and d.get(f.key) in (None, f.none_as):
            kwargs[f.attr] = None
        elif f.absent_from is not None and d.get(f.key) is None:
            kwargs[f.attr] = value_from_wire(f.hint, f.absent_from(d))
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
        from_wire = getattr(hint, "from_wire", None) or getattr(hint, "from_dict", None)
        source = value if isinstance(value, Mapping) else {}
        return from_wire(source) if callable(from_wire) else read(hint, source)
    if origin in (tuple, list, set, frozenset) or hint in (tuple, list, set, frozenset):
        items: Sequence[Any] = value if isinstance(value, (list, tuple)) else ()
        item_hints = typing.get_args(hint)
        if origin is tuple and item_hints and item_hints[-1] is not Ellipsis:  # a fixed tuple: each item its type
            given = list(items)[: len(item_hints)]
            given += [None] * (len(item_hints) - len(given))
            return tuple(value_from_wire(h, v) for h, v in zip(item_hints, given, strict=True))
        item = item_hints[0] if item_hints else Any
        if isinstance(item, type) and dataclasses.is_dataclass(
            item
        ):  # a list of objects: what is not one is passed over
            items = [v for v in items if isinstance(v, Mapping)]
        values = [value_from_wire(item, v) for v in items]
        kind = origin or hint
        return values if kind is list else tuple(values) if kind is tuple else kind(values)
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
    if origin in (set, frozenset) or hint in (set, frozenset):
        return (origin or hint)()
    if origin in (list,) or hint is list:
        return []
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return {}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return value_from_wire(hint, {})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        raise ValueError(f"no {hint.__name__} given")
    return {bool: False, int: 0, float: 0.0, str: ""}.get(hint)


# -- the schema of what a writer emits ------------------------------------------------------------------------
JsonSchema = dict[str, Any]
REF_PREFIX = "#/components/schemas/"  # where an OpenAPI document keeps its schemas
_SIMPLE: dict[type, JsonSchema] = {
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
}


class Schemas:
    """The JSON Schemas (draft 2020-12, as OpenAPI 3.1 takes them) of result types' wire forms, collected by class
    name: ``ref(T)`` is a reference to T's schema, which it adds to ``components`` with that of every type T nests.

    A schema says what the type's writer emits: its keys by wire name, those always written ``required`` (a key
    left out while None, empty or False is not), null where None is written, an enum as its values, a tuple, list
    or set as an array, a map as an object (its keys are strings), a flattened part's keys inline, a computed key
    as its property's type, and no key besides unless the type keeps a host's (``extra``)."""

    def __init__(self, prefix: str = REF_PREFIX) -> None:
        self.prefix = prefix
        self.components: dict[str, JsonSchema] = {}
        self._types: dict[str, type] = {}

    def ref(self, cls: type) -> JsonSchema:
        """A reference to ``cls``'s schema (worked out once, with every type it nests)."""
        name = cls.__name__
        seen = self._types.setdefault(name, cls)
        if seen is not cls:
            raise TypeError(f"two wire types are named {name}: {seen.__module__}'s and {cls.__module__}'s")
        if name not in self.components:
            self.components[name] = {}  # taken before it is worked out: a type that nests itself refers to itself
            summary = _summary(cls)
            body = self.body(cls)
            self.components[name] = {"description": summary, **body} if summary else body
        return {"$ref": self.prefix + name}

    def body(self, cls: type) -> JsonSchema:
        """The schema of ``cls``'s JSON object, inline: declared beside a writer written by hand, else the codec's."""
        declared = getattr(cls, "wire_schema", None)
        if callable(declared):
            return typing.cast(JsonSchema, declared(self))
        if _writes_itself(cls):
            raise TypeError(f"{cls.__name__} writes its JSON by hand: declare its schema (a wire_schema classmethod)")
        return self.written(cls)

    def written(self, cls: type) -> JsonSchema:
        """The schema of what ``write`` makes of ``cls`` (a writer written by hand builds its own on it)."""
        names, fields = _write_plan(typing.cast(Hashable, cls))
        properties: dict[str, JsonSchema] = {}
        required: list[str] = []
        additional: JsonSchema | bool = False
        for key, attr in _layout(cls).lead.items():
            properties[key] = self._attribute(cls, attr)
            required.append(key)
        for name in names:
            f = fields.get(name)
            if f is None:  # computed: always written
                properties[name] = self._attribute(cls, name)
                required.append(name)
            elif f.extra:
                additional = self._values(f.hint)
            elif f.flatten:
                part = _flat_type(f.hint)
                inline = self.body(part)
                properties.update(inline["properties"])
                required += inline.get("required", []) if f.hint is part else []  # an optional part: none of them
                additional = inline.get("additionalProperties", False) or additional
            else:
                properties[f.key] = self._field(f)
                if not (f.omit_none or f.omit_empty or f.omit_false):
                    required.append(f.key)
        return object_schema(properties, required, additional)

    def of(self, hint: Any) -> JsonSchema:
        """The schema of a value of type ``hint`` as the codec writes it."""
        if hint is Any or hint is object:
            return {}
        if hint is None or hint is type(None):
            return {"type": "null"}
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.ClassVar:
            return self.of(args[0])
        if origin in (Union, types.UnionType):
            return any_of([self.of(a) for a in args])
        if origin is typing.Literal:
            return {"enum": list(args)}
        if isinstance(hint, type) and hint in _SIMPLE:
            return dict(_SIMPLE[hint])
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema(hint)
        if isinstance(hint, type) and _written_type(hint):
            return self.ref(hint)
        kind = origin or hint
        if kind is tuple and args and args[-1] is not Ellipsis:  # a fixed tuple: each item its type
            items = [self.of(a) for a in args]
            return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
        if kind in (tuple, list, set, frozenset, Sequence):
            array: JsonSchema = {"type": "array", "items": self.of(args[0] if args else Any)}
            return array | {"uniqueItems": True} if kind in (set, frozenset) else array
        if kind in (dict, Mapping):
            return {"type": "object", "additionalProperties": self._values(hint)}
        raise TypeError(f"no JSON Schema for {hint!r}")

    def _field(self, f: _Field) -> JsonSchema:
        hint = f.hint if f.shape is None else f.shape
        if f.omit_false:
            return {"const": True}  # written only when set
        if f.none_as is not dataclasses.MISSING:
            return any_of([self.of(_without_none(hint)), {"const": f.none_as}])
        return self.of(_without_none(hint) if f.omit_none or f.omit_empty else hint)

    def _values(self, hint: Any) -> JsonSchema | bool:
        """The schema of a map's values (any value: ``True``)."""
        args = typing.get_args(hint)
        value = args[1] if len(args) == 2 else Any
        return self.of(value) if value is not Any else True

    def _attribute(self, cls: type, name: str) -> JsonSchema:
        """The schema of a key a writer computes: its property's return type, or the class's constant."""
        member = inspect.getattr_static(cls, name)
        if isinstance(member, property) and member.fget is not None:
            hints = typing.get_type_hints(member.fget)
            if "return" not in hints:
                raise TypeError(f"{cls.__name__}.{name}: a key its writer computes needs its return type")
            return self.of(hints["return"])
        value = getattr(cls, name)  # a constant of the class (an event's kind)
        if isinstance(value, enum.Enum | str | int | float):
            return {"const": value_to_wire(value)}
        return self.of(typing.get_type_hints(cls)[name])


def schema(cls: type) -> JsonSchema:
    """A JSON Schema of ``cls``'s wire form that stands alone: a reference to it beside every schema it uses."""
    s = Schemas(prefix="#/$defs/")
    root = s.ref(cls)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": s.components}


def object_schema(
    properties: Mapping[str, JsonSchema], required: Sequence[str] = (), additional: JsonSchema | bool = False
) -> JsonSchema:
    """A JSON object's schema: its keys' schemas, those always there, and what other keys may hold (none: False)."""
    out: JsonSchema = {"type": "object", "properties": dict(properties)}
    if required:
        out["required"] = list(dict.fromkeys(required))
    out["additionalProperties"] = additional
    return out


def any_of(schemas: Sequence[JsonSchema]) -> JsonSchema:
    """One of several schemas: a list of types where each is one bare type, else ``anyOf`` (never nested)."""
    flat = [branch for s in schemas for branch in (s["anyOf"] if set(s) == {"anyOf"} else [s])]
    unique = [s for i, s in enumerate(flat) if s not in flat[:i]]
    if {} in unique:
        return {}
    if len(unique) == 1:
        return unique[0]
    if all(set(s) == {"type"} and isinstance(s["type"], str) for s in unique):
        return {"type": [s["type"] for s in unique]}
    return {"anyOf": unique}


def _enum_schema(cls: type[enum.Enum]) -> JsonSchema:
    values = [m.value for m in cls]
    out: JsonSchema = (
        {"type": "string", "enum": values} if all(isinstance(v, str) for v in values) else {"enum": values}
    )
    if "_missing_" in cls.__dict__:  # it keeps a value a newer part of the engine sends, written back as sent
        return {"anyOf": [out, {"type": "string"}]}
    return out


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return hint
    members = tuple(a for a in typing.get_args(hint) if a is not type(None))
    return members[0] if len(members) == 1 else Union[members]  # noqa: UP007 - built from a tuple


def _written_type(cls: type) -> bool:
    """A type the codec writes as an object of its own (``value_to_wire``)."""
    return dataclasses.is_dataclass(cls) or any(hasattr(cls, m) for m in ("to_wire", "to_dict", "wire_schema"))


def _writes_itself(cls: type) -> bool:
    """Whether a type's JSON comes from a method written by hand rather than the codec's writer."""
    to_wire = inspect.getattr_static(cls, "to_wire", None)
    if to_wire is not None:
        return not isinstance(to_wire, writer)
    return inspect.getattr_static(cls, "to_dict", None) is not None


def _summary(cls: type) -> str:
    """The first paragraph of a type's docstring, on one line ("" when it has none of its own)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):  # what dataclasses write for a class without a docstring
        return ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split()).replace("``", "`")  # Markdown's code marks


# -- the two wire methods a result type takes -------------------------------------------------------------------
class writer:
    """``to_wire = wire.writer()``: the type's ``to_wire()`` is ``write(self)``. ``computed`` names attributes
    that are not fields (properties) to write after the fields; ``order``, every attribute written (fields and
    computed ones), in the order written; ``lead``, keys written first from attributes under another name
    (``{"type": "kind"}``: a class's kind)."""

    def __init__(
        self, *, computed: Sequence[str] = (), order: Sequence[str] = (), lead: Mapping[str, str] | None = None
    ) -> None:
        self.computed = tuple(computed)
        self.order = tuple(order)
        self.lead = dict(lead or {})  # wire key -> attribute, written before everything else (an event's type)

    def __get__(self, obj: object, owner: type[Any]) -> Callable[[], dict[str, Any]]:
        return functools.partial(write, obj)


_PLAIN = writer()


class reader:
    """``from_wire = wire.reader()``: the type's ``from_wire(data)`` is ``read(cls, data)``."""

    def __get__(self, obj: object, owner: type[T]) -> Callable[[Any], T]:
        return functools.partial(read, owner)


# -- raw JSON ---------------------------------------------------------------------------------------------------
# A value as JSON carries it, before a reader types it or after a writer wrote it: a body just parsed, the keys a
# host adds, an event as a newer engine sent it. The one alias for raw JSON, so a reader of such a value narrows it
# before use. At run time it is Any: the codec keeps a field of this type as it came.
if typing.TYPE_CHECKING:
    JsonValue: TypeAlias = "bool | int | float | str | list[JsonValue] | dict[str, JsonValue] | None"
else:
    JsonValue = Any
JsonObject: TypeAlias = dict[str, JsonValue]


__all__ = [
    "REF_PREFIX",
    "JsonObject",
    "JsonSchema",
    "JsonValue",
    "Schemas",
    "any_of",
    "field",
    "keys",
    "meta",
    "object_schema",
    "read",
    "reader",
    "schema",
    "value_from_wire",
    "value_to_wire",
    "write",
    "writer",
]
