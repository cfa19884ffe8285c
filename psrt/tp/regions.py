"""The autograd functions at the edges of tensor- and sequence-parallel regions.

Each one's name says what it does in forward; its backward is the transpose.
A "tensor-parallel region" is where activations are split along the hidden
(last) dimension across the TP set; a "sequence-parallel region" is where they
are split along the sequence (``SEQUENCE_DIM``, batch-first layout) instead.
A region given no gradient passes none on and runs no collective (:mod:`psrt.autograd`): a zero-bubble
weight pass (:mod:`psrt.pp.split_backward`) sends none along the activations'
path, and every rank of the set skips alike.
"""
from __future__ import annotations

import torch

from psrt.autograd import skips_without_gradient
from psrt.topology import ProcessSet
from psrt.tp import comm

SEQUENCE_DIM = 1  # activations are [batch, sequence, hidden]
HIDDEN_DIM = -1


@skips_without_gradient
class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (each rank's partial input grad)."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce_(grad.contiguous().clone(), ctx.process_set), None


@skips_without_gradient
class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward (summing partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, process_set):
        return comm.all_reduce_(x.contiguous().clone(), process_set)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@skips_without_gradient
class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's block of the hidden dimension; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return comm.split(x, HIDDEN_DIM, process_set)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, HIDDEN_DIM, ctx.process_set), None


@skips_without_gradient
class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the hidden dimension; keep this rank's block of the gradient backward."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return comm.all_gather(x, HIDDEN_DIM, process_set)

    @staticmethod
    def backward(ctx, grad):
        return comm.split(grad, HIDDEN_DIM, ctx.process_set), None


@skips_without_gradient
class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's block of the sequence; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return comm.split(x, SEQUENCE_DIM, process_set)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, SEQUENCE_DIM, ctx.process_set), None


@skips_without_gradient
class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence before a column-parallel layer; backward reduce-scatters,
    since every rank's gradient of the full sequence is partial."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return comm.all_gather(x, SEQUENCE_DIM, process_set)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad, SEQUENCE_DIM, ctx.process_set), None


@skips_without_gradient
class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Sum partial outputs and keep this rank's block of the sequence; all-gather backward."""

    @staticmethod
    def forward(ctx, x, process_set):
        ctx.process_set = process_set
        return comm.reduce_scatter(x, SEQUENCE_DIM, process_set)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, SEQUENCE_DIM, ctx.process_set), None


class _SequenceParallelParameters(torch.autograd.Function):
    """Identity forward on parameters used inside a sequence-parallel region; backward sums
    their gradients over the TP set in one all-reduce, since each rank saw only its block
    of the sequence."""

    @staticmethod
    def forward(ctx, process_set, *params):
        ctx.process_set = process_set
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_(flat, ctx.process_set)
        return (None, *(piece.view_as(g) for piece, g in zip(flat.split([g.numel() for g in grads]), grads)))


def _region(function: type[torch.autograd.Function]):
    def apply(x: torch.Tensor, process_set: ProcessSet | None) -> torch.Tensor:
        return x if comm.group_size(process_set) == 1 else function.apply(x, process_set)
    apply.__name__ = function.__name__.lstrip("_")
    apply.__doc__ = function.__doc__
    return apply


copy_to_tensor_parallel_region = _region(_CopyToTensorParallelRegion)
"""``copy_to_tensor_parallel_region(x, process_set)``: identity forward; all-reduce of the gradient
backward (each rank's partial input grad).  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order, and runs
backward through it (the backward communicates).
"""
reduce_from_tensor_parallel_region = _region(_ReduceFromTensorParallelRegion)
"""``reduce_from_tensor_parallel_region(x, process_set)``: all-reduce forward (summing partial
outputs); identity backward.  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order.
"""
scatter_to_tensor_parallel_region = _region(_ScatterToTensorParallelRegion)
"""``scatter_to_tensor_parallel_region(x, process_set)``: keep this rank's block of the hidden
dimension; all-gather the gradient backward.  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order, and runs
backward through it (the backward communicates).
"""
gather_from_tensor_parallel_region = _region(_GatherFromTensorParallelRegion)
"""``gather_from_tensor_parallel_region(x, process_set)``: all-gather along the hidden dimension; keep
this rank's block of the gradient backward.  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order.
"""
scatter_to_sequence_parallel_region = _region(_ScatterToSequenceParallelRegion)
"""``scatter_to_sequence_parallel_region(x, process_set)``: keep this rank's block of the sequence;
all-gather the gradient backward.  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order, and runs
backward through it (the backward communicates).
"""
gather_from_sequence_parallel_region = _region(_GatherFromSequenceParallelRegion)
"""``gather_from_sequence_parallel_region(x, process_set)``: all-gather the sequence before a column-
parallel layer; backward reduce-scatters, since every rank's gradient of the full sequence is
partial.  With ``process_set`` None or of one rank, ``x`` itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order.
"""
reduce_scatter_to_sequence_parallel_region = _region(_ReduceScatterToSequenceParallelRegion)
"""``reduce_scatter_to_sequence_parallel_region(x, process_set)``: sum partial outputs and keep this
rank's block of the sequence; all-gather backward.  With ``process_set`` None or of one rank, ``x``
itself.

Collective: every rank of ``process_set`` (the TP set) calls it, in the same order.
"""


def sequence_parallel_parameters(process_set: ProcessSet | None, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``params`` as used inside a sequence-parallel region: their gradients come out summed
    over the TP set, so every rank's replica gets the full-sequence gradient.

    Collective: every rank of ``process_set`` (the TP set) calls it, in the same order, and runs
    backward through it (the backward communicates).
    """
    if comm.group_size(process_set) == 1 or not torch.is_grad_enabled():
        return params
    return _SequenceParallelParameters.apply(process_set, *params)
