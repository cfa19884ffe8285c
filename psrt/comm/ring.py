"""Chunked ring allreduce and reduce-scatter on host buffers.

For large messages a plain ring (reduce-scatter, then all-gather, each step one
``Sendrecv`` per segment plus a reduction) beats Open MPI's own allreduce on
shared memory: each received segment is reduced while still in cache, and no
temporary of the message's size is ever allocated (Open MPI's allocates and
page-faults one on every call above 32 MiB here).  For small
messages MPI's own algorithms win on latency, so the MPI communicator picks
between the two by size (``Config.ring_threshold``).

Every rank must call with the same element count, dtype and op.  On a crowded host each
exchange waits by napping (:func:`_sendrecv`).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from mpi4py import MPI

from psrt.comm.base import all_of
from psrt.comm.crowding import crowded
from psrt.comm.mpi_requests import MpiRequest
from psrt.comm.poll import wait_politely

Reducer = Callable[[np.ndarray, np.ndarray, np.ndarray], None]  # (a, b, out)

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


def _sendrecv(comm: MPI.Comm, send: np.ndarray, dest: int, recv: np.ndarray, source: int, tag: int) -> None:
    """One exchange with the neighbours: MPI's blocking ``Sendrecv`` on a host with cores to
    spare, its non-blocking halves waited for politely on a crowded one, where MPI's own
    wait would take the core the neighbour needs (:mod:`psrt.comm.crowding`; a local choice:
    either matches the neighbour's)."""
    if not crowded():
        comm.Sendrecv(send, dest, tag, recv, source, tag)
        return
    what = f"ring exchange with ranks {source} and {dest}"
    wait_politely(all_of([MpiRequest(comm.Irecv(recv, source, tag), what),
                          MpiRequest(comm.Isend(send, dest, tag), what)]))


def _reduce_into(comm: MPI.Comm, mine: np.ndarray, outgoing: np.ndarray, dest: np.ndarray,
                 left: int, right: int, scratch: np.ndarray, segment: int, rounds: int,
                 reduce: Reducer, scale: float) -> None:
    """Send ``outgoing`` right while receiving the left neighbour's partial sum of the
    block whose local contribution is ``mine``; ``dest = op(mine, received)``.

    Every rank makes the same number of ``rounds`` (the largest block's segment
    count), so a pair of neighbours never disagrees on how many messages pass
    between them; a block with fewer segments sends or receives empty ones.
    A ``scale`` other than 1 multiplies each reduced segment while it is in cache.
    """
    for start in range(0, rounds * segment, segment):
        send_part = outgoing[start:start + segment]
        mine_part = mine[start:start + segment]
        dest_part = dest[start:start + segment]
        incoming = scratch[:mine_part.size]
        _sendrecv(comm, send_part, right, incoming, left, _TAG_REDUCE)
        reduce(mine_part, incoming, dest_part)
        if scale != 1.0:
            np.multiply(dest_part, scale, out=dest_part, casting="unsafe")


def ring_reduce_scatter(comm: MPI.Comm, source: np.ndarray, bounds: list[tuple[int, int]],
                        segment: int, reduce: Reducer, scale: float = 1.0,
                        out: np.ndarray | None = None) -> None:
    """Reduce block ``bounds[(rank + 1) % size]`` of every rank's ``source`` (and scale it).

    Without ``out`` the partial sums are written into ``source`` itself (the first
    half of an in-place allreduce) and the result is left in that block.  With
    ``out``, ``source`` is only read: partial sums go to two block-sized buffers
    (none at all for two ranks) and the result to ``out``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    largest = max(stop - start for start, stop in bounds)
    rounds = -(-largest // segment)
    scratch = np.empty(min(segment, largest), dtype=source.dtype)
    partials = ([np.empty(largest, dtype=source.dtype) for _ in range(2)]
                if out is not None and size > 2 else [])
    outgoing = None
    for step in range(size - 1):
        send_lo, send_hi = bounds[(rank - step) % size]
        recv_lo, recv_hi = bounds[(rank - step - 1) % size]
        mine = source[recv_lo:recv_hi]
        last = step == size - 2
        if out is None:
            outgoing, dest = source[send_lo:send_hi], mine
        else:
            if outgoing is None:
                outgoing = source[send_lo:send_hi]
            dest = out if last else partials[step % 2][:recv_hi - recv_lo]
        _reduce_into(comm, mine, outgoing, dest, left, right, scratch, segment, rounds,
                     reduce, scale if last else 1.0)
        outgoing = dest


def ring_allgather(comm: MPI.Comm, flat: np.ndarray, bounds: list[tuple[int, int]]) -> None:
    """Circulate block ``bounds[(rank + 1) % size]`` of every rank until all hold all blocks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    for step in range(size - 1):
        send_lo, send_hi = bounds[(rank + 1 - step) % size]
        recv_lo, recv_hi = bounds[(rank - step) % size]
        _sendrecv(comm, flat[send_lo:send_hi], right, flat[recv_lo:recv_hi], left, _TAG_GATHER)


def ring_allreduce(comm: MPI.Comm, flat: np.ndarray, segment: int, reduce: Reducer,
                   scale: float = 1.0) -> None:
    """Allreduce the 1-D array ``flat`` in place, then multiply it by ``scale``."""
    bounds = chunk_bounds(flat.size, comm.Get_size())
    ring_reduce_scatter(comm, flat, bounds, segment, reduce, scale)
    ring_allgather(comm, flat, bounds)
