"""DistributedOptimizer against the same training done in one process on the concatenated batch."""
from __future__ import annotations

import functools
import warnings

import torch

import psrt.torch as hvd
from psrt.torch.optimizer import Bucketing, DistributedOptimizer

from _harness import Checks
from _training_common import (ROWS_PER_RANK, Mlp, assert_params_close, assert_params_equal, expect_raises,
                              global_batch, loss_of, my_rows, zero_grads)

STEPS = 3
#: Caps small enough that the MLP (about 1.7 KiB of float64 gradients) spans several buckets.
SMALL = Bucketing(first_bucket_bytes=64, bucket_bytes=512, overlap=True)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def train(model, optimizer, key, *, distributed, micro=1, clip=None, extra_steps=range(STEPS),
          dtype=torch.float64, set_to_none_on_model=False) -> None:
    """STEPS steps; each rank trains on its rows of the global batch, the reference on all rows."""
    for step in range(STEPS):
        if set_to_none_on_model:
            model.zero_grad(set_to_none=True)
        else:
            optimizer.zero_grad(set_to_none=False)
        for m in range(micro):
            x, y = global_batch(key, step, m, dtype)
            if distributed:
                x, y = my_rows(x), my_rows(y)
            (loss_of(model, x, y, use_extra=step in extra_steps) / micro).backward()
        if clip is None:
            optimizer.step()
            continue
        if distributed:
            optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if distributed:
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()


def reference(key, make, *, dtype=torch.float64, lr_scale=1.0, **options) -> Mlp:
    model = Mlp(key, dtype)
    zero_grads(model)
    optimizer = make(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] *= lr_scale
    train(model, optimizer, key, distributed=False, dtype=dtype, **options)
    return model


def distributed(key, make, *, dtype=torch.float64, wrap=None, **options) -> tuple[Mlp, torch.optim.Optimizer]:
    model = Mlp(key, dtype)
    optimizer = DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                     **(wrap or {}))
    train(model, optimizer, key, distributed=True, dtype=dtype, **options)
    return model, optimizer


def matches_single_process(key, make, wrap=None, *, ref_options=None, **options) -> None:
    model, _ = distributed(key, make, wrap=wrap, **options)
    assert_params_close(model, reference(key, make, **(ref_options or options)), key)


def fp16_compression(key) -> None:
    """Float32 model, gradients travel as float16: close to the reference, but not equal to it."""
    model, _ = distributed(key, sgd, wrap={"compression": hvd.Compression.fp16}, dtype=torch.float32)
    want = reference(key, sgd, dtype=torch.float32)
    assert_params_close(model, want, key, rtol=1e-3, atol=1e-4)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), want.parameters())), (
        f"{key}: bitwise equal to the float32 reference, so nothing was compressed")


def overlap_on_equals_off(key) -> None:
    on, _ = distributed(key, adam, wrap={"bucketing": SMALL})
    off, _ = distributed(key, adam, wrap={"bucketing": Bucketing(64, 512, overlap=False)})
    assert_params_equal(on, off, key)
    assert_params_close(on, reference(key, adam), key)


def overlap_starts_allreduces_during_backward(key) -> None:
    for overlap in (True, False):
        model = Mlp(key)
        optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                         bucketing=Bucketing(64, 512, overlap=overlap))
        x, y = global_batch(key, 0)
        loss_of(model, my_rows(x), my_rows(y), use_extra=True).backward()
        started = [bucket.launched for bucket in optimizer._buckets]
        optimizer.step()
        assert len(started) > 2, f"{key}: expected several buckets, got {len(started)}"
        assert started == [overlap] * len(started), (
            f"{key}: with overlap={overlap}, buckets started during backward: {started}")


def groups(key) -> None:
    """groups=2 gives two buckets; an explicit group is one bucket and each other parameter its own."""
    for spec, buckets in ((2, 2), ("explicit", 5)):
        model = Mlp(key)
        chosen = spec if spec != "explicit" else [[model.out.weight, model.hidden.weight]]
        optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                         groups=chosen)
        assert len(optimizer._buckets) == buckets, f"{key}: groups={spec}: {len(optimizer._buckets)} buckets"
        train(model, optimizer, key, distributed=True)
        assert_params_close(model, reference(key, sgd), f"{key}: groups={spec}")


def clip_between_synchronize_and_step(key) -> None:
    matches_single_process(key, sgd, clip=1e-3)


def unused_parameter(key) -> None:
    """The extra head is used in step 1 only: its bucket is reduced (zeros) in the other steps."""
    matches_single_process(key, sgd, wrap={"bucketing": SMALL}, extra_steps=(1,))


def model_zero_grad_set_to_none(key) -> None:
    model, _ = distributed(key, sgd, wrap={"bucketing": SMALL}, set_to_none_on_model=True)
    assert_params_close(model, reference(key, sgd), key)


