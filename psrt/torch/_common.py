"""Pieces shared by every collective of the torch API: turning a call into engine work.

Each public collective looks the current runtime up once (it is an API edge, as Horovod's
free functions are), takes its process set's channel (:mod:`psrt.engine.channel`, the API
psrt's own strategies use too) and hands both to these pieces, which never look them up
themselves."""
from __future__ import annotations

import torch

from psrt.engine import Channel, Work
from psrt.engine.channel import Execute, Finish
from psrt.runtime import Runtime
from psrt.torch.validation import check_name, check_tensor


def prepare(tensor: object, name: object) -> torch.Tensor:
    """Validate on the calling rank (before the runtime is looked up: bad input fails the
    same with or without ``init()``); returns the tensor."""
    tensor = check_tensor(tensor)
    check_name(name)
    return tensor


def tensor_work(channel: Channel, collective: str, tensor: torch.Tensor, name: str | None, agreed: dict,
                execute: Execute, finish: Finish | None = None) -> Work:
    """An engine work whose ranks must agree on dtype, device and ``agreed``."""
    descriptor = (("dtype", tensor.dtype), ("device", tensor.device.type), *agreed.items())
    return channel.execute(collective, name, descriptor, tensor.device, execute, finish)


def rows_and_tail(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """First dimension and the rest; a 0-d tensor counts as one row."""
    return (1, ()) if tensor.dim() == 0 else (tensor.shape[0], tuple(tensor.shape[1:]))


def remember(current: Runtime, signature: tuple, known: object) -> None:
    """Keep what a call worked out (its prepared work, ...) for later calls whose arguments
    give the same ``signature`` (looked up in ``current.calls``); on the runtime, so a new
    runtime starts afresh, and bounded like the response cache, whose entries these mostly
    are."""
    if len(current.calls) < current.config.cache_capacity:
        current.calls[signature] = known


def submit(current: Runtime, channel: Channel, work: Work, blocking: bool) -> object:
    """Run ``work`` on this thread and return its output, or start it and return a handle
    (Horovod's: the facade's own, which psrt's strategies never use)."""
    return channel.run(work) if blocking else current.handles.register(channel.start(work))


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
