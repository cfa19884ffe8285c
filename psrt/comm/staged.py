"""CUDA tensors carried through host memory, for ranks that share one GPU.

NCCL refuses a communicator in which two ranks sit on the same device ("Duplicate GPU
detected"), so several ranks on one GPU (a laptop, a test machine, a GPU split between
jobs) cannot use :class:`~psrt.comm.nccl.NcclCommunicator`.  :func:`device_transport`
asks the group's members which device each uses and gives them NCCL where every member has
a device of its own, and otherwise a :class:`HostStagedCommunicator`: each CUDA tensor is
copied to host memory, carried by the group's MPI communicator, and copied back, the way
pipeline activations and context-parallel blocks already travel.  Every member of a group
gets the same kind of transport, since they all see the same answer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from psrt.comm import streams
from psrt.comm.base import Communicator, Persistent, ElementwiseOp, Request, then
from psrt.comm.nccl import NcclCommunicator


def shares_a_device(identities: Sequence[object]) -> bool:
    """True when two members of a group named the same device."""
    return len(set(identities)) < len(identities)


def device_transport(host: Communicator, device: torch.device) -> Communicator:
    """The communicator for CUDA tensors on ``device`` over the ranks of ``host``: NCCL
    where the members' devices are distinct, host staging where two share one.  Collective
    over ``host``: every member calls it at the same point."""
    if shares_a_device(host.allgather_object(streams.api().identity(device))):
        return HostStagedCommunicator(host)
    return NcclCommunicator(host, device)


class HostStagedCommunicator(Communicator):
    """:class:`Communicator` for CUDA tensors over an MPI communicator: each call copies its
    CUDA inputs into pinned host memory on the calling thread's current stream (the engine's
    communication stream, so compute goes on meanwhile), waits for that copy (MPI reads host
    memory: one of the host waits docs/concepts/gpu-streams.md lists), runs the host
    collective, and copies the result back on the same stream when its request completes.
    The caller must wait for (or test until done) every request it starts, since the copy
    back is enqueued then; ``host`` stays owned by whoever made it."""

    def __init__(self, host: Communicator, owns_host: bool = False) -> None:
        self._host = host
        self._owns_host = owns_host
        self.rank, self.size, self.max_tag = host.rank, host.size, host.max_tag

    @staticmethod
    def _staged(tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of a CUDA input (the tensor itself on the host)."""
        if not tensor.is_cuda:
            return tensor
        staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staged.copy_(tensor.detach(), non_blocking=True)
        cuda = streams.api()
        cuda.host_wait(cuda.record(cuda.current(tensor.device)), "host staging: MPI reads the device's "
                       "tensor from host memory")
        return staged

    @staticmethod
    def _landing(tensor: torch.Tensor) -> torch.Tensor:
        """Pinned host memory for a CUDA output (the tensor itself on the host)."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) if tensor.is_cuda else tensor

    @staticmethod
    def _back(request: Request, device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> Request:
        if host_tensor is device_tensor:
            return request
        # Pinned memory used by a non-blocking copy is not reused before the copy has run.
        return then(request, lambda: device_tensor.copy_(host_tensor, non_blocking=True))

    # -- collectives ---------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        self.iallreduce(tensor, op, scale).wait()

    def iallreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> Request:
        staged = self._staged(tensor)
        return self._back(self._host.iallreduce(staged, op, scale), tensor, staged)

    def persistent_allreduce(self, tensor: torch.Tensor, op: ElementwiseOp) -> Persistent:
        return Persistent(lambda: self.iallreduce(tensor, op))

    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> Request:
        into = self._landing(recv)
        return self._back(self._host.allgatherv(self._staged(send), into, counts), recv, into)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        staged = self._staged(tensor)
        return self._back(self._host.broadcast(staged, root), tensor, staged)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int],
                  recv: torch.Tensor, recv_counts: Sequence[int]) -> Request:
        into = self._landing(recv)
        return self._back(self._host.alltoallv(self._staged(send), send_counts, into, recv_counts), recv, into)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                       counts: Sequence[int], op: ElementwiseOp) -> Request:
        into = self._landing(recv)
        return self._back(self._host.reduce_scatter(self._staged(send), into, counts, op), recv, into)

    def barrier(self) -> Request:
        if torch.cuda.is_initialized():
            cuda = streams.api()
            cuda.host_wait_stream(cuda.current(torch.device("cuda")), "a barrier: the host passes it once "
                                  "the work queued before it has run")
        return self._host.barrier()

    # -- point to point -----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        staged = self._staged(tensor)  # kept alive by the host request until it completes
        return self._host.isend(staged, dest, tag)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        into = self._landing(tensor)
        return self._back(self._host.irecv(into, source, tag), tensor, into)

    # -- host-side pieces ---------------------------------------------------------------
    def exchange_counts(self, counts: Sequence[int]) -> list[int]:
        return self._host.exchange_counts(counts)

    def allgather_object(self, obj: object) -> list:
        return self._host.allgather_object(obj)

    def split(self, color: int | None, key: int = 0) -> HostStagedCommunicator | None:
        host = self._host.split(color, key)
        return None if host is None else HostStagedCommunicator(host, owns_host=True)

    def free(self) -> None:
        if self._owns_host:
            self._host.free()
