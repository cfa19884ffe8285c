"""psrt.zero.dcp in one process (world size 1, DCP with ``no_dist``): ZeRO's state has the keys,
nesting and shapes torch's own ``get_*_state_dict`` give the same model and optimizer, and a
checkpoint moves between ZeRO and plain torch both ways, training on equal to torch.  Moves
between ranks counts (FSDP2 on some, ZeRO-3 on others) are in
tests/parallel/scripts/torch_backend_check.py."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                      set_model_state_dict, set_optimizer_state_dict)

import psrt.torch as hvd
from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt.zero import ZeroOptimizer
from psrt.zero import dcp as zero_dcp
from psrt.zero.dcp import FlatRangeShard, ModelState, OptimizerState

ADAMW = {"lr": 0.02, "weight_decay": 0.1}


class Net(nn.Module):
    """1-, 2- and 3-D parameters and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.Linear(5, 7)
        self.mix = nn.Parameter(torch.randn(3, 7, 3) * 0.3)
        self.out = nn.Linear(3, 3)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.einsum("bi,kij->bj", torch.tanh(self.inner(x)), self.mix)) + self.shift


def batches(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator)) for _ in range(count)]


def train(model: nn.Module, optimizer, data) -> None:
    for x, y in data:
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def torch_state(model: nn.Module, optimizer) -> dict:
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}


def reference(steps: int = 4) -> dict[str, torch.Tensor]:
    model = Net(seed=1)
    train(model, torch.optim.AdamW(model.parameters(), **ADAMW), batches()[:steps])
    return model.state_dict()


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def zero_parameters(zero: ZeroOptimizer) -> dict[str, torch.Tensor]:
    with zero.gathered_parameters():
        return {name: value.clone() for name, value in zero.model.state_dict().items()}


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    yield
    hvd.shutdown()


