"""Allreduce on torch tensors, Horovod-compatible: the call's machinery and the plain forms.

Every call becomes a named work for the engine, built through its process set's channel
(:mod:`psrt.engine.channel`), which matches ranks by name (unnamed calls are named from a
per-process counter), checks that shape, dtype, op and scale factors agree, and fuses
allreduces that are ready together.  ``allreduce_`` on a contiguous tensor reduces in the
tensor's own memory: no copy is added on that path.  ``op=Adasum`` is not elementwise: its
work runs on its own, never fused (see :mod:`psrt.torch.adasum`).  The grouped forms and the
sparse allreduce are in :mod:`psrt.torch.collectives.grouped_allreduce`.

The out-of-place forms are differentiable, as in Horovod: the gradient of an
allreduce is the same allreduce of the output's gradient (see
:mod:`psrt.torch.collectives._differentiable`).
"""
from __future__ import annotations

import operator
from typing import NamedTuple, Sequence

import torch

from psrt import runtime
from psrt.engine import Channel, PreparedAllreduce, Work
from psrt.errors import InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common, adasum
from psrt.torch.collectives._differentiable import derived, linear, tracked
from psrt.torch.compression import compressor
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_scale, check_tensor


def _resolve(dtypes: Sequence[torch.dtype], name: object, op: object, average: object,
             prescale_factor: object, postscale_factor: object) -> tuple[ReduceOp, float, float]:
    """Validate the arguments every allreduce form shares."""
    check_name(name)
    op = resolve_op(op, average)
    pre = check_scale(prescale_factor, "prescale_factor")
    post = check_scale(postscale_factor, "postscale_factor")
    if torch.bool in dtypes:
        if op in (ReduceOp.Sum, ReduceOp.Average):
            raise InvalidArgumentError(f"op {op.name} is not defined for bool tensors; use Min "
                                       "(logical and) or Max (logical or)")
        if pre != 1.0 or post != 1.0:
            raise InvalidArgumentError("prescale_factor/postscale_factor cannot apply to bool "
                                       "tensors")
    return op, pre, post


class AllreduceCall(NamedTuple):
    """What a call's arguments work out to, before any tensor data is touched: kept for
    repeated calls (a training loop's, a gradient bucket's), whose validation and
    announcement it skips."""

    channel: Channel
    op: ReduceOp
    pre: float
    post: float
    prepared: PreparedAllreduce | None  # None for Adasum, whose work is executed
    folds: list[float | None]
    express: bool  # a blocking call of one tensor whose scale is folded in may take the express path
    name: str | None


def _repeat_key(tensors: list[torch.Tensor], name: object, op: object, average: object,
                prescale_factor: object, postscale_factor: object, process_set: object) -> tuple | None:
    """The key a named call's :class:`AllreduceCall` is kept under, or None when its arguments
    are not of the exact types a call can stand for (they are validated in full instead: True
    equals 1 but is no scale factor).  The set's id is part of it, so a removed set (whose
    id is cleared) never matches."""
    if (name.__class__ is not str or prescale_factor.__class__ is not float
            or postscale_factor.__class__ is not float or (op is not None and op.__class__ is not ReduceOp)
            or (average is not None and average.__class__ is not bool)
            or process_set.__class__ is not ProcessSet):
        return None
    if len(tensors) == 1:  # flat: the common case, and a key for every call
        tensor = tensors[0]
        return (name, op, average, prescale_factor, postscale_factor, process_set, process_set.process_set_id,
                tensor.dtype, tensor.shape, tensor.device)
    return (name, op, average, prescale_factor, postscale_factor, process_set, process_set.process_set_id,
            *[(t.dtype, t.shape, t.device) for t in tensors])


def remembered_call(current: runtime.Runtime, tensors: list[torch.Tensor], grouped: bool, name: object, op: object,
                    average: object, prescale_factor: object, postscale_factor: object,
                    process_set: ProcessSet) -> AllreduceCall:
    """:func:`allreduce_call` on ``process_set``'s channel, or what an earlier call with the
    same arguments worked out (building it costs more than the rest of a small allreduce's
    Python)."""
    key = _repeat_key(tensors, name, op, average, prescale_factor, postscale_factor, process_set)
    known = current.calls.get(key) if key is not None else None
    if known is not None:
        return known
    call = allreduce_call(current.channel(process_set), tensors, grouped, name, op, average, prescale_factor,
                          postscale_factor)
    if key is not None:
        _common.remember(current, key, call)
    return call


