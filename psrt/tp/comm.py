"""The collectives of tensor parallelism, over a TP process set.

They sit on every layer's critical path and are called in the same order on
every rank of the set by construction (the ranks run the same layers on the
same batch), so they go straight to a communicator of the set's own (never the
one the engine thread uses) instead of through the engine's negotiation, which
costs ~0.4 ms per call on a CPU host.  What
negotiation would have caught, disagreeing shapes or dtypes, is checked by a
small all-reduce of the call's digest on the host communicator before each
collective: every rank of the set raises the same
:class:`CollectiveMismatchError` (naming both shapes) instead of hanging or
reducing mismatched buffers.  ``PSRT_TP_CHECK_SHAPES=0`` skips the
header (one small collective less per call) for jobs whose shapes are known good.

``stats`` counts the collectives by kind and the seconds spent in them, for
tests (which check the number of collectives per layer) and benchmarks (which
report the communication share of a step).
"""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from psrt import runtime
from psrt.comm.base import Communicator, ReduceOp
from psrt.errors import CollectiveMismatchError, InvalidArgumentError
from psrt.topology import ProcessSet

_HEADER_DIMS = 8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class CommStats:
    """Collectives run since the last ``reset``: how many of each kind, and how long."""

    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def reset(self) -> None:
        self.counts.clear()
        self.seconds = 0.0


stats = CommStats()


def group_size(process_set: ProcessSet | None) -> int:
    return 1 if process_set is None else process_set.size()


def group_rank(process_set: ProcessSet | None) -> int:
    return 0 if process_set is None else process_set.rank()


