"""Broadcast on torch CPU tensors, Horovod-compatible: out-of-place (differentiable),
in-place and asynchronous forms.

``root_rank`` is a world rank that must be a member of the process set, as in
Horovod.  The gradient of a broadcast is the Average over ranks of the output's
gradient on the root, zeros elsewhere.
"""
from __future__ import annotations

import torch

from psrt import runtime
from psrt.engine import Channel, Work
from psrt.runtime import global_process_set
from psrt.runtime import rank as world_rank
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.collectives._differentiable import derived, tracked
from psrt.torch.collectives.allreduce import allreduce
from psrt.torch.ops import ReduceOp
from psrt.torch.validation import check_root


def _broadcast(tensor, root_rank, name, process_set, in_place, blocking):
    tensor = _common.prepare(tensor, name)
    current = runtime.current()
    channel = current.channel(process_set)
    root = check_root(root_rank, channel.ranks)
    return _common.submit(current, channel, broadcast_work(channel, tensor, root, name, in_place), blocking)


def broadcast_work(channel: Channel, tensor: torch.Tensor, root_rank: int, name: str | None, in_place: bool) -> Work:
    """The work giving every rank world rank ``root_rank``'s ``tensor``: into ``tensor`` itself
    (``in_place``), else into a new tensor; either is the work's output."""
    if in_place:
        buffer = _common.contiguous_buffer(tensor)
        target = tensor
    else:
        buffer = target = tensor.detach().clone(memory_format=torch.contiguous_format)
    return channel.broadcast(buffer, root_rank, name=name, finish=lambda _: _common.write_back(target, buffer))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: a dense tensor; its shape, dtype and device must be the same on every rank
        (its values matter on the root only).
    :param root_rank: the rank whose values everyone gets: a world rank (as in Horovod) that
        is a member of ``process_set``, the same on every rank.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to broadcast to: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: ``tensor``, holding the root's values.
    """
    return _broadcast(tensor, root_rank, name, process_set, True, True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`broadcast`; ``synchronize(handle)`` returns a new tensor holding
    ``root_rank``'s values.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: a dense tensor; its shape, dtype and device must be the same on every rank
        (its values matter on the root only).
    :param root_rank: the rank whose values everyone gets: a world rank (as in Horovod) that
        is a member of ``process_set``, the same on every rank.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to broadcast to: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _broadcast(tensor, root_rank, name, process_set, False, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`broadcast_`; ``synchronize(handle)`` returns ``tensor``, overwritten with
    ``root_rank``'s values (do not touch it until then).

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: a dense tensor; its shape, dtype and device must be the same on every rank
        (its values matter on the root only).
    :param root_rank: the rank whose values everyone gets: a world rank (as in Horovod) that
        is a member of ``process_set``, the same on every rank.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to broadcast to: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _broadcast(tensor, root_rank, name, process_set, True, False)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast forward; backward gives the root the Average of the gradients, others zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.name, ctx.process_set = root_rank, name, process_set
        return _broadcast(tensor, root_rank, name, process_set, False, True)

    @staticmethod
    def backward(ctx, grad):
        averaged = allreduce(grad, name=derived(ctx.name, "grad"), op=ReduceOp.Average, process_set=ctx.process_set)
        if world_rank() != ctx.root_rank:  # root_rank is a world rank, as in Horovod
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s tensor (a world rank in the set), differentiably: the
    gradient is the Average over ranks of the output's gradient on the root, zeros elsewhere.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: a dense tensor; its shape, dtype and device must be the same on every rank
        (its values matter on the root only).
    :param root_rank: the rank whose values everyone gets: a world rank (as in Horovod) that
        is a member of ``process_set``, the same on every rank.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to broadcast to: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: a new tensor holding the root's values.
    """
    if not tracked((tensor,)):
        return _broadcast(tensor, root_rank, name, process_set, False, True)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
