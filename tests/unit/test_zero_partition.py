"""The ZeRO partition as a plain value: who owns which elements, computed without communication."""
from __future__ import annotations

import pytest
import torch

from psrt.zero.partition import ParamInfo, Partition, Read, expected_bytes, reshard_reads, writers
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


def _flat_values(partition: Partition, values: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each shard's flat tensor of each group, padding zero."""
    shards = []
    for shard in range(partition.num_shards):
        per_group = []
        for group, flat in enumerate(partition.groups):
            out = torch.zeros(flat.shard_numel)
            for piece in partition.pieces(group, shard):
                out[piece.shard_offset:piece.shard_offset + piece.stop - piece.start] = values[piece.param][piece.start:piece.stop]
            per_group.append(out)
        shards.append(per_group)
    return shards


@pytest.mark.parametrize("saved_groups, saved_shards", [([[0], [1, 2], [3, 4]], 4), ([[0, 1, 2, 3, 4]], 2),
                                                        ([[4, 3], [2, 1, 0]], 3), ([[0], [1], [2], [3], [4]], 1)])
@pytest.mark.parametrize("groups, shards", [([[0, 1], [2, 3, 4]], 2), ([[0], [1, 2], [3, 4]], 4), ([[0, 1, 2, 3, 4]], 3)])
def test_reshard_reads_rebuild_every_shard_of_another_layout(saved_groups, saved_shards, groups, shards):
    """Each shard of the new layout, built only from its reads of the saved shards, is the shard
    the new layout holds: every element once, from wherever the saved layout put it."""
    params = infos(45, 477, 53, 159, 3)
    values = [torch.arange(info.numel, dtype=torch.float32) + 1000 * i for i, info in enumerate(params)]
    saved, current = Partition.build(params, saved_groups, saved_shards), Partition.build(params, groups, shards)
    stored, want = _flat_values(saved, values), _flat_values(current, values)
    for shard in range(shards):
        got = [torch.zeros(flat.shard_numel) for flat in current.groups]
        for read in reshard_reads(saved, current, shard):
            assert 0 <= read.begin < read.end <= saved.groups[read.group].shard_numel
            got[read.into][read.offset:read.offset + read.end - read.begin] = stored[read.shard][read.group][read.begin:read.end]
        assert all(torch.equal(a, b) for a, b in zip(got, want[shard])), f"shard {shard} differs"


def test_reshard_reads_join_runs_and_read_only_the_overlapping_shards():
    params = infos(3, 5)  # 8 elements, one group: saved over 4 shards of 2, read back over 2 shards of 4
    saved, current = Partition.build(params, [[0, 1]], 4), Partition.build(params, [[0, 1]], 2)
    assert reshard_reads(saved, current, 1) == [Read(shard=2, group=0, begin=0, end=2, into=0, offset=0),
                                                Read(shard=3, group=0, begin=0, end=2, into=0, offset=2)]
    assert reshard_reads(current, current, 0) == [Read(0, 0, 0, 4, 0, 0)]  # the same layout: one read of its own shard


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("sizes", [(45, 477, 53, 159, 3), (10,) * 9, (1000, 1, 1, 1), (5, 5, 5, 5, 5, 30)])
def test_no_shard_writes_more_than_its_share_plus_the_largest_parameter(sizes, shards):
    partition = Partition.build(infos(*sizes), [list(range(len(sizes)))], shards)
    owner = writers(partition)
    assert len(owner) == len(sizes) and set(owner) <= set(range(shards))
    for shard in range(shards):
        owned = sum(size for size, o in zip(sizes, owner) if o == shard)
        assert owned <= partition.groups[0].shard_numel + max(sizes), (shard, owned)
    assert writers(partition) == owner  # the same plan on every rank