def views_with_accumulation_zero_grad_and_an_unused_parameter(key) -> None:
    """Gradients are views of the bucket buffers after zero_grad(set_to_none=False), over steps
    that zero them both ways (set_to_none=True, then False), accumulate two backward passes each, and leave the extra
    head without a gradient except in step 1: the same parameters as one process."""
    model = Mlp(key)
    optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                     backward_passes_per_step=2, bucketing=SMALL)
    reference_model = Mlp(key)
    zero_grads(reference_model)
    reference_optimizer = sgd(reference_model.parameters())
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        reference_optimizer.zero_grad(set_to_none=False)
        for micro in range(2):
            x, y = global_batch(key, step, micro)
            (loss_of(model, my_rows(x), my_rows(y), use_extra=step == 1) / 2).backward()
            (loss_of(reference_model, x, y, use_extra=step == 1) / 2).backward()
        optimizer.step()
        reference_optimizer.step()
        for bucket in optimizer._buckets:  # zeroed in place: views, and each bucket one tensor
            assert step % 2 == 0 or all(param.grad._base is bucket.buffer for param in bucket.params), (
                f"{key}: step {step}: a gradient of {bucket.name} is not a view of its buffer")
    assert_params_close(model, reference_model, key)


def process_set_of_all_but_the_last_rank(key) -> None:
    """Members average among themselves (the reference trains on their rows); the last rank,
    outside the set, trains alone on its own rows."""
    rank, size = hvd.rank(), hvd.size()
    members = list(range(size - 1))
    process_set = hvd.add_process_set(members)
    model = Mlp(key)
    optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                     process_set=process_set)
    reference_model = Mlp(key)
    zero_grads(reference_model)
    reference_optimizer = sgd(reference_model.parameters())
    rows = [r for r in range(size) if (r in members) == (rank in members)]
    for step in range(STEPS):
        x, y = global_batch(key, step)
        for model_, optimizer_, used in ((model, optimizer, [rank]), (reference_model, reference_optimizer, rows)):
            optimizer_.zero_grad(set_to_none=False)
            picked = torch.cat([torch.arange(r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK) for r in used])
            loss_of(model_, x[picked], y[picked], use_extra=True).backward()
            optimizer_.step()
    hvd.remove_process_set(process_set)
    assert_params_close(model, reference_model, f"{key}: rank {rank} ({'in' if rank in members else 'outside'})")


def wrapper_is_the_optimizers_class(key) -> None:
    model = Mlp(key)
    optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    assert isinstance(optimizer, torch.optim.SGD) and type(optimizer).__name__ == "SGD", type(optimizer).__mro__
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train(model, optimizer, key, distributed=True)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.05, optimizer.param_groups[0]["lr"]
    plain = sgd(Mlp(key).parameters())
    plain.load_state_dict(optimizer.state_dict())
    assert plain.param_groups[0]["lr"] == 0.05 and len(plain.state) == len(optimizer.state)


def names_must_be_unique_and_complete(key) -> None:
    model = Mlp(key)
    named = list(model.named_parameters())
    duplicated = [("same", p) for _, p in named]
    expect_raises(ValueError, lambda: DistributedOptimizer(sgd(model.parameters()), named_parameters=duplicated),
                  "Found duplicates: same", key)
    expect_raises(ValueError, lambda: DistributedOptimizer(sgd(model.parameters()), named_parameters=named[1:]),
                  "were not named", key)


def misuse_raises_horovods_errors(key) -> None:
    model = Mlp(key)
    # Overlap on: zero_grad races only with allreduces that backward started.
    optimizer = DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                     bucketing=SMALL)
    x, y = global_batch(key, 0)
    loss_of(model, my_rows(x), my_rows(y), use_extra=True).backward()
    expect_raises(AssertionError, optimizer.zero_grad, "before optimizer.step() or optimizer.synchronize()", key)
    expect_raises(AssertionError, lambda: loss_of(model, my_rows(x), my_rows(y), True).backward(),
                  "backward_passes_per_step", key)
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), f"{key}: no warning, got {caught}"


def add_checks(checks: Checks) -> None:
    checks.add("optimizer/sgd_momentum_matches_single_process", matches_single_process, sgd)
    checks.add("optimizer/adam_matches_single_process", matches_single_process, adam, {"bucketing": SMALL})
    checks.add("optimizer/backward_passes_per_step_2_matches_single_process",
               functools.partial(matches_single_process, micro=2), adam,
               {"backward_passes_per_step": 2, "bucketing": SMALL})
    checks.add("optimizer/gradient_predivide_factor_matches_single_process", matches_single_process, sgd,
               {"gradient_predivide_factor": 2.0})
    checks.add("optimizer/op_sum_sums_gradients",
               functools.partial(matches_single_process, ref_options={"lr_scale": hvd.size()}), sgd, {"op": hvd.Sum})
    checks.add("optimizer/fp16_compression_is_close_to_single_process", fp16_compression)
    checks.add("optimizer/overlap_on_equals_overlap_off", overlap_on_equals_off)
    checks.add("optimizer/overlap_starts_allreduces_during_backward", overlap_starts_allreduces_during_backward)
    checks.add("optimizer/groups_match_single_process", groups)
    checks.add("optimizer/clip_between_synchronize_and_step", clip_between_synchronize_and_step)
    checks.add("optimizer/unused_parameter_matches_single_process", unused_parameter)
    checks.add("optimizer/model_zero_grad_set_to_none", model_zero_grad_set_to_none)
    checks.add("optimizer/views_with_accumulation_zero_grad_and_an_unused_parameter",
               views_with_accumulation_zero_grad_and_an_unused_parameter)
    checks.add("optimizer/process_set_of_all_but_the_last_rank", process_set_of_all_but_the_last_rank)
    checks.add("optimizer/wrapper_is_the_optimizers_class", wrapper_is_the_optimizers_class)
    checks.add("optimizer/names_must_be_unique_and_complete", names_must_be_unique_and_complete)
    checks.add("optimizer/misuse_raises_horovods_errors", misuse_raises_horovods_errors)
