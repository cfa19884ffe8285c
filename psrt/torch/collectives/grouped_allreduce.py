"""Grouped allreduce (a list of tensors negotiated and fused as one unit) and Horovod's sparse
allreduce, on the machinery of :mod:`psrt.torch.collectives.allreduce`."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from psrt import runtime
from psrt.engine import Channel
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
# allgather's module imports this one too (allgather's gradient is a grouped allreduce): bind the
# module, use it at call time
from psrt.torch.collectives import allgather as allgather_family
from psrt.torch.collectives.allreduce import allreduce_work, remembered_call
from psrt.torch.collectives._differentiable import LINEAR_OPS, derived, linear, start_each, tracked
from psrt.torch.compression import compressor
from psrt.torch.ops import ReduceOp, resolve_op
from psrt.torch.validation import check_name, check_tensor_list


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
    call = remembered_call(current, tensors, True, name, op, average, prescale_factor, postscale_factor,
                           process_set)
    return _common.submit(current, call.channel, allreduce_work(call, tensors, in_place, grouped=True), blocking)


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
    return start_sparse_allreduce(runtime.current().channel(process_set), tensor, name, op)


def start_sparse_allreduce(channel: Channel, tensor: torch.Tensor, name: str | None,
                           op: ReduceOp) -> Callable[[], torch.Tensor]:
    """Start :func:`sparse_allreduce_async`'s two allgathers over ``channel`` (arguments
    checked); returns the function that waits for them and returns the result."""
    # Entries as rows, so that allgather concatenates every rank's entries.
    parts = [tensor._indices().t().contiguous(), tensor._values()]
    gather = allgather_family.allgather_work
    works = start_each(channel, [lambda: gather(channel, parts[0], derived(name, "indices")),
                                 lambda: gather(channel, parts[1], derived(name, "values"))])

    def result() -> torch.Tensor:
        indices, values = [channel.wait(work) for work in works]
        if op is ReduceOp.Average and values.is_floating_point():
            values = values / channel.size
        reduced = torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=True)
        if op is ReduceOp.Average and not values.is_floating_point():
            reduced = reduced.coalesce()
            reduced._values().div_(channel.size, rounding_mode="trunc")
        return reduced

    return result
