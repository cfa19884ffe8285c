"""ZeRO stages 0-3 against a single process on the concatenated batch and against allreduce DP,
in one job (``psrun -np N python zero_check.py``); rank 0 prints one JSON line per check.

Every rank trains its own single-process reference from the same seeds.  Float64 throughout
except the mixed-precision checks.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

import psrt.torch as hvd
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.full_state import full_state_dict
from psrt.zero import ZeroOptimizer, consolidate, expected_bytes

import _harness
from _training_common import expect_raises
from _zero_common import (ZNet, assert_model_matches, assert_shards_match, batch, loss_of, mine,
                          reference_step, shard_slices)

STEPS = 3
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
}
BUCKET = 200  # elements: stages 0-2 get groups of 215, 477 and 45 elements


def check_matches_references(key: str, stage: int, optimizer: str, accumulation: int) -> None:
    cls, kwargs = OPTIMIZERS[optimizer]
    model, reference, dp_model = ZNet(key), ZNet(key), ZNet(key)
    zero = ZeroOptimizer(model, cls, stage=stage, reduce_bucket_size=BUCKET, **kwargs)
    reference_optimizer = cls(reference.parameters(), **kwargs)
    dp = hvd.DistributedOptimizer(cls(dp_model.parameters(), **kwargs), dp_model.named_parameters(),
                                  backward_passes_per_step=accumulation)
    for step in range(STEPS):
        reference_optimizer.zero_grad()
        for micro in range(accumulation):
            x, y = batch(key, step, micro)
            with torch.no_grad():
                want = loss_of(reference, mine(x), mine(y), accumulation)
            got = loss_of(model, mine(x), mine(y), accumulation)
            torch.testing.assert_close(got.detach(), want, **TIGHT, msg=lambda m: f"step {step} loss: {m}")
            got.backward()
            loss_of(reference, x, y, accumulation).backward()
            loss_of(dp_model, mine(x), mine(y), accumulation).backward()
        zero.synchronize()
        assert_shards_match(zero, reference, reference_optimizer, f"step {step} before the update", **TIGHT)
        reference_optimizer.step()
        zero.step()
        zero.zero_grad()
        dp.step()
        dp.zero_grad()
    assert_shards_match(zero, reference, reference_optimizer, f"after {STEPS} steps", **TIGHT)
    assert_model_matches(zero, reference, "vs single process", **TIGHT)
    assert_model_matches(zero, dp_model, "vs allreduce DP", **TIGHT)


def check_clipping_matches_torch(key: str, norm_type: float) -> None:
    for stage in (0, 1, 2, 3):
        model, reference = ZNet(key), ZNet(key)
        zero = ZeroOptimizer(model, torch.optim.SGD, stage=stage, reduce_bucket_size=BUCKET, lr=0.1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        x, y = batch(key, 0, 0)
        loss_of(model, mine(x), mine(y), 1).backward()
        loss_of(reference, x, y, 1).backward()
        max_norm = 0.05
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        got = zero.clip_grad_norm_(max_norm, norm_type)
        assert want > max_norm, f"the test must clip: norm {float(want)} <= {max_norm}"
        torch.testing.assert_close(got, want.to(got.dtype), **TIGHT, msg=lambda m: f"stage {stage} norm: {m}")
        assert_shards_match(zero, reference, reference_optimizer, f"stage {stage} clipped", **TIGHT)
        reference_optimizer.step()
        zero.step()
        assert_model_matches(zero, reference, f"stage {stage} after a clipped step", **TIGHT)


def wide_net(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(63, 63) for _ in range(6)]).to(dtype)


def check_memory_follows_the_formulas(key: str) -> None:
    """bf16 compute with Adam: 2 bytes of parameters, 2 of gradients and 12 of optimizer state per
    element (fp32 masters, exp_avg, exp_avg_sq), sharded as the stage says."""
    world = hvd.size()
    for stage in (0, 1, 2, 3):
        model = wide_net()
        numel = sum(p.numel() for p in model.parameters())
        zero = ZeroOptimizer(model, torch.optim.Adam, stage=stage, compute_dtype=torch.bfloat16,
                             reduce_bucket_size=3000, lr=1e-3)
        x = torch.randn(4, 63, generator=torch.Generator().manual_seed(hvd.rank())).to(torch.bfloat16)
        for step in range(2):
            model(x).float().pow(2).mean().backward()
            if step == 0:
                zero.step()
        measured = zero.memory_report()
        zero.step()
        expected = expected_bytes(stage, numel, world, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
        # Padding: at most world - 1 elements per group; Adam's step counters: 4 bytes per group.
        slack = len(zero.groups) * (world * 16 + 4)
        for what in ("params", "grads", "optimizer"):
            assert abs(measured[what] - expected[what]) <= slack, \
                f"stage {stage} {what}: measured {measured[what]} bytes, formula {expected[what]:.0f} (+/- {slack})"


def check_stage3_gathers_only_what_runs(key: str) -> None:
    """With a prefetch budget of one element, at most the running layer and the next are gathered,
    whether or not reductions overlap backward; outside forward and backward nothing is."""
    for overlap in (True, False):
        model = wide_net(torch.float64)
        layer_bytes = (63 * 63 + 63) * 8
        zero = ZeroOptimizer(model, torch.optim.SGD, stage=3, allgather_bucket_size=1, overlap=overlap, lr=0.1)
        x = torch.randn(4, 63, dtype=torch.float64)
        for _ in range(2):
            model(x).pow(2).mean().backward()
            zero.step()
        peak, shards = zero.gatherer.peak_gathered_bytes, zero.memory_report()["params"]
        padded_layer = -(-(63 * 63 + 63) // hvd.size()) * hvd.size() * 8
        assert peak <= 2 * padded_layer, f"overlap={overlap}: peak gathered {peak} bytes > two layers"
        assert peak >= layer_bytes, f"overlap={overlap}: peak gathered {peak} bytes < one layer: nothing measured"
        assert shards <= 6 * padded_layer // hvd.size(), f"overlap={overlap}: {shards} bytes held after the step"
        expect_raises(InvalidArgumentError, model.state_dict, "parameters are sharded", "state_dict outside")
        with zero.gathered_parameters():
            assert len(model.state_dict()) == 12, "state_dict inside gathered_parameters()"


def _fail_when_backward_reaches_the_output(module, args, output) -> None:
    output.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("planted failure")))


def check_a_backward_that_raised_leaves_no_trace(key: str) -> None:
    """A backward that fails halfway (after the last layer's gradients, before the first's), then
    zero_grad() and a normal step: the same as the reference's normal step.  Stage 3 with its
    default units (ZNet is one root unit) and with one unit per module."""
    for stage, units in ((1, "blocks"), (2, "blocks"), (3, "blocks"), (3, "modules")):
        model, reference = ZNet(key), ZNet(key)
        zero = ZeroOptimizer(model, torch.optim.SGD, stage=stage, reduce_bucket_size=BUCKET, units=units, lr=0.1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        x, y = batch(key, 0, 0)
        planted = model.middle.register_forward_hook(_fail_when_backward_reaches_the_output)
        try:
            loss_of(model, mine(x), mine(y), 1).backward()
            raise AssertionError("the planted failure did not fire")
        except RuntimeError as exc:
            assert "planted failure" in str(exc), exc
        planted.remove()
        zero.zero_grad()
        loss_of(model, mine(x), mine(y), 1).backward()
        zero.step()
        reference_step(reference, reference_optimizer, key, 0, 1)
        assert_model_matches(zero, reference, f"stage {stage} after a failed backward", **TIGHT)


def check_bf16_tracks_the_fp32_reference(key: str) -> None:
    """bf16 compute with fp32 masters stays within bf16's precision of fp32 training."""
    failures = []
    for stage in (1, 2, 3):
        model, reference = ZNet(key, torch.float32), ZNet(key, torch.float32)
        zero = ZeroOptimizer(model, torch.optim.SGD, stage=stage, compute_dtype=torch.bfloat16, lr=0.1, momentum=0.9)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "model not cast to bf16"
        assert all(g.master.dtype == torch.float32 for g in zero.groups), "masters are not fp32"
        for step in range(STEPS):
            x, y = batch(key, step, 0, torch.float32)
            loss_of(model, mine(x).bfloat16(), mine(y).bfloat16(), 1).float().backward()
            zero.step()
            reference_step(reference, reference_optimizer, key, step, 1, torch.float32)
        got, want = [], []
        for g, shard_part, param, param_part in shard_slices(zero):
            got.append(zero.groups[g].master[shard_part])
            want.append(list(reference.parameters())[param].detach().reshape(-1)[param_part])
        got, want = torch.cat(got), torch.cat(want)
        error = float((got - want).norm() / want.norm())
        failures.append(None if error < 1e-2 else f"stage {stage}: masters off by {error:.2%} (relative norm)")
    assert not any(failures), [f for f in failures if f]


