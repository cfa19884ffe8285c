"""What the differentiable collectives share, and the gradients they give.

``allreduce``, ``grouped_allreduce``, ``allgather``, ``grouped_allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``grouped_reducescatter``
(each in its family's module) return what the plain collectives return and, when an input requires a
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
from typing import Callable, Sequence

import torch

from psrt.engine import Channel, Work
from psrt.errors import InvalidArgumentError
from psrt.torch.ops import ReduceOp
from psrt.torch.validation import check_tensor_list

LINEAR_OPS = (ReduceOp.Sum, ReduceOp.Average)


def tracked(tensors: Sequence[object]) -> bool:
    """Whether autograd must record the call: grad mode is on and an input requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors)


def derived(name: str | None, suffix: str) -> str | None:
    return None if name is None else f"{name}.{suffix}"


def linear(op: ReduceOp, collective: str) -> ReduceOp:
    if op not in LINEAR_OPS:
        raise InvalidArgumentError(f"the gradient of {collective} with op={op.name} is not "
                                   "defined in psrt; use Sum or Average, or detach the input")
    return op


def tensor_group(tensors: object, collective: str) -> list[torch.Tensor]:
    tensors = check_tensor_list(tensors)
    if not tensors:
        raise InvalidArgumentError(f"{collective} needs at least one tensor")
    return tensors


class WorkGroup:
    """Several works of one channel completing as one (what a grouped call's handle stands
    for): waited for together, every one of them even after one failed."""

    def __init__(self, channel: Channel, works: list[Work], combine: Callable[[list], object] = list) -> None:
        self._channel, self._works, self._combine = channel, works, combine

    def done(self) -> bool:
        return all([work.done() for work in self._works])

    def result(self) -> object:
        results, error = [], None
        for work in self._works:
            try:
                results.append(self._channel.wait(work))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return self._combine(results)


def start_each(channel: Channel, builders: Sequence[Callable[[], Work]]) -> list[Work]:
    """Build and start one work per builder, in order; returns them.

    If building or starting one fails, the ones already started are waited for (their
    peers started them too) before the error propagates.
    """
    works: list[Work] = []
    try:
        for build in builders:
            works.append(channel.start(build()))
    except Exception:
        with contextlib.suppress(Exception):
            WorkGroup(channel, works).result()
        raise
    return works