def allreduce_call(channel: Channel, tensors: list[torch.Tensor], grouped: bool, name: object, op: object,
                   average: object, prescale_factor: object, postscale_factor: object) -> AllreduceCall:
    """Validate an allreduce of ``tensors`` over ``channel``'s set and prepare its work."""
    op, pre, post = _resolve({t.dtype for t in tensors}, name, op, average, prescale_factor, postscale_factor)
    if op is ReduceOp.Adasum:
        adasum.check_arguments(tensors, channel.size, "grouped_allreduce" if grouped else "allreduce")
    folds = [_folded_scale(t, op, post, channel.size) for t in tensors]
    prepared = None
    if op is not ReduceOp.Adasum:
        prepared = channel.prepare_allreduce(tensors, name=name, op=transport_op(op),
                                             scales=[1.0 if f is None else f for f in folds],
                                             agreed=_agreed(op, pre, post))
    express = prepared is not None and pre == 1.0 and len(tensors) == 1 and folds[0] is not None
    return AllreduceCall(channel, op, pre, post, prepared, folds, express, name)


def allreduce_work(call: AllreduceCall, tensors: list[torch.Tensor], in_place: bool, grouped: bool) -> Work:
    """The engine work reducing ``tensors`` (one, or a grouped call's) as ``call`` says:
    prescaled now; Average and postscale folded into the reduction for floating-point tensors,
    applied when finishing for integers and for Adasum (an executed work: see
    ``psrt.torch.adasum``).  Its output is the reduced tensor, or the list for ``grouped``."""
    channel, op, pre, post, prepared, folds = call[:6]
    if in_place:
        buffers = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    else:
        buffers = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    if pre != 1.0:
        for buffer in buffers:
            _common.scale_(buffer, pre)

    if None not in folds and all(map(operator.is_, buffers, tensors)):
        output = tensors if grouped else tensors[0]  # reduced where it lies, scale folded in

        def finish(_: object) -> torch.Tensor | list[torch.Tensor]:
            return output
    else:
        def finish(_: object) -> torch.Tensor | list[torch.Tensor]:
            for buffer, fold in zip(buffers, folds):
                if fold is None:
                    _common.postscale_(buffer, op is ReduceOp.Average, post, channel.size)
            outputs = [_common.write_back(t, b) for t, b in zip(tensors, buffers)] if in_place else buffers
            return outputs if grouped else outputs[0]

    if prepared is None:  # Adasum is not elementwise: the engine cannot fuse it, it runs on its own
        descriptor = (*_layout(tensors), ("device", tensors[0].device.type), *_agreed(op, pre, post))
        return channel.execute("allreduce", call.name, descriptor, tensors[0].device,
                               lambda host, _: adasum.allreduce_(host, buffers), finish)
    return prepared.work(buffers, finish)


def _layout(tensors: list[torch.Tensor]) -> tuple:
    if len(tensors) == 1:
        return (("dtype", tensors[0].dtype), ("shape", tuple(tensors[0].shape)))
    return (("dtypes", tuple(t.dtype for t in tensors)), ("shapes", tuple(tuple(t.shape) for t in tensors)))


def _agreed(op: ReduceOp, pre: float, post: float) -> tuple:
    """What every rank's call must agree on besides the tensors' layout."""
    return (("op", op.name), ("prescale_factor", pre), ("postscale_factor", post))


def _allreduce(tensor, in_place, blocking, name, op, average, prescale_factor,
               postscale_factor, process_set):
    tensors = [check_tensor(tensor)]
    current = runtime.current()  # once per call, handed down
    call = remembered_call(current, tensors, False, name, op, average, prescale_factor, postscale_factor,
                           process_set)
    if blocking and call.express:
        buffer = tensor if in_place else tensor.detach().clone(memory_format=torch.contiguous_format)
        if buffer.is_contiguous():
            if call.channel.express(call.prepared, buffer):
                return buffer
            tensors, in_place = [buffer], True  # the copy made is reduced where it lies
    return _common.submit(current, call.channel, allreduce_work(call, tensors, in_place, grouped=False), blocking)


