"""The ZeRO partition as a plain value: who owns which elements, computed without communication."""
from __future__ import annotations

import pytest
import torch

from psrt.zero.partition import ParamInfo, Partition, expected_bytes
from psrt.zero.setup import _buckets


def infos(*sizes: int) -> list[ParamInfo]:
    return [ParamInfo(f"p{i}", (size,), "float32") for i, size in enumerate(sizes)]


def owners(partition: Partition) -> dict[tuple[int, int], list[int]]:
    """(param, element) -> the shards holding it, from the pieces alone."""
    held: dict[tuple[int, int], list[int]] = {}
    for group in range(len(partition.groups)):
        for shard in range(partition.num_shards):
            for piece in partition.pieces(group, shard):
                for element in range(piece.start, piece.stop):
                    held.setdefault((piece.param, element), []).append(shard)
    return held


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
@pytest.mark.parametrize("sizes, groups", [((53,), [[0]]), ((45, 477, 53, 159, 3), [[0], [1, 2], [3, 4]]),
                                           ((1, 1, 1), [[0, 1, 2]]), ((7, 2), [[1], [0]])])
def test_every_element_is_held_by_exactly_one_shard(sizes, groups, shards):
    partition = Partition.build(infos(*sizes), groups, shards)
    held = owners(partition)
    assert sorted(held) == [(p, e) for p, size in enumerate(sizes) for e in range(size)]
    assert all(len(where) == 1 for where in held.values())


@pytest.mark.parametrize("shards", [2, 4])
def test_a_53_element_parameter_is_padded_to_equal_shards(shards):
    partition = Partition.build(infos(53), [[0]], shards)
    shard_numel = partition.groups[0].shard_numel
    assert shard_numel == -(-53 // shards) and partition.padded_numel(0) == shard_numel * shards >= 53
    assert partition.padded_numel(0) - 53 < shards
    last = partition.pieces(0, shards - 1)
    assert last[-1].stop == 53 and last[-1].shard_offset + (last[-1].stop - last[-1].start) <= shard_numel
    assert partition.shard_range(0, 1) == (shard_numel, 2 * shard_numel)


def test_pieces_say_where_each_slice_sits_in_the_shard():
    partition = Partition.build(infos(3, 5), [[0, 1]], 2)  # 8 elements: shard 0 = p0[0:3] p1[0:1]
    assert [(p.param, p.start, p.stop, p.shard_offset) for p in partition.pieces(0, 0)] == [(0, 0, 3, 0), (1, 0, 1, 3)]
    assert [(p.param, p.start, p.stop, p.shard_offset) for p in partition.pieces(0, 1)] == [(1, 1, 5, 0)]


def test_a_total_not_divisible_by_the_world_is_padded_per_group():
    partition = Partition.build(infos(45, 477, 53, 159, 3), [[0], [1, 2], [3, 4]], 4)
    shard_numel = sum(flat.shard_numel for flat in partition.groups)
    assert shard_numel == 12 + 133 + 41
    assert shard_numel * 4 - 737 < 4 * len(partition.groups)


def test_bad_groupings_are_refused():
    with pytest.raises(ValueError, match="exactly once"):
        Partition.build(infos(3, 4), [[0]], 2)
    with pytest.raises(ValueError, match="exactly once"):
        Partition.build(infos(3, 4), [[0, 1], [1]], 2)
    with pytest.raises(ValueError, match="mix"):
        Partition.build([ParamInfo("a", (2,), "float32"), ParamInfo("b", (2,), "bfloat16")], [[0, 1]], 2)
    with pytest.raises(ValueError, match="num_shards"):
        Partition.build(infos(3), [[0]], 0)


def test_the_partition_is_the_same_value_every_time():
    build = lambda: Partition.build(infos(45, 477, 53), [[2, 1], [0]], 4)  # noqa: E731
    assert build() == build()


def test_gradient_buckets_follow_backward_order_and_the_size_cap():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (45, 477, 53, 159, 3)]
    everything = list(range(5))
    assert _buckets(params, everything, 200) == [[2, 3, 4], [1], [0]]
    assert _buckets(params, everything, 10_000) == [[0, 1, 2, 3, 4]]
    mixed = params[:2] + [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert sorted(map(sorted, _buckets(mixed, [0, 1, 2], 10_000))) == [[0, 1], [2]]
    # one optimizer group's parameters only (as ZeroOptimizer plans each group's buckets)
    assert _buckets(params, [0, 2, 4], 50) == [[2, 4], [0]]


@pytest.mark.parametrize("stage, want", [(0, (2, 2, 12)), (1, (2, 2, 3)), (2, (2, 0.5, 3)), (3, (0.5, 0.5, 3))])
def test_expected_bytes_are_zero_s_formulas(stage, want):
    got = expected_bytes(stage, 1, 4, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert (got["params"], got["grads"], got["optimizer"]) == want


def test_expected_bytes_refuses_unknown_stages():
    with pytest.raises(ValueError, match="ZeRO stage must be 0, 1, 2 or 3"):
        expected_bytes(4, 1, 4, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
