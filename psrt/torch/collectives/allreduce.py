"""Allreduce and grouped allreduce on torch CPU tensors, Horovod-compatible.

Every call becomes a named work for the engine, which matches ranks by name
(unnamed calls are named from a per-process counter), checks that shape,
dtype, op and scale factors agree, and fuses allreduces that are ready
together.  ``allreduce_`` on a contiguous tensor reduces in the tensor's own
memory: no copy is added on that path.  ``op=Adasum`` is not elementwise: its
work runs on its own, never fused (see :mod:`psrt.torch.adasum`).

The out-of-place forms are differentiable, as in Horovod: the gradient of an
allreduce is the same allreduce of the output's gradient (see
:mod:`psrt.torch.collectives._differentiable`).  ``sparse_allreduce_async`` reduces
a sparse COO tensor by gathering its entries.
"""
from __future__ import annotations

import functools
import operator
from typing import Callable, NamedTuple, Sequence

import torch

from psrt import runtime
from psrt.engine import Announcement, Express, Piece, Reduction, Work
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common, adasum
# allgather's module imports this one too (allgather's gradient is an allreduce): bind the module, use it at call time
from psrt.torch.collectives import allgather as allgather_family
from psrt.torch.collectives._differentiable import LINEAR_OPS, derived, issue_each, linear, tracked
from psrt.torch.compression import compressor
from psrt.torch.handles import synchronize
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_scale, check_tensor, check_tensor_list


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


class _Plan(NamedTuple):
    """What a call's arguments work out to, before any tensor data is touched: kept for
    repeated calls (a training loop's), whose validation and announcement it skips."""

    op: ReduceOp
    pre: float
    post: float
    set_size: int
    announcement: Announcement | None  # None for Adasum, whose work is executed
    folds: list[float | None]
    express: Express | None  # for a blocking call of one tensor whose scale is folded in


