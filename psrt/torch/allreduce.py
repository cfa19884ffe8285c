"""Allreduce and grouped allreduce on torch CPU tensors, Horovod-compatible.

Every rank of the process set must call the same allreduces in the same order
with the same shape, dtype, op and scale factors (checked before any data
moves).  ``allreduce_`` on a contiguous tensor reduces in the tensor's own
memory: no copy is added on that path.
"""
from __future__ import annotations

from typing import Sequence

import torch

from psrt.comm.base import CompletedRequest, Request
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.compression import Compression
from psrt.torch.handles import Pending, register
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_scale, check_tensor, check_tensor_list


class _AllOf(Request):
    """Completes when every request of a group has completed."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self._requests = list(requests)

    def test(self) -> bool:
        return all([r.test() for r in self._requests])

    def wait(self) -> None:
        for request in self._requests:
            request.wait()


def _check_op_for(tensors: Sequence[torch.Tensor], op: ReduceOp, pre: float, post: float) -> None:
    if any(t.dtype == torch.bool for t in tensors):
        if op in (ReduceOp.Sum, ReduceOp.Average):
            raise InvalidArgumentError(f"op {op.name} is not defined for bool tensors; use Min "
                                       "(logical and) or Max (logical or)")
        if pre != 1.0 or post != 1.0:
            raise InvalidArgumentError("prescale_factor/postscale_factor cannot apply to bool tensors")


def _start(tensors: list[torch.Tensor], in_place: bool, name: str | None, op: object,
           average: object, prescale_factor: object, postscale_factor: object,
           process_set: ProcessSet, blocking: bool, collective: str):
    """Validate, agree, and reduce ``tensors`` (fused per dtype); returns outputs or Pending."""
    check_name(name)
    op = resolve_op(op, average)
    pre = check_scale(prescale_factor, "prescale_factor")
    post = check_scale(postscale_factor, "postscale_factor")
    _check_op_for(tensors, op, pre, post)
    comm = _common.communicator(process_set)
    name = _common.op_name(collective, name)
    dtypes = tuple(str(t.dtype) for t in tensors)
    shapes = tuple(tuple(t.shape) for t in tensors)
    _common.agree(comm, name, (
        ("collective", collective), ("dtype", dtypes[0] if len(dtypes) == 1 else dtypes),
        ("shape", shapes[0] if len(shapes) == 1 else shapes), ("op", op.name),
        ("prescale_factor", pre), ("postscale_factor", post)))

    buffers, outputs = _fused_buffers(tensors, in_place)
    requests = []
    for buffer in buffers:
        _common.scale_(buffer, pre)
        flat = buffer.view(-1)
        if blocking:
            comm.allreduce(flat, transport_op(op))
        else:
            requests.append(comm.iallreduce(flat, transport_op(op)))

    def finish() -> list[torch.Tensor]:
        for buffer in buffers:
            _common.postscale_(buffer, op is ReduceOp.Average, post, comm.size)
        return outputs()

    request = _AllOf(requests) if requests else CompletedRequest()
    return _common.run(request, finish, blocking)


def _fused_buffers(tensors: list[torch.Tensor], in_place: bool):
    """Buffers to reduce, and a function giving the outputs once they are reduced.

    A single tensor is reduced in its own memory (in place) or in one clone;
    several tensors of one dtype are packed into one flat buffer so that a
    group costs one collective per dtype.
    """
    if len(tensors) == 1:
        (tensor,) = tensors
        buffer = (_common.contiguous_buffer(tensor) if in_place
                  else tensor.detach().clone(memory_format=torch.contiguous_format))
        target = tensor if in_place else buffer
        return [buffer], lambda: [_common.write_back(target, buffer)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    fused = {dtype: torch.cat([tensors[i].detach().reshape(-1) for i in members])
             for dtype, members in by_dtype.items()}

    def outputs() -> list[torch.Tensor]:
        results: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for dtype, members in by_dtype.items():
            pieces = fused[dtype].split([tensors[i].numel() for i in members])
            for i, piece in zip(members, pieces):
                piece = piece.view(tensors[i].shape)
                results[i] = tensors[i].copy_(piece) if in_place else piece
        return results

    return list(fused.values()), outputs


def _single(tensor, in_place, blocking, name, op, average, prescale_factor, postscale_factor,
            process_set, collective):
    check_tensor(tensor)
    started = _start([tensor], in_place, name, op, average, prescale_factor, postscale_factor,
                     process_set, blocking, collective)
    if blocking:
        return started[0]
    return register(Pending(started.request, lambda: started.finish()[0]))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return the result in a new tensor.

    Default op is Average.  ``compression`` (e.g. ``hvd.Compression.fp16``)
    changes what travels, not the dtype returned.
    """
    compression = _compressor(compression)
    compressed, ctx = compression.compress(check_tensor(tensor))
    reduced = _single(compressed, False, True, name, op, average, prescale_factor,
                      postscale_factor, process_set, "allreduce")
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return _single(tensor, True, True, name, op, average, prescale_factor, postscale_factor,
                   process_set, "allreduce")


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new tensor."""
    return _single(tensor, False, False, name, op, average, prescale_factor, postscale_factor,
                   process_set, "allreduce")


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor``."""
    return _single(tensor, True, False, name, op, average, prescale_factor, postscale_factor,
                   process_set, "allreduce")


def _grouped(tensors, in_place, blocking, name, op, average, prescale_factor, postscale_factor,
             process_set):
    tensors = check_tensor_list(tensors)
    if not tensors:
        raise InvalidArgumentError("grouped_allreduce needs at least one tensor")
    started = _start(tensors, in_place, name, op, average, prescale_factor, postscale_factor,
                     process_set, blocking, "grouped_allreduce")
    return started if blocking else register(started)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: object = None,
                      op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused operation; returns new tensors."""
    compression = _compressor(compression)
    packed = [compression.compress(t) for t in check_tensor_list(tensors)]
    reduced = _grouped([t for t, _ in packed], False, True, name, op, average, prescale_factor,
                       postscale_factor, process_set)
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, packed)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns the input tensors."""
    return _grouped(tensors, True, True, name, op, average, prescale_factor, postscale_factor,
                    process_set)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    return _grouped(tensors, False, False, name, op, average, prescale_factor, postscale_factor,
                    process_set)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    return _grouped(tensors, True, False, name, op, average, prescale_factor, postscale_factor,
                    process_set)


def _compressor(compression: object):
    compression = Compression.none if compression is None else compression
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ArgumentTypeError(f"compression must be hvd.Compression.none, hvd.Compression.fp16 "
                                f"or provide compress/decompress, got {compression!r}")
    return compression