def _shapes(tree):
    if isinstance(tree, dict):
        return {key: _shapes(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_shapes(value) for value in tree]
    return tuple(tree.shape) if isinstance(tree, torch.Tensor) else tree


def test_zero3_state_has_the_keys_nesting_and_shapes_torch_gives_the_same_model():
    model, zmodel = Net(seed=1), Net(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    zero = ZeroOptimizer(zmodel, torch.optim.AdamW, stage=3, **ADAMW)
    train(model, optimizer, batches()[:1])
    train(zmodel, zero, batches()[:1])
    theirs, ours = torch_state(model, optimizer), {"model": ModelState(zero).state_dict(),
                                                   "optim": OptimizerState(zero).state_dict()}
    assert _shapes(ours) == _shapes(theirs)
    assert isinstance(ours["model"]["mix"], FlatRangeShard) and ours["model"]["mix"].boxes == [((0, 0, 0), (3, 7, 3))]


@pytest.mark.parametrize("stage, layout", [(0, {}), (1, {}), (2, {}), (2, {"reduce_bucket_size": 20}), (3, {}),
                                           (3, {"units": "modules"})], ids=str)
def test_a_torch_checkpoint_loads_into_zero_and_trains_on_equal_to_torch(tmp_path, stage, layout):
    """Every stage, with one flat group or several (small buckets, a unit per module)."""
    model = Net(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    train(model, optimizer, batches()[:2])
    dcp.save(torch_state(model, optimizer), checkpoint_id=tmp_path, no_dist=True)
    zmodel = Net(seed=2)
    zero = ZeroOptimizer(zmodel, torch.optim.AdamW, stage=stage, lr=0.5, weight_decay=0.0, **layout)
    assert len(zero.groups) > 1 or not layout, f"{layout} made one flat group"
    dcp.load({"model": ModelState(zero), "optim": OptimizerState(zero)}, checkpoint_id=tmp_path, no_dist=True)
    assert (zero.param_groups[0]["lr"], zero.param_groups[0]["weight_decay"]) == (ADAMW["lr"], ADAMW["weight_decay"])
    train(zmodel, zero, batches()[2:])
    assert_matches(zero_parameters(zero), reference())


def test_a_zero3_checkpoint_loads_into_torch_and_trains_on_equal_to_torch(tmp_path):
    zmodel = Net(seed=1)
    zero = ZeroOptimizer(zmodel, torch.optim.AdamW, stage=3, **ADAMW)
    train(zmodel, zero, batches()[:2])
    dcp.save({"model": ModelState(zero), "optim": OptimizerState(zero)}, checkpoint_id=tmp_path, no_dist=True)
    model = Net(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    state = torch_state(model, optimizer)
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    train(model, optimizer, batches()[2:])
    assert_matches(model.state_dict(), reference())


def test_whole_tensors_load_too_and_mixed_precision_keeps_fp32_masters():
    """A consolidated state (plain tensors) goes through set_*; with bf16 compute the fp32
    masters take the values exactly and the parameters their bf16 rounding."""
    model = Net(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    train(model, optimizer, batches()[:2])
    zero = ZeroOptimizer(Net(seed=2), torch.optim.AdamW, stage=3, compute_dtype=torch.bfloat16, **ADAMW)
    zero_dcp.set_model_state_dict(zero, model.state_dict())
    zero_dcp.set_optimizer_state_dict(zero, get_optimizer_state_dict(model, optimizer))
    mine = zero_dcp.get_model_state_dict(zero)
    for name, value in model.state_dict().items():
        if isinstance(mine[name], FlatRangeShard):
            (offsets, sizes), = mine[name].boxes
            assert offsets == (0,) * value.dim() and sizes == tuple(value.shape)
            assert torch.equal(mine[name].local_views()[0], value), name
    want = {name: value if name == "shift" else value.to(torch.bfloat16) for name, value in model.state_dict().items()}
    assert_matches(zero_parameters(zero), want, tol=0)
    exp_avg = zero_dcp.get_optimizer_state_dict(zero)["state"]["mix"]["exp_avg"].local_views()[0]
    assert torch.equal(exp_avg, optimizer.state[model.mix]["exp_avg"])


def test_a_fresh_optimizer_gets_its_state_without_changing_the_weights():
    zero = ZeroOptimizer(Net(seed=1), torch.optim.AdamW, stage=3, **ADAMW)
    before = zero.groups[0].master.clone()
    state = zero_dcp.get_optimizer_state_dict(zero)
    assert sorted(state["state"]["mix"]) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(zero.groups[0].master, before) and zero.param_groups[0]["lr"] == ADAMW["lr"]
    assert zero.groups[0].master.grad is None


def test_different_steps_within_one_flat_group_are_refused_naming_both():
    model = Net(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    train(model, optimizer, batches()[:2])
    state = get_optimizer_state_dict(model, optimizer)
    state["state"]["out.bias"]["step"] = torch.tensor(1.0)
    zero = ZeroOptimizer(Net(seed=1), torch.optim.AdamW, stage=3, **ADAMW)
    zero_dcp.get_optimizer_state_dict(zero)  # the state exists from here on
    own = zero.state[zero.groups[0].master]
    before = {key: value.clone() for key, value in own.items()}
    refusal = r"one 'step' per flat group, but 'mix' has 2\.0 and 'out\.bias' 1\.0"
    with pytest.raises(InvalidArgumentError, match=refusal):
        zero_dcp.set_optimizer_state_dict(zero, state)
    assert all(torch.equal(own[key], value) for key, value in before.items()), "a refused load changed the state"


def test_other_parameter_groups_and_other_models_are_refused():
    model = Net(seed=1)
    optimizer = torch.optim.AdamW([{"params": [model.mix]}, {"params": [p for n, p in model.named_parameters()
                                                                           if n != "mix"]}], **ADAMW)
    train(model, optimizer, batches()[:1])
    zero = ZeroOptimizer(Net(seed=1), torch.optim.AdamW, stage=3, **ADAMW)
    with pytest.raises(InvalidArgumentError, match="build it with the same param_groups"):
        zero_dcp.set_optimizer_state_dict(zero, get_optimizer_state_dict(model, optimizer))
    with pytest.raises(InvalidArgumentError, match=r"missing \['mix'\], unexpected \['extra'\]"):
        zero_dcp.set_model_state_dict(zero, {**{k: v for k, v in model.state_dict().items() if k != "mix"},
                                             "extra": torch.zeros(1)})
    before = zero.groups[0].master.clone()
    with pytest.raises(InvalidArgumentError, match=r"mix: shape \(7, 3\) given, the parameter's is \(3, 7, 3\)"):
        zero_dcp.set_model_state_dict(zero, {**model.state_dict(), "mix": torch.zeros(7, 3)})
    with pytest.raises(InvalidArgumentError, match=r"shift: expected a tensor of shape \(3,\), got \(4,\)"):
        zero_dcp.set_model_state_dict(zero, {**model.state_dict(), "shift": torch.zeros(4)})
    assert torch.equal(zero.groups[0].master, before), "a refused load changed the weights"


def test_a_flat_range_shard_refuses_tensor_operations():
    zero = ZeroOptimizer(Net(seed=1), torch.optim.AdamW, stage=3, **ADAMW)
    shard = zero_dcp.get_model_state_dict(zero)["mix"]
    assert "FlatRangeShard(shape=(3, 7, 3)" in repr(shard)
    with pytest.raises(UnsupportedOperationError, match="holds only some boxes of the tensor"):
        shard + 1
