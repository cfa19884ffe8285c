"""Adasum, Horovod's adaptive summation (``op=hvd.Adasum``), for allreduce on CPU tensors.

Two gradients ``a`` and ``b`` are combined as

    a ⊕ b = (1 - a·b / (2‖a‖²)) a + (1 - a·b / (2‖b‖²)) b

which is their sum when they are orthogonal and their mean when they are parallel, so a
large effective batch does not overshoot the way a plain sum does.  Over a process set
whose size is a power of two the combination is applied as a binary tree: at level
``l`` (1, 2, 4, ...) rank ``r`` and rank ``r ^ l`` combine what their halves of the tree
hold so far, the lower rank's as ``a``.  Horovod (``horovod/common/ops/adasum``) walks the
same tree with vector halving and distance doubling; psrt uses recursive doubling, in
which the two ranks of a level exchange whole tensors: log2(size) exchanges of the whole
tensor, the same combinations.

Each tensor of a call gets its own coefficients (a grouped call is not one long
vector), dot products and norms are taken in float64, and a level's result is computed
in float64 and rounded to the tensor's dtype, as Horovod does.  The lower rank of each
pair computes the coefficients and sends them to the higher one, so both apply the
same numbers and every rank ends with bit-identical tensors.
"""
from __future__ import annotations

import math
import sys
from typing import Sequence

import torch

from psrt.comm.base import Communicator, all_of
from psrt.errors import UnsupportedOperationError

#: Below this squared norm a vector counts as zero and keeps weight 1 (Horovod's threshold).
_ZERO_NORM_SQUARED = math.sqrt(sys.float_info.min)
_DATA_TAG, _WEIGHTS_TAG = 0, 1


def check_arguments(tensors: Sequence[torch.Tensor], set_size: int, collective: str) -> None:
    """Raise, before any communication, for what Adasum cannot combine."""
    bad = sorted({str(t.dtype) for t in tensors if not t.is_floating_point()})
    if bad:
        raise UnsupportedOperationError(f"{collective} with op=Adasum needs floating-point tensors, "
                                        f"got {', '.join(bad)}")
    devices = sorted({str(t.device) for t in tensors if not t.is_cpu})
    if devices:
        raise UnsupportedOperationError(f"{collective} with op=Adasum runs on CPU tensors only, got "
                                        f"tensors on {', '.join(devices)}")
    if set_size & (set_size - 1):
        raise UnsupportedOperationError(f"{collective} with op=Adasum needs a process set whose size is "
                                        f"a power of two, this one has {set_size} ranks")


def coefficients(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Adasum's weights of ``a`` and ``b`` (flat tensors); a zero vector keeps weight 1."""
    a64, b64 = a.double(), b.double()
    dot = torch.dot(a64, b64).item()
    a_squared, b_squared = torch.dot(a64, a64).item(), torch.dot(b64, b64).item()
    a_weight = 1.0 - dot / (2.0 * a_squared) if a_squared >= _ZERO_NORM_SQUARED else 1.0
    b_weight = 1.0 - dot / (2.0 * b_squared) if b_squared >= _ZERO_NORM_SQUARED else 1.0
    return a_weight, b_weight


def combine(a: torch.Tensor, b: torch.Tensor, a_weight: float, b_weight: float) -> torch.Tensor:
    """``a_weight * a + b_weight * b`` computed in float64, in ``a``'s dtype."""
    return (a.double() * a_weight).add_(b.double() * b_weight).to(a.dtype)


def allreduce_(comm: Communicator, tensors: Sequence[torch.Tensor]) -> None:
    """Replace each of ``tensors`` by the Adasum of the ranks' tensors, in place.

    Collective over ``comm``, whose size must be a power of two; every rank passes
    contiguous tensors of the same shapes and dtypes, in the same order.
    """
    flat = [t.view(-1) for t in tensors]
    level = 1
    while level < comm.size:
        peer, lower = comm.rank ^ level, comm.rank & level == 0
        theirs = [torch.empty_like(f) for f in flat]
        all_of([comm.isend(f, peer, _DATA_TAG) for f in flat]
               + [comm.irecv(t, peer, _DATA_TAG) for t in theirs]).wait()
        pairs = [(mine, other) if lower else (other, mine) for mine, other in zip(flat, theirs)]
        if lower:
            weights = torch.tensor([coefficients(a, b) for a, b in pairs], dtype=torch.float64)
            comm.send(weights, peer, _WEIGHTS_TAG)
        else:
            weights = torch.empty((len(flat), 2), dtype=torch.float64)
            comm.recv(weights, peer, _WEIGHTS_TAG)
        for mine, (a, b), (a_weight, b_weight) in zip(flat, pairs, weights.tolist()):
            mine.copy_(combine(a, b, a_weight, b_weight))
        level <<= 1
