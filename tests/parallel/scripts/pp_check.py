"""Pipeline parallelism over all ranks of the job (PP = 2 or 4): every schedule and
micro-batch count (fewer, as many and more micro-batches than stages) against the
unsplit model on the full batch in float64, the executor's in-flight counters,
and bad inputs (mismatched micro-batches, disagreeing stages, wrong messages).
"""
from __future__ import annotations

import torch
from torch import nn

import _harness
import psrt.torch as hvd
from _training_common import expect_raises, randn
from psrt import pp
from psrt.errors import CommunicationError, InvalidArgumentError
from psrt.grid import ProcessGrid
from psrt.pp.p2p import BACKWARD_TAG, StageLink, message_id

WIDTHS = [5, 9, 7, 8, 6, 9, 7, 4, 3]  # 8 blocks of uneven size
ROWS = 24  # divisible by every micro-batch count used


def blocks(key: str) -> list[nn.Module]:
    made = []
    for i, (width_in, width_out) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layer = nn.Linear(width_in, width_out).double()
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(randn(key, param.shape, "init", i, name) * 0.5)
        made.append(nn.Sequential(layer, nn.Tanh()) if i < len(WIDTHS) - 2 else layer)
    return made


def mse_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def check_matches_unsplit_model(key: str, schedule: str, microbatches: int, chunks: int,
                                recompute: str | None = None) -> None:
    g = grid()
    p, r = g.shape.pp, g.coords.pp
    full = blocks(key)
    reference = nn.Sequential(*blocks(key))
    x, y = randn(key, (ROWS, WIDTHS[0]), "x"), randn(key, (ROWS, WIDTHS[-1]), "y")
    ref_loss = mse_sum(reference(x), y)
    ref_loss.backward()
    stage = pp.PipelineStage(full, g.pp_set, chunks=chunks, recompute=recompute)
    pipe = pp.Pipeline(stage, mse_sum, microbatches=microbatches, schedule=schedule, loss_reduction="sum")
    loss = pipe.step(x if g.is_first_stage else None, y if g.is_last_stage else None)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12, msg=lambda m: f"loss: {m}")
    grads = {name: param.grad for name, param in reference.named_parameters()}
    names = [name for name, _ in stage.named_parameters()]
    assert names, "this stage holds no parameters"
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=1e-12, atol=1e-12,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
    held = pipe.profile.in_flight
    expected = {"gpipe": microbatches, "1f1b": min(p - r, microbatches)}.get(schedule, pp.in_flight(pipe.actions))
    assert held == expected, f"stage {r} held {held} micro-batches at once, expected {expected}"
    events = pipe.profile.events
    computes = (3 if schedule == "zb-h1" else 2) * microbatches * chunks  # ZB-H1 splits each backward in two
    assert len(events) == computes, f"{len(events)} compute events, expected {computes}"
    assert 0 < pipe.profile.compute <= pipe.profile.wall and pipe.profile.peak_activation_bytes > 0


def check_mean_loss_matches_full_batch_mean(key: str) -> None:
    g = grid()
    reference = nn.Sequential(*blocks(key))
    x, y = randn(key, (ROWS, WIDTHS[0]), "x"), randn(key, (ROWS, WIDTHS[-1]), "y")
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    stage = pp.PipelineStage(blocks(key), g.pp_set)
    pipe = pp.Pipeline(stage, nn.functional.mse_loss, microbatches=4)
    loss = pipe.step(x if g.is_first_stage else None, y if g.is_last_stage else None)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-12)
    grads = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-12, atol=1e-12)


