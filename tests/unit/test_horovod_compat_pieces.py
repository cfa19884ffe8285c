"""Pieces of Horovod compatibility checked in one process: Adasum's pairwise combination,
integer Average rounding, error classes that are both Horovod's and psrt's, and the
single-rank forms of join, alltoall and sparse_allreduce_async."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

import psrt.torch as hvd
from psrt.errors import InvalidArgumentTypeError, UnsupportedOperationError
from psrt.torch import _common, adasum
from psrt.torch.validation import check_splits


@pytest.fixture
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def test_adasum_of_orthogonal_vectors_is_their_sum():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, -2.0])
    assert adasum.coefficients(a, b) == (1.0, 1.0)
    assert torch.equal(adasum.combine(a, b, 1.0, 1.0), a + b)


def test_adasum_of_parallel_vectors_is_their_mean():
    a = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    a_weight, b_weight = adasum.coefficients(a, 3 * a)
    torch.testing.assert_close(adasum.combine(a, 3 * a, a_weight, b_weight), 2 * a, rtol=1e-15, atol=0.0)


def test_adasum_keeps_weight_one_for_a_zero_vector():
    assert adasum.coefficients(torch.zeros(3), torch.ones(3)) == (1.0, 1.0)


def test_adasum_combines_in_float64_and_returns_the_dtype():
    a, b = torch.tensor([1.0, 1e-3], dtype=torch.float16), torch.tensor([0.5, 1.0], dtype=torch.float16)
    got = adasum.combine(a, b, *adasum.coefficients(a, b))
    want = adasum.combine(a.double(), b.double(), *adasum.coefficients(a.double(), b.double()))
    assert got.dtype == torch.float16 and torch.equal(got, want.half())


@pytest.mark.parametrize("tensors, size, fragment", [
    ([torch.ones(2, dtype=torch.int32)], 2, "floating-point"),
    ([torch.ones(2), torch.ones(2, dtype=torch.bool)], 2, "torch.bool"),
    ([torch.ones(2)], 3, "power of two"),
    ([torch.ones(2)], 6, "6 ranks"),
])
def test_adasum_refuses_what_it_cannot_combine_with_a_value_and_runtime_error(tensors, size, fragment):
    with pytest.raises(UnsupportedOperationError, match=fragment) as caught:
        adasum.check_arguments(tensors, size, "allreduce")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)


def test_integer_average_rounds_toward_zero_as_horovod():
    sums = torch.tensor([-75, 75, -7, 7, -1, 98], dtype=torch.int64)
    _common.postscale_(sums, True, 1.0, 2)
    assert sums.tolist() == [-37, 37, -3, 3, 0, 49]
    multiple = torch.tensor([49 * 3], dtype=torch.int32)
    _common.postscale_(multiple, True, 1.0, 49)  # 147 * (1 / 49) is just below 3 in float64
    assert multiple.tolist() == [3]


@pytest.mark.parametrize("splits", [[1.0, 1.0], torch.tensor([1.0, 1.0]), "11"])
def test_non_integer_splits_are_a_value_error_and_a_type_error(splits):
    with pytest.raises(InvalidArgumentTypeError, match="splits") as caught:
        check_splits(splits, 2, 2)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TypeError)


def test_join_takes_a_device_and_returns_the_last_rank(world_of_one):
    assert hvd.join() == 0 and hvd.join(device=-1) == 0 and hvd.join(0) == 0
    with pytest.raises(TypeError, match="device"):
        hvd.join(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="-3"):
        hvd.join(-3)


def test_alltoall_returns_the_splits_only_when_given(world_of_one):
    rows = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(hvd.alltoall(rows), rows)
    received, splits = hvd.alltoall(rows, splits=torch.tensor([3]))
    assert torch.equal(received, rows) and splits.tolist() == [3]
    pair = hvd.synchronize(hvd.alltoall_async(rows))
    assert isinstance(pair, tuple) and torch.equal(pair[0], rows) and pair[1].tolist() == [3]


def test_sparse_allreduce_async_returns_a_callable_handle(world_of_one):
    sparse = torch.sparse_coo_tensor([[0, 2, 0]], torch.tensor([1.0, 2.0, 3.0]), (4,), check_invariants=True)
    handle = hvd.sparse_allreduce_async(sparse, name="sparse", op=hvd.Average)
    got = handle()
    assert got.is_sparse and not got.is_coalesced() and torch.equal(got.to_dense(), sparse.to_dense())
    integers = torch.sparse_coo_tensor([[1, 1]], torch.tensor([-3, 2]), (3,), check_invariants=True)
    assert hvd.sparse_allreduce_async(integers, name="ints", op=hvd.Average)().to_dense().tolist() == [0, -1, 0]


def test_mpi_ops_holds_the_objects_horovod_code_imports_from_it(world_of_one):
    """``from horovod.torch.mpi_ops import synchronize, allreduce_async, poll`` keeps working
    with psrt's name: the same objects as hvd's, usable as such."""
    from psrt.torch import mpi_ops
    from psrt.torch.mpi_ops import allreduce_async, poll, synchronize

    assert (allreduce_async, poll, synchronize) == (hvd.allreduce_async, hvd.poll, hvd.synchronize)
    assert all(getattr(mpi_ops, name) is getattr(hvd, name) for name in mpi_ops.__all__)
    assert len(set(mpi_ops.__all__)) == len(mpi_ops.__all__) and set(mpi_ops.__all__) <= set(hvd.__all__)
    handle = allreduce_async(torch.arange(3.0), name="mpi_ops.check", op=hvd.Sum)
    while not poll(handle):
        pass
    assert torch.equal(synchronize(handle), torch.arange(3.0))


def test_horovod_variables_say_each_ranks_place_as_horovodrun_does():
    """Rank 3 of 2 hosts x 2 slots: local rank 1 of 2, cross rank 1 of 2 (its host's index)."""
    from psrt.rank_env import horovod_variables

    def group(rank: int, size: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, size=size)

    topology = SimpleNamespace(world=group(3, 4), local=group(1, 2), cross=group(1, 2))
    assert horovod_variables(topology, "node2") == {
        "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "node2"}


def test_init_sets_the_horovod_variables(monkeypatch):
    monkeypatch.setenv("HOROVOD_RANK", "7")  # inherited from psrun's environment: replaced
    hvd.init()
    try:
        assert (os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"], os.environ["HOROVOD_CROSS_SIZE"]) == \
            ("0", "1", "1")
        assert os.environ["HOROVOD_HOSTNAME"] == socket.gethostname()
    finally:
        hvd.shutdown()
