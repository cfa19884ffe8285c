"""Finding parameters shared across pipeline stages, in one process (the exchange itself runs
in tests/parallel/scripts/gpt_check.py's tied-embedding layouts)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psrt.errors import InvalidArgumentError
from psrt.pp.schedule import one_f_one_b
from psrt.pp.tied import check_schedule, find_ties


def tied_blocks() -> list[nn.Module]:
    first, middle, last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return [first, middle, last]


def test_the_first_stage_owns_a_shared_parameter_and_the_others_hold_copies():
    ranges = [range(0, 2), range(2, 3)]
    blocks = tied_blocks()
    ties, aliases = find_ties(blocks, ranges, stages=2, rank=0)
    assert aliases == {"2.weight": "0.weight"}
    assert len(ties) == 1 and ties[0].is_owner and ties[0].peers == [1] and ties[0].tensor is blocks[0].weight
    blocks = tied_blocks()
    ties, _ = find_ties(blocks, ranges, stages=2, rank=1)
    copy = ties[0]
    assert not copy.is_owner and copy.peers == [0] and copy.names == ["2.weight"]
    assert "weight" not in dict(blocks[2].named_parameters()), "the copy is still a parameter of the last stage"
    assert blocks[2].weight is copy.tensor and torch.equal(copy.tensor, blocks[0].weight)
    assert "weight" not in blocks[2].state_dict(), "the copy is saved by its owner only"


def test_a_parameter_shared_on_one_rank_is_left_alone():
    ties, aliases = find_ties(tied_blocks(), [range(0, 3)], stages=1, rank=0)
    assert ties == [] and aliases == {}


def test_an_owner_that_sends_after_its_last_backward_is_refused():
    blocks = [nn.Linear(4, 4) for _ in range(4)]
    blocks[3].weight = blocks[1].weight  # first used by the second of three stages
    ranges = [range(0, 1), range(1, 2), range(2, 4)]
    ties, _ = find_ties(blocks, ranges, stages=3, rank=1)
    with pytest.raises(InvalidArgumentError, match="owned by a stage that still sends after its last backward"):
        check_schedule(ties, one_f_one_b(3, 4)[1], rank=1, microbatches=4)


def test_a_frozen_shared_parameter_needs_no_exchange():
    blocks = tied_blocks()
    blocks[0].weight.requires_grad_(False)
    ties, aliases = find_ties(blocks, [range(0, 2), range(2, 3)], stages=2, rank=1)
    assert ties == [] and aliases == {} and "weight" in dict(blocks[2].named_parameters(remove_duplicate=False))