def check_activation_memory_follows_in_flight(key: str) -> None:
    """Peak activation bytes: GPipe holds all m micro-batches, 1F1B at most p - r (plus one
    gradient on its way), so delivered messages must not keep their payloads alive."""
    g = grid()
    p, r, m = g.shape.pp, g.coords.pp, 8
    x, y = randn(key, (ROWS, WIDTHS[0]), "x"), randn(key, (ROWS, WIDTHS[-1]), "y")

    def peak(schedule: str, microbatches: int, rows: int) -> int:
        pipe = pp.Pipeline(pp.PipelineStage(blocks(key), g.pp_set), mse_sum, microbatches=microbatches,
                           schedule=schedule)
        pipe.step(x[:rows] if g.is_first_stage else None, y[:rows] if g.is_last_stage else None)
        return pipe.profile.peak_activation_bytes

    one = peak("gpipe", 1, ROWS // m)
    gpipe, one_f_one_b = peak("gpipe", m, ROWS), peak("1f1b", m, ROWS)
    assert gpipe >= m * one, f"GPipe peak {gpipe} B is below {m} micro-batches of {one} B"
    bound = (min(p - r, m) + 1) * one
    assert one_f_one_b <= bound, f"1F1B peak {one_f_one_b} B exceeds {min(p - r, m)} micro-batches + one ({bound} B)"


def check_full_recompute_keeps_less(key: str) -> None:
    """With ``recompute="full"`` a stage keeps each block's input instead of everything its
    blocks save, so its peak activation bytes fall (the same 1F1B step otherwise)."""
    g = grid()
    x, y = randn(key, (ROWS, WIDTHS[0]), "x"), randn(key, (ROWS, WIDTHS[-1]), "y")

    def wide_blocks() -> list[nn.Module]:  # each keeps a 4x wider hidden activation unless recomputed
        torch.manual_seed(5)
        return [nn.Sequential(nn.Linear(a, 4 * a), nn.Tanh(), nn.Linear(4 * a, b)).double()
                for a, b in zip(WIDTHS, WIDTHS[1:])]

    def peak(recompute: str | None) -> int:
        pipe = pp.Pipeline(pp.PipelineStage(wide_blocks(), g.pp_set, recompute=recompute), mse_sum, microbatches=4)
        pipe.step(x if g.is_first_stage else None, y if g.is_last_stage else None)
        return pipe.profile.peak_activation_bytes

    kept, recomputed = peak(None), peak("full")
    assert 0 < recomputed < kept / 2, f"stage {g.coords.pp}: {recomputed} B with full recomputation, {kept} B without"
    expect_raises(InvalidArgumentError, lambda: pp.PipelineStage(blocks(key), g.pp_set, recompute="selective"),
                  "recompute must be one of None, 'full', got 'selective'", "selective recomputation of a stage")


def check_frozen_first_block(key: str) -> None:
    """A first block that needs no gradient: its stage skips the backward it does not need
    and the rest still matches the unsplit model."""
    g = grid()
    full, reference = blocks(key), nn.Sequential(*blocks(key))
    for module in (full[0], reference[0]):
        module.requires_grad_(False)
    x, y = randn(key, (ROWS, WIDTHS[0]), "x"), randn(key, (ROWS, WIDTHS[-1]), "y")
    mse_sum(reference(x), y).backward()
    stage = pp.PipelineStage(full, g.pp_set, split=[1] * (g.shape.pp - 1) + [len(full) - g.shape.pp + 1])
    pipe = pp.Pipeline(stage, mse_sum, microbatches=4, loss_reduction="sum")
    pipe.step(x if g.is_first_stage else None, y if g.is_last_stage else None)
    grads = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        if name.startswith("0."):
            assert param.grad is None, f"frozen {name} got a gradient"
        else:
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-12, atol=1e-12)


def check_explicit_split(key: str) -> None:
    g = grid()
    p = g.shape.pp
    counts = [1] * (p - 1) + [len(WIDTHS) - 1 - (p - 1)]
    stage = pp.PipelineStage(blocks(key), g.pp_set, split=counts)
    mine = [int(name) for name, _ in stage.named_children()]
    start = sum(counts[:g.coords.pp])
    assert mine == list(range(start, start + counts[g.coords.pp])), f"stage {g.coords.pp} holds blocks {mine}"


