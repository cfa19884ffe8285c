"""Alltoall on torch CPU tensors, Horovod-compatible: blocking (differentiable) and
asynchronous forms.

Ranks learn each other's splits when the collective runs; the trailing dimensions,
dtype and device must agree.  The gradient sends each gradient block back where its
rows came from.
"""
from __future__ import annotations

import math

import torch

from psrt.comm.base import Communicator
from psrt.errors import InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt import runtime
from psrt.torch import _common
from psrt.torch.collectives._differentiable import derived, tracked
from psrt.torch.validation import check_splits


def _alltoall(tensor, splits, name, process_set, blocking):
    tensor = _common.prepare(tensor, name)
    current = runtime.current()
    channel = current.channel(process_set)
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    rows, tail = _common.rows_and_tail(tensor)
    splits = check_splits(splits, rows, channel.size)
    send = _common.contiguous_buffer(tensor).reshape(-1)
    row = math.prod(tail)

    def execute(host: Communicator, data: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        received = host.exchange_counts(splits)
        output = torch.empty((sum(received), *tail), dtype=tensor.dtype, device=tensor.device)
        data.alltoallv(send, [s * row for s in splits], output.view(-1),
                       [r * row for r in received]).wait()
        return output, torch.tensor(received, dtype=torch.int32)

    work = _common.tensor_work(channel, "alltoall", tensor, name, {"trailing_shape": tail}, execute)
    return _common.submit(current, channel, work, blocking)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`alltoall`; ``synchronize(handle)`` returns (received rows, received
    splits) whether or not splits were given, as Horovod's does.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: the rows to send: a dense tensor with at least one dimension; the other
        dimensions, dtype and device must agree over the ranks.
    :param splits: how many rows go to each rank of the set, in set-rank order: a list of
        non-negative ints or a 1-D integer tensor, one entry per rank, summing to the first
        dimension; default None: the first dimension is divided evenly (the set size must
        divide it).
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to exchange with: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _alltoall(tensor, splits, name, process_set, False)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall forward; backward sends each gradient block back where its rows came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _alltoall(tensor, splits, name, process_set, True)
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_received_grad):
        returned, _ = _alltoall(grad, ctx.received, derived(ctx.name, "grad"), ctx.process_set, True)
        return returned, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows to rank r, differentiably; returns the received rows and, when
    ``splits`` is given, the received splits (an int32 tensor), as Horovod's ``alltoall`` does.
    The gradient sends each gradient block back where its rows came from.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: the rows to send: a dense tensor with at least one dimension; the other
        dimensions, dtype and device must agree over the ranks.
    :param splits: how many rows go to each rank of the set, in set-rank order: a list of
        non-negative ints or a 1-D integer tensor, one entry per rank, summing to the first
        dimension; default None: the first dimension is divided evenly (the set size must
        divide it).
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to exchange with: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the rows received, in set-rank order of their senders (and the received splits
        when ``splits`` is given).
    """
    if not tracked((tensor,)):
        output, received = _alltoall(tensor, splits, name, process_set, True)
        return output if splits is None else (output, received)
    return HorovodAlltoall.apply(tensor, splits, name, process_set)
