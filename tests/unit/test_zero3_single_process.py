"""ZeRO-3 in one process (world size 1, no launcher): its units, its bookkeeping and its host
work, each against plain torch on the same model, seed and data where results are concerned."""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import psrt.torch as hvd
from psrt.engine import Engine
from psrt.zero import ZeroOptimizer
from psrt.zero.released import is_released

VOCAB, DIM, ROWS, TOKENS = 11, 8, 3, 5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def gpt(layers: int = 3, tie: bool = False) -> nn.Sequential:
    """[embedding, block x layers, head], float64, the same values for the same arguments;
    ``tie``: the head's weight is the embedding's (GPT-2's tie)."""
    torch.manual_seed(0)
    model = nn.Sequential(Embed(), *(Block() for _ in range(layers)), Head()).double()
    if tie:
        model[-1].out.weight = model[0].tokens.weight
    return model


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, TOKENS + 1), generator=torch.Generator().manual_seed(100 * step + micro))
    return ids[:, :-1], ids[:, 1:]


def loss_of(model: nn.Module, step: int, micro: int = 0, accumulation: int = 1) -> torch.Tensor:
    x, y = batch(step, micro)
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accumulation


def train(model: nn.Module, optimizer, steps: int = 3, accumulation: int = 1) -> None:
    for step in range(steps):
        for micro in range(accumulation):
            loss_of(model, step, micro, accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_matches_reference(zero: ZeroOptimizer, reference: nn.Module) -> None:
    with zero.gathered_parameters():
        for (name, got), want in zip(zero.model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12,
                                       msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def test_zero3_units_are_blocks_by_default():
    model = gpt(layers=3)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)
    units = [unit.module for unit in zero.gatherer.units]
    assert units == [model, model[1], model[2], model[3]], [type(m).__name__ for m in units]
    root = {id(p) for group in zero.gatherer.units[0].groups for p in group.params}
    assert root == {id(p) for p in [*model[0].parameters(), *model[4].parameters()]}, "root: embedding and head"
    per_module = ZeroOptimizer(gpt(layers=3), torch.optim.AdamW, stage=3, units="modules", lr=1e-3)
    assert len(per_module.gatherer.units) == 1 + 3 * 3 + 2  # embedding, 3 x (norm, fc1, fc2), norm, out


@pytest.mark.parametrize("units", ["blocks", "modules", "second_block", "tied"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_zero3_matches_single_process_torch(units, accumulation):
    """AdamW, 3 steps: the parameters equal torch's on the same model, seed and data, whatever
    the units, with gradient accumulation too; the tied head and embedding stay one parameter."""
    tie = units == "tied"
    model, reference = gpt(tie=tie), gpt(tie=tie)
    option = {"second_block": [model[2]], "tied": "blocks"}.get(units, units)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, units=option, lr=1e-2, weight_decay=0.1)
    train(model, zero, accumulation=accumulation)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1), accumulation=accumulation)
    assert_matches_reference(zero, reference)
    assert not tie or model[-1].out.weight is model[0].tokens.weight, "the tie was broken"


def test_zero3_a_tie_across_two_blocks_matches_torch():
    """A weight registered in two blocks (two units) is gathered for the second block's use and
    reduced once."""
    model, reference = gpt(), gpt()
    for m in (model, reference):
        m[3].fc1.weight = m[1].fc1.weight
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    train(model, zero)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    assert_matches_reference(zero, reference)
    assert zero.gatherer.gathered_bytes() == 0, "a use left its unit gathered after the step"


def test_zero3_world_size_one_runs_no_collective(monkeypatch):
    """Over one rank the gathers and reductions are local copies: the engine gets no work, while
    the units still gather (a peak) and release (nothing left, every parameter released)."""
    model = gpt()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    engine_calls = []
    for name in ("submit", "run", "wait", "express"):
        original = getattr(Engine, name)
        monkeypatch.setattr(Engine, name, lambda self, *args, _name=name, _original=original, **kwargs:
                            (engine_calls.append(_name), _original(self, *args, **kwargs))[1])
    train(model, zero, accumulation=2)
    assert engine_calls == [], f"the engine was called: {engine_calls[:5]}"
    assert zero.gatherer.peak_gathered_bytes > 0, "nothing was gathered"
    assert zero.gatherer.gathered_bytes() == 0 and all(is_released(p) for p in model.parameters())


