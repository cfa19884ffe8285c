"""DistributedOptimizer's bucket plan, checked as data (no communication), and, in a world of
one, how the optimizer handles gradients: autograd's own tensors, one grouped allreduce per bucket,
started on the process set's engine channel."""
from __future__ import annotations

import os

import pytest
import torch

import psrt.torch as hvd
import psrt.torch.averaging
from psrt.dp import Bucketing, Slot, overlap_pays, plan_buckets, split_evenly
from psrt.torch.optimizer import DistributedOptimizer

F32, F64 = "float32", "float64"


def slots(*numels: int, key=F32, size=4) -> list[Slot]:
    return [Slot(n, size, key) for n in numels]


def test_first_bucket_closes_at_its_small_cap_and_later_ones_at_the_large_cap():
    plan = plan_buckets(slots(10, 10, 30, 30, 30, 5), first_bucket_bytes=80, bucket_bytes=200)
    assert [b.members for b in plan] == [(0, 1), (2, 3), (4, 5)]


def test_buckets_take_consecutive_slots_in_ready_order():
    plan = plan_buckets(slots(3, 4, 5, 6), first_bucket_bytes=20, bucket_bytes=40)
    assert [(b.key, b.members) for b in plan] == [(F32, (0, 1)), (F32, (2, 3))]


def test_the_last_bucket_holds_what_is_left_below_the_cap():
    plan = plan_buckets(slots(5, 1, 1), first_bucket_bytes=20, bucket_bytes=1000)
    assert [b.members for b in plan] == [(0,), (1, 2)]


def test_dtypes_get_buckets_of_their_own_and_their_own_first_bucket():
    mixed = [Slot(4, 4, F32), Slot(4, 8, F64), Slot(4, 4, F32), Slot(4, 8, F64)]
    plan = plan_buckets(mixed, first_bucket_bytes=16, bucket_bytes=1000)
    assert [(b.key, b.members) for b in plan] == [(F32, (0,)), (F64, (1,)), (F32, (2,)), (F64, (3,))]


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


# -- the optimizer in a world of one: autograd's gradients, one grouped allreduce per bucket -------
@pytest.fixture
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def wrapped(model: torch.nn.Module, **kwargs):
    """Overlap on unless a test says otherwise: these tests watch buckets start in backward."""
    kwargs.setdefault("bucketing", Bucketing(overlap=True))
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                **kwargs)


