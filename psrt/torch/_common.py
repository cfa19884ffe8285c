"""Pieces shared by every collective of the torch API."""
from __future__ import annotations

from typing import Callable

import torch

from psrt import runtime
from psrt.comm.base import Communicator, Request
from psrt.topology import ProcessSet
from psrt.torch.agreement import Descriptor, check_agreement
from psrt.torch.handles import Pending, register


def communicator(process_set: ProcessSet) -> Communicator:
    """The caller's host communicator for ``process_set`` (raises before init or for
    non-members); agreement checks and size exchanges run on it whatever the device."""
    return runtime.current().topology.communicator(process_set)


def transport(process_set: ProcessSet, tensor: torch.Tensor, host: Communicator) -> Communicator:
    """The communicator that carries ``tensor``'s data: ``host`` (MPI) for CPU tensors, the
    set's NCCL communicator for CUDA tensors."""
    if tensor.is_cpu:
        return host
    return runtime.current().topology.transport(process_set, tensor.device)


def agree(comm: Communicator, name: str | None, descriptor: Descriptor) -> None:
    """Cross-rank argument check, unless disabled with ``PSRT_CHECK_CONSISTENCY=0``."""
    if runtime.current().config.check_consistency:
        check_agreement(comm, name, descriptor)


def contiguous_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when contiguous (zero copy), else a contiguous copy."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def write_back(target: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Copy a result computed in ``buffer`` into ``target`` unless they are the same tensor."""
    if buffer is not target:
        target.copy_(buffer)
    return target


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place; integers are scaled in float64 and truncated, as Horovod does."""
    if factor == 1.0:
        return
    if tensor.is_floating_point():
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.double().mul_(factor))


def postscale_(tensor: torch.Tensor, average: bool, factor: float, set_size: int) -> None:
    """Apply the postscale factor and, for Average, the division by the set size.

    Integer averages use floor division, as Horovod does.
    """
    if average and not tensor.is_floating_point():
        scale_(tensor, factor)
        tensor.floor_divide_(set_size)
    else:
        scale_(tensor, factor / set_size if average else factor)


def run(request: Request, finish: Callable[[], object], blocking: bool) -> object:
    """Either wait and return the output, or register it and return a handle."""
    pending = Pending(request, finish)
    return pending.result() if blocking else register(pending)
