"""A registration: the set of KV tensors one TP rank registers with the engine.

This is what vLLM hands a KV connector in ``register_kv_caches``: for every tensor its name, dtype and per-token
shape, plus the KV group (block pool) it lives in. BSR's accounting coefficient is derived from it:
``c = Σ c_i``, the bytes of one chunk of every registered tensor on one rank.

The schema (documented in docs/registration.md)::

    {"model": "...", "tp_size": 2, "chunk_size": 256, "aux_bytes": 0,
     "groups": [{"name": "attn", "block_size": 64}],
     "tensors": [{"name": "layers.0.kv", "dtype": "bf16", "shape": [2, 4, 128], "group": "attn"}]}

``shape`` is the per-token shape on one rank (heads already divided by TP). ``bytes_per_token`` may be given
instead of ``shape`` for opaque tensors.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bsr_cli.core import wire
from bsr_cli.core.units import canonical_dtype, dtype_bytes
from bsr_cli.errors import InvalidInput

_REG_HINT = "docs/registration.md describes the format; `bsr registration show demo --json` prints a valid one"

DEFAULT_CHUNK_SIZE = 256
# Anything above this per chunk per rank is a typo, not a model (1 TiB per 256 tokens).
MAX_BYTES_PER_CHUNK = 1 << 40
SCHEMA_VERSION = 1
# The fields of each level; anything else is a typo or a newer schema, refused rather than ignored.
_TOP_KEYS = frozenset({"schema", "model", "tp_size", "world_size", "chunk_size", "aux_bytes", "groups", "tensors"})
_GROUP_KEYS = frozenset({"name", "block_size"})
_TENSOR_KEYS = frozenset({"name", "dtype", "shape", "bytes_per_token", "group"})


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: a block pool with its own block size (vLLM's hybrid allocator groups)."""

    name: str
    block_size: int = 16

    to_wire = wire.writer()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)

    to_wire = wire.writer()


