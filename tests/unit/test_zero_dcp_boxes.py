"""A ZeRO shard's flat range of a parameter as DCP boxes: a plain value, checked against the
elements themselves without any communication."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from psrt.zero.boxes import boxes_of_range

SHAPES = [(), (1,), (7,), (7, 5), (3, 7, 3), (2, 3, 4, 5), (4, 1, 3), (0, 5), (5, 0)]


def _ranges(numel: int):
    return [(a, b) for a in range(numel + 1) for b in range(a, numel + 1)] if numel <= 40 else \
        [(a, b) for a, b in itertools.combinations(range(0, numel + 1, 7), 2)] + [(0, numel), (1, numel - 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_boxes_cover_exactly_the_flat_range_in_order_as_views(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).reshape(shape)
    for start, stop in _ranges(numel):
        boxes = boxes_of_range(shape, start, stop)
        covered = []
        for box in boxes:
            block = index[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            assert list(block.shape) == list(box.sizes), (shape, start, stop, box)
            # consecutive flat elements starting at box.start: the box is a view of the range
            assert block.reshape(-1).tolist() == list(range(box.start, box.start + box.numel)), (shape, box)
            covered += block.reshape(-1).tolist()
        assert covered == list(range(start, stop)), (shape, start, stop, boxes)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_range_takes_at_most_two_boxes_per_dim_less_one(shape):
    for start, stop in _ranges(math.prod(shape)):
        assert len(boxes_of_range(shape, start, stop)) <= max(1, 2 * len(shape) - 1), (shape, start, stop)


def test_whole_rows_are_one_box_and_a_split_row_three():
    assert [(b.offsets, b.sizes) for b in boxes_of_range((7, 5), 10, 25)] == [((2, 0), (3, 5))]
    assert [(b.offsets, b.sizes) for b in boxes_of_range((7, 5), 8, 27)] == [
        ((1, 3), (1, 2)), ((2, 0), (3, 5)), ((5, 0), (1, 2))]


def test_a_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match=r"flat range \[3, 40\) is not within a tensor of shape \(7, 5\)"):
        boxes_of_range((7, 5), 3, 40)