def all_reduce_(tensor: torch.Tensor, process_set: ProcessSet | None, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Reduce a contiguous ``tensor`` in place over the set; returns it."""
    if group_size(process_set) == 1:
        return tensor
    with _timed("all_reduce", process_set):
        _transport(process_set, tensor, "all_reduce").allreduce(tensor, op)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in set-rank order."""
    size = group_size(process_set)
    if size == 1:
        return tensor
    with _timed("all_gather", process_set):
        comm = _transport(process_set, tensor, "all_gather")
        send = tensor.contiguous()
        out = torch.empty((size, *send.shape), dtype=send.dtype, device=send.device)
        _finish(comm.allgatherv(send.view(-1), out.view(-1), [send.numel()] * size), send)
    return out.flatten(0, 1) if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """Sum over the set, then keep this rank's block of ``dim`` (which the size must divide)."""
    size = group_size(process_set)
    if size == 1:
        return tensor
    with _timed("reduce_scatter", process_set):
        comm = _transport(process_set, tensor, "reduce_scatter")  # agreed first: every rank raises alike
        _check_divisible(tensor, dim, size)
        send = torch.stack(tensor.chunk(size, dim)) if dim != 0 else tensor.contiguous()
        block = send.shape[1:] if dim != 0 else (tensor.shape[0] // size, *tensor.shape[1:])
        out = torch.empty(block, dtype=tensor.dtype, device=tensor.device)
        _finish(comm.reduce_scatter(send.reshape(-1), out.view(-1), [out.numel()] * size, ReduceOp.SUM), send)
    return out


def split(tensor: torch.Tensor, dim: int, process_set: ProcessSet | None) -> torch.Tensor:
    """This rank's block of ``dim`` (no communication)."""
    size = group_size(process_set)
    if size == 1:
        return tensor
    _check_divisible(tensor, dim, size)
    return tensor.chunk(size, dim)[group_rank(process_set)].contiguous()


def _check_divisible(tensor: torch.Tensor, dim: int, size: int) -> None:
    if tensor.shape[dim] % size:
        raise InvalidArgumentError(f"dimension {dim} of a tensor of shape {tuple(tensor.shape)} is not "
                                   f"divisible by the tensor-parallel size {size}")


@contextmanager
def _timed(kind: str, process_set: ProcessSet) -> Iterator[None]:
    """Count and time one collective, and let the watchdog report it if it stalls."""
    current = runtime.current()
    start = time.perf_counter()
    with current.watchdog.waiting("a tensor-parallel collective",
                                  lambda: f"tensor-parallel {kind} on rank {current.topology.world.rank} over "
                                          f"{process_set!r}", lambda: current.topology.ranks_of(process_set)):
        yield
    stats.counts[kind] += 1
    stats.seconds += time.perf_counter() - start


def _transport(process_set: ProcessSet, tensor: torch.Tensor, kind: str) -> Communicator:
    """The set's communicator for ``tensor``'s device, after every rank agreed on the call."""
    current = runtime.current()
    check = current.config.tp_check_shapes
    setting = ("PSRT_TP_CHECK_SHAPES", check)
    topology = current.topology
    if check:
        _agree(topology, process_set, topology.direct(process_set, None, setting), kind, tensor)
    return topology.direct(process_set, tensor.device, setting)


def agree(process_set: ProcessSet | None, value: object) -> list:
    """Every rank's ``value``, in set-rank order (a small host exchange on the set's own
    communicator): for checks that must fail on every rank alike before a collective."""
    if group_size(process_set) == 1:
        return [value]
    current = runtime.current()
    setting = ("PSRT_TP_CHECK_SHAPES", current.config.tp_check_shapes)
    with current.watchdog.waiting("a tensor-parallel collective",
                                  lambda: f"a tensor-parallel check on rank {current.topology.world.rank} over "
                                          f"{process_set!r}", lambda: current.topology.ranks_of(process_set)):
        return current.topology.direct(process_set, None, setting).allgather_object(value)


def _agree(topology, process_set: ProcessSet, host: Communicator, kind: str, tensor: torch.Tensor) -> None:
    """One all-reduce (max of the call's digest and of its negation) tells every rank
    whether all made the same call; only when they did not are the headers gathered,
    to name what differs."""
    digest = hash((_KINDS.index(kind), _dtype_index(tensor.dtype), *tensor.shape))
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    host.allreduce(extremes, ReduceOp.MAX)
    highest, negated_lowest = extremes.tolist()
    if highest == -negated_lowest:
        return
    header = _header(kind, tensor)
    everyone = torch.empty((host.size, header.numel()), dtype=torch.int64)
    host.allgatherv(header, everyone.view(-1), [header.numel()] * host.size).wait()
    differing = (everyone != header).any(dim=1).nonzero().flatten().tolist() or [host.rank]
    ranks = topology.ranks_of(process_set)
    raise CollectiveMismatchError(
        f"tensor-parallel {kind} over {process_set!r}: rank {ranks[host.rank]} has "
        f"{_describe(header)} but rank {ranks[differing[0]]} has {_describe(everyone[differing[0]])}")


def _finish(request, tensor: torch.Tensor) -> None:
    """Host collectives complete here; CUDA ones are ordered on the stream, so the host
    need not wait for them."""
    if not tensor.is_cuda:
        request.wait()


def _header(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """Kind, dtype, number of dimensions and the first ``_HEADER_DIMS`` sizes: enough to
    name what differs (built only once ranks are known to disagree)."""
    shape = list(tensor.shape)[:_HEADER_DIMS]
    shape += [-1] * (_HEADER_DIMS - len(shape))
    return torch.tensor([_KINDS.index(kind), _dtype_index(tensor.dtype), tensor.dim(), *shape], dtype=torch.int64)


def _dtype_index(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _describe(header: torch.Tensor) -> str:
    kind, dtype, ndim, *shape = header.tolist()
    name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "another dtype"
    dims = ", ".join(map(str, shape[:ndim])) + (", ..." if ndim > _HEADER_DIMS else "")
    return f"{_KINDS[kind]} of a {name} tensor of shape ({dims}{',' if ndim == 1 else ''})"
