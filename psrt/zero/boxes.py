"""A flat range of a row-major tensor as a few N-D boxes, the unit in which
``torch.distributed.checkpoint`` (DCP) stores a tensor's chunks.

A ZeRO shard holds each parameter as a flat range ``[start, stop)`` of its elements, which
in general is not a block of rows: it may begin and end part-way through a row.  Such a
range is the union of at most ``2 * ndim - 1`` boxes, in flat order: the rest of the row it
starts in (itself such a range one dim lower), the whole rows after it, and the start of the
row it ends in.  Each box covers consecutive flat elements, so it is a view of the shard.
Pure functions of the shape and the range, tested without any communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """Elements ``offsets[d] <= index[d] < offsets[d] + sizes[d]`` of a tensor, which are the
    flat elements ``[start, start + numel)`` of it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes_of_range(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes whose union is the flat elements ``[start, stop)`` of a tensor of ``shape``,
    in flat order, each covering consecutive elements; none for an empty range."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) is not within a tensor of shape {tuple(shape)} "
                         f"({numel} elements)")
    if start == stop:
        return []
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    return [Box(offsets, sizes, sum(o * s for o, s in zip(offsets, strides)))
            for offsets, sizes in _split(tuple(shape), start, stop)]


def _split(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of the boxes of ``[start, stop)``, a non-empty range of ``shape``."""
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    first, end = -(-start // row), stop // row  # the whole rows: [first, end)
    if first > end:  # inside one row
        return _in_row(shape, start // row, start % row, stop % row)
    head = _in_row(shape, first - 1, start - (first - 1) * row, row) if start < first * row else []
    rows = [((first,) + (0,) * (len(shape) - 1), (end - first,) + shape[1:])] if first < end else []
    tail = _in_row(shape, end, 0, stop - end * row) if end * row < stop else []
    return head + rows + tail


def _in_row(shape: tuple[int, ...], index: int, start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of elements ``[start, stop)`` of row ``index`` (along dim 0) of ``shape``."""
    return [((index,) + offsets, (1,) + sizes) for offsets, sizes in _split(shape[1:], start, stop)]
