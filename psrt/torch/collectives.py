"""Allgather, broadcast, alltoall, reducescatter and barrier on torch CPU tensors.

Horovod-compatible names, arguments and semantics.  Each call becomes a named
work for the engine, which matches ranks by name and checks that the
arguments that must agree (dtype, shapes, root, op) do, before any data
moves; ranks learn each other's first dimensions (allgather) or splits
(alltoall) when the collective runs.
"""
from __future__ import annotations

import math

import torch

from psrt.comm.base import Communicator
from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt import runtime
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_root, check_scale, check_splits, check_tensor


def _prepare(tensor: object, name: object,
             process_set: ProcessSet) -> tuple[torch.Tensor, list[int]]:
    """Validate on the calling rank; returns the tensor and the set's world ranks."""
    tensor = check_tensor(tensor)
    check_name(name)
    return tensor, _common.set_ranks(process_set)


def _work(collective: str, tensor: torch.Tensor, name: str | None, process_set: ProcessSet,
          ranks: list[int], agreed: dict, execute, finish=lambda value: value):
    """An engine work whose ranks must agree on dtype, device and ``agreed``."""
    descriptor = (("dtype", tensor.dtype), ("device", tensor.device.type), *agreed.items())
    return _common.make_work(collective, name, process_set, ranks, descriptor, tensor.device,
                             execute=execute, finish=finish)


