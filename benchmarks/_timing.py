"""Timing a window of training steps the same way in every benchmark that alternates
implementations."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


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


def median_call_seconds(comm, calls: dict[str, Callable[[], object]], iters: int, blocks: int) -> dict[str, float]:
    """Median over ``iters`` calls of the slowest rank's seconds, per call of ``calls``, on
    the mpi4py communicator ``comm``.  The calls take turns in ``blocks`` blocks (the first
    rotating, so that none always follows the same one), each block after two untimed
    calls, each timed call after a barrier."""
    mine: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for index, block in enumerate(np.array_split(np.arange(iters), blocks)):
        shift = index % len(order)
        for name in order[shift:] + order[:shift]:
            call = calls[name]
            call()
            call()
            for _ in block:
                comm.Barrier()
                start = time.perf_counter()
                call()
                mine[name].append(time.perf_counter() - start)
    from mpi4py import MPI  # here: the benchmarks import it only after psrt has started it

    result = {}
    for name, samples in mine.items():
        times = np.array(samples)
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        result[name] = float(np.median(times))
    return result