def test_zero3_gathered_bytes_tracked_incrementally_matches_storages():
    """The count kept as groups gather and release equals the sum of the gathered buffers'
    storages before and after every module's forward and at every gradient, and its peak is
    at least the largest sum seen."""
    model = gpt()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, allgather_bucket_size=1, lr=1e-2)
    seen = []

    def check(*_) -> None:
        storages = sum(group.full.untyped_storage().nbytes() for group in zero.groups)
        assert zero.gatherer.gathered_bytes() == storages, (zero.gatherer.gathered_bytes(), storages)
        seen.append(storages)

    for module in model.modules():
        module.register_forward_pre_hook(check)
        module.register_forward_hook(check)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(check)
    train(model, zero, steps=2)
    check()
    assert len(seen) > 50 and max(seen) > 0
    assert zero.gatherer.peak_gathered_bytes >= max(seen)


def test_zero3_backward_prefetches_in_reverse_order_of_forward_ends():
    """With a budget of one element, forward prefetches the unit that starts next and backward
    the one that ended before: the root's backward comes first and prefetches the last block."""
    model = gpt(layers=3)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, allgather_bucket_size=1, lr=1e-2)
    train(model, zero, steps=1)
    ahead, behind = zero.gatherer.prefetch_lists()
    assert ahead == [[1], [2], [3], []], ahead    # units: root, block 0, 1, 2
    assert behind == [[3], [], [1], [2]], behind


def test_zero3_keeps_its_gradient_shard_buffer_across_steps():
    """The reduced gradient lands in one buffer per group, the same tensor every step (no
    concatenation into a new tensor per step)."""
    model = gpt()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    pointers = []
    for step in range(2):
        loss_of(model, step).backward()
        assert all(group.grad is group.grad_buffer for group in zero.groups)
        pointers.append([group.grad.data_ptr() for group in zero.groups])
        zero.step()
    assert pointers[0] == pointers[1]


def test_zero3_state_dict_inside_gathered_parameters_holds_readable_copies():
    model, reference = gpt(tie=True), gpt(tie=True)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    train(model, zero, steps=1)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), steps=1)
    with pytest.raises(Exception, match="parameters are sharded"):
        model.state_dict()
    with zero.gathered_parameters():
        state = model.state_dict()
    want = reference.state_dict()
    assert sorted(state) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def python_calls(step, steps: int = 2) -> float:
    """Python function calls ('call' events of sys.setprofile) per call of ``step``."""
    count = [0]

    def hook(frame, event, arg) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(hook)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return count[0] / steps


def test_zero3_step_costs_about_the_python_calls_of_plain_torch():
    """A ZeRO-3 step at world size 1 runs at most twice the Python calls of plain torch's step on
    the same model (the bookkeeping is O(1) per unit; once 50 times as many on a 12-layer GPT)."""
    def stepper(model, optimizer):
        return lambda: train(model, optimizer, steps=1)

    model, reference = gpt(layers=6), gpt(layers=6)
    steps = {"zero3": stepper(model, ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)),
             "torch": stepper(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))}
    for step in steps.values():
        step()
    calls = {name: python_calls(step) for name, step in steps.items()}
    assert calls["zero3"] <= 2 * calls["torch"], calls


@pytest.mark.parametrize("units, message", [
    ("layers", "units must be 'blocks', 'modules' or a list"),
    ([], "non-empty list"),
    ([nn.Linear(2, 2)], r"units\[0\] \(Linear\) is not a module of the model"),
    ("twice", r"units\[1\] \(Block\) is listed twice"),
])
def test_zero3_bad_units_are_refused_naming_what_to_change(units, message):
    model = gpt()
    units = [model[1], model[1]] if units == "twice" else units
    with pytest.raises(Exception, match=message):
        ZeroOptimizer(model, torch.optim.AdamW, stage=3, units=units, lr=1e-3)


class PartlyUsedBlock(Block):
    """A block whose MLP runs only when ``whole`` is set (its norm always does)."""

    whole = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.whole else x + self.norm(x)


class SkipsABlock(nn.Module):
    """The GPT, whose second block runs only when ``use_second`` is set, and whose third block
    uses only part of its parameters then."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.use_second = gpt(), True
        self.net[3].__class__ = PartlyUsedBlock

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.net[3].whole = self.use_second
        x = self.net[1](self.net[0](ids))
        x = self.net[2](x) if self.use_second else x
        return self.net[4](self.net[3](x))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_zero3_parameters_without_a_gradient_count_as_zeros(accumulation):
    """A block left out of some backward passes, and one partly, train as torch does with zero
    gradients."""
    model, reference = SkipsABlock(), SkipsABlock()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        for micro in range(accumulation):
            model.use_second = reference.use_second = (step + micro) % 2 == 0
            loss_of(model, step, micro, accumulation).backward()
            loss_of(reference, step, micro, accumulation).backward()
        for param in reference.parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        zero.step()
        optimizer.step()
        optimizer.zero_grad()
    assert_matches_reference(zero, reference)
