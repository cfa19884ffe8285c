"""Hierarchical allreduce (Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``) for host tensors.

A flat allreduce over ranks on several hosts sends every rank's data across the
network.  With several ranks per host it pays to reduce on each host first, over
shared memory, onto the host's leader (its lowest world rank); then only the
leaders allreduce across the network, and each leader broadcasts the result to
its host.

Each step is a collective of an ordinary communicator, so dtype widening
(float16/bfloat16 go through float32 and are rounded once), psrt's ring above
the threshold and MPI's error translation are theirs.  Hosts may run different
numbers of ranks: a leader carries its whole host's sum, so no step depends on
the host sizes (Horovod's NCCL variant splits the message among a host's ranks
and therefore needs equal hosts; this one does not).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from psrt.comm.base import Communicator, ElementwiseOp, Request
from psrt.comm.buffers import WIDENED_FOR_REDUCTION

logger = logging.getLogger("psrt")


class HierarchicalCommunicator(Communicator):
    """The flat communicator of a multi-host group, with :meth:`allreduce` done in three
    steps (reduce on the host, allreduce among hosts, broadcast on the host).

    Everything else goes to the flat communicator unchanged; so does :meth:`iallreduce`,
    which nothing issues on a data communicator (the three steps would need a progress
    loop to run without blocking).  It owns its host and leader communicators, which
    :meth:`free` releases, and not the flat one.  One thread at a time may use it.
    """

    def __init__(self, flat: Communicator, host: Communicator, leaders: Communicator | None,
                 forced: bool = True) -> None:
        """``forced``: every allreduce goes in three steps (``PSRT_HIERARCHICAL_ALLREDUCE=1``);
        else only sizes whose band of the flat communicator's tuning table says
        ``"hierarchical"`` (see :mod:`psrt.comm.tuning`), the others go flat."""
        self._flat, self._host, self._leaders = flat, host, leaders  # leaders: None off the leader
        self._forced = forced
        self.rank, self.size, self.max_tag = flat.rank, flat.size, flat.max_tag
        self._scratch = torch.empty(0)  # the leader's host sum, kept to spare an allocation per call
        self.allreduces = 0  # done hierarchically, so that a job can show this path was taken

    def allreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        """As the flat allreduce (same result up to the order floating-point sums are
        added in); every rank must call it with the same element count, dtype and op."""
        if not self._forced and not self._flat.choice.hierarchical(tensor.nbytes):
            self._flat.allreduce(tensor, op, scale)
            return
        self.allreduce_hierarchically(tensor, op, scale)

    def allreduce_hierarchically(self, tensor: torch.Tensor, op: ElementwiseOp = ElementwiseOp.SUM,
                                 scale: float = 1.0) -> None:
        """:meth:`allreduce` in three steps whatever its size (as the tuner measures it)."""
        if tensor.numel() == 0:
            self._flat.allreduce(tensor, op, scale)
            return
        work = (tensor.float() if tensor.dtype in WIDENED_FOR_REDUCTION else tensor).reshape(-1)
        if self._host.size == 1:
            host_sum = work
        else:  # rank 0 of the host (its leader) receives the whole message, the others nothing
            host_sum = self._leader_buffer(work) if self._leaders is not None else work[:0]
            counts = [work.numel()] + [0] * (self._host.size - 1)
            self._host.reduce_scatter(work, host_sum, counts, op).wait()
        if self._leaders is not None:
            self._leaders.allreduce(host_sum, op, scale)  # the scale is applied here only
            if host_sum.data_ptr() != tensor.data_ptr():
                tensor.copy_(host_sum.view(tensor.shape))
        if self._host.size > 1:
            self._host.broadcast(tensor, 0).wait()
        self.allreduces += 1

    def _leader_buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self._scratch.dtype != like.dtype or self._scratch.numel() < like.numel():
            self._scratch = torch.empty(like.numel(), dtype=like.dtype)
        return self._scratch[:like.numel()]

    def iallreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> Request:
        return self._flat.iallreduce(tensor, op, scale)

    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Request:
        return self._flat.allgatherv(send, recv, counts)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        return self._flat.broadcast(tensor, root)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int],
                  recv: torch.Tensor, recv_counts: Sequence[int]) -> Request:
        return self._flat.alltoallv(send, send_counts, recv, recv_counts)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                       counts: Sequence[int], op: ElementwiseOp) -> Request:
        return self._flat.reduce_scatter(send, recv, counts, op)

    def barrier(self) -> Request:
        return self._flat.barrier()

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        return self._flat.isend(tensor, dest, tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        return self._flat.irecv(tensor, source, tag)

    def exchange_counts(self, counts: Sequence[int]) -> list[int]:
        return self._flat.exchange_counts(counts)

    def allgather_object(self, obj: object) -> list:
        return self._flat.allgather_object(obj)

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        return self._flat.split(color, key)

    def free(self) -> None:
        for comm in (self._leaders, self._host):
            if comm is not None:
                comm.free()
        self._scratch = torch.empty(0)


def hierarchical_or_none(world: Communicator, local: Communicator,
                         forced: bool = True) -> HierarchicalCommunicator | None:
    """A hierarchical communicator over ``world`` (``local``: the caller's host), or None
    where it cannot help: one host, or one rank on every host (said in a warning where
    ``forced``, the user having asked for it; else the tuning table chooses, see
    :class:`HierarchicalCommunicator`).

    Collective over ``world``, before anything else uses it (it makes communicators of its
    own, so that its steps never meet another thread's collectives on ``local``).
    """
    sizes = [size for size in world.allgather_object(local.size if local.rank == 0 else None)
             if size is not None]  # one per host, by its leader's world rank
    if len(sizes) < 2 or max(sizes) < 2:
        if world.rank == 0 and forced:
            logger.warning("psrt: hierarchical allreduce is on, but the job runs %s rank(s) per host; it "
                           "helps only with several hosts, some of them running several ranks, so "
                           "allreduces stay flat", "/".join(map(str, sizes)))
        return None
    host = local.split(0, key=local.rank)
    leaders = world.split(0 if local.rank == 0 else None, key=world.rank)
    assert host is not None
    return HierarchicalCommunicator(world, host, leaders, forced)
