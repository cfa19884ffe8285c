"""Chunked ring allreduce and reduce-scatter on host buffers.

For large messages a plain ring (reduce-scatter, then all-gather, each step one
``Sendrecv`` per segment plus an in-place reduction) beats Open MPI's own
allreduce on shared memory: each received segment is reduced while still in
cache, and no temporary of the message's size is ever allocated.  For small
messages MPI's own algorithms win on latency, so the MPI communicator picks
between the two by size (``Config.ring_threshold``).

Every rank must call with the same element count, dtype and op.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

Reducer = Callable[[np.ndarray, np.ndarray], None]

_TAG_REDUCE = 101
_TAG_GATHER = 102


def chunk_bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _reduce_into(comm: MPI.Comm, chunk: np.ndarray, outgoing: np.ndarray, left: int,
                 right: int, scratch: np.ndarray, segment: int, rounds: int, reduce: Reducer,
                 scale: float) -> None:
    """Send ``outgoing`` right while receiving the left neighbour's ``chunk``, reducing into it.

    Every rank makes the same number of ``rounds`` (the largest block's segment
    count), so a pair of neighbours never disagrees on how many messages pass
    between them; a block with fewer segments sends or receives empty ones.
    A ``scale`` other than 1 multiplies each reduced segment while it is in cache.
    """
    for start in range(0, rounds * segment, segment):
        send_part = outgoing[start:start + segment]
        recv_part = chunk[start:start + segment]
        incoming = scratch[:recv_part.size]
        comm.Sendrecv(send_part, right, _TAG_REDUCE, incoming, left, _TAG_REDUCE)
        reduce(recv_part, incoming)
        if scale != 1.0:
            np.multiply(recv_part, scale, out=recv_part, casting="unsafe")


def ring_reduce_scatter(comm: MPI.Comm, flat: np.ndarray, bounds: list[tuple[int, int]],
                        segment: int, reduce: Reducer, scale: float = 1.0) -> None:
    """Leave the fully reduced (and scaled) block ``bounds[(rank + 1) % size]`` in ``flat``."""
    rank, size = comm.Get_rank(), comm.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    largest = max(stop - start for start, stop in bounds)
    rounds = -(-largest // segment)
    scratch = np.empty(min(segment, largest), dtype=flat.dtype)
    for step in range(size - 1):
        send_lo, send_hi = bounds[(rank - step) % size]
        recv_lo, recv_hi = bounds[(rank - step - 1) % size]
        last = step == size - 2
        _reduce_into(comm, flat[recv_lo:recv_hi], flat[send_lo:send_hi], left, right,
                     scratch, segment, rounds, reduce, scale if last else 1.0)


def ring_allgather(comm: MPI.Comm, flat: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Circulate block ``bounds[(rank + 1) % size]`` of every rank until all hold all blocks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    for step in range(size - 1):
        send_lo, send_hi = bounds[(rank + 1 - step) % size]
        recv_lo, recv_hi = bounds[(rank - step) % size]
        comm.Sendrecv(flat[send_lo:send_hi], right, _TAG_GATHER,
                      flat[recv_lo:recv_hi], left, _TAG_GATHER)


def ring_allreduce(comm: MPI.Comm, flat: np.ndarray, segment: int, reduce: Reducer,
                   scale: float = 1.0) -> None:
    """Allreduce the 1-D array ``flat`` in place, then multiply it by ``scale``."""
    bounds = chunk_bounds(flat.size, comm.Get_size())
    ring_reduce_scatter(comm, flat, bounds, segment, reduce, scale)
    ring_allgather(comm, flat, bounds)
