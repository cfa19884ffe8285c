"""Sharded ZeRO checkpoints across jobs of different sizes.

``zero_resume.py save DIR`` (4 ranks): trains each stage for SAVED_STEPS steps, saves into
DIR/stage<S>, and checks that the consolidated checkpoint equals the live model and the
single-process reference; a checkpoint of another model or stage, or an incomplete one, is
refused; ranks 0-1 save over their own process set and all four load (2 -> 4); the fp16
loss scale comes back; a 100 MB checkpoint saved by ranks 0-1 is restored by all four within
each rank's shard plus the largest tensor of peak memory.  ``zero_resume.py load DIR`` (2
ranks): loads each into a differently initialised model and continues; the result equals the
reference trained without interruption.
The global batch is the same whatever the rank count.
"""
from __future__ import annotations

import os
import shutil
import sys

import torch

import psrt.torch as hvd
from psrt.errors import CheckpointError, InvalidArgumentError
from psrt.zero import ZeroOptimizer, consolidate
from psrt.zero.checkpoint import shard_file

import _harness
from _memory import peak_growth
from _training_common import expect_raises, randn
from _zero_common import ZNet, assert_model_matches, assert_shards_match

KEY = "zero-resume"
SAVED_STEPS, MORE_STEPS = 2, 2
GLOBAL_ROWS = 12
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
ADAM = {"lr": 0.01, "weight_decay": 0.01}


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return randn(KEY, (GLOBAL_ROWS, 5), "x", step), randn(KEY, (GLOBAL_ROWS, 3), "y", step)


def rows(process_set) -> slice:
    per_rank = GLOBAL_ROWS // process_set.size()
    return slice(process_set.rank() * per_rank, (process_set.rank() + 1) * per_rank)


def train(model, optimizer, steps: range, distributed: bool, process_set=hvd.global_process_set) -> None:
    for step in steps:
        x, y = global_batch(step)
        if distributed:
            x, y = x[rows(process_set)], y[rows(process_set)]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def reference(steps: int):
    model = ZNet(KEY)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    train(model, optimizer, range(steps), distributed=False)
    return model, optimizer


def check_save_consolidates_to_the_live_model(name: str, directory: str, stage: int) -> None:
    model = ZNet(KEY)
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, reduce_bucket_size=200, **ADAM)
    train(model, zero, range(SAVED_STEPS), distributed=True)
    zero.save(directory, extra={"step": SAVED_STEPS})
    full = consolidate(directory)
    assert full["extra"] == {"step": SAVED_STEPS} and full["world_size"] == hvd.size(), full["extra"]
    with zero.gathered_parameters():
        for param_name, param in model.named_parameters():
            assert torch.equal(full["model"][param_name], param.detach()), f"consolidated {param_name} != live"
    ref_model, ref_optimizer = reference(SAVED_STEPS)
    for param_name, param in ref_model.named_parameters():
        torch.testing.assert_close(full["model"][param_name], param.detach(), **TIGHT)
    plain = torch.optim.AdamW(ZNet(KEY).parameters(), **ADAM)
    plain.load_state_dict(full["optimizer"])  # an ordinary optimizer state_dict
    for index, param in enumerate(ref_model.parameters()):
        for key, value in ref_optimizer.state[param].items():
            torch.testing.assert_close(full["optimizer"]["state"][index][key], value, **TIGHT)


def check_load_continues_like_the_reference(name: str, directory: str, stage: int) -> None:
    model = ZNet(KEY + "/fresh")  # different values, same layout
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=stage, reduce_bucket_size=300, **ADAM)
    extra = zero.load(directory)
    assert extra == {"step": SAVED_STEPS}, extra
    train(model, zero, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), distributed=True)
    ref_model, ref_optimizer = reference(SAVED_STEPS + MORE_STEPS)
    assert_shards_match(zero, ref_model, ref_optimizer, f"stage {stage} resumed", **TIGHT)
    assert_model_matches(zero, ref_model, f"stage {stage} resumed", **TIGHT)


def check_two_ranks_save_and_four_load(name: str, root: str) -> None:
    """N < M: ranks 0 and 1 train and save over their own process set; all four ranks load."""
    pair = hvd.add_process_set([0, 1])
    directory = os.path.join(root, "pair")
    if hvd.rank() < 2:
        model = ZNet(KEY)
        zero = ZeroOptimizer(model, torch.optim.AdamW, stage=2, process_set=pair, reduce_bucket_size=200, **ADAM)
        train(model, zero, range(SAVED_STEPS), distributed=True, process_set=pair)
        zero.save(directory, extra={"step": SAVED_STEPS})
    hvd.barrier()
    hvd.remove_process_set(pair)
    model = ZNet(KEY + "/fresh")
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=2, reduce_bucket_size=100, **ADAM)
    assert zero.load(directory) == {"step": SAVED_STEPS}
    train(model, zero, range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS), distributed=True)
    ref_model, ref_optimizer = reference(SAVED_STEPS + MORE_STEPS)
    assert_shards_match(zero, ref_model, ref_optimizer, "2 -> 4 ranks", **TIGHT)
    assert_model_matches(zero, ref_model, "2 -> 4 ranks", **TIGHT)


WIDTH, LAYERS = 1024, 8  # 8.4M float32 elements: a 100 MB checkpoint with AdamW's two moments
SLACK = 4 << 20  # the reader's block (1 MiB in float32), buffers, and library code paged in on first use


