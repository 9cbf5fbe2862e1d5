"""Byte sizes as humans write them ("64Gi", "512Mi", "1G", "1.5GiB") and back.

Kubernetes quantity suffixes are accepted (Ki Mi Gi Ti binary, k K M G T decimal) plus the
"iB"/"B" spellings people type. Fractions are allowed when the result is a whole number of bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40, "pi": 1 << 50}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtTpP]i?)?(?:[bB])?\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError (with the reason) for garbage, zero, negatives, fractions."""
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r} must be greater than zero")
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 1073741824, 512Mi, 64Gi, 1G, 1.5GiB)")
    number, suffix = match.groups()
    try:
        value = Decimal(number)
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{text!r} is not a size") from exc
    suffix = (suffix or "").lower()
    factor = _BINARY[suffix] if suffix.endswith("i") else _DECIMAL.get(suffix, 1)
    total = value * factor
    if total != total.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    size = int(total)
    if size <= 0:
        raise ValueError(f"{text!r} must be greater than zero")
    return size


def format_bytes(size: float) -> str:
    """Short binary rendering for tables and logs: 1536 -> '1.5 KiB', 64 << 30 -> '64.0 GiB'."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """Latency rendering for tables: µs below 1 ms, ms below 1 s, else seconds."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.2f}s"


def align_up(n: int, a: int) -> int:
    """`n` rounded up to a multiple of `a`."""
    return -(-n // a) * a


def align_down(n: int, a: int) -> int:
    """`n` rounded down to a multiple of `a`."""
    return n // a * a
