"""Byte sizes as people write them: ``80GiB``, ``16G`` (binary), ``80GB`` (decimal)."""
from __future__ import annotations

import re

from psrt.errors import ArgumentTypeError, InvalidArgumentError

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """An int of bytes, or a string: a number with K, M, G or T (powers of 1024, also written
    KiB, MiB, ...) or KB, MB, GB, TB (powers of 1000)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ArgumentTypeError(f"a memory size must be an int of bytes or a string such as '16GiB', "
                                f"got {type(value).__name__}")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise InvalidArgumentError(f"cannot read {value!r} as a size: write e.g. 16GiB, 16G, 80GB or 1073741824")
        number, prefix, suffix = float(match.group(1)), match.group(2).upper(), match.group(3).upper()
        scale = _DECIMAL[prefix] if suffix == "B" and prefix else _BINARY[prefix]
        value = number * scale
    if not value > 0:
        raise InvalidArgumentError(f"a memory size must be positive, got {value!r}")
    return int(value)


def format_bytes(nbytes: float) -> str:
    """``1.50 GiB``, ``320 MiB``, ``12.0 KiB``, ``512 B``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(nbytes) >= scale:
            value = nbytes / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"