def wide(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def wide_step(model, optimizer) -> None:
    model(torch.ones(2, WIDTH)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def shard_bytes(zero) -> int:
    """This rank's master values and their per-element optimizer state."""
    tensors = [group.master for group in zero.groups] + [
        value for group in zero.groups for value in zero.optimizer.state[group.master].values()
        if value.dim() == 1]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_restore_reads_only_own_slices(name: str, root: str) -> None:
    """A 100 MB stage-2 checkpoint saved by ranks 0-1 and restored by all four: saving raises a
    rank's peak resident memory by no more than its shard, restoring by no more than its new
    shard plus the largest tensor (and 4 MiB), well under the whole checkpoint; the restored
    model is the one saved."""
    pair = hvd.add_process_set([0, 1])
    directory = os.path.join(root, "wide")
    if hvd.rank() < 2:
        zero = ZeroOptimizer(wide(0), torch.optim.AdamW, stage=2, process_set=pair, **ADAM)
        wide_step(zero.model, zero)
        _, grown = peak_growth(lambda: zero.save(directory))
        assert grown <= shard_bytes(zero) + SLACK, f"saving grew resident memory by {grown}, its shard is " \
                                                   f"{shard_bytes(zero)}"
        del zero
    hvd.barrier()
    hvd.remove_process_set(pair)
    zero = ZeroOptimizer(wide(1), torch.optim.AdamW, stage=2, **ADAM)
    _, grown = peak_growth(lambda: zero.load(directory))
    whole, largest = 3 * WIDTH * WIDTH * LAYERS * 4, WIDTH * WIDTH * 4
    bound = shard_bytes(zero) + largest + SLACK
    assert bound < 0.6 * whole, f"the bound {bound} says nothing about a {whole}-byte checkpoint"
    assert grown <= bound, (f"restoring grew resident memory by {grown} bytes, above the shard {shard_bytes(zero)} + "
                            f"the largest tensor {largest} (+{SLACK}); the checkpoint holds {whole}")
    reference = wide(0)
    wide_step(reference, torch.optim.AdamW(reference.parameters(), **ADAM))
    for (key, got), want in zip(zero.model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(got, want), f"restored {key} differs from the saved one"


def check_fp16_loss_scale_survives_a_resume(name: str, root: str) -> None:
    model = ZNet(KEY, torch.float32)
    zero = ZeroOptimizer(model, torch.optim.SGD, stage=1, compute_dtype=torch.float16, lr=0.1)
    zero.loss_scaler.value, zero.loss_scaler._good_steps = 512.0, 17
    zero.save(os.path.join(root, "fp16"))
    again = ZeroOptimizer(ZNet(KEY, torch.float32), torch.optim.SGD, stage=1, compute_dtype=torch.float16, lr=0.1)
    again.load(os.path.join(root, "fp16"))
    assert (again.loss_scaler.value, again.loss_scaler._good_steps) == (512.0, 17), again.loss_scaler.state_dict()
    assert all(p.dtype == torch.float16 for p in again.model.parameters()), "loaded model not in float16"


def check_mismatched_checkpoints_are_refused(name: str, root: str) -> None:
    torch.manual_seed(0)
    other_model = torch.nn.Sequential(torch.nn.Linear(5, 9, bias=False), torch.nn.Linear(9, 54)).double()
    zero = ZeroOptimizer(other_model, torch.optim.AdamW, stage=2, **ADAM)
    expect_raises(InvalidArgumentError, lambda: zero.load(os.path.join(root, "stage2")),
                  "is of a different model: trainable parameter 0 is 'first.weight'", "other model")
    zero = ZeroOptimizer(ZNet(KEY), torch.optim.AdamW, stage=3, **ADAM)
    expect_raises(InvalidArgumentError, lambda: zero.load(os.path.join(root, "stage2")),
                  "was written by stage 2, this optimizer is stage 3", "other stage")
    zero = ZeroOptimizer(ZNet(KEY), torch.optim.SGD, stage=2, lr=0.1)
    expect_raises(InvalidArgumentError, lambda: zero.load(os.path.join(root, "stage2")),
                  "holds torch.optim.adamw.AdamW state", "other optimizer")
    expect_raises(InvalidArgumentError, lambda: zero.load(os.path.join(root, "missing")),
                  "zero_meta.json is missing", "no checkpoint")
    zero = ZeroOptimizer(ZNet(KEY), torch.optim.AdamW, stage=2, **ADAM)
    for again in ("again-a", "again-b"):
        zero.save(os.path.join(root, again))
    if hvd.rank() == 0:  # a directory with one shard from the other save
        shutil.copy(shard_file(os.path.join(root, "again-b"), 1), shard_file(os.path.join(root, "again-a"), 1))
    hvd.barrier()
    expect_raises((InvalidArgumentError, CheckpointError), lambda: zero.load(os.path.join(root, "again-a")),
                  "belongs to another save", "mixed saves")  # CheckpointError where a rank reads no shard 1


def main() -> None:
    action, root = sys.argv[1], sys.argv[2]
    hvd.init()
    checks = _harness.Checks()
    for stage in (1, 2, 3):
        directory = os.path.join(root, f"stage{stage}")
        if action == "save":
            checks.add(f"save/stage{stage}", check_save_consolidates_to_the_live_model, directory, stage)
        else:
            checks.add(f"load/stage{stage}", check_load_continues_like_the_reference, directory, stage)
    if action == "save":
        checks.add("load/refuses_mismatched_checkpoints", check_mismatched_checkpoints_are_refused, root)
        checks.add("load/two_ranks_save_four_load", check_two_ranks_save_and_four_load, root)
        checks.add("load/fp16_loss_scale_survives_a_resume", check_fp16_loss_scale_survives_a_resume, root)
        checks.add("load/restore_reads_only_own_slices", check_restore_reads_only_own_slices, root)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
