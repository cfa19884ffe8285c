"""Pieces shared by every collective of the torch API: turning a call into engine work.

Each public collective looks the current runtime up once (it is an API edge, as Horovod's
free functions are) and hands it to these pieces, which never look it up themselves."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from psrt.comm.base import Communicator
from psrt.engine import Announcement, Descriptor, Reduction, Work
from psrt.runtime import Runtime
from psrt.topology import ProcessSet
from psrt.torch.validation import check_name, check_tensor


def set_ranks(current: Runtime, process_set: ProcessSet) -> list[int]:
    """The world ranks of ``process_set``; raises for an unregistered set, or when the
    caller is not a member."""
    topology = current.topology
    topology.communicator(process_set)
    return topology.ranks_of(process_set)


def prepare(tensor: object, name: object) -> torch.Tensor:
    """Validate on the calling rank (before the runtime is looked up: bad input fails the
    same with or without ``init()``); returns the tensor."""
    tensor = check_tensor(tensor)
    check_name(name)
    return tensor


def tensor_work(current: Runtime, collective: str, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet, ranks: list[int], agreed: dict, execute, finish=lambda value: value):
    """An engine work whose ranks must agree on dtype, device and ``agreed``."""
    descriptor = (("dtype", tensor.dtype), ("device", tensor.device.type), *agreed.items())
    return make_work(current, collective, name, process_set, ranks, descriptor, tensor.device,
                             execute=execute, finish=finish)


def rows_and_tail(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """First dimension and the rest; a 0-d tensor counts as one row."""
    return (1, ()) if tensor.dim() == 0 else (tensor.shape[0], tuple(tensor.shape[1:]))


def make_work(current: Runtime, collective: str, name: str | None, process_set: ProcessSet, ranks: Sequence[int],
              descriptor: Descriptor, device: torch.device, *,
              buffers: list[torch.Tensor] | None = None, reduction: Reduction | None = None,
              execute: Callable[[Communicator, Communicator], object] | None = None,
              finish: Callable[[object], object] = lambda value: value) -> Work:
    """A work for the engine (see :func:`announce`)."""
    return Work(announce(current, collective, name, process_set, ranks, descriptor, reduction), device=device,
                buffers=buffers, execute=execute, finish=finish)


def announce(current: Runtime, collective: str, name: str | None, process_set: ProcessSet, ranks: Sequence[int],
             descriptor: Descriptor, reduction: Reduction | None = None) -> Announcement:
    """What ranks negotiate about a call.  Unnamed ops get Horovod's counter-based name (see
    :mod:`psrt.engine.names`) and stay out of the response cache, since their names never
    repeat."""
    names = current.names
    return Announcement(
        key=(process_set.process_set_id, name if name is not None else names.unnamed(collective)),
        ranks=tuple(ranks), descriptor=(("collective", collective), *descriptor),
        reduction=reduction, cacheable=name is not None)


def remembered(current: Runtime, signature: tuple) -> object:
    """What an earlier call with the same signature worked out (see :func:`remember`)."""
    return current.announcements.get(signature)


def remember(current: Runtime, signature: tuple, known: object) -> None:
    """Keep what a call worked out (its announcement, ...) for later calls whose arguments
    give the same ``signature``; on the runtime, so a new runtime starts afresh, and
    bounded like the response cache, whose entries these mostly are."""
    if len(current.announcements) < current.config.cache_capacity:
        current.announcements[signature] = known


def submit(current: Runtime, work: Work, blocking: bool) -> object:
    """Hand a work to the engine and return a handle, or run it (on this thread, see
    :meth:`Engine.run`) and return its output."""
    return current.engine.run(work) if blocking else current.handles.register(current.engine.submit(work))


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

    An integer Average is rounded toward zero (-75 / 2 = -37), as Horovod's is: it scales
    the sum by ``factor / size`` in float64 and truncates.  Here the division by the size
    is exact integer arithmetic, so a sum that is a multiple of the size is never rounded
    down by a float64 reciprocal (49 * (1 / 49) < 1).
    """
    if average and not tensor.is_floating_point():
        scale_(tensor, factor)
        tensor.div_(set_size, rounding_mode="trunc")
    else:
        scale_(tensor, factor / set_size if average else factor)
