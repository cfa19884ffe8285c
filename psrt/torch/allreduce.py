"""Allreduce and grouped allreduce on torch CPU tensors, Horovod-compatible.

Every call becomes a named work for the engine, which matches ranks by name
(unnamed calls are named from a per-process counter), checks that shape,
dtype, op and scale factors agree, and fuses allreduces that are ready
together.  ``allreduce_`` on a contiguous tensor reduces in the tensor's own
memory: no copy is added on that path.
"""
from __future__ import annotations

from typing import Sequence

import torch

from psrt.engine import Reduction
from psrt.errors import InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import _common
from psrt.torch.compression import compressor
from psrt.torch.ops import ReduceOp, resolve_op, transport_op
from psrt.torch.validation import check_name, check_scale, check_tensor, check_tensor_list


def _resolve(dtypes: Sequence[torch.dtype], name: object, op: object, average: object,
             prescale_factor: object, postscale_factor: object) -> tuple[ReduceOp, float, float]:
    """Validate the arguments every allreduce form shares."""
    check_name(name)
    op = resolve_op(op, average)
    pre = check_scale(prescale_factor, "prescale_factor")
    post = check_scale(postscale_factor, "postscale_factor")
    if torch.bool in dtypes:
        if op in (ReduceOp.Sum, ReduceOp.Average):
            raise InvalidArgumentError(f"op {op.name} is not defined for bool tensors; use Min "
                                       "(logical and) or Max (logical or)")
        if pre != 1.0 or post != 1.0:
            raise InvalidArgumentError("prescale_factor/postscale_factor cannot apply to bool "
                                       "tensors")
    return op, pre, post


def _allreduce_work(tensor: torch.Tensor, in_place: bool, name: str | None, op: ReduceOp,
                    pre: float, post: float, process_set: ProcessSet, ranks: list[int]):
    """The engine work reducing ``tensor`` (prescaled now; Average and postscale folded into
    the reduction for floats, applied when finishing for integers)."""
    if in_place:
        buffer = _common.contiguous_buffer(tensor)
    else:
        buffer = tensor.detach().clone(memory_format=torch.contiguous_format)
    _common.scale_(buffer, pre)
    fold = _folded_scale(buffer, op, post, len(ranks))
    reduction = Reduction(set_id=process_set.process_set_id, device=str(tensor.device),
                          dtype=tensor.dtype, shape=tuple(tensor.shape), op=transport_op(op),
                          scale=1.0 if fold is None else fold)

    def finish(_: object) -> torch.Tensor:
        if fold is None:
            _common.postscale_(buffer, op is ReduceOp.Average, post, len(ranks))
        return _common.write_back(tensor, buffer) if in_place else buffer

    descriptor = (("dtype", tensor.dtype), ("shape", tuple(tensor.shape)),
                  ("device", tensor.device.type), ("op", op.name), ("prescale_factor", pre),
                  ("postscale_factor", post))
    return _common.make_work("allreduce", name, process_set, ranks, descriptor, tensor.device,
                             buffer=buffer, reduction=reduction, finish=finish)


def _allreduce(tensor, in_place, blocking, name, op, average, prescale_factor,
               postscale_factor, process_set):
    check_tensor(tensor)
    op, pre, post = _resolve((tensor.dtype,), name, op, average, prescale_factor,
                             postscale_factor)
    ranks = _common.set_ranks(process_set)
    work = _allreduce_work(tensor, in_place, name, op, pre, post, process_set, ranks)
    return _common.submit(work, blocking)


def _folded_scale(buffer: torch.Tensor, op: ReduceOp, post: float, set_size: int) -> float | None:
    """The factor the transport can fold into a floating-point reduction (None for integers,
    whose Average is a floor division applied afterwards)."""
    if not buffer.is_floating_point():
        return None
    return post / set_size if op is ReduceOp.Average else post


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: object = None, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the process set and return the result in a new tensor.

    Default op is Average.  ``compression`` (e.g. ``hvd.Compression.fp16``)
    changes what travels, not the dtype returned.
    """
    compression = compressor(compression)
    compressed, ctx = compression.compress(check_tensor(tensor))
    reduced = _allreduce(compressed, False, True, name, op, average, prescale_factor,
                         postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    return _allreduce(tensor, True, True, name, op, average, prescale_factor, postscale_factor,
                      process_set)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new tensor."""
    return _allreduce(tensor, False, False, name, op, average, prescale_factor,
                      postscale_factor, process_set)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start an in-place allreduce; ``synchronize(handle)`` returns ``tensor``."""
    return _allreduce(tensor, True, False, name, op, average, prescale_factor, postscale_factor,
                      process_set)


# -- grouped -------------------------------------------------------------------------
def _grouped(tensors, in_place, blocking, name, op, average, prescale_factor, postscale_factor,
             process_set):
    """One allreduce per tensor, submitted together: the engine runs them in the same
    cycle, fused where dtypes agree.  Members are named ``name.0``, ``name.1``..."""
    tensors = check_tensor_list(tensors)
    if not tensors:
        raise InvalidArgumentError("grouped_allreduce needs at least one tensor")
    op, pre, post = _resolve({t.dtype for t in tensors}, name, op, average, prescale_factor,
                             postscale_factor)
    if len({t.device for t in tensors}) > 1:
        raise InvalidArgumentError(f"grouped_allreduce needs all tensors on one device, got "
                                   f"{sorted({str(t.device) for t in tensors})}")
    ranks = _common.set_ranks(process_set)
    works = [_allreduce_work(t, in_place, None if name is None else f"{name}.{i}", op, pre, post,
                             process_set, ranks) for i, t in enumerate(tensors)]
    return _common.submit(works, blocking)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: object = None,
                      op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused operation; returns new tensors."""
    compression = compressor(compression)
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
