"""Timing a window of training steps the same way in every benchmark that alternates
implementations."""
from __future__ import annotations

import time
from typing import Callable


def timed_window(comm, step: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds per step over ``steps`` steps after ``warmup`` untimed ones, the slowest rank's
    of the mpi4py communicator ``comm``.  The times are gathered with ``allgather``, not with
    mpi4py's pickled ``allreduce``: that one holds the GIL while it waits, and psrt's engine
    thread in this rank may have to answer a slower rank's negotiation round meanwhile."""
    for _ in range(warmup):
        step()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return max(comm.allgather((time.perf_counter() - start) / steps))
