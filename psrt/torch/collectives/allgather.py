"""Allgather on torch CPU tensors, Horovod-compatible: plain, asynchronous, grouped and
differentiable forms, and ``allgather_into_async`` into a caller's buffer.

Ranks learn each other's first dimensions when the collective runs, so they may
differ by rank; the trailing dimensions, dtype and device must agree.  The gradient
of an allgather is the Average over ranks of the output's gradient, this rank's rows.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from psrt import runtime
from psrt.comm.base import Communicator
from psrt.engine import Channel, Work
from psrt.errors import InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.collectives.allreduce import allreduce
# grouped_allreduce's module imports this one too (a sparse allreduce is two allgathers): bind the
# module, use it at call time
from psrt.torch.collectives import grouped_allreduce as grouped_family
from psrt.torch.collectives._differentiable import WorkGroup, derived, start_each, tensor_group, tracked
from psrt.torch.handles import synchronize
from psrt.torch.ops import ReduceOp
from psrt.torch.validation import check_name, check_tensor


def allgather_work(channel: Channel, tensor: torch.Tensor, name: str | None) -> Work:
    """The work gathering every rank's rows of ``tensor`` (whose first dimension may differ by
    rank) over ``channel``'s set; its output is the gathered tensor."""
    rows, tail = _common.rows_and_tail(tensor)
    send = _common.contiguous_buffer(tensor).reshape(-1)

    def execute(host: Communicator, data: Communicator) -> torch.Tensor:
        all_rows = host.exchange_counts([rows] * host.size)
        output = torch.empty((sum(all_rows), *tail), dtype=tensor.dtype, device=tensor.device)
        row = math.prod(tail)
        data.allgatherv(send, output.view(-1), [r * row for r in all_rows]).wait()
        return output

    return _common.tensor_work(channel, "allgather", tensor, name, {"trailing_shape": tail}, execute)


def _allgather(tensor, name, process_set, blocking):
    tensor = _common.prepare(tensor, name)
    current = runtime.current()
    channel = current.channel(process_set)
    return _common.submit(current, channel, allgather_work(channel, tensor, name), blocking)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`allgather` and return at once; ``hvd.synchronize(handle)`` returns the
    gathered tensor.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: this rank's rows: a dense tensor whose first dimension may differ by rank;
        the other dimensions, dtype and device must agree.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to gather over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _allgather(tensor, name, process_set, False)


def allgather_into_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> int:
    """Start gathering every rank's equally sized ``tensor`` into ``output``, in rank order,
    without allocating (``torch.distributed.all_gather_into_tensor``; psrt's addition).
    ``synchronize`` returns ``output``.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: this rank's part: a dense tensor of the same number of elements, dtype and
        device on every rank.
    :param output: where the parts go, in set-rank order: contiguous, of ``tensor``'s dtype and
        device, with set-size times its elements, not overlapping ``tensor``.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to gather over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    tensor = _common.prepare(tensor, name)
    current = runtime.current()
    channel = current.channel(process_set)
    output = check_tensor(output, "output")
    if not output.is_contiguous() or output.dtype != tensor.dtype or output.device != tensor.device \
            or output.numel() != tensor.numel() * channel.size:
        raise InvalidArgumentError(
            f"allgather_into: output must be a contiguous {tensor.dtype} tensor on {tensor.device} with "
            f"{channel.size} x {tensor.numel()} elements, got {output.dtype} on {output.device} with "
            f"{output.numel()}{'' if output.is_contiguous() else ' (not contiguous)'}")
    if output.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        raise InvalidArgumentError("allgather_into: output and tensor share memory; gather from a copy")
    work = channel.allgather_into(_common.contiguous_buffer(tensor), output, name=name)
    return _common.submit(current, channel, work, False)


def _rows(shape: torch.Size) -> int:
    return shape[0] if len(shape) else 1  # a 0-d tensor is gathered as one row


def _row_offsets(rows: list[int], name: str | None, process_set: ProcessSet) -> list[int]:
    """Where this rank's rows start in each gathered tensor (the rows of lower set ranks)."""
    every = _allgather(torch.tensor([rows], dtype=torch.int64), derived(name, "grad.rows"), process_set, True)
    return every[:process_set.rank()].sum(dim=0).tolist()


class HorovodAllgather(torch.autograd.Function):
    """Allgather forward; backward averages the gradient over ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.name, ctx.process_set = tensor.shape, name, process_set
        return _allgather(tensor, name, process_set, True)

    @staticmethod
    def backward(ctx, grad):
        rows = _rows(ctx.shape)
        offset, = _row_offsets([rows], ctx.name, ctx.process_set)
        averaged = allreduce(grad, name=derived(ctx.name, "grad"), op=ReduceOp.Average,
                                              process_set=ctx.process_set)
        return averaged.narrow(0, offset, rows).reshape(ctx.shape), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank),
    differentiably: the gradient is this rank's rows of the Average over ranks of the output's
    gradient.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: this rank's rows: a dense tensor whose first dimension may differ by rank;
        the other dimensions, dtype and device must agree.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to gather over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: a new tensor: every rank's rows, in set-rank order.
    """
    if not tracked((tensor,)):
        return _allgather(tensor, name, process_set, True)
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of each tensor (named ``name.0``, ``name.1``, ...); ``synchronize``
    returns the list of gathered tensors.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensors: a list of dense tensors, gathered each as ``tensor`` is in
        :func:`allgather`; the list's length and each position's trailing dimensions and
        dtype must agree over the ranks.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to gather over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    tensors = [_common.prepare(t, None) for t in tensor_group(tensors, "grouped_allgather")]
    check_name(name)
    current = runtime.current()
    channel = current.channel(process_set)
    works = start_each(channel, [lambda t=t, i=i: allgather_work(channel, t, derived(name, str(i)))
                                 for i, t in enumerate(tensors)])
    return current.handles.register(WorkGroup(channel, works))


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather forward; backward as :class:`HorovodAllgather`, as one grouped op."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.shapes, ctx.name, ctx.process_set = [t.shape for t in tensors], name, process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        rows = [_rows(shape) for shape in ctx.shapes]
        offsets = _row_offsets(rows, ctx.name, ctx.process_set)
        averaged = grouped_family.grouped_allreduce(list(grads), name=derived(ctx.name, "grad"),
                                                      op=ReduceOp.Average, process_set=ctx.process_set)
        return (None, None) + tuple(g.narrow(0, o, n).reshape(shape) for g, o, n, shape
                                    in zip(averaged, offsets, rows, ctx.shapes))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list, differentiably; returns the gathered tensors.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensors: a list of dense tensors, gathered each as ``tensor`` is in
        :func:`allgather`; the list's length and each position's trailing dimensions and
        dtype must agree over the ranks.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param process_set: the ranks to gather over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: one gathered tensor per input, in order.
    """
    tensors = tensor_group(tensors, "grouped_allgather")
    if not tracked(tensors):
        return synchronize(grouped_allgather_async(tensors, name, process_set))
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))
