"""torch.distributed's arguments as psrt's direct layer takes them: reductions, the one
tensor per call, contiguous buffers, rows, and the checks a call makes on this rank alone
before any communication."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from psrt.comm.base import ElementwiseOp
from psrt.comm.direct import DirectGroup
from psrt.errors import InvalidArgumentError, UnsupportedOperationError

#: Who runs these collectives, in psrt's errors and stall reports
LABEL = "torch.distributed"

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {_RedOpType.SUM: ElementwiseOp.SUM, _RedOpType.MIN: ElementwiseOp.MIN, _RedOpType.MAX: ElementwiseOp.MAX,
        _RedOpType.PRODUCT: ElementwiseOp.PRODUCT}


def reduction(op: dist.ReduceOp | _RedOpType, size: int, dtype: torch.dtype) -> tuple[ElementwiseOp, float]:
    """psrt's reduction and the factor to scale its result by, for torch's ``op``: an
    average is a sum times 1/size, and a pre-multiplied sum a sum times its factor (both
    linear, so scaling after the reduction gives the same result)."""
    if op == _RedOpType.SUM:  # most calls: a comparison costs a fifth of unpacking the op
        return ElementwiseOp.SUM, 1.0
    kind, factor = (op, None) if isinstance(op, _RedOpType) else op.__getstate__()
    if kind in _OPS:
        return _OPS[kind], 1.0
    if kind in (_RedOpType.AVG, _RedOpType.PREMUL_SUM):
        if not dtype.is_floating_point:
            raise InvalidArgumentError(f"{LABEL}: {kind.name} of a {dtype} tensor: psrt averages and scales "
                                       "floating-point tensors only (sum, then divide)")
        if kind == _RedOpType.AVG:
            return ElementwiseOp.SUM, 1.0 / size
        return ElementwiseOp.SUM, float(factor)
    raise UnsupportedOperationError(f"{LABEL}: psrt's backend has no {kind.name} reduction (it has SUM, AVG, "
                                    "PREMUL_SUM, MIN, MAX and PRODUCT)")


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is contiguous, else a contiguous copy to write back."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def single(tensors: Sequence, call: str):
    """The one tensor (or list) of a call: psrt's backend serves one device per process."""
    if len(tensors) != 1:
        raise UnsupportedOperationError(f"{LABEL} {call}: psrt's backend takes one tensor per rank "
                                        f"(one device per process), got {len(tensors)}")
    return tensors[0]


def check_like(tensors: Sequence[torch.Tensor], count: int, model: torch.Tensor, call: str, which: str) -> None:
    """``count`` tensors of ``model``'s dtype and number of elements, or an error saying which
    differs (checked before any communication)."""
    if len(tensors) != count:
        raise InvalidArgumentError(f"{LABEL} {call}: {which} holds {len(tensors)} tensors, one per rank of the "
                                   f"group ({count}) expected")
    for index, tensor in enumerate(tensors):
        if tensor.dtype != model.dtype or tensor.numel() != model.numel():
            raise InvalidArgumentError(
                f"{LABEL} {call}: {which}[{index}] is a {tensor.dtype} tensor of shape {tuple(tensor.shape)}, "
                f"not {model.numel()} elements of {model.dtype} like the tensor of shape {tuple(model.shape)}")


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous 2-D view (rows of dim 0, the rest flattened) of ``tensor``, zero rows
    included; a 0-d tensor is one row of one element."""
    if not tensor.dim():
        return tensor.reshape(1, 1)
    return contiguous(tensor).view(tensor.shape[0], math.prod(tensor.shape[1:]))


def op_of(opts: object) -> dist.ReduceOp | _RedOpType:
    return _RedOpType.SUM if opts is None else opts.reduceOp


def even_split(tensor: torch.Tensor, size: int, which: str) -> list[int]:
    rows = tensor.shape[0] if tensor.dim() else 1
    if rows % size:
        raise InvalidArgumentError(f"{LABEL} all_to_all_single: the {which} has {rows} rows, which the group's "
                                   f"{size} ranks do not divide (pass split sizes)")
    return [rows // size] * size


def expect_counts(got: list[int], expected: list[int], direct: DirectGroup, call: str, which: str) -> None:
    """What the members sent here must be what the caller made room for."""
    if got != expected:
        raise InvalidArgumentError(f"{LABEL} {call} on rank {direct.ranks[direct.rank]}: {which} {expected}, but "
                                   f"the members send {got} (member r sends the r-th count)")