@dataclass(frozen=True)
class Registration:
    model: str
    tp_size: int
    groups: tuple[KVGroup, ...]
    tensors: tuple[TensorSpec, ...]
    chunk_size: int = DEFAULT_CHUNK_SIZE
    # Bytes the restore runtime stages besides chunk payloads (never proportional to the plan). 0 for bsr's own
    # runtime, whose per-window bookkeeping lives outside the pool; a host may declare its own.
    aux_bytes: int = 0
    source: str = field(default="", compare=False, metadata=wire.meta(skip=True))  # where it was read from

    def __post_init__(self) -> None:
        _validate(self)

    # -- accounting coefficients -------------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.tensors)

    @property
    def bytes_per_chunk(self) -> int:
        """c = Σ c_i: bytes of one chunk of every registered tensor on one rank."""
        return self.bytes_per_token * self.chunk_size

    def group_bytes_per_chunk(self, group: str) -> int:
        return sum(t.bytes_per_token for t in self.tensors if t.group == group) * self.chunk_size

    def tensors_of(self, group: str) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.tensors if t.group == group)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    def group(self, name: str) -> KVGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise InvalidInput(f"registration has no KV group {name!r}", hint=f"groups: {', '.join(self.group_names)}")

    # -- identity and serialisation ------------------------------------------------------------------------------
    @property
    def schema(self) -> int:
        """The schema version this registration is written in (docs/registration.md)."""
        return SCHEMA_VERSION

    # The documented schema (what a registration file holds); ``from_dict`` reads it back, strictly.
    to_wire = wire.writer(order=("schema", "model", "tp_size", "chunk_size", "aux_bytes", "groups", "tensors"))
    to_dict = to_wire  # the older name, which hosts and tests use

    @property
    def identity(self) -> str:
        """A stable hash of everything that decides object layout: two registrations with the same identity
        stage and install identical bytes. The model name is included (it is part of every chunk key)."""
        canonical = json.dumps(self.to_wire(), sort_keys=True, separators=(",", ":"))
        return "reg-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "") -> Registration:
        if not isinstance(data, Mapping):
            raise InvalidInput(f"{source or 'registration'}: expected an object at the top level", hint=_REG_HINT)
        where = source or "registration"
        schema = data.get("schema", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise InvalidInput(
                f"{where}: registration schema {schema!r} is not supported (this bsr reads schema {SCHEMA_VERSION})",
                hint="upgrade bsr, or write the registration in the documented schema (docs/registration.md)",
            )
        unknown = sorted(str(k) for k in set(data) - _TOP_KEYS)
        if unknown:
            raise InvalidInput(
                f"{where}: unknown registration field(s) {', '.join(unknown)}",
                hint=f"fields: {', '.join(sorted(_TOP_KEYS))} (docs/registration.md)",
            )
        try:
            groups_raw = data.get("groups")
            tensors_raw = data["tensors"]
            if not isinstance(tensors_raw, list):
                raise InvalidInput(f"{where}: 'tensors' must be a list", hint=_REG_HINT)
            tensors = tuple(_tensor_from_dict(t, where) for t in tensors_raw)
            if groups_raw is None:
                # Groups may be implied by the tensors (block size 16, vLLM's default).
                names = list(dict.fromkeys(t.group for t in tensors))
                groups = tuple(KVGroup(n) for n in names)
            else:
                if not isinstance(groups_raw, list):
                    raise InvalidInput(f"{where}: 'groups' must be a list", hint=_REG_HINT)
                for g in groups_raw:
                    if isinstance(g, Mapping) and set(g) - _GROUP_KEYS:
                        raise InvalidInput(
                            f"{where}: group {g.get('name')!r}: unknown field(s) "
                            + ", ".join(sorted(str(k) for k in set(g) - _GROUP_KEYS)),
                            hint=_REG_HINT,
                        )
                groups = tuple(
                    KVGroup(str(g["name"]), _positive_int(g.get("block_size", 16), f"{where}: block_size"))
                    for g in groups_raw
                )
            return cls(
                model=str(data.get("model", "unknown")),
                tp_size=_positive_int(data.get("tp_size", data.get("world_size", 1)), f"{where}: tp_size"),
                chunk_size=_positive_int(data.get("chunk_size", DEFAULT_CHUNK_SIZE), f"{where}: chunk_size"),
                aux_bytes=_nonneg_int(data.get("aux_bytes", 0), f"{where}: aux_bytes"),
                groups=groups,
                tensors=tensors,
                source=source,
            )
        except KeyError as e:
            raise InvalidInput(f"{where}: missing field {e.args[0]!r}", hint=_REG_HINT) from None
        except (TypeError, AttributeError):
            raise InvalidInput(f"{where}: malformed registration (see docs/registration.md)", hint=_REG_HINT) from None


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str | float):
        raise InvalidInput(f"{what} must be a positive integer, got {value!r}", hint=_REG_HINT)
    try:
        n = int(value)
    except ValueError:
        raise InvalidInput(f"{what} must be a positive integer, got {value!r}", hint=_REG_HINT) from None
    if n != float(value) or n <= 0:
        raise InvalidInput(f"{what} must be a positive integer, got {value!r}", hint=_REG_HINT)
    return n


def _nonneg_int(value: Any, what: str) -> int:
    if value in (0, "0"):
        return 0
    return _positive_int(value, what)


