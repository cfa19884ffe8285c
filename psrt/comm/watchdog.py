"""Stall reports for communication the caller's thread runs itself (tensor-parallel
collectives, pipeline messages), which the engine's negotiation never sees.

The caller waits in MPI as usual (no polling on the fast path); it only marks what
it is waiting for.  A daemon thread looks once a second: a wait older than
``PSRT_STALL_CHECK_TIME`` is logged, naming what and whom it waits for, and one
older than ``PSRT_STALL_SHUTDOWN_TIME`` (when set) ends the job with that message,
as the engine does for its own collectives.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

logger = logging.getLogger("psrt")

_LOOK_EVERY_S = 1.0


class Watchdog:
    def __init__(self, check_s: float, shutdown_s: float, end_job: Callable[[str], None]) -> None:
        self._check_s, self._shutdown_s, self._end_job = check_s, shutdown_s, end_job
        self._waits: dict[int, tuple[float, Callable[[], str]]] = {}  # thread id -> (since, what)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @contextmanager
    def waiting(self, what: Callable[[], str]) -> Iterator[None]:
        """Mark the calling thread as waiting on others for ``what()`` (evaluated only if
        the wait becomes a stall)."""
        if self._thread is None:
            self._start()
        ident = threading.get_ident()
        self._waits[ident] = (time.monotonic(), what)
        try:
            yield
        finally:
            self._waits.pop(ident, None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="psrt-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the watching thread (at shutdown)."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _watch(self) -> None:
        reported: set[tuple[int, float]] = set()
        while not self._stopping.wait(_LOOK_EVERY_S):
            now = time.monotonic()
            current = list(self._waits.items())
            reported &= {(ident, since) for ident, (since, _) in current}
            for ident, (since, what) in current:
                waited = now - since
                if waited < self._check_s:
                    continue
                message = f"stall: {what()} has waited {waited:.0f} s (a rank may be stuck, or ranks run " \
                          "different code)"
                if self._shutdown_s > 0 and waited >= self._shutdown_s:
                    self._end_job(f"{message} (PSRT_STALL_SHUTDOWN_TIME={self._shutdown_s:g} s)")
                if (ident, since) not in reported:
                    reported.add((ident, since))
                    logger.warning("psrt: %s", message)
