"""SyncBatchNorm against torch's BatchNorm on the concatenation of every rank's batch.

Ranks hold batches of different sizes (one may be empty).  Two training
iterations check outputs, input gradients, the summed weight and bias
gradients and the running statistics; then eval mode checks the output.
"""
from __future__ import annotations

import torch

import psrt.torch as hvd
from psrt.torch.sync_batch_norm import SyncBatchNorm

from _harness import Checks
from _training_common import randn

CHANNELS = 3
ITERATIONS = 2


class Mismatches(list):
    """Differences found so far; raised together at the end, so that a rank which finds one
    still runs every collective of the check and the ranks stay in step."""

    def close(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        try:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        except AssertionError as exc:
            self.append(f"{what}: {exc}")

    def raise_any(self, key: str) -> None:
        assert not self, f"{key}: {len(self)} mismatches; first: {self[0]}"


def matches_batch_norm(key: str, reference_class: type, tail: tuple[int, ...], rows_of, momentum=0.1) -> None:
    rank, size = hvd.rank(), hvd.size()
    mismatches = Mismatches()
    rows = [rows_of(r) for r in range(size)]
    mine = slice(sum(rows[:rank]), sum(rows[:rank + 1]))
    reference = reference_class(CHANNELS, momentum=momentum).double()
    synced = SyncBatchNorm(CHANNELS, momentum=momentum).double()
    with torch.no_grad():
        for module in (reference, synced):
            module.weight.copy_(randn(key, (CHANNELS,), "weight"))
            module.bias.copy_(randn(key, (CHANNELS,), "bias"))
    for it in range(ITERATIONS):
        batch = torch.cat([randn(key, (rows[r], CHANNELS, *tail), "x", it, r) * (it + 1) + it for r in range(size)])
        grad_out = randn(key, batch.shape, "dy", it)
        x_all, x_mine = batch.clone().requires_grad_(), batch[mine].clone().requires_grad_()
        out_all, out_mine = reference(x_all), synced(x_mine)
        (out_all * grad_out).sum().backward()
        (out_mine * grad_out[mine]).sum().backward()
        mismatches.close(out_mine, out_all[mine], f"{key}: output, iteration {it}")
        mismatches.close(x_mine.grad, x_all.grad[mine], f"{key}: input gradient, iteration {it}")
    for name in ("weight", "bias"):
        summed = hvd.allreduce(getattr(synced, name).grad, op=hvd.Sum, name=f"{key}.{name}")
        mismatches.close(summed, getattr(reference, name).grad, f"{key}: {name} gradient summed over ranks")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        mismatches.close(getattr(synced, name), getattr(reference, name), f"{key}: {name}")
    synced.eval(), reference.eval()
    batch = torch.cat([randn(key, (rows[r], CHANNELS, *tail), "eval", r) for r in range(size)])
    mismatches.close(synced(batch[mine]), reference(batch)[mine], f"{key}: eval output")
    mismatches.raise_any(key)


def add_checks(checks: Checks) -> None:
    checks.add("sync_batch_norm/1d_unequal_batches", matches_batch_norm, torch.nn.BatchNorm1d, (),
               lambda r: 2 * r + 1)
    checks.add("sync_batch_norm/1d_sequence_input", matches_batch_norm, torch.nn.BatchNorm1d, (5,),
               lambda r: r + 1)
    checks.add("sync_batch_norm/2d_unequal_batches", matches_batch_norm, torch.nn.BatchNorm2d, (4, 3),
               lambda r: r % 2 + 1)
    checks.add("sync_batch_norm/2d_cumulative_average", matches_batch_norm, torch.nn.BatchNorm2d, (2, 2),
               lambda r: r + 1, None)
    checks.add("sync_batch_norm/rank_with_empty_batch", matches_batch_norm, torch.nn.BatchNorm1d, (),
               lambda r: 0 if r == 0 else r + 1)
