"""broadcast_parameters, broadcast_optimizer_state, broadcast_object and allgather_object.

Ranks start from rank-dependent states; every rank rebuilds the root's state
itself (it is a function of the root's rank) and checks it now holds exactly that.
"""
from __future__ import annotations

import torch

import psrt.torch as hvd
from psrt.torch.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from psrt.torch.optimizer import DistributedOptimizer

from _harness import Checks
from _training_common import Mlp, assert_params_close, failure_of, global_batch, loss_of, my_rows, randn


def model_with_buffers(key: str, rank: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5)).double()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                tensor.copy_(randn(key, tensor.shape, rank, name).abs())
            else:
                tensor.fill_(rank + 3)
    return model


def assert_state_dicts_equal(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for name in want:
        assert torch.equal(got[name], want[name]), f"{what}: {name} is {got[name]}, expected {want[name]}"


def broadcast_parameters_state_dict(key: str) -> None:
    """A state_dict, buffers (running stats, an int64 counter) included, from root 0."""
    model = model_with_buffers(key, hvd.rank())
    broadcast_parameters(model.state_dict(), root_rank=0)
    assert_state_dicts_equal(model.state_dict(), model_with_buffers(key, 0).state_dict(), key)


def broadcast_parameters_named(key: str) -> None:
    """named_parameters() from the last rank; the parameters still train afterwards."""
    root = hvd.size() - 1
    model = model_with_buffers(key, hvd.rank())
    broadcast_parameters(list(model.named_parameters()), root_rank=root)
    want = model_with_buffers(key, root)
    for (name, got), expected in zip(model.named_parameters(), want.parameters()):
        assert torch.equal(got, expected), f"{key}: {name} differs from root {root}'s"
        assert got.requires_grad and got.is_leaf, f"{key}: {name} is no longer a trainable leaf"


def trained_adam(key: str, rank: int) -> tuple[Mlp, torch.optim.Adam]:
    """Rank r's model and Adam after r local steps with lr and betas of its own (rank 0 has
    no state yet: Adam creates it at the first step)."""
    model = Mlp(f"{key}/{rank}")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1), betas=(0.9, 0.99 - 0.001 * rank))
    for step in range(rank):
        x, y = global_batch(f"{key}/{rank}", step)
        optimizer.zero_grad()
        loss_of(model, x, y, use_extra=True).backward()
        optimizer.step()
    return model, optimizer


def assert_optimizer_equal(got: torch.optim.Optimizer, want: torch.optim.Optimizer, params, want_params,
                           what: str) -> None:
    for group, expected in zip(got.param_groups, want.param_groups):
        for option, value in expected.items():
            if option != "params":
                assert group[option] == value and type(group[option]) is type(value), (
                    f"{what}: option {option} is {group[option]!r}, root has {value!r}")
    for index, (param, want_param) in enumerate(zip(params, want_params)):
        state, expected = got.state.get(param, {}), want.state.get(want_param, {})
        assert list(state) == list(expected), (
            f"{what}: parameter {index} has state {list(state)}, the root {list(expected)}")
        for name, value in expected.items():
            assert torch.equal(state[name], value), f"{what}: parameter {index} state {name} differs from root's"


def broadcast_adam_state(key: str) -> None:
    """From the last rank (which has state) to ranks with other lr, betas and state, or none."""
    root = hvd.size() - 1
    model, optimizer = trained_adam(key, hvd.rank())
    optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    broadcast_parameters(model.state_dict(), root_rank=root)
    broadcast_optimizer_state(optimizer, root_rank=root)
    want_model, want = trained_adam(key, root)
    state_error = failure_of(lambda: assert_optimizer_equal(optimizer, want, list(model.parameters()),
                                                            list(want_model.parameters()), key))
    # One more step together equals the root's step on the whole batch (Adam's step count included).
    x, y = global_batch(key, "after")
    optimizer.zero_grad()
    loss_of(model, my_rows(x), my_rows(y), use_extra=True).backward()
    optimizer.step()
    want.zero_grad()
    loss_of(want_model, x, y, use_extra=True).backward()
    want.step()
    assert state_error is None, state_error
    assert_params_close(model, want_model, f"{key}: after a step")


def broadcast_empty_adam_state(key: str) -> None:
    """A root without state (rank 0, no step yet) creates it as Horovod does, by a step on zero
    gradients; every rank then holds that state and the root's options."""
    model, optimizer = trained_adam(key, hvd.rank())
    broadcast_optimizer_state(optimizer, root_rank=0)
    want_model, want = trained_adam(key, 0)
    for param in want_model.parameters():
        param.grad = torch.zeros_like(param)
    want.step()
    assert_optimizer_equal(optimizer, want, list(model.parameters()), list(want_model.parameters()), key)


def sample_object(rank: int) -> dict:
    return {"rank": rank, "items": list(range(100 * rank)), "pair": (0.1 * rank, f"r{rank}"),
            "tensor": torch.arange(rank + 1, dtype=torch.float64), "none": None}


def assert_object_equal(got: object, want: dict, what: str) -> None:
    assert isinstance(got, dict) and set(got) == set(want), f"{what}: got {got!r}"
    assert torch.equal(got["tensor"], want["tensor"]), f"{what}: tensor {got['tensor']}"
    assert {k: v for k, v in got.items() if k != "tensor"} == {k: v for k, v in want.items() if k != "tensor"}, (
        f"{what}: got {got!r}")


def broadcast_object_check(key: str) -> None:
    root = 1 % hvd.size()
    got = broadcast_object(sample_object(root) if hvd.rank() == root else None, root_rank=root, name=key)
    assert_object_equal(got, sample_object(root), key)
    assert broadcast_object("unnamed" if hvd.rank() == 0 else 17) == "unnamed", f"{key}: default root and name"


def allgather_object_check(key: str) -> None:
    got = allgather_object(sample_object(hvd.rank()), name=key)
    assert isinstance(got, list) and len(got) == hvd.size(), f"{key}: got {type(got).__name__} of {len(got)}"
    for rank, item in enumerate(got):
        assert_object_equal(item, sample_object(rank), f"{key}: rank {rank}'s object")


def add_checks(checks: Checks) -> None:
    checks.add("broadcast_parameters/state_dict_from_root_0", broadcast_parameters_state_dict)
    checks.add("broadcast_parameters/named_parameters_from_last_rank", broadcast_parameters_named)
    checks.add("broadcast_optimizer_state/adam_from_last_rank", broadcast_adam_state)
    checks.add("broadcast_optimizer_state/root_without_state", broadcast_empty_adam_state)
    checks.add("broadcast_object/from_rank_1", broadcast_object_check)
    checks.add("allgather_object/objects_of_every_size", allgather_object_check)
