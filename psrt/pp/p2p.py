"""Activations and their gradients between neighbouring pipeline stages.

Every message is a small header (message id, dtype, shape) followed by the
payload, both on the PP set's own host communicator (not the engine's).  The
receiver allocates from the header, so it never needs to know shapes in
advance, and checks the id against what its schedule expects next and, for
gradients, the shape against the activation it sent: a disagreement between
stages is an error naming both sides, never a truncated buffer or a hang.

Sends never block and receives do: the execution model the schedule checker
proves deadlock-free.  NCCL's sends block until the peer receives, under which
1F1B's crossing sends deadlock unless each is fused with the opposite receive
(Megatron's ``batch_isend_irecv``); until psrt does that, CUDA activations are
staged through host memory and travel over MPI.
"""
from __future__ import annotations

import torch

from psrt import runtime
from psrt.comm.base import Request, all_of
from psrt.errors import CommunicationError
from psrt.topology import ProcessSet

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8
FORWARD_TAG, BACKWARD_TAG = 11, 12


def message_id(microbatch: int, stage: int) -> int:
    """What a message carries, as one int: the micro-batch and the sending virtual stage."""
    return microbatch * 1_000_000 + stage


def describe_id(ident: int) -> str:
    microbatch, stage = divmod(ident, 1_000_000)
    return f"micro-batch {microbatch} from virtual stage {stage}"


class StageLink:
    """Sends and receives of one pipeline rank over the PP process set."""

    def __init__(self, process_set: ProcessSet) -> None:
        """Collective over the PP set (it opens the set's own communicator)."""
        current = runtime.current()
        self._host = current.topology.direct(process_set)
        self._ranks = current.topology.ranks_of(process_set)
        self._watchdog = current.watchdog

    def send(self, tensor: torch.Tensor, dest: int, tag: int, ident: int) -> Request:
        """Start sending ``tensor`` to set rank ``dest``; keep the request until it completes."""
        if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
            raise CommunicationError(f"pipeline stages exchange floating-point tensors of at most {_MAX_DIMS} "
                                     f"dimensions, got {tensor.dtype} of shape {tuple(tensor.shape)}")
        payload = tensor.detach().contiguous()
        if payload.is_cuda:
            payload = payload.cpu()
        shape = list(payload.shape) + [-1] * (_MAX_DIMS - payload.dim())
        header = torch.tensor([ident, _DTYPES.index(payload.dtype), payload.dim(), *shape], dtype=torch.int64)
        return all_of([self._host.isend(header, dest, tag), self._host.isend(payload, dest, tag)])

    def recv(self, source: int, tag: int, ident: int, device: torch.device,
             like: torch.Tensor | None = None) -> torch.Tensor:
        """Receive the next message from set rank ``source``; it must be ``ident`` and, when
        ``like`` is given, have its shape and dtype."""
        header = torch.empty(3 + _MAX_DIMS, dtype=torch.int64)
        with self._watchdog.waiting("a pipeline message",
                                    lambda: f"pipeline rank {self._host.rank}'s receive of {describe_id(ident)} "
                                            f"from pipeline rank {source} (world rank {self._ranks[source]})",
                                    (self._ranks[source],)):
            self._host.recv(header, source, tag)
        got, dtype_index, ndim, *dims = header.tolist()
        shape, dtype = tuple(dims[:ndim]), _DTYPES[dtype_index]
        # the payload is taken off the link even when it is refused, so nothing is left behind
        # for a later receive to match
        tensor = torch.empty(shape, dtype=dtype)
        self._host.recv(tensor, source, tag)
        if got != ident:
            raise CommunicationError(f"pipeline rank {self._host.rank} expected {describe_id(ident)} but rank "
                                     f"{source} sent {describe_id(got)}: the stages run different schedules")
        if like is not None and (shape != tuple(like.shape) or dtype != like.dtype):
            raise CommunicationError(
                f"pipeline rank {self._host.rank}: the gradient of {describe_id(ident)} from rank {source} has "
                f"shape {shape} ({dtype}) but the activation it belongs to has shape {tuple(like.shape)} "
                f"({like.dtype})")
        return tensor.to(device)