def _rows_and_tail(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """First dimension and the rest; a 0-d tensor counts as one row."""
    return (1, ()) if tensor.dim() == 0 else (tensor.shape[0], tuple(tensor.shape[1:]))


# -- allgather -------------------------------------------------------------------
def _allgather_work(tensor, name, process_set, ranks):
    rows, tail = _rows_and_tail(tensor)
    send = _common.contiguous_buffer(tensor).reshape(-1)

    def execute(host: Communicator, data: Communicator) -> torch.Tensor:
        all_rows = host.exchange_counts([rows] * host.size)
        output = torch.empty((sum(all_rows), *tail), dtype=tensor.dtype, device=tensor.device)
        row = math.prod(tail)
        data.allgatherv(send, output.view(-1), [r * row for r in all_rows]).wait()
        return output

    return _work("allgather", tensor, name, process_set, ranks, {"trailing_shape": tail}, execute)


def _allgather(tensor, name, process_set, blocking):
    tensor, ranks = _prepare(tensor, name, process_set)
    return _common.submit(_allgather_work(tensor, name, process_set, ranks), blocking)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank)."""
    return _allgather(tensor, name, process_set, True)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _allgather(tensor, name, process_set, False)


def allgather_into_async(tensor: torch.Tensor, output: torch.Tensor, name: str | None = None,
                         process_set: ProcessSet = global_process_set) -> int:
    """Start gathering every rank's equally sized ``tensor`` into ``output``, in rank order,
    without allocating (``torch.distributed.all_gather_into_tensor``; psrt's addition).

    ``output`` must be contiguous, of ``tensor``'s dtype and device, with set-size times its
    elements, and must not overlap ``tensor``.  ``synchronize`` returns ``output``.
    """
    tensor, ranks = _prepare(tensor, name, process_set)
    output = check_tensor(output, "output")
    if not output.is_contiguous() or output.dtype != tensor.dtype or output.device != tensor.device \
            or output.numel() != tensor.numel() * len(ranks):
        raise InvalidArgumentError(
            f"allgather_into: output must be a contiguous {tensor.dtype} tensor on {tensor.device} with "
            f"{len(ranks)} x {tensor.numel()} elements, got {output.dtype} on {output.device} with "
            f"{output.numel()}{'' if output.is_contiguous() else ' (not contiguous)'}")
    if output.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
        raise InvalidArgumentError("allgather_into: output and tensor share memory; gather from a copy")
    send = _common.contiguous_buffer(tensor).reshape(-1)

    def execute(host: Communicator, data: Communicator) -> torch.Tensor:
        data.allgatherv(send, output.view(-1), [send.numel()] * len(ranks)).wait()
        return output

    work = _work("allgather_into", tensor, name, process_set, ranks, {"numel": send.numel()}, execute)
    return _common.submit(work, False)


# -- broadcast -------------------------------------------------------------------
def _broadcast(tensor, root_rank, name, process_set, in_place, blocking):
    tensor, ranks = _prepare(tensor, name, process_set)
    root = check_root(root_rank, ranks)
    if in_place:
        buffer = _common.contiguous_buffer(tensor)
        target = tensor
    else:
        buffer = target = tensor.detach().clone(memory_format=torch.contiguous_format)

    def execute(host: Communicator, data: Communicator) -> None:
        data.broadcast(buffer, ranks.index(root)).wait()

    work = _work("broadcast", tensor, name, process_set, ranks,
                 {"shape": tuple(tensor.shape), "root_rank": root}, execute,
                 lambda _: _common.write_back(target, buffer))
    return _common.submit(work, blocking)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s tensor (a global rank, member of the process set)."""
    return _broadcast(tensor, root_rank, name, process_set, False, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns ``tensor``."""
    return _broadcast(tensor, root_rank, name, process_set, True, True)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _broadcast(tensor, root_rank, name, process_set, False, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    return _broadcast(tensor, root_rank, name, process_set, True, False)


# -- alltoall --------------------------------------------------------------------
def _alltoall(tensor, splits, name, process_set, blocking):
    tensor, ranks = _prepare(tensor, name, process_set)
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    rows, tail = _rows_and_tail(tensor)
    splits = check_splits(splits, rows, len(ranks))
    send = _common.contiguous_buffer(tensor).reshape(-1)
    row = math.prod(tail)

    def execute(host: Communicator, data: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        received = host.exchange_counts(splits)
        output = torch.empty((sum(received), *tail), dtype=tensor.dtype, device=tensor.device)
        data.alltoallv(send, [s * row for s in splits], output.view(-1),
                       [r * row for r in received]).wait()
        return output, torch.tensor(received, dtype=torch.int32)

    work = _work("alltoall", tensor, name, process_set, ranks, {"trailing_shape": tail}, execute)
    return _common.submit(work, blocking)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows to rank r; returns the received rows and, when ``splits`` is
    given, the received splits (an int32 tensor), as Horovod's ``alltoall`` does.

    Without ``splits`` the first dimension is divided evenly.
    """
    output, received = _alltoall(tensor, splits, name, process_set, True)
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`alltoall`; ``synchronize(handle)`` returns (received rows, received
    splits) whether or not splits were given, as Horovod's does."""
    return _alltoall(tensor, splits, name, process_set, False)


# -- reducescatter -----------------------------------------------------------------
def reducescatter_rows(rows: int, set_size: int) -> list[int]:
    """Rows each rank keeps: the first ``rows % size`` ranks get one more, as in Horovod."""
    base, extra = divmod(rows, set_size)
    return [base + (1 if r < extra else 0) for r in range(set_size)]


def _reducescatter_work(tensor, name, op, pre, post, process_set, ranks):
    rows, tail = _rows_and_tail(tensor)
    row = math.prod(tail)
    kept = reducescatter_rows(rows, len(ranks))
    me = ranks.index(runtime.rank())
    send = _common.contiguous_buffer(tensor)
    if pre != 1.0:
        send = send.clone()
        _common.scale_(send, pre)
    output = torch.empty((kept[me], *tail), dtype=tensor.dtype, device=tensor.device)

    def execute(host: Communicator, data: Communicator) -> None:
        data.reduce_scatter(send.view(-1), output.view(-1), [k * row for k in kept],
                            transport_op(op)).wait()

    def finish(_: object) -> torch.Tensor:
        _common.postscale_(output, op is ReduceOp.Average, post, len(ranks))
        return output

    agreed = {"shape": tuple(tensor.shape), "op": op.name, "prescale_factor": pre,
              "postscale_factor": post}
    return _work("reducescatter", tensor, name, process_set, ranks, agreed, execute, finish)


def _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor, blocking):
    tensor, ranks = _prepare(tensor, name, process_set)
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    op = resolve_op(op)
    if tensor.dtype == torch.bool:
        raise InvalidArgumentError("reducescatter is not defined for bool tensors")
    if op not in (ReduceOp.Sum, ReduceOp.Average):
        raise UnsupportedOperationError(f"reducescatter supports only Sum and Average, got {op.name}")
    pre = check_scale(prescale_factor, "prescale_factor")
    post = check_scale(postscale_factor, "postscale_factor")
    work = _reducescatter_work(tensor, name, op, pre, post, process_set, ranks)
    return _common.submit(work, blocking)


def reducescatter(tensor: torch.Tensor, name: str | None = None, op: ReduceOp | None = None,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce over the set and keep this rank's block of rows (default op Average)."""
    return _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor, True)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None,
                        op: ReduceOp | None = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    return _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor,
                          False)


# -- barrier -------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier.

    It runs through the engine like any collective, so outstanding async
    operations keep progressing around it.
    """
    ranks = _common.set_ranks(process_set)

    def execute(host: Communicator, data: Communicator) -> None:
        host.barrier().wait()

    _common.submit(_common.make_work("barrier", "barrier", process_set, ranks, (),
                                     torch.device("cpu"), execute=execute), True)