def check_fp16_overflow_skips_the_step_everywhere(key: str) -> None:
    model = ZNet(key, torch.float32)
    zero = ZeroOptimizer(model, torch.optim.SGD, stage=1, compute_dtype=torch.float16, lr=0.1)
    assert zero.loss_scaler.dynamic and zero.loss_scaler.value == 2.0 ** 16, "float16 scales dynamically from 2^16"
    zero.loss_scaler.value = scale = 128.0  # low enough that only the planted inf overflows
    before = [g.master.clone() for g in zero.groups]
    x, y = batch(key, 0, 0, torch.float16)
    zero.scale_loss(loss_of(model, mine(x), mine(y), 1).float()).backward()
    if hvd.rank() == hvd.size() - 1:
        next(model.parameters()).grad[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert zero.step() is None, "the overflowing step was not skipped"
    assert any("overflowed" in str(w.message) for w in caught), "no warning about the skipped step"
    assert zero.loss_scaler.value == scale / 2, f"loss scale {zero.loss_scaler.value}, expected {scale / 2}"
    assert all(torch.equal(g.master, b) for g, b in zip(zero.groups, before)), "a skipped step changed the masters"
    zero.scale_loss(loss_of(model, mine(x), mine(y), 1).float()).backward()
    zero.step()
    assert any(not torch.equal(g.master, b) for g, b in zip(zero.groups, before)), "the next step did not update"


def check_bad_arguments_raise_before_communicating(key: str) -> None:
    """Rank 0 alone: an argument error that came after a collective would hang it (the others
    never join), and the watchdog would report the hang."""
    if hvd.rank() != 0:
        return
    model = ZNet(key)
    for stage in (4, -1, True, "2"):
        expect_raises(InvalidArgumentError, lambda s=stage: ZeroOptimizer(model, torch.optim.SGD, stage=s, lr=0.1),
                      "ZeRO stage must be 0, 1, 2 or 3", f"stage {stage!r}")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    expect_raises(ArgumentTypeError, lambda: ZeroOptimizer(model, sgd, stage=1), "optimizer_class", "instance")
    expect_raises(ArgumentTypeError, lambda: ZeroOptimizer("model", torch.optim.SGD, lr=0.1), "nn.Module", "model")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, compute_dtype=torch.int8),
                  "compute_dtype", "compute dtype")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, reduce_bucket_size=0),
                  "reduce_bucket_size", "bucket size")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(torch.nn.ReLU(), torch.optim.SGD, lr=0.1),
                  "no trainable parameters", "empty model")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, lr=-1.0),
                  "Invalid learning rate", "negative learning rate")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.Adam, lr=0.1, momentum=0.9),
                  "unexpected keyword argument 'momentum'", "unknown hyperparameter")
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, lr=0.1, loss_scale=-2),
                  "loss_scale must be", "negative loss scale")
    assert all(p.dtype == torch.float64 and p.untyped_storage().nbytes() > 0 for p in model.parameters()), \
        "a refused wrap changed the model"


