"""The one codec of bsr's result types (bsr_cli.core.wire): what it writes, what it reads back, and how it
tolerates what an older or newer writer sends."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import pytest

from bsr_cli.core import wire


class Colour(Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    name: str
    count: int

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Custom:
    """A type with a hand-written form still nests: the codec calls its own methods."""

    value: int

    def to_wire(self) -> dict[str, Any]:
        return {"v": self.value, "doubled": self.value * 2}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Custom:
        return cls(value=int(d.get("v") or 0))


@dataclass(frozen=True)
class Outer:
    request: str
    w: int = wire.field(name="W")
    colour: Colour = wire.field()
    shades: tuple[Colour, ...] = wire.field()
    inner: Inner = wire.field()
    maybe: Inner | None = wire.field()
    per_rank: dict[int, int] = wire.field()
    custom: Custom = wire.field()
    timeout_s: float = wire.field()
    healthy: bool = wire.field(absent=True)
    error: str | None = wire.field(default=None, omit_none=True)
    tags: tuple[str, ...] = ()
    host_fields: dict[str, Any] = wire.field(extra=True)

    to_wire = wire.writer()
    from_wire = wire.reader()


def _outer(**changes: Any) -> Outer:
    base: dict[str, Any] = dict(
        request="r1",
        w=32,
        colour=Colour.RED,
        shades=(Colour.BLUE, Colour.RED),
        inner=Inner("a", 3),
        maybe=None,
        per_rank={0: 5, 1: 7},
        custom=Custom(4),
        timeout_s=2.5,
        healthy=False,
        host_fields={"worker": {"pid": 9}},
    )
    base.update(changes)
    return Outer(**base)


def test_writes_fields_in_order_under_their_wire_names_with_host_keys_last() -> None:
    out = _outer().to_wire()
    assert list(out) == [
        "request",
        "W",
        "colour",
        "shades",
        "inner",
        "maybe",
        "per_rank",
        "custom",
        "timeout_s",
        "healthy",
        "tags",
        "worker",
    ]
    assert out["colour"] == "red" and out["shades"] == ["blue", "red"]
    assert out["inner"] == {"name": "a", "count": 3}
    assert out["per_rank"] == {"0": 5, "1": 7}  # JSON object keys are strings
    assert out["custom"] == {"v": 4, "doubled": 8}
    assert out["worker"] == {"pid": 9}
    json.dumps(out)  # plain JSON data


def test_omit_none_leaves_the_key_out_only_while_none() -> None:
    assert "error" not in _outer().to_wire()
    assert _outer(error="rank 1 died").to_wire()["error"] == "rank 1 died"


def test_round_trip_gives_the_same_object_and_keeps_host_keys() -> None:
    original = _outer(maybe=Inner("b", 1), error="x", tags=("t",))
    again = Outer.from_wire(json.loads(json.dumps(original.to_wire())))
    assert again == original
    assert again.to_wire() == original.to_wire()


def test_reads_an_older_writer_that_left_keys_out() -> None:
    got = Outer.from_wire({"request": "r2", "colour": "blue"})
    assert got.request == "r2" and got.colour is Colour.BLUE
    assert got.w == 0 and got.timeout_s == 0.0 and got.tags == () and got.per_rank == {}
    assert got.inner == Inner("", 0) and got.maybe is None and got.error is None
    assert got.healthy is True  # the field's `absent`, not the empty value of bool
    assert got.custom == Custom(0)  # through the nested type's own reader
    assert got.host_fields == {}


def test_reads_nulls_and_values_of_the_wrong_kind_as_empty() -> None:
    got = Outer.from_wire(
        {"request": None, "colour": "red", "inner": [1, 2], "per_rank": "x", "shades": None, "tags": None}
    )
    assert got.request == "" and got.inner == Inner("", 0) and got.per_rank == {} and got.shades == ()


def test_numbers_stay_as_sent_and_map_keys_are_read_as_their_type() -> None:
    got = Outer.from_wire({"colour": "red", "timeout_s": 10, "per_rank": {"2": "4"}})
    assert got.timeout_s == 10 and isinstance(got.timeout_s, int)  # an integral timeout prints as one
    assert got.per_rank == {2: 4}


def test_an_enum_value_it_does_not_know_is_an_error_not_a_guess() -> None:
    with pytest.raises(ValueError):
        Outer.from_wire({"colour": "green"})
    with pytest.raises(ValueError):  # a required enum the writer left out is not guessed either
        Outer.from_wire({})


def test_unknown_keys_are_kept_only_where_a_field_asks_for_them() -> None:
    assert Inner.from_wire({"name": "a", "count": 1, "new": True}) == Inner("a", 1)
    assert Outer.from_wire({"colour": "red", "new": True}).host_fields == {"new": True}


@dataclass(frozen=True)
class Legacy:
    """A core type that still names its wire methods to_dict/from_dict (HitBitmap, Registration, Marker)."""

    value: int

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "kind": "legacy"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Legacy:
        return cls(value=int(d["value"]))


@dataclass(frozen=True)
class HoldsLegacy:
    legacy: Legacy
    maybe: Legacy | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()


def test_a_type_named_the_older_way_nests_through_its_to_dict_and_from_dict() -> None:
    written = HoldsLegacy(Legacy(3)).to_wire()
    assert json.dumps(written) == '{"legacy": {"value": 3, "kind": "legacy"}, "maybe": null}'
    assert HoldsLegacy.from_wire(json.loads(json.dumps(written))) == HoldsLegacy(Legacy(3))


@dataclass(frozen=True)
class Part:
    fits: bool
    budget_bytes: int

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Why:
    message: str
    hint: str

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class Report:
    """Flattened parts, a key left out while empty, and keys computed from the fields."""

    chunks: tuple[int, ...]
    part: Part = wire.field(flatten=True)
    why: Why | None = wire.field(flatten=True, default=None)
    note: str = wire.field(omit_empty=True, default="")
    host_fields: dict[str, Any] = wire.field(extra=True)

    @property
    def total(self) -> int:
        return sum(self.chunks)

    @property
    def ok(self) -> bool:
        return self.part.fits

    to_wire = wire.writer(order=("ok", "chunks", "total", "part", "why", "note", "host_fields"))
    from_wire = wire.reader()


def test_flattened_parts_sit_inline_and_read_back_from_the_same_object() -> None:
    r = Report(chunks=(1, 2), part=Part(True, 7))
    assert r.to_wire() == {"ok": True, "chunks": [1, 2], "total": 3, "fits": True, "budget_bytes": 7}
    assert list(r.to_wire()) == ["ok", "chunks", "total", "fits", "budget_bytes"]
    assert Report.from_wire(r.to_wire()) == r  # the computed keys are passed over, not kept as a host's
    why = Report(chunks=(), part=Part(False, 0), why=Why("too big", "lower W"))
    assert list(why.to_wire())[-2:] == ["message", "hint"]
    assert Report.from_wire(why.to_wire()) == why


def test_an_optional_flattened_part_is_none_when_none_of_its_keys_came() -> None:
    assert Report.from_wire({"chunks": [], "other": 1}).why is None
    assert Report.from_wire({"chunks": [], "hint": "h"}).why == Why("", "h")
    assert Report.from_wire({"chunks": [], "other": 1}).host_fields == {"other": 1}


def test_omit_empty_leaves_an_empty_value_out_and_writes_a_given_one() -> None:
    assert "note" not in Report(chunks=(), part=Part(False, 0)).to_wire()
    assert Report(chunks=(), part=Part(False, 0), note="why").to_wire()["note"] == "why"


def test_computed_keys_come_after_the_fields_without_an_order() -> None:
    @dataclass(frozen=True)
    class Counted:
        items: tuple[str, ...]

        @property
        def count(self) -> int:
            return len(self.items)

        to_wire = wire.writer(computed=("count",))
        from_wire = wire.reader()

    assert list(Counted(("a",)).to_wire().items()) == [("items", ["a"]), ("count", 1)]
    assert Counted.from_wire({"items": ["a", "b"], "count": 9}) == Counted(("a", "b"))


def test_an_order_that_leaves_a_field_out_is_refused_not_written_short() -> None:
    @dataclass(frozen=True)
    class Short:
        a: int
        b: int

        to_wire = wire.writer(order=("b",))

    with pytest.raises(TypeError, match="leaves out a"):
        Short(1, 2).to_wire()


@dataclass(frozen=True)
class Plain:
    """Described fields without a default: they take ``wire.meta`` through ``dataclasses.field`` (a type checker
    reads any other call as a default)."""

    request: str
    w: int = dataclasses.field(metadata=wire.meta(name="W"))
    healthy: bool = dataclasses.field(metadata=wire.meta(absent=True))
    tokens: int
    error: str | None = dataclasses.field(default=None, metadata=wire.meta(omit_none=True))

    to_wire = wire.writer()
    from_wire = wire.reader()


def test_a_field_without_a_default_takes_its_wire_form_from_meta() -> None:
    plain = Plain("r1", 4, False, 10)
    assert json.dumps(plain.to_wire()) == json.dumps({"request": "r1", "W": 4, "healthy": False, "tokens": 10})
    assert Plain.from_wire(plain.to_wire()) == plain
    assert Plain.from_wire({"request": "r2"}) == Plain("r2", 0, True, 0)


@dataclass(frozen=True)
class Kept:
    prompt: str
    excluded: frozenset[str] = frozenset()
    parts: tuple[Inner, ...] = ()
    series: tuple[float, ...] = wire.field(skip=True, default=())  # a working value, not on the wire

    to_wire = wire.writer()
    from_wire = wire.reader()


def test_a_skipped_field_is_not_written_and_reads_back_as_its_default() -> None:
    k = Kept("p", series=(1.0, 2.0))
    assert "series" not in k.to_wire()
    assert Kept.from_wire({"prompt": "p", "series": [9.0]}).series == ()


def test_a_set_is_written_sorted_and_read_back_as_a_set() -> None:
    k = Kept("p", excluded=frozenset({"mooncake", "fs", "ssd", "cpu", "disk", "remote"}))
    assert k.to_wire()["excluded"] == ["cpu", "disk", "fs", "mooncake", "remote", "ssd"]
    assert Kept.from_wire(k.to_wire()) == k and isinstance(Kept.from_wire(k.to_wire()).excluded, frozenset)


def test_an_item_of_a_list_of_objects_that_is_not_an_object_is_passed_over() -> None:
    got = Kept.from_wire({"prompt": "p", "parts": [{"name": "a", "count": 1}, 7, None, "x"]})
    assert got.parts == (Inner("a", 1),)


def test_a_fixed_tuple_reads_each_item_as_its_own_type() -> None:
    assert wire.value_from_wire(tuple[bool, tuple[str, ...]], [1, ["a", "b"]]) == (True, ("a", "b"))
    assert wire.value_from_wire(tuple[int, str], [3]) == (3, "")  # an item left out reads as empty


class Tint(Enum):
    OK = "ok"
    DOWN = "down"


def _tint_from_ok(d: Any) -> Tint:
    return Tint.OK if d.get("ok") else Tint.DOWN


@dataclass(frozen=True)
class Older:
    ok: bool
    tint: Tint = wire.field(default=Tint.OK, absent_from=_tint_from_ok)  # an older writer implies it from `ok`
    cause: Tint | None = wire.field(default=None, none_as="")  # a writer that says "" for none

    to_wire = wire.writer()
    from_wire = wire.reader()


def test_none_as_travels_as_its_value_and_reads_back_as_none() -> None:
    assert Older(True).to_wire() == {"ok": True, "tint": "ok", "cause": ""}
    assert Older.from_wire({"ok": True, "tint": "ok", "cause": ""}).cause is None
    assert Older.from_wire({"ok": True, "tint": "ok", "cause": "down"}).cause is Tint.DOWN


def test_absent_from_works_a_missing_or_null_key_out_from_the_others() -> None:
    assert Older.from_wire({"ok": False}).tint is Tint.DOWN
    assert Older.from_wire({"ok": True, "tint": None}).tint is Tint.OK
    assert Older.from_wire({"ok": False, "tint": "ok"}).tint is Tint.OK  # a named one is taken as named


@dataclass(frozen=True, kw_only=True)
class Tagged:
    """A type whose kind (a class attribute) leads its JSON, with a field renamed on the wire."""

    kind: ClassVar[str] = "tagged"
    seq: int = 0
    fault_id: int = wire.field(name="id", default=0)

    to_wire = wire.writer(lead={"type": "kind"})


def test_lead_keys_come_first_and_keys_lists_the_renamed_fields() -> None:
    assert list(Tagged(seq=2, fault_id=5).to_wire().items()) == [("type", "tagged"), ("seq", 2), ("id", 5)]
    assert wire.keys(Tagged) == {"id": "fault_id"}
