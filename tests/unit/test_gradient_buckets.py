"""DistributedOptimizer's bucket plan, checked as data (no communication), and the flat
buffers and gradient views built from it, in a world of one."""
from __future__ import annotations

import pytest
import torch

import psrt.torch as hvd
from psrt.torch._buckets import Bucketing, Slot, buffer_sizes, plan_buckets, split_evenly
from psrt.torch.optimizer import DistributedOptimizer

F32, F64 = "float32", "float64"


def slots(*numels: int, key=F32, size=4) -> list[Slot]:
    return [Slot(n, size, key) for n in numels]


def test_first_bucket_closes_at_its_small_cap_and_later_ones_at_the_large_cap():
    plan = plan_buckets(slots(10, 10, 30, 30, 30, 5), first_bucket_bytes=80, bucket_bytes=200)
    assert [b.members for b in plan] == [(0, 1), (2, 3), (4, 5)]


def test_members_are_contiguous_in_ready_order():
    plan = plan_buckets(slots(3, 4, 5, 6), first_bucket_bytes=20, bucket_bytes=40)
    assert [(b.start, b.stop, b.offsets) for b in plan] == [(0, 7, (0, 3)), (7, 18, (7, 12))]
    assert buffer_sizes(plan) == {F32: 18}


def test_dtypes_get_buffers_of_their_own_and_their_own_first_bucket():
    mixed = [Slot(4, 4, F32), Slot(4, 8, F64), Slot(4, 4, F32), Slot(4, 8, F64)]
    plan = plan_buckets(mixed, first_bucket_bytes=16, bucket_bytes=1000)
    assert [(b.key, b.members, b.start) for b in plan] == [(F32, (0,), 0), (F64, (1,), 0), (F32, (2,), 4),
                                                            (F64, (3,), 4)]
    assert buffer_sizes(plan) == {F32: 8, F64: 8}


def test_a_tensor_larger_than_the_cap_is_a_bucket_of_its_own():
    plan = plan_buckets(slots(1000, 1), first_bucket_bytes=8, bucket_bytes=8)
    assert [b.members for b in plan] == [(0,), (1,)]


def test_each_group_is_one_bucket_per_dtype_ordered_by_its_first_ready_member():
    mixed = [Slot(2, 4, F32), Slot(2, 4, F32), Slot(2, 8, F64), Slot(2, 4, F32)]
    plan = plan_buckets(mixed, [[3], [2, 1, 0]])
    assert [(b.key, b.members) for b in plan] == [(F32, (0, 1)), (F64, (2,)), (F32, (3,))]


def test_groups_must_cover_every_slot_once():
    with pytest.raises(ValueError, match="exactly once"):
        plan_buckets(slots(1, 1, 1), [[0, 1], [1]])


@pytest.mark.parametrize("count, parts, runs", [
    (5, 2, [[0, 1, 2], [3, 4]]), (4, 4, [[0], [1], [2], [3]]), (2, 3, [[0], [1]]),
])
def test_split_evenly_gives_runs_differing_by_at_most_one(count, parts, runs):
    assert split_evenly(count, parts) == runs


@pytest.mark.parametrize("kwargs", [{"first_bucket_bytes": 0}, {"bucket_bytes": -1}, {"bucket_bytes": 1.5},
                                    {"overlap": 1}])
def test_bucketing_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="Bucketing"):
        Bucketing(**kwargs)


# -- the optimizer in a world of one: the buffers and views behind the plan -------------------------
@pytest.fixture
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def wrapped(model: torch.nn.Module, **kwargs):
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                **kwargs)


def test_gradients_are_views_laid_out_in_reverse_registration_order(world_of_one):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = wrapped(model)
    (flat,) = {bucket.flat.data_ptr() for bucket in optimizer._buckets}
    addresses = [p.grad.data_ptr() for p in model.parameters()]
    assert addresses == sorted(addresses, reverse=True) and min(addresses) == flat


def test_zero_grad_keeps_the_views_and_a_replaced_grad_is_copied_back(world_of_one):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model)
    views = [p.grad for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)  # the model, not the optimizer: grads become None
    model(torch.ones(1, 3)).sum().backward()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    assert torch.equal(model.bias.grad, torch.ones(2)), "the old gradient was added to, not replaced"
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is v and not v.any() for p, v in zip(model.parameters(), views))


def test_sparse_gradients_are_reduced_densely(world_of_one):
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    optimizer = wrapped(embedding)
    embedding(torch.tensor([1, 1, 3])).sum().backward()
    optimizer.step()
    assert not embedding.weight.grad.is_sparse
    assert embedding.weight.grad[:, 0].tolist() == [0, 2, 0, 1, 0]


def test_wrapping_rejects_what_it_cannot_reduce(world_of_one):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="Adasum"):
        wrapped(model, op=hvd.Adasum)
    with pytest.raises(ValueError, match="op != Average"):
        wrapped(model, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        wrapped(model, backward_passes_per_step=0)
    optimizer = wrapped(model)
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        DistributedOptimizer(optimizer)
    with pytest.raises(ValueError, match="before DistributedOptimizer"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
