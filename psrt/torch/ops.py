"""Horovod's reduction-op constants and how they map onto the transport's ops."""
from __future__ import annotations

import enum

from psrt.comm.base import ElementwiseOp as TransportOp
from psrt.errors import ArgumentTypeError, InvalidArgumentError


class ReduceOp(enum.IntEnum):
    """Reduction ops, numbered as in Horovod so ``hvd.Average`` etc. compare equal."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum,
                                           ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)

_TRANSPORT = {ReduceOp.Average: TransportOp.SUM, ReduceOp.Sum: TransportOp.SUM,
              ReduceOp.Min: TransportOp.MIN, ReduceOp.Max: TransportOp.MAX,
              ReduceOp.Product: TransportOp.PRODUCT}


def resolve_op(op: object, average: object = None,
               default: ReduceOp = ReduceOp.Average) -> ReduceOp:
    """The op a call asked for, accepting Horovod's deprecated ``average=`` flag."""
    if average is not None:
        if op is not None:
            raise InvalidArgumentError("pass either op= or the deprecated average=, not both")
        if not isinstance(average, bool):
            raise ArgumentTypeError(f"average must be a bool, got {type(average).__name__}")
        return ReduceOp.Average if average else ReduceOp.Sum
    if op is None:
        return default
    if isinstance(op, bool) or not isinstance(op, int):
        raise ArgumentTypeError(f"op must be one of hvd.Average, Sum, Adasum, Min, Max, Product; "
                                f"got {op!r} ({type(op).__name__})")
    try:
        return ReduceOp(op)
    except ValueError:
        raise InvalidArgumentError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Adasum, "
                                   "Min, Max or Product") from None


def transport_op(op: ReduceOp) -> TransportOp:
    """The transport's reduction for ``op``; Adasum has none (it is not an elementwise op)."""
    return _TRANSPORT[op]
