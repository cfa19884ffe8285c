"""A Chrome-trace timeline of every tensor's phases, as Horovod writes one.

Rank 0 writes it (its view of negotiation shows when the other ranks caught
up).  Each tensor gets a row; its phases are complete ("X") events:
NEGOTIATE (submitted, not yet in a negotiation round), WAIT_FOR_OTHER_RANKS
(announced, waiting for the rest of its set), QUEUE (agreed, waiting for
earlier work), MEMCPY_IN_FUSION_BUFFER, the collective itself, and
MEMCPY_OUT_FUSION_BUFFER.  The file is streamed as it goes and is valid JSON
once the timeline is stopped (Perfetto and chrome://tracing also read a file
cut short by a crash).
"""
from __future__ import annotations

import json
import threading
import time
from typing import IO

from psrt.errors import InvalidArgumentError


class Timeline:
    """Writes trace events to ``path``; safe to call from the engine and user threads."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False, asked_by: str = "start_timeline()") -> None:
        """``asked_by`` names what gave ``path`` (a variable, a call), for the error when the
        file cannot be created."""
        self.path = path
        self.mark_cycles = mark_cycles
        self._pid = rank
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._origin = time.perf_counter()
        self._file: IO[str] | None = _create(path, asked_by)
        self._file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._first = True
        self._emit({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"psrt rank {rank}"}})

    def _us(self, seconds: float) -> float:
        return round((seconds - self._origin) * 1e6, 3)

    def _emit(self, event: dict) -> None:
        self._file.write(("" if self._first else ",\n") + json.dumps(event))
        self._first = False

    def _row(self, tensor: str) -> int:
        row = self._rows.get(tensor)
        if row is None:
            row = self._rows[tensor] = len(self._rows) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": row,
                        "args": {"name": tensor}})
        return row

    def phase(self, tensor: str, phase: str, start: float, end: float, **args: object) -> None:
        """Record that ``tensor`` spent [start, end] (perf_counter seconds) in ``phase``."""
        with self._lock:
            if self._file is None:
                return
            self._emit({"name": phase, "ph": "X", "pid": self._pid, "tid": self._row(tensor),
                        "ts": self._us(start), "dur": round(max(end - start, 0.0) * 1e6, 3),
                        "args": {"tensor": tensor, **args}})

    def cycle(self, at: float) -> None:
        """An instant marker at the start of an engine cycle (if cycles are marked)."""
        if not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._emit({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": self._pid,
                            "tid": 0, "ts": self._us(at)})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]}\n")
                self._file.close()
                self._file = None


def _create(path: str, asked_by: str) -> IO[str]:
    try:
        return open(path, "w")
    except OSError as exc:
        raise InvalidArgumentError(f"{asked_by}: cannot write the timeline to {path!r} ({exc.strerror or exc}); "
                                   "rank 0 writes it, so its directory must exist on rank 0's host and be "
                                   "writable") from None
