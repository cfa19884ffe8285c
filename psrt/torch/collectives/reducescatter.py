"""Reducescatter on torch CPU tensors, Horovod-compatible: plain (differentiable),
asynchronous and grouped forms.

The first dimension is split as Horovod splits it (:func:`reducescatter_rows`); the
shape, dtype, op and scale factors must agree.  The gradient is the allgather of the
output's gradient times prescale * postscale, and times the set size for op Sum.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from psrt import runtime
from psrt.engine import Channel, Work
from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.collectives._differentiable import WorkGroup, derived, linear, start_each, tensor_group, tracked
from psrt.torch.collectives.allgather import allgather, grouped_allgather_async
from psrt.torch.compression import compressor
from psrt.torch.handles import synchronize
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_scale, check_tensor


def reducescatter_rows(rows: int, set_size: int) -> list[int]:
    """Rows each rank keeps: the first ``rows % size`` ranks get one more, as in Horovod."""
    base, extra = divmod(rows, set_size)
    return [base + (1 if r < extra else 0) for r in range(set_size)]


def _reducescatter_work(channel: Channel, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                        post: float) -> Work:
    rows, tail = _common.rows_and_tail(tensor)
    row = math.prod(tail)
    kept = reducescatter_rows(rows, channel.size)
    send = _common.contiguous_buffer(tensor)
    if pre != 1.0:
        send = send.clone()
        _common.scale_(send, pre)
    output = torch.empty((kept[channel.rank], *tail), dtype=tensor.dtype, device=tensor.device)

    def finish(_: object) -> torch.Tensor:
        _common.postscale_(output, op is ReduceOp.Average, post, channel.size)
        return output

    agreed = (("op", op.name), ("prescale_factor", pre), ("postscale_factor", post))
    return channel.reduce_scatter(send, output, [k * row for k in kept], name=name, op=transport_op(op),
                                  agreed=agreed, finish=finish)


def _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor, blocking):
    tensor = _common.prepare(tensor, name)
    current = runtime.current()
    channel = current.channel(process_set)
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    op, pre, post = _checked(tensor, op, prescale_factor, postscale_factor)
    return _common.submit(current, channel, _reducescatter_work(channel, tensor, name, op, pre, post), blocking)


def _checked(tensor: torch.Tensor, op: object, prescale_factor: object,
             postscale_factor: object) -> tuple[ReduceOp, float, float]:
    op = resolve_op(op)
    if tensor.dtype == torch.bool:
        raise InvalidArgumentError("reducescatter is not defined for bool tensors")
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise UnsupportedOperationError(f"reducescatter supports only Sum and Average, got {op.name}")
    return op, check_scale(prescale_factor, "prescale_factor"), check_scale(postscale_factor, "postscale_factor")


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Start :func:`reducescatter`; ``synchronize(handle)`` returns this rank's block.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: a dense, non-bool tensor with at least one dimension; its shape and dtype
        must be the same on every rank.  Its first dimension is split as Horovod splits it: the
        first ``rows % size`` ranks keep one row more.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param op: ``hvd.Average`` (None, the default, means it) or ``hvd.Sum``; other ops are
        refused.
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0.
    :param postscale_factor: a real number the result is multiplied by after the reduction;
        default 1.0.
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor,
                          False)


def _reducescatter_grad_scale(op: object, prescale_factor: float, postscale_factor: float,
                              process_set: ProcessSet) -> float:
    op = linear(resolve_op(op), "reducescatter")
    return prescale_factor * postscale_factor * (process_set.size() if op is ReduceOp.Sum else 1)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter forward; backward allgathers the scaled gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.name, ctx.process_set = name, process_set
        ctx.scale = (op, prescale_factor, postscale_factor, process_set)
        return _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor, True)

    @staticmethod
    def backward(ctx, grad):
        scaled = grad * _reducescatter_grad_scale(*ctx.scale)
        gathered = allgather(scaled, name=derived(ctx.name, "grad"), process_set=ctx.process_set)
        return (gathered,) + (None,) * 5


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: object = None,
                  op: ReduceOp | None = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the set and keep this rank's block of rows (default op Average),
    differentiably.  Horovod's signature: ``compression`` comes third.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: a dense, non-bool tensor with at least one dimension; its shape and dtype
        must be the same on every rank.  Its first dimension is split as Horovod splits it: the
        first ``rows % size`` ranks keep one row more.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param compression: how the tensor travels: ``hvd.Compression.none`` (None, the default),
        ``hvd.Compression.fp16`` or any object with ``compress`` and ``decompress``.
    :param op: ``hvd.Average`` (None, the default, means it) or ``hvd.Sum``; other ops are
        refused.
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0.
    :param postscale_factor: a real number the result is multiplied by after the reduction;
        default 1.0.
    :returns: this rank's block of the reduction, a new tensor.
    """
    compression = compressor(compression)
    compressed, state = compression.compress(check_tensor(tensor))
    if tracked((tensor,)):
        reduced = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                             postscale_factor)
    else:
        reduced = _reducescatter(compressed, name, op, process_set, prescale_factor, postscale_factor, True)
    return compression.decompress(reduced, state)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor (named ``name.0``, ``name.1``, ...);
    ``synchronize`` returns the list of this rank's blocks.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensors: a list of tensors, each reduce-scattered as ``tensor`` is in
        :func:`reducescatter`; each position's shape and dtype must agree over the ranks.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param op: ``hvd.Average`` (None, the default, means it) or ``hvd.Sum``; other ops are
        refused.
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0.
    :param postscale_factor: a real number the result is multiplied by after the reduction;
        default 1.0.
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    tensors = [_common.prepare(t, None) for t in tensor_group(tensors, "grouped_reducescatter")]
    check_name(name)
    current = runtime.current()
    channel = current.channel(process_set)
    for tensor in tensors:
        if tensor.dim() == 0:
            raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    checked = [_checked(t, op, prescale_factor, postscale_factor) for t in tensors]
    works = start_each(channel, [lambda t=t, i=i, c=c: _reducescatter_work(channel, t, derived(name, str(i)), *c)
                                 for i, (t, c) in enumerate(zip(tensors, checked))])
    return current.handles.register(WorkGroup(channel, works))


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter forward; backward allgathers each scaled gradient."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.name, ctx.process_set = name, process_set
        ctx.scale = (op, prescale_factor, postscale_factor, process_set)
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        scale = _reducescatter_grad_scale(*ctx.scale)
        gathered = synchronize(grouped_allgather_async(
            [g * scale for g in grads], derived(ctx.name, "grad"), ctx.process_set))
        return (None,) * 5 + tuple(gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: object = None, op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list, differentiably; returns this rank's blocks.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensors: a list of tensors, each reduce-scattered as ``tensor`` is in
        :func:`reducescatter`; each position's shape and dtype must agree over the ranks.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter, so every rank must make its unnamed calls in the same order.
    :param compression: how the tensor travels: ``hvd.Compression.none`` (None, the default),
        ``hvd.Compression.fp16`` or any object with ``compress`` and ``decompress``.
    :param op: ``hvd.Average`` (None, the default, means it) or ``hvd.Sum``; other ops are
        refused.
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0.
    :param postscale_factor: a real number the result is multiplied by after the reduction;
        default 1.0.
    :returns: this rank's block of each reduction, in order.
    """
    tensors = tensor_group(tensors, "grouped_reducescatter")
    compression = compressor(compression)
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    if tracked(tensors):
        reduced = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                    postscale_factor, *compressed)
    else:
        reduced = synchronize(grouped_reducescatter_async(compressed, name, op, process_set,
                                                          prescale_factor, postscale_factor))
    return [compression.decompress(t, state) for t, (_, state) in zip(reduced, packed)]
