"""Differentiable collectives, with Horovod's names, signatures and gradients.

``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``grouped_reducescatter``
return what the plain collectives return and, when an input requires a
gradient, record a ``torch.autograd.Function`` whose backward runs the adjoint
collective.  Every rank must then run backward through the same collectives in
the same order, as for any collective.  A backward collective is named after
the forward one (``name + ".grad"``), so ranks match by name; an unnamed
forward stays unnamed.

The gradients are Horovod's (``horovod/torch/mpi_ops.py``), so code ported
from Horovod trains the same.  Each rank ``r`` holds an upstream gradient
``g_r`` of its own output; the input gradient is

========================  ==================================================
allreduce (Sum, Average)  the same allreduce of ``g`` (op and scale factors)
allgather                 the Average over ranks of ``g``, this rank's rows
broadcast                 the Average over ranks of ``g`` on the root, zeros
                          elsewhere
alltoall                  ``g`` sent back with the splits received forward
reducescatter             allgather of ``g`` times prescale * postscale, and
                          times the set size for op Sum
========================  ==================================================

Allreduce and alltoall give the exact gradient of the sum of the ranks'
losses; allgather and broadcast that of their mean (exact for a loss that
every rank computes alike from the replicated output); reducescatter gives
``size`` times the sum's gradient, as Horovod's own tests require.  Min, Max
and Product have no gradient here: their backward raises rather than return
Horovod's (wrong) allreduce of ``g``.

Broadcast's ``root_rank`` is a world rank, as in Horovod and psrt's plain
broadcast.  ``alltoall`` returns (output, received splits) when splits are
given and the output alone without them, as Horovod's does.

Calls where no input requires a gradient go straight to the plain
collectives, skipping autograd's overhead (about 15 µs a call).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable, Sequence

import torch

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import global_process_set, rank as world_rank
from psrt.topology import ProcessSet
from psrt.torch.compression import compressor
from psrt.torch.handles import poll, register, synchronize
from psrt.torch.ops import ReduceOp, resolve_op
from psrt.torch.validation import check_name, check_tensor, check_tensor_list

# ``psrt.torch`` rebinds the name ``allreduce`` to a function, so ``from psrt.torch import
# allreduce`` would not give the module; the functions are looked up at call time.
_allreduce_mod = importlib.import_module("psrt.torch.allreduce")
_collectives_mod = importlib.import_module("psrt.torch.collectives")

_LINEAR_OPS = (ReduceOp.Sum, ReduceOp.Average)


def _tracked(tensors: Sequence[object]) -> bool:
    """Whether autograd must record the call: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def _derived(name: str | None, suffix: str) -> str | None:
    return None if name is None else f"{name}.{suffix}"


def _linear(op: ReduceOp, collective: str) -> ReduceOp:
    if op not in _LINEAR_OPS:
        raise InvalidArgumentError(f"the gradient of {collective} with op={op.name} is not "
                                   "defined in psrt; use Sum or Average, or detach the input")
    return op


def _group(tensors: object, collective: str) -> list[torch.Tensor]:
    tensors = check_tensor_list(tensors)
    if not tensors:
        raise InvalidArgumentError(f"{collective} needs at least one tensor")
    return tensors


# -- handles of grouped asynchronous calls ---------------------------------------------------
class _HandleGroup:
    """Several handles completed and released as one (a ``handles.Completion``)."""

    def __init__(self, members: list[int], combine: Callable[[list], object]) -> None:
        self._members, self._combine = members, combine

    def done(self) -> bool:
        return all([poll(h) for h in self._members])

    def result(self) -> object:
        results, error = [], None
        for handle in self._members:  # release every member, even after one failed
            try:
                results.append(synchronize(handle))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return self._combine(results)


def _issue_each(start: Callable[[int, torch.Tensor], int], tensors: list[torch.Tensor],
                combine: Callable[[list], object] = list) -> int:
    """Start one operation per tensor; one handle whose synchronize returns ``combine(outputs)``.

    If starting one fails, the ones already started are completed and released
    (their peers started them too) before the error propagates.
    """
    members: list[int] = []
    try:
        for index, tensor in enumerate(tensors):
            members.append(start(index, tensor))
    except Exception:
        with contextlib.suppress(Exception):
            _HandleGroup(members, list).result()
        raise
    return register(_HandleGroup(members, combine))


