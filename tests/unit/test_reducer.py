"""The gradient reducer with a fake completion strategy (no communication): readiness counting,
bucket order, zero-fill, passes per step, and gradients kept as views of the bucket buffers."""
from __future__ import annotations

import pytest
import torch

from psrt.dp import Bucket, BucketStrategy, GradientReducer, whole_buffer


class Recording(BucketStrategy):
    """Records what the reducer asks for; ``finish`` doubles a bucket's gradients (a stand-in
    for a reduction over two ranks, in place)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def ready(self, bucket: Bucket) -> None:
        self.events.append(("ready", bucket.index))

    def launch(self, bucket: Bucket) -> None:
        self.events.append(("launch", bucket.index))
        bucket.started = [grad.clone() for grad in bucket.grads()]

    def finish(self, bucket: Bucket) -> None:
        self.events.append(("finish", bucket.index))
        for grad, sent in zip(bucket.grads(), bucket.started):
            grad.copy_(sent * 2)

    def all_finished(self) -> None:
        self.events.append(("all_finished", -1))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.unused = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        y = self.second(torch.tanh(self.first(x)))
        return self.unused(y) if use_unused else y


def reducer_for(model: Net, **options) -> tuple[GradientReducer, Recording, list[torch.nn.Parameter]]:
    """Parameters in ready order (the reverse of registration): unused.bias, unused.weight,
    second.bias, second.weight, first.bias, first.weight; one bucket per layer."""
    params = list(model.parameters())[::-1]
    strategy = Recording()
    reducer = GradientReducer(params, [[0, 1], [2, 3], [4, 5]], strategy, names=["u", "s", "f"],
                              param_names=[f"p{i}" for i in range(6)], **options)
    return reducer, strategy, params


def loss(model: Net, use_unused: bool = True) -> torch.Tensor:
    return model(torch.ones(2, 3), use_unused).sum()


def test_a_bucket_launches_during_backward_once_its_last_member_is_ready():
    model = Net()
    reducer, strategy, _ = reducer_for(model)
    loss(model).backward()
    assert strategy.events == [("launch", 0), ("ready", 0), ("launch", 1), ("ready", 1), ("launch", 2), ("ready", 2)]
    reducer.synchronize()
    assert strategy.events[6:] == [("finish", 0), ("finish", 1), ("finish", 2), ("all_finished", -1)]
    assert not reducer.in_flight


def test_without_overlap_every_bucket_launches_at_synchronize_in_bucket_order():
    model = Net()
    reducer, strategy, _ = reducer_for(model, overlap=False)
    loss(model).backward()
    assert strategy.events == [("ready", 0), ("ready", 1), ("ready", 2)]
    reducer.synchronize()
    assert [e for e in strategy.events if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]


@pytest.mark.parametrize("views", [False, True])
def test_a_parameter_without_a_gradient_gets_zeros_and_its_bucket_launches_at_synchronize(views):
    model = Net()
    reducer, strategy, params = reducer_for(model, views=views)
    loss(model, use_unused=False).backward()
    assert ("launch", 0) not in strategy.events and params[0].grad is None
    reducer.synchronize()
    assert ("launch", 0) in strategy.events
    assert all(p.grad is not None and not p.grad.any() for p in model.unused.parameters())
    if views:
        assert all(p.grad._base is reducer.buckets[0].buffer for p in model.unused.parameters())


def test_passes_per_step_launch_after_the_last_pass_and_one_more_raises():
    model = Net()
    reducer, strategy, _ = reducer_for(model, passes_per_step=2)
    loss(model).backward()
    assert not strategy.events, "a bucket launched before its last pass"
    loss(model).backward()
    assert [e for e in strategy.events if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        loss(model).backward()


def test_a_strategy_names_its_own_error_for_one_pass_too_many():
    class Strict(Recording):
        def too_many_passes(self, name: str) -> BaseException:
            return RuntimeError(f"{name} twice")

    model = Net()
    params = list(model.parameters())[::-1]
    reducer = GradientReducer(params, [[0, 1], [2, 3], [4, 5]], Strict(), names=["u", "s", "f"],
                              param_names=[f"p{i}" for i in range(6)])
    loss(model).backward()
    assert reducer.in_flight
    with pytest.raises(RuntimeError, match=r"p\d twice"):
        loss(model).backward()


def test_gradients_become_views_when_zeroed_in_place_and_stay_autograds_after_set_to_none():
    model = Net()
    reference = Net()
    reducer, _, params = reducer_for(model, views=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, set_to_none in enumerate((True, False, False, True)):
        if set_to_none:
            optimizer.zero_grad(set_to_none=True)
        else:
            reducer.zero_into_views()  # what DistributedOptimizer.zero_grad(set_to_none=False) does
        reference_optimizer.zero_grad(set_to_none=set_to_none)
        loss(model).backward()
        loss(reference).backward()
        reducer.synchronize()
        for p in reference.parameters():
            p.grad.mul_(2)  # what the fake reduction does
        for bucket in reducer.buckets:
            views = [p.grad._base is bucket.buffer for p in bucket.params]
            assert views == [not set_to_none] * len(views), f"step {step}: views {views}"
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.grad, theirs.grad), f"step {step}"
        optimizer.step()
        reference_optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params), "zero_grad() must leave .grad None, as torch's"


def test_views_accumulate_in_place_over_passes():
    model = Net()
    reducer, _, params = reducer_for(model, views=True, passes_per_step=2)
    loss(model).backward()
    first = [p.grad.clone() for p in params]
    buffers = [p.grad.data_ptr() for p in params]
    loss(model).backward()
    assert [p.grad.data_ptr() for p in params] == buffers, "the second pass replaced a view"
    assert all(torch.allclose(p.grad, 2 * g) for p, g in zip(params, first))
    reducer.synchronize()


def test_a_gradient_set_by_hand_is_reduced_where_it_is():
    model = Net()
    reducer, _, params = reducer_for(model, views=True, overlap=False)
    reducer.zero_into_views()  # no gradients yet: nothing to zero
    loss(model).backward()
    mine = torch.full_like(params[0], 3.0)
    params[0].grad = mine
    assert not whole_buffer(reducer.buckets[0]) and whole_buffer(reducer.buckets[1]) is False
    reducer.synchronize()
    assert params[0].grad is mine and torch.equal(mine, torch.full_like(mine, 6.0))


def test_a_bucket_travels_whole_only_when_every_dense_gradient_is_its_view():
    model = Net()
    reducer, _, params = reducer_for(model, views=True)
    loss(model).backward()
    reducer.synchronize()
    assert not any(whole_buffer(bucket) for bucket in reducer.buckets), "autograd's fresh gradients are not views"
    reducer.zero_into_views()
    loss(model).backward()
    assert all(whole_buffer(bucket) for bucket in reducer.buckets)
    reducer.synchronize()


def test_a_sparse_gradient_stays_sparse_and_its_slot_is_zeros():
    embedding = torch.nn.Embedding(5, 2, sparse=True)
    dense = torch.nn.Parameter(torch.ones(3))
    strategy = Recording()
    strategy.finish = lambda bucket: None
    reducer = GradientReducer([dense, embedding.weight], [[0, 1]], strategy, names=["b"], param_names=["d", "e"],
                              views=True, overlap=False)
    (embedding(torch.tensor([1, 3])).sum() + dense.sum()).backward()
    reducer.synchronize()
    reducer.zero_into_views()
    bucket = reducer.buckets[0]
    bucket.views[1].fill_(7.0)  # stale data in the sparse member's slot
    (embedding(torch.tensor([1, 3])).sum() + dense.sum()).backward()
    assert embedding.weight.grad.is_sparse and dense.grad._base is bucket.buffer
    assert whole_buffer(bucket) and not bucket.views[1].any()
    reducer.synchronize()


def test_every_backward_synchronizes_when_backward_ends():
    model = Net()
    reducer, strategy, _ = reducer_for(model, every_backward=True, overlap=False)
    loss(model, use_unused=False).backward()
    assert ("all_finished", -1) in strategy.events, "the end-of-backward callback did not run"
    assert [e for e in strategy.events if e[0] == "finish"] == [("finish", 0), ("finish", 1), ("finish", 2)]
    strategy.events.clear()
    loss(model, use_unused=False).backward()  # counts restarted: no error for a second backward
    assert ("all_finished", -1) in strategy.events


def test_without_hooks_only_synchronize_launches():
    model = Net()
    reducer, strategy, _ = reducer_for(model, hooks=False)
    loss(model).backward()
    assert not strategy.events
    reducer.synchronize()
    assert [e[0] for e in strategy.events].count("launch") == 3


def test_hooks_go_with_the_reducer():
    model = Net()
    reducer, strategy, _ = reducer_for(model)
    del reducer
    loss(model).backward()
    assert not strategy.events
