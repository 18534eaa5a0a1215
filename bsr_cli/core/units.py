"""Byte units and dtype sizes."""

from __future__ import annotations

from bsr_cli.errors import InvalidInput

KiB = 1024
MiB = 1024**2
GiB = 1024**3

# Bytes per element, keyed by every spelling an operator is likely to type (vLLM, torch, HF config names).
DTYPE_BYTES: dict[str, int] = {
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# Canonical short names, used in keys and identities so "bfloat16" and "bf16" register identically.
_CANONICAL = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}


def canonical_dtype(name: str) -> str:
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        known = ", ".join(sorted({_CANONICAL.get(k, k) for k in DTYPE_BYTES}))
        raise InvalidInput(f"unknown dtype {name!r}", hint=f"use one of: {known}")
    return _CANONICAL.get(key, key)


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[canonical_dtype(name)]


def format_bytes(n: float | None, *, compact: bool = False, exact: bool = False, unit: str | None = None) -> str:
    """The one byte formatter every reader of bsr sees (CLI tables, the TUI, bench tables and plots).

    By default binary units with two decimals, the way the paper writes them (500.75 MiB); ``compact`` for dense
    panels (4.0 MiB, 512 KiB, 12 GiB); ``exact`` puts the exact count first, as operators quote it
    (525,074,432 (500.75 MiB)); ``unit`` ("MiB", ...) gives the number alone in that unit, for table columns headed
    by it (512, 1,536.50). None reads as a dash.
    """
    if n is None:
        return "—"
    if unit is not None:
        size = _UNITS[unit]
        return f"{int(n) // size:,}" if n % size == 0 else f"{n / size:,.2f}"
    if exact:
        return f"{int(n):,} ({format_bytes(n)})" if abs(n) >= KiB else f"{int(n):,} B"
    n = float(n)
    for name, size in _UNITS.items():
        if abs(n) >= size and size > 1:
            v = n / size
            if compact:
                return f"{v:.0f} {name}" if v >= 100 or (v == int(v) and v >= 10) else f"{v:.1f} {name}"
            return f"{v:.2f} {name}"
    return f"{int(n)} B"


_UNITS = {"TiB": 1024**4, "GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}

_SUFFIXES = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "m": 10**6, "mb": 10**6, "mib": MiB}
_SUFFIXES |= {"g": 10**9, "gb": 10**9, "gib": GiB, "t": 10**12, "tb": 10**12, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """Parse '16GiB', '512 MiB', '1.5G' or a plain integer into bytes."""
    s = str(text).strip().lower().replace("_", "").replace(",", "")
    i = len(s)
    while i > 0 and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    number, suffix = s[:i].strip(), s[i:].strip()
    if not number or suffix not in _SUFFIXES:
        raise InvalidInput(f"cannot read a size from {text!r}", hint="write e.g. 16GiB, 512MiB or 1073741824")
    try:
        value = float(number) * _SUFFIXES[suffix]
    except ValueError:
        raise InvalidInput(
            f"cannot read a size from {text!r}", hint="write a size as 64MiB, 1GiB, 500MB or a number of bytes"
        ) from None
    if value < 0:
        raise InvalidInput(
            f"size must not be negative: {text!r}", hint="write a size as 64MiB, 1GiB, 500MB or a number of bytes"
        )
    return int(value)


def parse_rate(text: str) -> float:
    """Parse a transfer rate in bytes per second: '10.31GB/s', '9.6 GiB/s', '500MB/s' or a plain number."""
    s = str(text).strip()
    body = s[:-2] if s.lower().endswith("/s") else s
    try:
        value = parse_bytes(body) if body.strip() else -1
    except InvalidInput:
        value = -1
    if value <= 0:
        raise InvalidInput(f"cannot read a positive rate from {text!r}", hint="write e.g. 10.31GB/s or 9.6GiB/s")
    return float(value)
