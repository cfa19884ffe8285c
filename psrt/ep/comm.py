"""The all-to-all of expert parallelism, over an EP process set, with its autograd.

Dispatch and combine send each rank a different number of token rows (uneven splits).  They
run on the set's direct group (:meth:`psrt.comm.direct.DirectGroup.all_to_all`), on the
caller's thread like TP's collectives: the members exchange their row counts and row shapes
first, so a rank sending rows of another width is one error on every rank.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from psrt.autograd import skips_without_gradient
from psrt.comm.stats import CommStats
from psrt.runtime import Runtime, given
from psrt.topology import ProcessSet

_LABEL = "expert-parallel"


def stats(runtime: Runtime | None = None) -> CommStats:
    """The expert-parallel all-to-alls ``runtime`` (default: the current one) has run since the
    last ``reset()`` and the seconds spent in them."""
    return given(runtime).stats[_LABEL]



def exchange(tensor: torch.Tensor, send_rows: Sequence[int], process_set: ProcessSet,
             received: Sequence[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Rows ``[sum(send_rows[:r]), sum(send_rows[:r + 1]))`` go to member r; returns what
    arrived (in member order) and how many rows came from each member (``received``: known
    already, agreed with the members, which skips their exchange).  No autograd."""
    start = time.perf_counter()
    topology = process_set.topology  # the set's registration gives its direct group and counts
    out, arrived = topology.direct(process_set).all_to_all(tensor, list(send_rows), label=_LABEL, received=received)
    topology.stats[_LABEL].add("all_to_all", start)
    return out, arrived


@skips_without_gradient
class _AllToAll(torch.autograd.Function):
    """:func:`exchange` forward; backward sends each gradient row back where its row came from."""

    @staticmethod
    def forward(ctx, tensor, send_rows, received, process_set):
        out, _ = exchange(tensor, send_rows, process_set, received)
        ctx.send_rows, ctx.received, ctx.process_set = send_rows, received, process_set
        return out

    @staticmethod
    def backward(ctx, grad):
        back, _ = exchange(grad.contiguous(), ctx.received, ctx.process_set, ctx.send_rows)
        return back, None, None, None


def all_to_all(tensor: torch.Tensor, send_rows: Sequence[int], received: Sequence[int],
               process_set: ProcessSet) -> torch.Tensor:
    """Differentiable :func:`exchange` of rows whose counts (``send_rows`` out, ``received`` in)
    and row shape the members have agreed on already.

    Collective: every rank of ``process_set`` calls it, in the same order, and runs backward
    through it (the backward communicates).
    """
    return _AllToAll.apply(tensor, tuple(send_rows), tuple(received), process_set)