# -- allreduce ----------------------------------------------------------------------------
class HorovodAllreduce(torch.autograd.Function):
    """Allreduce forward; the same allreduce (op and scale factors) of the gradient backward."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.name = name
        ctx.options = dict(average=average, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return _allreduce_mod.allreduce(tensor, name=name, **ctx.options)

    @staticmethod
    def backward(ctx, grad):
        _linear(resolve_op(ctx.options["op"], ctx.options["average"]), "allreduce")
        reduced = _allreduce_mod.allreduce(grad, name=_derived(ctx.name, "grad"), **ctx.options)
        return (reduced,) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set (default op Average), differentiably."""
    if not _tracked((tensor,)):
        return _allreduce_mod.allreduce(tensor, average, name, compression, op, prescale_factor,
                                        postscale_factor, process_set)
    compression = compressor(compression)
    compressed, state = compression.compress(tensor)
    reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    return compression.decompress(reduced, state)


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce forward and backward, with the same options."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set,
                *tensors):
        ctx.name = name
        ctx.options = dict(average=average, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return tuple(_allreduce_mod.grouped_allreduce(list(tensors), name=name, **ctx.options))

    @staticmethod
    def backward(ctx, *grads):
        _linear(resolve_op(ctx.options["op"], ctx.options["average"]), "grouped_allreduce")
        reduced = _allreduce_mod.grouped_allreduce(list(grads), name=_derived(ctx.name, "grad"),
                                                   **ctx.options)
        return (None,) * 6 + tuple(reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: object = None,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one operation, differentiably; returns new tensors."""
    tensors = check_tensor_list(tensors)
    if not _tracked(tensors):
        return _allreduce_mod.grouped_allreduce(tensors, average, name, compression, op,
                                                prescale_factor, postscale_factor, process_set)
    compression = compressor(compression)
    packed = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor,
                                            postscale_factor, process_set,
                                            *[t for t, _ in packed])
    return [compression.decompress(t, state) for t, (_, state) in zip(reduced, packed)]


# -- allgather ----------------------------------------------------------------------------
def _rows(shape: torch.Size) -> int:
    return shape[0] if len(shape) else 1  # a 0-d tensor is gathered as one row


def _row_offsets(rows: list[int], name: str | None, process_set: ProcessSet) -> list[int]:
    """Where this rank's rows start in each gathered tensor (the rows of lower set ranks)."""
    every = _collectives_mod.allgather(torch.tensor([rows], dtype=torch.int64),
                                       name=_derived(name, "grad.rows"), process_set=process_set)
    return every[:process_set.rank()].sum(dim=0).tolist()


class HorovodAllgather(torch.autograd.Function):
    """Allgather forward; backward averages the gradient over ranks and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.shape, ctx.name, ctx.process_set = tensor.shape, name, process_set
        return _collectives_mod.allgather(tensor, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        rows = _rows(ctx.shape)
        offset, = _row_offsets([rows], ctx.name, ctx.process_set)
        averaged = _allreduce_mod.allreduce(grad, name=_derived(ctx.name, "grad"),
                                            op=ReduceOp.Average, process_set=ctx.process_set)
        return averaged.narrow(0, offset, rows).reshape(ctx.shape), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension, differentiably."""
    if not _tracked((tensor,)):
        return _collectives_mod.allgather(tensor, name, process_set)
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather of each tensor (named ``name.0``, ``name.1``, ...); ``synchronize``
    returns the list of gathered tensors."""
    tensors = _group(tensors, "grouped_allgather")
    check_name(name)
    return _issue_each(lambda i, t: _collectives_mod.allgather_async(
        t, name=_derived(name, str(i)), process_set=process_set), tensors)


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
        averaged = _allreduce_mod.grouped_allreduce(list(grads), name=_derived(ctx.name, "grad"),
                                                    op=ReduceOp.Average,
                                                    process_set=ctx.process_set)
        return (None, None) + tuple(g.narrow(0, o, n).reshape(shape) for g, o, n, shape
                                    in zip(averaged, offsets, rows, ctx.shapes))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list, differentiably; returns the gathered tensors."""
    tensors = _group(tensors, "grouped_allgather")
    if not _tracked(tensors):
        return synchronize(grouped_allgather_async(tensors, name, process_set))
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ----------------------------------------------------------------------------
class HorovodBroadcast(torch.autograd.Function):
    """Broadcast forward; backward gives the root the Average of the gradients, others zeros."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.name, ctx.process_set = root_rank, name, process_set
        return _collectives_mod.broadcast(tensor, root_rank, name=name, process_set=process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = _allreduce_mod.allreduce(grad, name=_derived(ctx.name, "grad"),
                                            op=ReduceOp.Average, process_set=ctx.process_set)
        if world_rank() != ctx.root_rank:  # root_rank is a world rank, as in Horovod
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s tensor (a world rank in the set), differentiably."""
    if not _tracked((tensor,)):
        return _collectives_mod.broadcast(tensor, root_rank, name, process_set)
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall -----------------------------------------------------------------------------
class HorovodAlltoall(torch.autograd.Function):
    """Alltoall forward; backward sends each gradient block back where its rows came from."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = synchronize(_collectives_mod.alltoall_async(
            tensor, splits, name=name, process_set=process_set))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *_received_grad):
        returned, _ = _collectives_mod.alltoall(grad, splits=ctx.received,
                                                name=_derived(ctx.name, "grad"),
                                                process_set=ctx.process_set)
        return returned, None, None, None


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows to rank r, differentiably; returns the received rows and,
    when ``splits`` is given, the received splits (Horovod's return)."""
    if not _tracked((tensor,)):
        return _collectives_mod.alltoall(tensor, splits, name, process_set)
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# -- reducescatter ------------------------------------------------------------------------
def _reducescatter_grad_scale(op: object, prescale_factor: float, postscale_factor: float,
                              process_set: ProcessSet) -> float:
    op = _linear(resolve_op(op), "reducescatter")
    return prescale_factor * postscale_factor * (process_set.size() if op is ReduceOp.Sum else 1)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter forward; backward allgathers the scaled gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.name, ctx.process_set = name, process_set
        ctx.scale = (op, prescale_factor, postscale_factor, process_set)
        return _collectives_mod.reducescatter(tensor, name=name, op=op, process_set=process_set,
                                              prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor)

    @staticmethod
    def backward(ctx, grad):
        scaled = grad * _reducescatter_grad_scale(*ctx.scale)
        gathered = _collectives_mod.allgather(scaled, name=_derived(ctx.name, "grad"),
                                              process_set=ctx.process_set)
        return (gathered,) + (None,) * 5


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: object = None,
                  op: ReduceOp | None = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the set and keep this rank's block of rows (default op Average),
    differentiably.  Horovod's signature: ``compression`` comes third."""
    compression = compressor(compression)
    compressed, state = compression.compress(check_tensor(tensor))
    if _tracked((tensor,)):
        reduced = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                             postscale_factor)
    else:
        reduced = _collectives_mod.reducescatter(compressed, name, op, process_set,
                                                 prescale_factor, postscale_factor)
    return compression.decompress(reduced, state)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp | None = None,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor (named ``name.0``, ``name.1``, ...);
    ``synchronize`` returns the list of this rank's blocks."""
    tensors = _group(tensors, "grouped_reducescatter")
    check_name(name)
    return _issue_each(lambda i, t: _collectives_mod.reducescatter_async(
        t, name=_derived(name, str(i)), op=op, process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor), tensors)


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
            [g * scale for g in grads], _derived(ctx.name, "grad"), ctx.process_set))
        return (None,) * 5 + tuple(gathered)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: object = None, op: ReduceOp | None = None,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list, differentiably; returns this rank's blocks."""
    tensors = _group(tensors, "grouped_reducescatter")
    compression = compressor(compression)
    packed = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in packed]
    if _tracked(tensors):
        reduced = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                                    postscale_factor, *compressed)
    else:
        reduced = synchronize(grouped_reducescatter_async(compressed, name, op, process_set,
                                                          prescale_factor, postscale_factor))
    return [compression.decompress(t, state) for t, (_, state) in zip(reduced, packed)]


# -- sparse allreduce ---------------------------------------------------------------------
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp | None,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Start a Sum or Average of a sparse COO tensor over the set, Horovod's way: allgather
    the indices (as ``name.indices``) and the values (as ``name.values``).

    Returns a function that waits and returns the result (``handle()``, as in Horovod):
    every rank's entries side by side, not coalesced, the values divided by the set size
    for Average.  An integer Average is coalesced first, so that each sum is rounded toward
    zero once, as a dense integer Average is.  Every rank must pass a tensor of the same
    size and dtype, with any number of entries.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        kind = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ArgumentTypeError(f"sparse_allreduce_async needs a sparse COO tensor, got {kind}")
    op = resolve_op(op)
    if op not in _LINEAR_OPS:
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

    handle = _issue_each(lambda i, t: _collectives_mod.allgather_async(
        t, name=_derived(name, suffixes[i]), process_set=process_set), parts, combine)
    return functools.partial(synchronize, handle)
