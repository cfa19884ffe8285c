"""The direct layer's one header format: what a message or a collective call is, in sixteen
int64 that every rank reads alike.

A :class:`Header` names its kind and an id, the dtype (by the one dtype table,
:data:`psrt.comm.buffers.WIRE_DTYPES`) and shape of the tensor it carries, and four ints
more.  The direct groups (:mod:`psrt.comm.direct`) send it before a message's data, and
their agreement check (:mod:`psrt.comm.agreement`) compares its digest across ranks;
parameter-server requests (:mod:`psrt.ps.protocol`) are headers too, so one format, and one
description of it in errors, serves every caller.  Kept apart from the groups so that the
format can be read, and tested, without a communicator.
"""
from __future__ import annotations

import array
import enum
import math
from collections.abc import Sequence

import torch

from psrt.comm.buffers import dtype_code, dtype_of
from psrt.errors import InvalidArgumentError

MAX_DIMS = 8
MAX_ARGS = 4
#: kind, id, dtype, number of dimensions, the first MAX_DIMS sizes, MAX_ARGS ints
HEADER_WORDS = 4 + MAX_DIMS + MAX_ARGS
_DIGEST_MASK = (1 << 62) - 1  # a digest and its negation both fit in an int64


class Kind(enum.IntEnum):
    """What a header describes, for the direct layer's own calls (parameter-server
    requests name their operation instead: a kind means what its channel says)."""

    MESSAGE = 0
    ALL_REDUCE = 1
    ALL_GATHER = 2
    REDUCE_SCATTER = 3
    BROADCAST = 4
    GATHER = 5
    SCATTER = 6
    BARRIER = 7
    REDUCE = 8


#: Collectives whose header's first arg is the root (as a rank of the group)
_ROOTED = (Kind.BROADCAST, Kind.GATHER, Kind.SCATTER, Kind.REDUCE)
#: Reductions whose header's first arg, where given, is the op: its place in OP_NAMES
_REDUCING = (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER)
OP_NAMES = ("sum", "min", "max", "product")


class Header:
    """A message's or a call's description, in the one layout every rank reads.

    ``shape`` keeps every dimension of a tensor it was made from; only the first
    :data:`MAX_DIMS` travel, with the true number of dimensions (``ndim``), so a decoded
    header of a deeper tensor can name it but not rebuild it.
    """

    __slots__ = ("args", "dtype", "ident", "kind", "ndim", "shape")

    def __init__(self, kind: int, ident: int = 0, dtype: torch.dtype | None = None,
                 shape: Sequence[int] = (), args: Sequence[int] = (), ndim: int | None = None) -> None:
        if len(args) > MAX_ARGS:
            raise ValueError(f"a header carries at most {MAX_ARGS} ints besides the shape, got {len(args)}")
        self.kind, self.ident, self.dtype = kind, ident, dtype
        self.shape, self.args = tuple(shape), tuple(args)
        self.ndim = len(self.shape) if ndim is None else ndim

    @classmethod
    def of(cls, kind: int, tensor: torch.Tensor, ident: int = 0, args: Sequence[int] = ()) -> Header:
        return cls(kind, ident, tensor.dtype, tensor.shape, args)

    def words(self) -> list[int]:
        dims = list(self.shape[:MAX_DIMS])
        return [int(self.kind), self.ident, -1 if self.dtype is None else dtype_code(self.dtype), self.ndim,
                *dims, *[-1] * (MAX_DIMS - len(dims)), *self.args, *[0] * (MAX_ARGS - len(self.args))]

    def encode(self) -> torch.Tensor:
        return _int64s(self.words())

    @classmethod
    def decode(cls, words: Sequence[int]) -> Header:
        kind, ident, code, ndim = words[:4]
        return cls(kind, ident, dtype_of(code), words[4:4 + min(ndim, MAX_DIMS)], words[4 + MAX_DIMS:], ndim)

    @property
    def complete(self) -> bool:
        """Whether a tensor can be allocated from this header (a known dtype, every size)."""
        return self.dtype is not None and self.ndim <= MAX_DIMS

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def digest(self) -> int:
        """The same int on every rank for equal headers (ints hash alike in every process)."""
        return hash((int(self.kind), self.ident, dtype_code(self.dtype), self.ndim, *self.shape,
                     *self.args)) & _DIGEST_MASK

    def describe(self) -> str:
        """``all_reduce of a float32 tensor of shape (4, 16)``."""
        if self.kind == Kind.BARRIER:
            return "barrier"
        kind = Kind(self.kind).name.lower() if self.kind in Kind._value2member_map_ else f"kind {self.kind}"
        dims = ", ".join(map(str, self.shape[:MAX_DIMS])) + (", ..." if self.ndim > MAX_DIMS else "")
        root = f" from rank {self.args[0]}" if self.kind in _ROOTED and self.args else ""
        if self.kind in _REDUCING and self.args and 0 < self.args[0] < len(OP_NAMES):
            root = f" ({OP_NAMES[self.args[0]]})"  # a sum goes without saying
        return f"{kind}{root} of a {self.dtype_name} tensor of shape ({dims}{',' if self.ndim == 1 else ''})"

    def describe_tensor(self) -> str:
        """``float32 tensor of shape (4, 16)``."""
        return f"{self.dtype_name} tensor of shape {tuple(self.shape)}"

    def describe_rows(self) -> str:
        """``rows of float32 of shape (16,)``: what an all-to-all's rows are (the header of one row)."""
        return f"rows of {self.dtype_name} of shape {tuple(self.shape)}"

    @property
    def dtype_name(self) -> str:
        """``float32``, or ``another dtype`` for one this psrt cannot name."""
        return "another dtype" if self.dtype is None else str(self.dtype).removeprefix("torch.")


def _int64s(values: list[int]) -> torch.Tensor:
    """A new int64 tensor of ``values``: a third of ``torch.tensor``'s cost, which matters
    on paths that run once per message."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def check_divisible(tensor: torch.Tensor, dim: int, size: int, label: str) -> None:
    """A tensor split into ``size`` blocks along ``dim`` must split evenly."""
    if tensor.shape[dim] % size:
        raise InvalidArgumentError(f"dimension {dim} of a tensor of shape {tuple(tensor.shape)} is not "
                                   f"divisible by the {label} size {size}")
