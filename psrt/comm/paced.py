"""How a communicator's large allreduces wait, agreed by its ranks.

A blocking MPI allreduce is the fastest on a host with cores to spare.  On a crowded one
(:mod:`psrt.comm.crowding`) its spin holds the core the other ranks need and the call slows
to the scheduler's time slices; MPI's non-blocking call waited for by napping
(:func:`psrt.comm.poll.wait_politely`) does not.  A blocking collective and a non-blocking
one do not match in MPI, so every rank must choose the same for each call: :class:`Pace`
agrees on it.  Allreduces below :data:`PACED_BYTES` always block: one exchange, where a nap
would cost more than it saves.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from psrt.comm.crowding import crowded
from psrt.comm.mpi_requests import MpiRequest
from psrt.comm.poll import wait_politely

__all__ = ["PACED_BYTES", "Pace"]

#: Allreduces from this size wait as the ranks agree; smaller ones always block.
PACED_BYTES = 64 << 10


class Pace:
    """A communicator's large allreduces: blocking, or napping while any rank's host is
    crowded.  Collectives reach a communicator in the same order on every rank, so the ranks
    count their large allreduces, and at every :data:`AGREE_EVERY`-th they agree on the choice
    for the next ones (the largest of their verdicts, in one allreduce of an integer on
    ``agree_on``, a communicator of the same ranks that carries no other collective)."""

    AGREE_EVERY = 16
    __slots__ = ("_comm", "_calls", "_crowded", "_verdict")

    def __init__(self, agree_on: MPI.Comm) -> None:
        self._comm, self._calls, self._crowded = agree_on, 0, False
        self._verdict = np.zeros(1, np.int32)

    def allreduce(self, comm: MPI.Comm, spec: list, op: MPI.Op, what: str) -> None:
        """One in-place allreduce of ``spec`` on ``comm`` (the paced communicator, ``what`` its
        description), blocking or napping as agreed; a blocking call's MPI failures are left
        to the caller."""
        self._calls += 1
        if self._calls % self.AGREE_EVERY == 0:
            self._verdict[0] = crowded()
            self._comm.Allreduce(MPI.IN_PLACE, self._verdict, MPI.MAX)
            self._crowded = bool(self._verdict[0])
        if self._crowded:
            wait_politely(MpiRequest(comm.Iallreduce(MPI.IN_PLACE, spec, op), what))
        else:
            comm.Allreduce(MPI.IN_PLACE, spec, op)