def _folded_scale(tensor: torch.Tensor, op: ReduceOp, post: float, set_size: int) -> float | None:
    """The factor the transport can fold into the reduction: None where it cannot, for
    integers that need scaling (an integer Average is a division rounded toward zero,
    applied afterwards) and for Adasum, which the transport does not run."""
    if op is ReduceOp.Adasum:
        return None
    if tensor.is_floating_point():
        return post / set_size if op is ReduceOp.Average else post
    return 1.0 if op is not ReduceOp.Average and post == 1.0 else None


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce forward; the same allreduce (op and scale factors) of the gradient backward."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.name, ctx.options = name, (op, average, prescale_factor, postscale_factor, process_set)
        return _allreduce(tensor, False, True, name, *ctx.options)

    @staticmethod
    def backward(ctx, grad):
        op, average = ctx.options[:2]
        linear(resolve_op(op, average), "allreduce")
        return (_allreduce(grad, False, True, derived(ctx.name, "grad"), *ctx.options),) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return the result in a new tensor,
    differentiably: the gradient is the same allreduce (op and scale factors) of the output's
    gradient, for ops Sum and Average.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: the tensor to reduce: dense, on the CPU (or a CUDA device where NCCL is
        available), of a dtype psrt carries (floating point, integer or bool); its shape and
        dtype must be the same on every rank.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter (``allreduce.noname.<n>``), so every rank must make its unnamed calls in the same
        order.  A name must not be pending on this rank already.
    :param compression: how the tensor travels: ``hvd.Compression.none`` (None, the default,
        means it), ``hvd.Compression.fp16`` (floating-point tensors travel as float16), or any
        object with ``compress`` and ``decompress``; the result keeps the input's dtype.
    :param op: the reduction: ``hvd.Average`` (None, the default, means it), ``Sum``, ``Min``,
        ``Max``, ``Product`` or ``Adasum``.  Bool tensors take only ``Min`` (logical and) and
        ``Max`` (logical or); an integer Average divides rounding toward zero; ``Adasum`` needs
        floating-point CPU tensors and a process set whose size is a power of two.
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0 (not allowed with bool tensors).
    :param postscale_factor: a real number the result is multiplied by after the reduction
        (and after Average's division); default 1.0 (not allowed with bool tensors).
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: a new tensor of ``tensor``'s shape and dtype holding the reduction.
    """
    compression = compressor(compression)
    compressed, state = compression.compress(check_tensor(tensor))
    if tracked((tensor,)):
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor,
                                         process_set)
    else:
        reduced = _allreduce(compressed, False, True, name, op, average, prescale_factor, postscale_factor,
                             process_set)
    return compression.decompress(reduced, state)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`: reduce ``tensor`` over the process set into its own memory
    (no copy for a contiguous tensor); returns ``tensor``.  Not differentiable.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensor: the tensor to reduce: dense, on the CPU (or a CUDA device where NCCL is
        available), of a dtype psrt carries (floating point, integer or bool); its shape and
        dtype must be the same on every rank.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter (``allreduce.noname.<n>``), so every rank must make its unnamed calls in the same
        order.  A name must not be pending on this rank already.
    :param op: the reduction: ``hvd.Average`` (None, the default, means it), ``Sum``, ``Min``,
        ``Max``, ``Product`` or ``Adasum``.  Bool tensors take only ``Min`` (logical and) and
        ``Max`` (logical or); an integer Average divides rounding toward zero; ``Adasum`` needs
        floating-point CPU tensors and a process set whose size is a power of two.
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0 (not allowed with bool tensors).
    :param postscale_factor: a real number the result is multiplied by after the reduction
        (and after Average's division); default 1.0 (not allowed with bool tensors).
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: ``tensor``, holding the reduction.
    """
    return _allreduce(tensor, True, True, name, op, average, prescale_factor, postscale_factor,
                      process_set)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`allreduce` and return at once; ``hvd.synchronize(handle)`` waits and
    returns the new tensor, ``hvd.poll(handle)`` says whether it is done.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: the tensor to reduce: dense, on the CPU (or a CUDA device where NCCL is
        available), of a dtype psrt carries (floating point, integer or bool); its shape and
        dtype must be the same on every rank.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter (``allreduce.noname.<n>``), so every rank must make its unnamed calls in the same
        order.  A name must not be pending on this rank already.
    :param op: the reduction: ``hvd.Average`` (None, the default, means it), ``Sum``, ``Min``,
        ``Max``, ``Product`` or ``Adasum``.  Bool tensors take only ``Min`` (logical and) and
        ``Max`` (logical or); an integer Average divides rounding toward zero; ``Adasum`` needs
        floating-point CPU tensors and a process set whose size is a power of two.
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0 (not allowed with bool tensors).
    :param postscale_factor: a real number the result is multiplied by after the reduction
        (and after Average's division); default 1.0 (not allowed with bool tensors).
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _allreduce(tensor, False, False, name, op, average, prescale_factor,
                      postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce and return at once; ``hvd.synchronize(handle)`` waits and
    returns ``tensor``, which must not be touched until then.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: the tensor to reduce: dense, on the CPU (or a CUDA device where NCCL is
        available), of a dtype psrt carries (floating point, integer or bool); its shape and
        dtype must be the same on every rank.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by; default None: named from a per-process
        counter (``allreduce.noname.<n>``), so every rank must make its unnamed calls in the same
        order.  A name must not be pending on this rank already.
    :param op: the reduction: ``hvd.Average`` (None, the default, means it), ``Sum``, ``Min``,
        ``Max``, ``Product`` or ``Adasum``.  Bool tensors take only ``Min`` (logical and) and
        ``Max`` (logical or); an integer Average divides rounding toward zero; ``Adasum`` needs
        floating-point CPU tensors and a process set whose size is a power of two.
    :param prescale_factor: a real number each rank's tensor is multiplied by before the
        reduction; default 1.0 (not allowed with bool tensors).
    :param postscale_factor: a real number the result is multiplied by after the reduction
        (and after Average's division); default 1.0 (not allowed with bool tensors).
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: the handle (an int) for ``poll`` and ``synchronize``.
    """
    return _allreduce(tensor, True, False, name, op, average, prescale_factor, postscale_factor,
                      process_set)


