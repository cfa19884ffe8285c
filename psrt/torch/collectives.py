"""Allgather, broadcast, alltoall, reducescatter and barrier on torch CPU tensors.

Horovod-compatible names, arguments and semantics.  Every rank of the
process set must call the same collectives in the same order; arguments that
must agree across ranks are checked before any data moves, and ranks learn
each other's first dimensions (allgather) or splits (alltoall) in the same
step.
"""
from __future__ import annotations

import math

import torch

from psrt.comm.base import Communicator
from psrt.errors import InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_root, check_scale, check_splits, check_tensor


def _prepare(collective: str, tensor: object, name: object, process_set: ProcessSet,
             **agreed: object) -> tuple[torch.Tensor, Communicator, Communicator]:
    """Validate, resolve the group, and agree on dtype, device and ``agreed`` across ranks.

    Returns the tensor, the host communicator (for size exchanges) and the
    communicator that carries the tensor's data.
    """
    tensor = check_tensor(tensor)
    check_name(name)
    host = _common.communicator(process_set)
    _common.agree(host, name, (("collective", collective), ("dtype", tensor.dtype),
                               ("cuda", tensor.is_cuda), *agreed.items()))
    return tensor, host, _common.transport(process_set, tensor, host)


def _rows_and_tail(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """First dimension and the rest; a 0-d tensor counts as one row."""
    return (1, ()) if tensor.dim() == 0 else (tensor.shape[0], tuple(tensor.shape[1:]))


# -- allgather -------------------------------------------------------------------
def _allgather(tensor, name, process_set, blocking):
    tensor = check_tensor(tensor)
    rows, tail = _rows_and_tail(tensor)
    tensor, host, comm = _prepare("allgather", tensor, name, process_set, trailing_shape=tail)
    all_rows = host.exchange_counts([rows] * comm.size)
    row = math.prod(tail)
    output = torch.empty((sum(all_rows), *tail), dtype=tensor.dtype, device=tensor.device)
    send = _common.contiguous_buffer(tensor).reshape(-1)
    request = comm.allgatherv(send, output.view(-1), [r * row for r in all_rows])
    return _common.run(request, lambda: output, blocking)


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along the first dimension (which may differ by rank)."""
    return _allgather(tensor, name, process_set, True)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    return _allgather(tensor, name, process_set, False)


# -- broadcast -------------------------------------------------------------------
def _broadcast(tensor, root_rank, name, process_set, in_place, blocking):
    tensor = check_tensor(tensor)
    root = check_root(root_rank, _common.communicator(process_set).size)
    tensor, _, comm = _prepare("broadcast", tensor, name, process_set,
                               shape=tuple(tensor.shape), root_rank=root)
    if in_place:
        buffer = _common.contiguous_buffer(tensor)
        target = tensor
    else:
        buffer = target = tensor.detach().clone(memory_format=torch.contiguous_format)
    request = comm.broadcast(buffer, root)
    return _common.run(request, lambda: _common.write_back(target, buffer), blocking)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a copy of ``root_rank``'s tensor (``root_rank`` counts within the process set)."""
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
    tensor = check_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("alltoall needs a tensor with at least one dimension")
    rows, tail = _rows_and_tail(tensor)
    splits = check_splits(splits, rows, _common.communicator(process_set).size)
    tensor, host, comm = _prepare("alltoall", tensor, name, process_set, trailing_shape=tail)
    received = host.exchange_counts(splits)
    row = math.prod(tail)
    output = torch.empty((sum(received), *tail), dtype=tensor.dtype, device=tensor.device)
    send = _common.contiguous_buffer(tensor).reshape(-1)
    request = comm.alltoallv(send, [s * row for s in splits], output.view(-1),
                             [r * row for r in received])
    received_splits = torch.tensor(received, dtype=torch.int32)
    return _common.run(request, lambda: (output, received_splits), blocking)


def alltoall(tensor: torch.Tensor, splits=None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows to rank r; returns (received rows, received splits).

    Without ``splits`` the first dimension is divided evenly.
    """
    return _alltoall(tensor, splits, name, process_set, True)


def alltoall_async(tensor: torch.Tensor, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    return _alltoall(tensor, splits, name, process_set, False)


# -- reducescatter -----------------------------------------------------------------
def reducescatter_rows(rows: int, set_size: int) -> list[int]:
    """Rows each rank keeps: the first ``rows % size`` ranks get one more, as in Horovod."""
    base, extra = divmod(rows, set_size)
    return [base + (1 if r < extra else 0) for r in range(set_size)]


def _reducescatter(tensor, name, op, process_set, prescale_factor, postscale_factor, blocking):
    tensor = check_tensor(tensor)
    if tensor.dim() == 0:
        raise InvalidArgumentError("reducescatter needs a tensor with at least one dimension")
    op = resolve_op(op)
    if tensor.dtype == torch.bool:
        raise InvalidArgumentError("reducescatter is not defined for bool tensors")
    pre = check_scale(prescale_factor, "prescale_factor")
    post = check_scale(postscale_factor, "postscale_factor")
    tensor, _, comm = _prepare("reducescatter", tensor, name, process_set,
                               shape=tuple(tensor.shape), op=op.name, prescale_factor=pre,
                               postscale_factor=post)
    rows, tail = _rows_and_tail(tensor)
    row = math.prod(tail)
    kept = reducescatter_rows(rows, comm.size)
    send = _common.contiguous_buffer(tensor)
    if pre != 1.0:
        send = send.clone()
        _common.scale_(send, pre)
    output = torch.empty((kept[comm.rank], *tail), dtype=tensor.dtype, device=tensor.device)
    request = comm.reduce_scatter(send.view(-1), output.view(-1), [k * row for k in kept],
                                  transport_op(op))

    def finish() -> torch.Tensor:
        _common.postscale_(output, op is ReduceOp.Average, post, comm.size)
        return output

    return _common.run(request, finish, blocking)


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
    """Return once every rank of the process set has called barrier."""
    comm = _common.communicator(process_set)
    _common.agree(comm, "barrier", (("collective", "barrier"),))
    comm.barrier().wait()
