"""How much a call raised this process's peak resident memory (Linux: ``/proc/self``)."""
from __future__ import annotations

import ctypes
import gc
import re
from typing import Callable, TypeVar

T = TypeVar("T")


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024


def _release_freed_memory() -> None:
    """Hand the memory freed so far back to the system, so that the call cannot reuse it
    unseen (glibc keeps freed blocks resident for the next allocations)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what it keeps, it keeps
        pass


def peak_growth(call: Callable[[], T]) -> tuple[T, int]:
    """``call()``'s result and the bytes by which resident memory peaked above what it was
    before the call (memory freed before is handed back to the system, and the peak, VmHWM,
    reset to the resident memory, first)."""
    _release_freed_memory()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from what is resident now
    before = _resident_bytes("VmRSS")
    result = call()
    return result, _resident_bytes("VmHWM") - before
