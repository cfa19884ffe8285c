"""Byte sizes as the benchmarks' command lines and tables write them (``64K``, ``16M``)."""
from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", MiB), ("K", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