class TwoHeads(torch.nn.Module):
    """Three small layers (each its own bucket under ``SMALL``); ``extra`` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out, self.extra = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        y = self.out(torch.tanh(self.hidden(x)))
        return y + self.extra(x) if use_extra else y


SMALL = Bucketing(first_bucket_bytes=8, bucket_bytes=8, overlap=True)


@pytest.fixture
def grouped_calls(monkeypatch):
    """Every grouped allreduce the optimizer starts: (name, the list of tensors)."""
    calls = []
    real = psrt.torch.averaging.allreduce_work

    def recording(call, tensors, *args, **kwargs):
        calls.append((call.name, list(tensors)))
        return real(call, tensors, *args, **kwargs)

    monkeypatch.setattr(psrt.torch.averaging, "allreduce_work", recording)
    return calls


def test_wrapping_creates_no_gradients_and_backward_assigns_its_own(world_of_one):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = wrapped(model)
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 4, "gradients share memory: they are views of one buffer"
    assert all(p.grad.untyped_storage().nbytes() == p.grad.nbytes for p in model.parameters())
    optimizer.step()


def test_each_bucket_is_one_grouped_allreduce_of_the_gradients_themselves(world_of_one, grouped_calls):
    model = TwoHeads()
    optimizer = wrapped(model, bucketing=Bucketing(first_bucket_bytes=32, bucket_bytes=1 << 20))
    model(torch.ones(2, 3), use_extra=True).sum().backward()
    grads = {id(p.grad) for p in model.parameters()}
    optimizer.step()
    assert [name for name, _ in grouped_calls] == [bucket.name for bucket in optimizer._buckets]
    assert [len(tensors) for _, tensors in grouped_calls] == [len(b.members) for b in optimizer._buckets] == [2, 4]
    assert {id(t) for _, tensors in grouped_calls for t in tensors} == grads, "something other than .grad was sent"
    assert {id(p.grad) for p in model.parameters()} == grads, "the reduction replaced a gradient tensor"


def test_zero_grad_sets_none_by_default_and_zeroes_in_place_when_asked(world_of_one):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    (bucket,) = optimizer._buckets
    grads = [p.grad for p in model.parameters()]
    assert all(g._base is bucket.buffer and not g.any() for g in grads), "zeroed in place as views of the bucket"
    model(torch.ones(1, 3)).sum().backward()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads)), "autograd accumulates into a kept .grad"
    assert torch.equal(model.bias.grad, torch.ones(2))
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    assert torch.equal(model.bias.grad, torch.ones(2))
    optimizer.step()


def test_zero_grad_while_allreduces_are_outstanding_raises(world_of_one):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model)
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(AssertionError, match="before optimizer.step"):
        optimizer.zero_grad()
    optimizer.synchronize()
    with optimizer.skip_synchronize():
        optimizer.step()
    optimizer.zero_grad()


def test_a_parameter_without_a_gradient_gets_zeros_at_synchronize(world_of_one, grouped_calls):
    model = TwoHeads()
    optimizer = wrapped(model, bucketing=SMALL)
    model(torch.ones(2, 3)).sum().backward()
    assert model.extra.weight.grad is None and model.extra.bias.grad is None
    started = [bucket.launched for bucket in optimizer._buckets]
    assert started == [False, False, True, True, True, True], "the unused head's buckets cannot start in backward"
    optimizer.synchronize()
    assert len(grouped_calls) == 6
    for param in model.extra.parameters():
        assert param.grad is not None and param.grad.shape == param.shape and not param.grad.any()
    with optimizer.skip_synchronize():
        optimizer.step()


def test_model_zero_grad_set_to_none_between_steps(world_of_one):
    model = TwoHeads()
    optimizer = wrapped(model, bucketing=SMALL)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.ones(2, 3), use_extra=True).sum().backward()
        optimizer.step()
        assert torch.equal(model.out.bias.grad, torch.full((2,), 2.0))


def test_backward_passes_per_step_starts_the_allreduce_after_the_last_pass(world_of_one, grouped_calls):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model, backward_passes_per_step=2)
    model(torch.ones(1, 3)).sum().backward()
    assert not grouped_calls
    model(torch.ones(1, 3)).sum().backward()
    assert len(grouped_calls) == 1
    optimizer.step()
    assert torch.equal(model.bias.grad, torch.full((2,), 2.0))


def test_fp16_compression_reduces_into_the_gradient_tensors(world_of_one, grouped_calls):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model, compression=hvd.Compression.fp16)
    model(torch.full((1, 3), 1 / 3)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.step()
    assert [t.dtype for t in grouped_calls[0][1]] == [torch.float16, torch.float16]
    assert all(p.grad is g and g.dtype == torch.float32 for p, g in zip(model.parameters(), grads))
    assert torch.equal(model.weight.grad, torch.full((2, 3), 1 / 3, dtype=torch.float16).float())


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_sparse_gradients_are_reduced_and_stay_sparse_as_in_horovod(world_of_one, overlap, sparse_as_dense,
                                                                   grouped_calls):
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    optimizer = wrapped(embedding, sparse_as_dense=sparse_as_dense, bucketing=Bucketing(overlap=overlap))
    embedding(torch.tensor([1, 1, 3])).sum().backward()
    grad = embedding.weight.grad
    optimizer.step()
    assert embedding.weight.grad is grad and grad.is_sparse
    assert grad.to_dense()[:, 0].tolist() == [0, 2, 0, 1, 0]
    assert len(grouped_calls) == (1 if sparse_as_dense else 0), "only sparse_as_dense reduces it densely"


def test_wrapping_rejects_what_it_cannot_reduce(world_of_one):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="hvd.Adasum"):
        wrapped(model, op=hvd.Min)
    with pytest.raises(ValueError, match="op != Average"):
        wrapped(model, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        wrapped(model, backward_passes_per_step=0)
    optimizer = wrapped(model)
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        DistributedOptimizer(optimizer)
    with pytest.raises(ValueError, match="before DistributedOptimizer"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})


@pytest.mark.parametrize("devices, ranks, cores, threads, pays", [
    ([torch.device("cpu")], 2, 2, 1, False),    # this box: 2 ranks fill both cores
    ([torch.device("cpu")], 2, 4, 1, True),     # a core to spare for each rank's engine thread
    ([torch.device("cpu")], 8, 64, 4, True),
    ([torch.device("cpu")], 8, 64, 8, False),   # torch's threads already take every core
    ([torch.device("cuda", 0)], 8, 8, 8, True),  # GPU gradients: NCCL works while the GPU computes
])
def test_overlap_is_on_where_communication_has_resources_of_its_own(devices, ranks, cores, threads, pays):
    assert overlap_pays(devices, ranks, cores, threads) is pays


def test_overlap_left_unset_is_decided_for_this_host(world_of_one):
    model = torch.nn.Linear(3, 2)
    optimizer = wrapped(model, bucketing=Bucketing())
    assert optimizer._overlap is overlap_pays([torch.device("cpu")], 1, len(os.sched_getaffinity(0)),
                                              torch.get_num_threads())


@pytest.mark.parametrize("overlap", [None, True, False])
def test_zero_optimizer_overlaps_by_the_same_policy_unless_told(world_of_one, monkeypatch, overlap):
    from psrt.zero import ZeroOptimizer
    for host_pays in (True, False):
        monkeypatch.setattr("psrt.zero.optimizer.overlap_pays_here", lambda params, ranks_on_host: host_pays)
        zero = ZeroOptimizer(torch.nn.Linear(3, 2), torch.optim.SGD, stage=2, overlap=overlap, lr=0.1)
        assert zero.overlap is (host_pays if overlap is None else overlap)


def test_after_zero_grad_in_place_each_bucket_is_one_allreduce_of_its_buffer(world_of_one, grouped_calls):
    model = TwoHeads()
    optimizer = wrapped(model, bucketing=Bucketing(first_bucket_bytes=32, bucket_bytes=1 << 20))
    model(torch.ones(2, 3), use_extra=True).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    grouped_calls.clear()
    model(torch.ones(2, 3), use_extra=True).sum().backward()
    grads = {id(p.grad) for p in model.parameters()}
    optimizer.step()
    assert [tensors for _, tensors in grouped_calls] == [[b.buffer] for b in optimizer._buckets], (
        "something other than the bucket buffer was sent")
    assert {id(p.grad) for p in model.parameters()} == grads, "the reduction replaced a gradient tensor"
