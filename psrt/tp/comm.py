"""The collectives of tensor parallelism, over a TP process set.

They sit on every layer's critical path and are called in the same order on every rank
of the set by construction (the ranks run the same layers on the same batch), so they run
on the set's direct group (:mod:`psrt.comm.direct`) instead of through the engine's
negotiation.  The group checks that every rank made the same call (collective, dtype,
shape, op) once per such call: the first time a call is made, the ranks exchange it (one
small collective); later calls of it run on a communicator of its own with no check
(:mod:`psrt.comm.keyed`).  A rank whose call differs, new or known, is still the same
:class:`CollectiveMismatchError` on every rank, naming the ranks, their calls and call
sites, never a hang or a reduction of mismatched buffers: at once where every rank's call
was new, otherwise a second or two later, when the watchdog finds the ranks blocked on
different calls' communicators (:mod:`psrt.comm.breaker`).  CUDA tensors are checked on
every call.  ``PSRT_TP_CHECK_SHAPES=0`` skips the check entirely, for jobs whose shapes are
known good (a mismatch is then the transport's undefined behaviour); every rank of a set
must run with the same setting.

:func:`stats` counts the collectives by kind and the seconds spent in them, for tests
(which check the number of collectives per layer) and benchmarks (which report the
communication share of a step); the counts belong to the runtime.
"""
from __future__ import annotations

import time

import torch

from psrt.comm.base import ElementwiseOp
from psrt.comm.direct import DirectGroup
from psrt.comm.header import check_divisible
from psrt.comm.keyed import ONCE
from psrt.comm.stats import CommStats
from psrt.runtime import Runtime, given
from psrt.topology import ProcessSet

_LABEL = "tensor-parallel"


def stats(runtime: Runtime | None = None) -> CommStats:
    """The tensor-parallel collectives ``runtime`` (default: the current one) has run since the
    last ``reset()``."""
    return given(runtime).stats[_LABEL]


def group_size(process_set: ProcessSet | None) -> int:
    return 1 if process_set is None else process_set.size()


def group_rank(process_set: ProcessSet | None) -> int:
    return 0 if process_set is None else process_set.rank()


def all_reduce_(tensor: torch.Tensor, process_set: ProcessSet | None,
                op: ElementwiseOp = ElementwiseOp.SUM) -> torch.Tensor:
    """Reduce a contiguous ``tensor`` in place over the set; returns it."""
    if group_size(process_set) == 1:
        return tensor
    start = time.perf_counter()
    group, check, counts = _group(process_set)
    group.all_reduce_(tensor, op, label=_LABEL, check=check)
    counts.add("all_reduce", start)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in set-rank order."""
    if group_size(process_set) == 1:
        return tensor
    start = time.perf_counter()
    group, check, counts = _group(process_set)
    out = group.all_gather(tensor, dim, label=_LABEL, check=check)
    counts.add("all_gather", start)
    return out


def reduce_scatter(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """Sum over the set, then keep this rank's block of ``dim`` (which the size must divide)."""
    if group_size(process_set) == 1:
        return tensor
    start = time.perf_counter()
    group, check, counts = _group(process_set)
    out = group.reduce_scatter(tensor, dim, label=_LABEL, check=check)
    counts.add("reduce_scatter", start)
    return out


def split(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """This rank's block of ``dim`` (no communication)."""
    size = group_size(process_set)
    if size == 1:
        return tensor
    check_divisible(tensor, dim, size, _LABEL)
    return tensor.chunk(size, dim)[group_rank(process_set)].contiguous()


def agree(process_set: ProcessSet | None, value: object) -> list:
    """Every rank's ``value``, in set-rank order (a small host exchange on the set's direct
    group): for checks that must fail on every rank alike before a collective."""
    if group_size(process_set) == 1:
        return [value]
    group, _, _ = _group(process_set)
    return group.allgather_object(value, label=_LABEL)


def _group(process_set: ProcessSet) -> tuple[DirectGroup, bool | str, CommStats]:
    """The set's direct group; how calls on it are checked (once per call, or not at all: a
    setting every rank of the set must share, which the group compares on its first
    collective); the counts.  All from the topology the set is registered with: nothing is
    looked up per call."""
    topology = process_set.topology
    return topology.direct(process_set), ONCE if topology.tp_check_shapes else False, topology.stats[_LABEL]