def check_parameters_that_differ_across_ranks_are_refused(key: str) -> None:
    model = ZNet(key)
    if hvd.rank() == 1:
        with torch.no_grad():
            model.middle.bias[7] += 1e-9
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1),
                  "'middle.bias' has different values on rank 1 and rank 0", "perturbed rank 1")
    if hvd.rank() == 1:
        model = ZNet(key + "/other-shape")
        model.last = torch.nn.Linear(53, 4).double()
    expect_raises(InvalidArgumentError, lambda: ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1),
                  "'last.weight' on rank 1", "other shape on rank 1")


def groups_of(model: torch.nn.Module) -> list[dict]:
    """The usual split, listed out of registration order: biases without weight decay at a
    higher learning rate, then the weights with weight decay."""
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    return [{"params": biases, "weight_decay": 0.0, "lr": 0.02}, {"params": weights, "weight_decay": 0.1}]


def check_param_groups_match_torch(key: str, stage: int) -> None:
    """AdamW with two parameter groups equals torch's AdamW with the same groups on the whole
    batch; the checkpoint keeps the groups, consolidates into a state_dict that torch's
    optimizer with those groups loads, and a new wrap resumes from it in step with torch."""
    model, reference = ZNet(key), ZNet(key)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, reduce_bucket_size=BUCKET,
                         param_groups=groups_of(model), lr=0.01)
    reference_optimizer = torch.optim.AdamW(groups_of(reference), lr=0.01)
    assert [g["weight_decay"] for g in zero.param_groups] == [0.0, 0.1], "groups' options on the shards"

    def step(optimizer_, step_index: int) -> None:
        x, y = batch(key, step_index, 0)
        loss_of(model, mine(x), mine(y), 1).backward()
        loss_of(reference, x, y, 1).backward()
        optimizer_.step()
        optimizer_.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    for step_index in range(STEPS):
        step(zero, step_index)
    assert_shards_match(zero, reference, reference_optimizer, f"after {STEPS} steps", **TIGHT)
    assert_model_matches(zero, reference, "vs torch with the same groups", **TIGHT)
    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-zero-groups-") if hvd.rank() == 0 else None,
                                     root_rank=0, name=f"{key}.dir")
    try:
        zero.save(directory)
        full = consolidate(directory)
        plain = ZNet(key + "/fresh")
        plain.load_state_dict(full["model"])
        plain_optimizer = torch.optim.AdamW(groups_of(plain), lr=0.01)
        plain_optimizer.load_state_dict(full["optimizer"])
        want = reference_optimizer.state_dict()
        got = plain_optimizer.state_dict()
        assert got["param_groups"] == want["param_groups"], f"consolidated groups {got['param_groups']}"
        for index, state in want["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(got["state"][index][name], value, **TIGHT,
                                           msg=lambda m, i=index, n=name: f"consolidated {n} of parameter {i}: {m}")
        resumed_model = ZNet(key + "/other-start")
        resumed = ZeroOptimizer(resumed_model, torch.optim.AdamW, stage=stage, reduce_bucket_size=BUCKET,
                                param_groups=groups_of(resumed_model), lr=0.5)
        resumed.load(directory)
        assert [g["lr"] for g in resumed.param_groups] == [0.02, 0.01], "learning rates not restored per group"
        model = resumed_model
        step(resumed, STEPS)
        assert_model_matches(resumed, reference, "resumed, one step later", **TIGHT)
        ungrouped_model = ZNet(key)
        ungrouped = ZeroOptimizer(ungrouped_model, torch.optim.AdamW, stage=stage, lr=0.01)
        expect_raises(InvalidArgumentError, lambda: ungrouped.load(directory),
                      "has parameter groups [[2, 4], [0, 1, 3]] (parameter indices), this optimizer [[0, 1, 2, 3, 4]]",
                      "a grouped checkpoint into an ungrouped optimizer")
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def check_bad_param_groups(key: str) -> None:
    """Refused on the calling rank before any communication, naming the parameter."""
    model = ZNet(key)
    weights = [model.first.weight, model.middle.weight, model.last.weight]
    biases = [model.middle.bias, model.last.bias]

    def wrap(groups):
        return ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_groups=groups, lr=0.01)

    expect_raises(InvalidArgumentError, lambda: wrap([{"params": weights}]),
                  "trainable parameters ['middle.bias', 'last.bias'] are in no parameter group", "a parameter left out")
    expect_raises(InvalidArgumentError, lambda: wrap([{"params": weights + biases[:1]}, {"params": biases}]),
                  "parameter 'middle.bias' is in parameter groups 0 and 1", "a parameter in two groups")
    stranger = torch.nn.Parameter(torch.zeros(2, 2))
    expect_raises(InvalidArgumentError, lambda: wrap([{"params": weights + biases + [stranger]}]),
                  "lists a tensor of shape (2, 2) that is not a parameter of the model", "a foreign tensor")
    expect_raises(ArgumentTypeError, lambda: wrap({"params": weights + biases}),
                  "param_groups must be a non-empty list of dicts", "one dict instead of a list")
    model.first.weight.requires_grad_(False)
    expect_raises(InvalidArgumentError, lambda: wrap([{"params": weights + biases}]),
                  "lists 'first.weight', which does not require a gradient", "a frozen parameter")