def _repeat_key(tensors: list[torch.Tensor], name: object, op: object, average: object,
                prescale_factor: object, postscale_factor: object, process_set: object) -> tuple | None:
    """The key a named call's :class:`_Plan` is kept under, or None when its arguments are
    not of the exact types a plan can stand for (they are validated in full instead: True
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


def _plan(current: runtime.Runtime, tensors: list[torch.Tensor], grouped: bool, name: object, op: object, average: object,
          prescale_factor: object, postscale_factor: object, process_set: ProcessSet) -> _Plan:
    """Validate a call's arguments and announce its work, or take what an earlier call with
    the same arguments worked out (building it costs more than the rest of a small
    allreduce's Python)."""
    key = _repeat_key(tensors, name, op, average, prescale_factor, postscale_factor, process_set)
    known = _common.remembered(current, key) if key is not None else None
    if known is not None:
        return known
    op, pre, post = _resolve({t.dtype for t in tensors}, name, op, average, prescale_factor, postscale_factor)
    ranks = _common.set_ranks(current, process_set)
    if op is ReduceOp.Adasum:
        adasum.check_arguments(tensors, len(ranks), "grouped_allreduce" if grouped else "allreduce")
    folds = [_folded_scale(t, op, post, len(ranks)) for t in tensors]
    announcement = None
    if op is not ReduceOp.Adasum:
        reduction = Reduction(process_set.process_set_id, str(tensors[0].device), transport_op(op),
                              tuple(Piece(t.numel(), t.dtype, 1.0 if f is None else f)
                                    for t, f in zip(tensors, folds)))
        announcement = _common.announce(current, "allreduce", name, process_set, ranks,
                                        _descriptor(tensors, op, pre, post), reduction)
    plan = _Plan(op, pre, post, len(ranks), announcement, folds,
                 Express(announcement) if announcement is not None and pre == 1.0 and len(tensors) == 1
                 and folds[0] is not None else None)
    if key is not None:
        _common.remember(current, key, plan)
    return plan


def _allreduce_work(current: runtime.Runtime, tensors: list[torch.Tensor], in_place: bool, plan: _Plan, name: str | None,
                    process_set: ProcessSet, grouped: bool) -> Work:
    """The engine work reducing ``tensors`` (one, or a grouped call's): prescaled now;
    Average and postscale folded into the reduction for floating-point tensors, applied when
    finishing for integers and for Adasum (an executed work: see ``psrt.torch.adasum``).
    Its output is the reduced tensor, or the list for ``grouped``."""
    op, pre, post, set_size, announcement, folds, _ = plan
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
                    _common.postscale_(buffer, op is ReduceOp.Average, post, set_size)
            outputs = [_common.write_back(t, b) for t, b in zip(tensors, buffers)] if in_place else buffers
            return outputs if grouped else outputs[0]

    if op is ReduceOp.Adasum:  # not elementwise: the engine cannot fuse it, it runs on its own
        return _common.make_work(current, "allreduce", name, process_set, _common.set_ranks(current, process_set),
                                 _descriptor(tensors, op, pre, post), tensors[0].device,
                                 execute=lambda host, _: adasum.allreduce_(host, buffers), finish=finish)
    return Work(announcement, device=tensors[0].device, buffers=buffers, finish=finish)


def _descriptor(tensors: list[torch.Tensor], op: ReduceOp, pre: float, post: float) -> tuple:
    """What every rank's call must agree on."""
    if len(tensors) == 1:
        layout = (("dtype", tensors[0].dtype), ("shape", tuple(tensors[0].shape)))
    else:
        layout = (("dtypes", tuple(t.dtype for t in tensors)),
                  ("shapes", tuple(tuple(t.shape) for t in tensors)))
    return (*layout, ("device", tensors[0].device.type), ("op", op.name),
            ("prescale_factor", pre), ("postscale_factor", post))


def _allreduce(tensor, in_place, blocking, name, op, average, prescale_factor,
               postscale_factor, process_set):
    tensors = [check_tensor(tensor)]
    current = runtime.current()  # once per call, handed down
    plan = _plan(current, tensors, False, name, op, average, prescale_factor, postscale_factor, process_set)
    if blocking and plan.express is not None:
        buffer = tensor if in_place else tensor.detach().clone(memory_format=torch.contiguous_format)
        if buffer.is_contiguous():
            announcement = plan.announcement
            if current.engine.express(
                    plan.express, buffer, lambda: Work(announcement, device=buffer.device, buffers=[buffer])):
                return buffer
            tensors, in_place = [buffer], True  # the copy made is reduced where it lies
    return _common.submit(current, _allreduce_work(current, tensors, in_place, plan, name, process_set, grouped=False),
                          blocking)


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


# -- grouped -------------------------------------------------------------------------
def _grouped(tensors, in_place, blocking, name, op, average, prescale_factor, postscale_factor,
             process_set):
    """One work for the whole list, negotiated as a unit: large tensors are reduced where
    they lie, small ones of one dtype share a message (in place if they are back-to-back
    views of one buffer, else packed)."""
    tensors = check_tensor_list(tensors)
    if not tensors:
        raise InvalidArgumentError("grouped_allreduce needs at least one tensor")
    if len({t.device for t in tensors}) > 1:
        raise InvalidArgumentError(f"grouped_allreduce needs all tensors on one device, got "
                                   f"{sorted({str(t.device) for t in tensors})}")
    current = runtime.current()  # once per call, handed down
    plan = _plan(current, tensors, True, name, op, average, prescale_factor, postscale_factor, process_set)
    return _common.submit(current, _allreduce_work(current, tensors, in_place, plan, name, process_set, grouped=True),
                          blocking)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce forward and backward, with the same options."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.name, ctx.options = name, (op, average, prescale_factor, postscale_factor, process_set)
        return tuple(_grouped(list(tensors), False, True, name, *ctx.options))

    @staticmethod
    def backward(ctx, *grads):
        op, average = ctx.options[:2]
        linear(resolve_op(op, average), "grouped_allreduce")
        return (None,) * 6 + tuple(_grouped(list(grads), False, True, derived(ctx.name, "grad"), *ctx.options))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: object = None,
                      op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused operation, differentiably; returns new tensors.

    The list is negotiated as a unit: it runs when every rank has submitted the whole list.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensors: a non-empty list or tuple of dense tensors, all on one device (the CPU, or a
        CUDA device where NCCL is available); each tensor's shape and dtype must be the same on
        every rank, in the same list position.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by (the list is one unit under this name);
        default None: named from a per-process counter, so every rank must make its unnamed
        calls in the same order.  A name must not be pending on this rank already.
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
    :returns: one new tensor per input, in order, each holding its reduction.
    """
    tensors = check_tensor_list(tensors)
    compression = compressor(compression)
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    if tracked(tensors):
        reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                                process_set, *compressed)
    else:
        reduced = _grouped(compressed, False, True, name, op, average, prescale_factor, postscale_factor,
                           process_set)
    return [compression.decompress(t, state) for t, (_, state) in zip(reduced, packed)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`: each tensor is reduced into its own memory; returns
    the input tensors.  Not differentiable.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param tensors: a non-empty list or tuple of dense tensors, all on one device (the CPU, or a
        CUDA device where NCCL is available); each tensor's shape and dtype must be the same on
        every rank, in the same list position.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by (the list is one unit under this name);
        default None: named from a per-process counter, so every rank must make its unnamed
        calls in the same order.  A name must not be pending on this rank already.
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
    :returns: the input tensors, as a list, holding their reductions.
    """
    return _grouped(tensors, True, True, name, op, average, prescale_factor, postscale_factor,
                    process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`grouped_allreduce` and return at once; ``hvd.synchronize(handle)`` waits and
    returns the list of new tensors.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensors: a non-empty list or tuple of dense tensors, all on one device (the CPU, or a
        CUDA device where NCCL is available); each tensor's shape and dtype must be the same on
        every rank, in the same list position.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by (the list is one unit under this name);
        default None: named from a per-process counter, so every rank must make its unnamed
        calls in the same order.  A name must not be pending on this rank already.
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
    return _grouped(tensors, False, False, name, op, average, prescale_factor, postscale_factor,
                    process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place :func:`grouped_allreduce` and return at once; ``hvd.synchronize(handle)``
    waits and returns the input tensors, which must not be touched until then.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensors: a non-empty list or tuple of dense tensors, all on one device (the CPU, or a
        CUDA device where NCCL is available); each tensor's shape and dtype must be the same on
        every rank, in the same list position.
    :param average: Horovod's deprecated flag: ``True`` means ``op=Average``, ``False`` means
        ``op=Sum``; default None (``op`` decides).  Passing both ``average`` and ``op`` is an
        error.
    :param name: what the ranks match the call by (the list is one unit under this name);
        default None: named from a per-process counter, so every rank must make its unnamed
        calls in the same order.  A name must not be pending on this rank already.
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
    return _grouped(tensors, True, False, name, op, average, prescale_factor, postscale_factor,
                    process_set)


# -- sparse allreduce ---------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp | None,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start a Sum or Average of a sparse COO tensor over the set, Horovod's way: allgather
    the indices (as ``name.indices``) and the values (as ``name.values``).

    Returns a function that waits and returns the result (``handle()``, as in Horovod):
    every rank's entries side by side, not coalesced, the values divided by the set size
    for Average.  An integer Average is coalesced first, so that each sum is rounded toward
    zero once, as a dense integer Average is.

    Collective: every rank of ``process_set`` calls it, in the same order (named calls may start
    in any order, so long as no rank waits for one before starting the others).

    :param tensor: a sparse COO tensor; its size and dtype must be the same on every rank, its
        number of entries may differ.
    :param name: what the ranks match the call by (its two allgathers are ``name.indices`` and
        ``name.values``); None names them from a per-process counter, so every rank must then
        make its unnamed calls in the same order.
    :param op: ``hvd.Sum`` or ``hvd.Average`` (None means Average); other ops are refused.
    :param process_set: the ranks to reduce over: a registered process set this rank belongs
        to; default ``global_process_set`` (every rank).
    :returns: a function that waits and returns the reduced sparse tensor.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        kind = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ArgumentTypeError(f"sparse_allreduce_async needs a sparse COO tensor, got {kind}")
    op = resolve_op(op)
    if op not in LINEAR_OPS:
        raise InvalidArgumentError(f"sparse_allreduce_async supports op Sum and Average, not "
                                   f"{op.name}")
    check_name(name)
    set_size = process_set.size()
    # Entries as rows, so that allgather concatenates every rank's entries.
    parts = [tensor._indices().t().contiguous(), tensor._values()]
    suffixes = ("indices", "values")

    def combine(gathered: list[torch.Tensor]) -> torch.Tensor:
        indices, values = gathered
        if op is ReduceOp.Average and values.is_floating_point():
            values = values / set_size
        result = torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=True)
        if op is ReduceOp.Average and not values.is_floating_point():
            result = result.coalesce()
            result._values().div_(set_size, rounding_mode="trunc")
        return result

    handle = issue_each(runtime.current().handles,
                        lambda i, t: allgather_family.allgather_async(t, name=derived(name, suffixes[i]),
                                                                      process_set=process_set), parts, combine)
    return functools.partial(synchronize, handle)