def check_bad_inputs(key: str) -> None:
    """Every stage raises the same error: the check happens in one exchange before any message."""
    g = grid()
    p = g.shape.pp
    expect_raises(InvalidArgumentError, lambda: pp.PipelineStage(blocks(key)[:p - 1], g.pp_set),
                  f"more pipeline stages ({p}) than blocks ({p - 1})", "too few blocks")
    stage = pp.PipelineStage(blocks(key), g.pp_set)
    x, y = randn(key, (10, WIDTHS[0]), "x"), randn(key, (10, WIDTHS[-1]), "y")
    pipe = pp.Pipeline(stage, mse_sum, microbatches=4)

    def step(inputs, targets, on=pipe):
        return on.step(inputs if g.is_first_stage else None, targets if g.is_last_stage else None)

    expect_raises(InvalidArgumentError, lambda: step(x, y), "a batch of 10 rows does not split into 4",
                  "batch not divisible")
    expect_raises(InvalidArgumentError, lambda: step(x[:8], y[:4]),
                  "the first stage has a batch of 8 rows but the last stage has 4 rows", "targets of another batch")
    other = pp.Pipeline(stage, mse_sum, microbatches=2 if g.coords.pp == 0 else 4)
    expect_raises(InvalidArgumentError, lambda: step(x[:8], y[:8], on=other), "pipeline stages disagree",
                  "micro-batch counts differ")
    # only the first stage lacks its batch, yet every stage raises (none waits for a message)
    expect_raises(InvalidArgumentError, lambda: pipe.step(None, y[:8] if g.is_last_stage else None),
                  "the first pipeline stage needs the inputs", "no inputs")
    expect_raises(InvalidArgumentError, lambda: pipe.step(x[:8] if g.is_first_stage else None, [1.0] * 8),
                  "the last pipeline stage needs the targets as a tensor with a batch dimension, got list",
                  "targets of the wrong type")
    expect_raises(InvalidArgumentError, lambda: pp.Pipeline(stage, mse_sum, microbatches=3, schedule="zigzag"),
                  "unknown pipeline schedule 'zigzag'", "unknown schedule")
    # interleaving is chosen by the stage's chunks; a schedule naming otherwise is refused
    expect_raises(InvalidArgumentError, lambda: pp.Pipeline(stage, mse_sum, microbatches=4, schedule="interleaved"),
                  "schedule 'interleaved' does not fit the PipelineStage, which holds one model chunk per rank",
                  "interleaved schedule on a one-chunk stage")
    chunked = pp.PipelineStage(blocks(key), g.pp_set, chunks=2)
    expect_raises(InvalidArgumentError, lambda: pp.Pipeline(chunked, mse_sum, microbatches=4, schedule="1f1b"),
                  "schedule '1f1b' does not fit the PipelineStage, which holds 2 model chunks per rank",
                  "1F1B on a two-chunk stage")
    assert pp.Pipeline(chunked, mse_sum, microbatches=2 * g.shape.pp).schedule == "interleaved", \
        "a two-chunk stage does not default to the interleaved schedule"
    # a clean step still works afterwards: nothing was left on the links
    step(x[:8], y[:8])


def check_wrong_messages_are_refused(key: str) -> None:
    """A gradient of the wrong shape, or a message for another micro-batch, is an error on the
    receiving stage (naming both sides), and the link stays usable."""
    g = grid()
    link = StageLink(g.runtime.topology.direct(g.pp_set))
    r = g.coords.pp
    if r == 1:
        link.send(torch.zeros(2, 4, dtype=torch.float64), 0, BACKWARD_TAG, message_id(0, 1)).wait()
        link.send(torch.zeros(2, 3, dtype=torch.float64), 0, BACKWARD_TAG, message_id(5, 1)).wait()
        link.send(torch.ones(2, 3, dtype=torch.float64), 0, BACKWARD_TAG, message_id(1, 1)).wait()
    elif r == 0:
        like = torch.zeros(2, 3, dtype=torch.float64)
        expect_raises(CommunicationError, lambda: link.recv(1, BACKWARD_TAG, message_id(0, 1), like.device, like),
                      "has shape (2, 4) (torch.float64) but the activation it belongs to has shape (2, 3)",
                      "gradient shape")
        expect_raises(CommunicationError, lambda: link.recv(1, BACKWARD_TAG, message_id(1, 1), like.device, like),
                      "expected micro-batch 1 from virtual stage 1 but rank 1 sent micro-batch 5", "micro-batch id")
        got = link.recv(1, BACKWARD_TAG, message_id(1, 1), like.device, like)
        assert torch.equal(got, torch.ones(2, 3, dtype=torch.float64)), "the link lost its order"


_GRID: list[ProcessGrid] = []


def grid() -> ProcessGrid:
    if not _GRID:
        _GRID.append(ProcessGrid(dp=1, tp=1, pp=hvd.size()))
    return _GRID[0]


def main() -> None:
    hvd.init()
    p = grid().shape.pp
    checks = _harness.Checks()
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for m in (1, 2, 3, 4, 8):
            checks.add(f"match/{schedule}/m{m}", check_matches_unsplit_model, schedule, m, 1)
    for m in (p, 2 * p):
        checks.add(f"match/interleaved/v2/m{m}", check_matches_unsplit_model, "interleaved", m, 2)
    checks.add("match/1f1b/m4/recompute_full", check_matches_unsplit_model, "1f1b", 4, 1, "full")
    checks.add("match/interleaved/v2/recompute_full", check_matches_unsplit_model, "interleaved", 2 * hvd.size(),
               2, "full")
    checks.add("memory/full_recompute_keeps_less", check_full_recompute_keeps_less)
    checks.add("match/mean_loss", check_mean_loss_matches_full_batch_mean)
    checks.add("match/frozen_first_block", check_frozen_first_block)
    checks.add("memory/activations_follow_in_flight", check_activation_memory_follows_in_flight)
    checks.add("split/explicit", check_explicit_split)
    checks.add("errors/bad_inputs", check_bad_inputs)
    checks.add("errors/wrong_messages", check_wrong_messages_are_refused)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
