"""The plain values behind the process grid, pipeline partitions and TP sharding, and
TP layers with no process set (one process), which must be the torch.nn layers."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from psrt import tp
from psrt.config import config_from_env
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.grid import Axis, Coordinates, GridShape, world_groups
from psrt.pp import balanced_split, explicit_split
from psrt.tp.sharding import Sharding


@pytest.mark.parametrize("dp,tp_size,pp,cp", [(1, 1, 1, 1), (2, 2, 2, 1), (3, 2, 1, 1), (1, 4, 2, 1), (2, 1, 3, 1),
                                              (2, 2, 1, 2), (1, 1, 2, 3), (2, 2, 2, 2)])
def test_grid_groups_partition_the_ranks_along_each_axis(dp, tp_size, pp, cp):
    shape = GridShape(dp=dp, tp=tp_size, pp=pp, cp=cp)
    for position in range(shape.size):
        assert shape.position(shape.coordinates(position)) == position
    for axis in Axis:
        groups = shape.groups(axis)
        assert sorted(p for g in groups for p in g) == list(range(shape.size))
        for group in groups:
            coords = [shape.coordinates(p) for p in group]
            assert [c.along(axis) for c in coords] == list(range(getattr(shape, axis.value)))
            others = [a for a in Axis if a is not axis]
            assert len({tuple(c.along(a) for a in others) for c in coords}) == 1


def test_tp_is_the_innermost_axis():
    shape = GridShape(dp=2, tp=2, pp=2)
    assert [shape.coordinates(p) for p in range(4)] == [
        Coordinates(dp=0, tp=0, pp=0), Coordinates(dp=0, tp=1, pp=0),
        Coordinates(dp=1, tp=0, pp=0), Coordinates(dp=1, tp=1, pp=0)]


def test_cp_comes_after_tp_and_before_dp_and_pp():
    """Megatron's and picotron's order: TP innermost, then CP, DP, PP."""
    shape = GridShape(dp=2, tp=2, pp=2, cp=2)
    assert [(c.tp, c.cp, c.dp, c.pp) for c in map(shape.coordinates, (0, 1, 2, 4, 8))] == [
        (0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1)]
    # the DP × CP group holds every rank with the same TP and PP coordinates
    assert shape.groups(Axis.DP, Axis.CP)[0] == [0, 2, 4, 6]
    with pytest.raises(InvalidArgumentError, match=r"dp × cp × tp × pp = 2 × 2 × 2 × 2 = 16 does not match the 8"):
        shape.check_fits(8)


def test_grid_product_must_match_the_world():
    with pytest.raises(InvalidArgumentError, match=r"dp × tp × pp = 2 × 2 × 2 = 8 does not match the 6 ranks"):
        GridShape(dp=2, tp=2, pp=2).check_fits(6)
    with pytest.raises(ArgumentTypeError, match="tp must be an int"):
        GridShape(dp=1, tp="2", pp=1)
    with pytest.raises(InvalidArgumentError, match="pp must be at least 1"):
        GridShape(dp=1, tp=1, pp=0)


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert balanced_split([10, 1, 1, 1, 1, 10], 3) == [range(0, 1), range(1, 5), range(5, 6)]
    assert balanced_split([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(InvalidArgumentError, match=r"more pipeline stages \(4\) than blocks \(3\)"):
        balanced_split([1, 2, 3], 4)


def test_explicit_split_covers_every_block():
    assert explicit_split(5, [2, 3]) == [range(0, 2), range(2, 5)]
    with pytest.raises(InvalidArgumentError, match="cover all 5 blocks"):
        explicit_split(5, [2, 2])
    with pytest.raises(InvalidArgumentError, match="at least one block"):
        explicit_split(5, [5, 0])
    with pytest.raises(ArgumentTypeError, match="sequence of ints"):
        explicit_split(5, [2.5, 2.5])


@pytest.mark.parametrize("full_size,parts,stride", [(12, 4, 1), (13, 4, 1), (37, 2, 1), (12, 2, 3), (24, 4, 3)])
def test_sharding_round_trips_with_padding_and_stride(full_size, parts, stride):
    full = torch.randn(full_size, 5)
    shards = [Sharding(dim=0, parts=parts, index=i, full_size=full_size, stride=stride) for i in range(parts)]
    blocks = [s.shard(full) for s in shards]
    assert len({b.shape for b in blocks}) == 1
    assert blocks[0].shape[0] * parts == shards[0].padded_size >= full_size
    assert torch.equal(shards[0].unshard(blocks), full)


def test_stride_splits_each_fused_part():
    full = torch.arange(12).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    block = Sharding(dim=0, parts=2, index=1, full_size=12, stride=3).shard(full)
    assert block.flatten().tolist() == [2, 3, 6, 7, 10, 11]


def test_sharding_along_the_last_dimension_pads_that_dimension():
    full = torch.randn(3, 7)
    sharding = Sharding(dim=1, parts=2, index=1, full_size=7)
    assert sharding.shard(full).shape == (3, 4)
    assert torch.equal(sharding.shard(full)[:, 3], torch.zeros(3))


def test_tp_layers_without_a_process_set_are_the_torch_layers():
    torch.manual_seed(0)
    column, row = tp.ColumnParallelLinear(8, 6), tp.RowParallelLinear(6, 8)
    embedding = tp.VocabParallelEmbedding(11, 8)
    torch.manual_seed(0)
    plain_column, plain_row, plain_embedding = nn.Linear(8, 6), nn.Linear(6, 8), nn.Embedding(11, 8)
    x, ids = torch.randn(2, 3, 8), torch.randint(0, 11, (2, 3))
    assert torch.equal(column(x), plain_column(x))
    assert torch.equal(row(column(x)), plain_row(plain_column(x)))
    assert torch.equal(embedding(ids), plain_embedding(ids))


def test_cross_entropy_without_a_process_set_is_torch_cross_entropy():
    logits = torch.randn(4, 5, 9, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (4, 5))
    ours = tp.vocab_parallel_cross_entropy(logits, targets, None, vocab_size=7)
    theirs = F.cross_entropy(logits[..., :7].reshape(-1, 7), targets.reshape(-1))
    torch.testing.assert_close(ours, theirs)
    grad_ours, = torch.autograd.grad(ours, logits)
    grad_theirs, = torch.autograd.grad(theirs, logits)
    torch.testing.assert_close(grad_ours, grad_theirs)
    assert torch.equal(grad_ours[..., 7:], torch.zeros(4, 5, 2, dtype=torch.float64))


def test_cross_entropy_refuses_targets_outside_the_vocabulary():
    with pytest.raises(InvalidArgumentError, match=r"targets must lie in \[0, 7\)"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 9), torch.tensor([1, 8]), None, vocab_size=7)
    with pytest.raises(InvalidArgumentError, match="do not match targets"):
        tp.vocab_parallel_cross_entropy(torch.randn(2, 9), torch.tensor([1, 2, 3]), None)


def test_attention_heads_must_divide_the_dimension():
    with pytest.raises(InvalidArgumentError, match=r"model dimension \(10\) is not divisible by the number of heads"):
        tp.ParallelSelfAttention(10, 4)


def test_load_full_state_dict_names_missing_keys():
    with pytest.raises(InvalidArgumentError, match="missing"):
        tp.load_full_state_dict(tp.ColumnParallelLinear(4, 4), {"weight": torch.zeros(4, 4)})


def test_tp_shape_check_is_on_by_default_and_can_be_turned_off():
    assert config_from_env({}).tp_check_shapes is True
    assert config_from_env({"PSRT_TP_CHECK_SHAPES": "0"}).tp_check_shapes is False


def test_round_robin_hosts_keep_tp_groups_on_one_host():
    # 2 hosts x 4 slots placed by node: host A has ranks 0, 2, 4, 6; host order lists them first
    host_order = [0, 2, 4, 6, 1, 3, 5, 7]
    groups = world_groups(GridShape(dp=2, tp=2, pp=2), host_order)
    assert groups[(Axis.TP,)] == [[0, 2], [4, 6], [1, 3], [5, 7]]  # each pair on one host
    assert groups[(Axis.PP,)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert (Axis.CP,) not in groups, "no CP sets are registered without context parallelism"


def test_a_placement_that_breaks_the_axis_order_is_refused_before_any_registration():
    with pytest.raises(InvalidArgumentError, match=r"the pp group \[0, 4, 1, 5\].*--map-by slot"):
        world_groups(GridShape(dp=2, tp=1, pp=4), [0, 2, 4, 6, 1, 3, 5, 7])


def test_full_state_dict_in_one_process_is_the_state_dict_and_loads_back():
    from psrt.full_state import full_state_dict, load_full_state_dict
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), tp.LayerNorm(4))
    whole = full_state_dict(model)
    assert whole.keys() == model.state_dict().keys()
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), tp.LayerNorm(4))
    load_full_state_dict(other, {**whole, "9.weight": torch.zeros(1)})  # entries of other ranks are ignored
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), whole.values()))
    with pytest.raises(InvalidArgumentError, match=r"needs \['1.bias'\], which the state_dict lacks"):
        load_full_state_dict(other, {k: v for k, v in whole.items() if k != "1.bias"})