def _tensor_from_dict(t: Any, where: str) -> TensorSpec:
    if not isinstance(t, Mapping):
        raise InvalidInput(f"{where}: each tensor must be an object", hint=_REG_HINT)
    name = str(t.get("name", "")).strip()
    if not name:
        raise InvalidInput(f"{where}: a tensor has no name", hint=_REG_HINT)
    extra = set(t) - _TENSOR_KEYS
    if extra:
        raise InvalidInput(
            f"{where}: tensor {name!r}: unknown field(s) {', '.join(sorted(str(k) for k in extra))}", hint=_REG_HINT
        )
    dtype = canonical_dtype(t.get("dtype", "bf16"))
    if "shape" in t:
        shape_raw = t["shape"]
        if not isinstance(shape_raw, list | tuple) or not shape_raw:
            raise InvalidInput(f"{where}: tensor {name!r}: shape must be a non-empty list", hint=_REG_HINT)
        shape = tuple(_positive_int(d, f"{where}: tensor {name!r} shape") for d in shape_raw)
    elif "bytes_per_token" in t:
        n = _positive_int(t["bytes_per_token"], f"{where}: tensor {name!r} bytes_per_token")
        size = dtype_bytes(dtype)
        if n % size:
            raise InvalidInput(
                f"{where}: tensor {name!r}: {n} bytes per token is not a multiple of {dtype}", hint=_REG_HINT
            )
        shape = (n // size,)
    else:
        raise InvalidInput(f"{where}: tensor {name!r} needs 'shape' or 'bytes_per_token'", hint=_REG_HINT)
    return TensorSpec(name=name, dtype=dtype, shape=shape, group=str(t.get("group", "default")))


def _validate(r: Registration) -> None:
    where = r.source or "registration"
    if r.chunk_size <= 0:
        raise InvalidInput(f"{where}: chunk_size must be positive", hint=_REG_HINT)
    if r.tp_size <= 0:
        raise InvalidInput(f"{where}: tp_size must be positive", hint=_REG_HINT)
    if not r.tensors:
        raise InvalidInput(f"{where}: registration has no tensors", hint="a registration needs at least one KV tensor")
    if not r.groups:
        raise InvalidInput(f"{where}: registration has no KV groups", hint=_REG_HINT)
    names = [g.name for g in r.groups]
    if len(set(names)) != len(names):
        raise InvalidInput(f"{where}: duplicate KV group names", hint=_REG_HINT)
    for g in r.groups:
        if g.block_size <= 0:
            raise InvalidInput(f"{where}: group {g.name!r}: block_size must be positive", hint=_REG_HINT)
        if r.chunk_size % g.block_size:
            raise InvalidInput(
                f"{where}: group {g.name!r}: chunk_size {r.chunk_size} is not a multiple of block_size {g.block_size}",
                hint="a window must cover whole destination blocks of every group",
            )
    seen: set[str] = set()
    for t in r.tensors:
        if t.name in seen:
            raise InvalidInput(f"{where}: duplicate tensor name {t.name!r}", hint=_REG_HINT)
        seen.add(t.name)
        if t.group not in names:
            raise InvalidInput(f"{where}: tensor {t.name!r} names unknown group {t.group!r}", hint=_REG_HINT)
    for name in names:
        if not any(t.group == name for t in r.tensors):
            raise InvalidInput(f"{where}: group {name!r} has no tensors", hint=_REG_HINT)
    if r.bytes_per_chunk > MAX_BYTES_PER_CHUNK:
        raise InvalidInput(f"{where}: {r.bytes_per_chunk} bytes per chunk is absurd (over 1 TiB)", hint=_REG_HINT)


@dataclass(frozen=True)
class RegistrationDiff:
    added: tuple[TensorSpec, ...]
    removed: tuple[TensorSpec, ...]
    changed: tuple[tuple[TensorSpec, TensorSpec], ...]
    settings: tuple[tuple[str, Any, Any], ...]  # (field, a, b) for model/tp/chunk/aux/groups
    bytes_per_chunk: tuple[int, int]

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.settings)


def diff_registrations(a: Registration, b: Registration) -> RegistrationDiff:
    by_a = {t.name: t for t in a.tensors}
    by_b = {t.name: t for t in b.tensors}
    added = tuple(t for n, t in by_b.items() if n not in by_a)
    removed = tuple(t for n, t in by_a.items() if n not in by_b)
    changed = tuple((by_a[n], by_b[n]) for n in by_a if n in by_b and by_a[n] != by_b[n])
    settings = []
    for name in ("model", "tp_size", "chunk_size", "aux_bytes"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            settings.append((name, x, y))
    ga = [(g.name, g.block_size) for g in a.groups]
    gb = [(g.name, g.block_size) for g in b.groups]
    if ga != gb:
        settings.append(("groups", ga, gb))
    return RegistrationDiff(added, removed, changed, tuple(settings), (a.bytes_per_chunk, b.bytes_per_chunk))
