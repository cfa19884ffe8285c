"""Activations and their gradients between neighbouring pipeline stages.

Every message is a direct-layer message (:meth:`psrt.comm.direct.DirectGroup.send`): a
header (message id, dtype, shape) followed by the payload, on the PP set's own direct group
(not the engine's communicator).  The receiver allocates from the header, so it never
needs to know shapes in advance, and checks the id against what its schedule expects next
and, for gradients, the shape against the activation it sent: a disagreement between
stages is an error naming both sides, never a truncated buffer or a hang.

Sends never block and receives do: the execution model the schedule checker
proves deadlock-free.  NCCL's sends block until the peer receives, under which
1F1B's crossing sends deadlock unless each is fused with the opposite receive
(Megatron's ``batch_isend_irecv``); until psrt does that, CUDA activations are
staged through host memory and travel over MPI.
"""
from __future__ import annotations

import torch

from psrt.comm.base import Request
from psrt.comm.direct import DirectGroup
from psrt.comm.header import MAX_DIMS
from psrt.errors import CommunicationError

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FORWARD_TAG, BACKWARD_TAG = 11, 12
TIED_VALUE_TAG, TIED_GRADIENT_TAG = 13, 14  # a shared parameter's value, owner to copy; its gradient back


def message_id(microbatch: int, stage: int) -> int:
    """What a message carries, as one int: the micro-batch and the sending virtual stage."""
    return microbatch * 1_000_000 + stage


def describe_id(ident: int) -> str:
    microbatch, stage = divmod(ident, 1_000_000)
    return f"micro-batch {microbatch} from virtual stage {stage}"


class StageLink:
    """Sends and receives of one pipeline rank over the PP process set."""

    def __init__(self, group: DirectGroup) -> None:
        """Messages go over the PP set's direct group, made with the set: nothing is opened here."""
        self._group = group

    def send(self, tensor: torch.Tensor, dest: int, tag: int, ident: int) -> Request:
        """Start sending ``tensor`` to set rank ``dest``; keep the request until it completes."""
        if tensor.dtype not in _FLOATS or tensor.dim() > MAX_DIMS:
            raise CommunicationError(f"pipeline stages exchange floating-point tensors of at most {MAX_DIMS} "
                                     f"dimensions, got {tensor.dtype} of shape {tuple(tensor.shape)}")
        payload = tensor.detach()
        return self._group.send(payload.cpu() if payload.is_cuda else payload, dest, tag, ident)

    def recv_tied(self, source: int, tag: int, index: int, like: torch.Tensor) -> torch.Tensor:
        """A shared parameter's value or gradient (``tag``) from set rank ``source``; it must be
        shared parameter ``index`` and have ``like``'s shape and dtype."""
        group, what = self._group, "value" if tag == TIED_VALUE_TAG else "gradient"
        header, tensor = group.recv(source, tag, kind="a shared parameter",
                                    what=lambda: f"pipeline rank {group.rank}'s receive of shared parameter {index}'s "
                                                 f"{what} from pipeline rank {source}")
        if header.ident != index or header.shape != tuple(like.shape) or header.dtype != like.dtype:
            raise CommunicationError(
                f"pipeline rank {group.rank} expected the {what} of shared parameter {index} ({tuple(like.shape)}, "
                f"{like.dtype}) from rank {source}, which sent shared parameter {header.ident} ({header.shape}, "
                f"{header.dtype}): the stages were built from different models")
        return tensor.to(like.device)

    def recv(self, source: int, tag: int, ident: int, device: torch.device,
             like: torch.Tensor | None = None) -> torch.Tensor:
        """Receive the next message from set rank ``source``; it must be ``ident`` and, when
        ``like`` is given, have its shape and dtype."""
        group = self._group
        # the payload is taken off the link even when it is refused, so nothing is left behind
        # for a later receive to match
        header, tensor = group.recv(source, tag, kind="a pipeline message",
                                    what=lambda: f"pipeline rank {group.rank}'s receive of {describe_id(ident)} "
                                                 f"from pipeline rank {source} (world rank {group.ranks[source]})")
        if header.ident != ident:
            raise CommunicationError(f"pipeline rank {group.rank} expected {describe_id(ident)} but rank "
                                     f"{source} sent {describe_id(header.ident)}: the stages run different schedules")
        if like is not None and (header.shape != tuple(like.shape) or header.dtype != like.dtype):
            raise CommunicationError(
                f"pipeline rank {group.rank}: the gradient of {describe_id(ident)} from rank {source} has "
                f"shape {header.shape} ({header.dtype}) but the activation it belongs to has shape "
                f"{tuple(like.shape)} ({like.dtype})")
        return tensor.to(device)
