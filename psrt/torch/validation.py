"""Checks on public-API arguments, run on the calling rank before any communication."""
from __future__ import annotations

import numbers
from typing import Sequence

import torch

from psrt.comm.nccl import nccl_available
from psrt.errors import (ArgumentTypeError, InvalidArgumentError, InvalidArgumentTypeError,
                         UnsupportedDeviceError)

#: dtypes carried by the collectives (bool for data movement and Min/Max).
SUPPORTED_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool,
})


def check_tensor(tensor: object, what: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu and not (tensor.is_cuda and nccl_available()):
        raise UnsupportedDeviceError(
            f"{what} is on device '{tensor.device}'; psrt carries CPU tensors over MPI and CUDA "
            "tensors over NCCL, which needs CuPy (pip install psrt[gpu]) and a visible GPU")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES))
        raise InvalidArgumentError(f"{what} has dtype {tensor.dtype}, which psrt does not "
                                   f"support; supported: {names}")
    if tensor.is_sparse:
        raise InvalidArgumentError(f"{what} is sparse; psrt collectives take dense tensors")
    return tensor


def check_tensor_list(tensors: object, what: str = "tensors") -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{what} must be a list or tuple of torch.Tensor, got "
                                f"{type(tensors).__name__}")
    return [check_tensor(t, f"{what}[{i}]") for i, t in enumerate(tensors)]


def check_name(name: object) -> str | None:
    if name is not None and not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a str or None, got {type(name).__name__}")
    return name


def check_scale(value: object, what: str) -> float:
    if type(value) is float:  # the common case, checked cheaply
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{what} must be a real number, got {value!r} "
                                f"({type(value).__name__})")
    return float(value)


def check_root(root_rank: object, set_ranks: Sequence[int]) -> int:
    """``root_rank`` is a global rank, as in Horovod, and must belong to the process set."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise ArgumentTypeError(f"root_rank must be an int, got {root_rank!r} "
                                f"({type(root_rank).__name__})")
    if root_rank not in set_ranks:
        raise InvalidArgumentError(f"root_rank {root_rank} is not a member of the process set "
                                   f"(ranks {list(set_ranks)})")
    return int(root_rank)


def check_splits(splits: object, rows: int, set_size: int) -> list[int]:
    """Per-destination row counts for alltoall (even split when ``splits`` is None).

    Splits that are not integers raise :class:`InvalidArgumentTypeError`: Horovod raises
    ``ValueError`` there, and psrt's convention for a wrong type is ``TypeError``.
    """
    if splits is None:
        if rows % set_size:
            raise InvalidArgumentError(f"alltoall without splits needs the first dimension "
                                       f"({rows}) to be divisible by the process set size "
                                       f"({set_size})")
        return [rows // set_size] * set_size
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype == torch.bool:
            raise InvalidArgumentTypeError(f"splits must be a 1-D integer tensor or a list of ints, "
                                           f"got a {splits.dim()}-D {splits.dtype} tensor")
        values: Sequence = splits.tolist()
    elif isinstance(splits, (list, tuple)):
        values = splits
    else:
        raise InvalidArgumentTypeError(f"splits must be a list of ints or a 1-D integer tensor, "
                                       f"got {type(splits).__name__}")
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
        raise InvalidArgumentTypeError(f"splits must contain ints, got {list(values)}")
    if len(values) != set_size:
        raise InvalidArgumentError(f"splits has {len(values)} entries but the process set has "
                                   f"{set_size} ranks")
    if any(v < 0 for v in values):
        raise InvalidArgumentError(f"splits must be non-negative, got {list(values)}")
    if sum(values) != rows:
        raise InvalidArgumentError(f"splits sum to {sum(values)} but the tensor's first "
                                   f"dimension is {rows}")
    return [int(v) for v in values]