class TiedNet(ZNet):
    """ZNet with a second module using ``middle.weight`` (tied, as GPT-2's input and output
    embeddings are) and a bias of its own."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        torch.manual_seed(0)
        self.tied = torch.nn.Linear(9, 53).double()
        self.tied.weight = self.middle.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        return self.last(torch.tanh(self.middle(hidden)) + torch.tanh(self.tied(hidden)))


def check_tied_parameters_match_torch(key: str, stage: int) -> None:
    """A parameter registered in two modules trains as in one process: stage 3 gathers it for
    each use and reduces its summed gradient once."""
    model, reference = TiedNet(key), TiedNet(key)
    zero = ZeroOptimizer(model, torch.optim.Adam, stage=stage, reduce_bucket_size=BUCKET, lr=0.01)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(STEPS):
        reference_step(reference, reference_optimizer, key, step, 1)
        x, y = batch(key, step, 0)
        loss_of(model, mine(x), mine(y), 1).backward()
        zero.step()
        zero.zero_grad()
    assert_model_matches(zero, reference, "tied weights vs torch", **TIGHT)
    whole = full_state_dict(model, optimizer=zero)  # one call, whatever the stage shards
    want = reference.state_dict()
    assert sorted(whole) == sorted(want), f"full_state_dict keys {sorted(whole)}"
    for name, value in want.items():
        close = torch.testing.assert_close
        close(whole[name], value, **TIGHT, msg=lambda m, n=name: f"full_state_dict {n}: {m}")
    if stage == 3:
        assert model.tied.weight is model.middle.weight, "the tie was broken"
        assert zero.gatherer.gathered_bytes() == 0, "a tied use left its unit gathered after the step"


def check_two_process_sets_train_independently(key: str) -> None:
    """Ranks {0, 1} and {2, 3} each run ZeRO-2 over their own set, on their own data."""
    pairs = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
    mine_set = pairs[hvd.rank() // 2]
    set_key = f"{key}/{hvd.rank() // 2}"
    model, reference = ZNet(set_key), ZNet(set_key)
    zero = ZeroOptimizer(model, torch.optim.Adam, stage=2, process_set=mine_set, reduce_bucket_size=BUCKET, lr=0.01)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(STEPS):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        rows = slice(3 * mine_set.rank(), 3 * mine_set.rank() + 3)
        model(x[rows]).pow(2).mean().backward()
        zero.step()
        reference_optimizer.zero_grad()
        reference(x).pow(2).mean().backward()
        reference_optimizer.step()
    assert_model_matches(zero, reference, f"set {hvd.rank() // 2}", **TIGHT)
    hvd.barrier()
    for process_set in pairs:
        hvd.remove_process_set(process_set)


def check_stage3_trains_the_tiny_gpt(key: str) -> None:
    """A model whose forward calls its submodules (the tiny GPT's embedding calls its position
    table) trains under stage 3 as under stage 0, which matches one process (above): each
    module's parameters are gathered when it runs."""
    sys.path.insert(0, str(EXAMPLES))
    from tiny_gpt import GPTConfig, build_blocks, loss_function
    config = GPTConfig(vocab_size=20, sequence_length=16, dim=32, heads=4, layers=2)
    losses = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*build_blocks(config))
        zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)
        data = torch.Generator().manual_seed(1 + hvd.rank())
        for _ in range(STEPS):
            ids = torch.randint(0, config.vocab_size, (4, config.sequence_length), generator=data)
            loss = loss_function(config, None)(model(ids), ids)
            loss.backward()
            zero.step()
            zero.zero_grad()
        losses[stage] = loss.item()
    assert abs(losses[0] - losses[3]) < 1e-5, f"tiny GPT losses after {STEPS} steps: {losses}"


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    for stage in (0, 1, 2, 3):
        for optimizer in OPTIMIZERS:
            for accumulation in (1, 3):
                checks.add(f"match/stage{stage}/{optimizer}/accumulate{accumulation}", check_matches_references,
                           stage, optimizer, accumulation)
    checks.add("clip/norm_2", check_clipping_matches_torch, 2.0)
    checks.add("clip/norm_inf", check_clipping_matches_torch, float("inf"))
    checks.add("memory/follows_the_formulas", check_memory_follows_the_formulas)
    checks.add("memory/stage3_gathers_only_what_runs", check_stage3_gathers_only_what_runs)
    checks.add("recovery/a_backward_that_raised_leaves_no_trace", check_a_backward_that_raised_leaves_no_trace)
    checks.add("precision/bf16_tracks_the_fp32_reference", check_bf16_tracks_the_fp32_reference)
    checks.add("precision/fp16_overflow_skips_the_step_everywhere", check_fp16_overflow_skips_the_step_everywhere)
    checks.add("errors/bad_arguments", check_bad_arguments_raise_before_communicating)
    checks.add("errors/parameters_differ_across_ranks", check_parameters_that_differ_across_ranks_are_refused)
    for stage in (1, 2, 3):
        checks.add(f"tied/stage{stage}/matches_torch", check_tied_parameters_match_torch, stage)
    for stage in (1, 2, 3):
        checks.add(f"param_groups/stage{stage}/match_torch_and_resume", check_param_groups_match_torch, stage)
    checks.add("errors/bad_param_groups", check_bad_param_groups)
    checks.add("models/stage3_trains_the_tiny_gpt", check_stage3_trains_the_tiny_gpt)
    if hvd.size() == 4:
        checks.add("process_sets/two_sets_train_independently", check_two_process_sets_train_independently)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
