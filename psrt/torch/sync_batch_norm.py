"""``SyncBatchNorm``: batch normalization whose training statistics cover every rank's batch.

With small per-rank batches, per-rank statistics are noisy; this layer
normalizes as if the ranks' batches were concatenated (they may differ in
size, even be empty on some ranks).  Forward gathers each rank's count, mean
and variance (one small allgather); backward sums two per-channel gradient
sums (one small allreduce).  Weight and bias gradients stay local, like every
other parameter's, for the optimizer to reduce.  Every rank of the process set
must run the layer the same number of times, in training mode together.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

import psrt.torch as hvd
from psrt.autograd import skips_without_gradient
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` (Horovod's ``hvd.SyncBatchNorm``).

    Training-mode statistics, and the running statistics updated from them, are those of all
    ranks' batches together; eval mode never communicates (it uses the running statistics, or
    without them the local batch's, as ``torch.nn.SyncBatchNorm`` does).

    Collective in training mode: every rank of ``process_set`` runs forward and backward through
    it, in the same order (each rank's batch may have its own size).

    :param num_features: the channels C of an input of shape (N, C, ...).
    :param eps: added to the variance for numerical stability; default 1e-5.
    :param momentum: the weight of each batch's statistics in the running ones; default 0.1,
        None for a cumulative average.
    :param affine: learn a per-channel weight and bias; default True.
    :param track_running_stats: keep running statistics (used in eval mode); default True.
    :param process_set: the ranks whose batches are normalised together: a registered process
        set; default ``global_process_set`` (every rank).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean, self.running_var,
                                    self.eps, self._running_factor(), self.process_set)

    def _running_factor(self) -> float:
        """How much of this batch's statistics enters the running ones (as ``_BatchNorm``)."""
        if not self.track_running_stats:
            return 0.0
        self.num_batches_tracked.add_(1)
        return 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum


def _channel_view(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-channel ``values`` shaped to broadcast over ``like`` (N, C, ...)."""
    return values.view(1, -1, *([1] * (like.dim() - 2)))


def _local_stats(x: torch.Tensor, reduce_dims: list[int]) -> torch.Tensor:
    """This rank's [count, mean..., biased variance...] in float64 (zeros for an empty batch)."""
    channels = x.size(1)
    count = x.numel() // channels if channels else 0
    if count == 0:
        mean = var = torch.zeros(channels, dtype=torch.float64, device=x.device)
    else:
        var, mean = torch.var_mean(x.to(torch.float64), dim=reduce_dims, correction=0)
    return torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device), mean, var])


def _combine(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean, biased variance and count of the union of the batches whose rows are in ``stats``."""
    channels = (stats.size(1) - 1) // 2
    counts, means, variances = stats[:, :1], stats[:, 1:1 + channels], stats[:, 1 + channels:]
    total = float(counts.sum())
    mean = (counts * means).sum(0) / total
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
    return mean, var, total


@skips_without_gradient
class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm over the concatenation of every rank's batch (forward and backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, process_set):
        reduce_dims = [0, *range(2, x.dim())]
        stats = hvd.allgather(_local_stats(x, reduce_dims).unsqueeze(0), name="SyncBatchNorm.stats",
                              process_set=process_set)
        mean, var, total = _combine(stats)
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over "
                             f"all ranks (input size {list(x.shape)} on this rank)")
        if running_mean is not None:
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_((var * (total / (total - 1))).to(running_var.dtype), alpha=factor)
        mean, invstd = mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)
        out = (x - _channel_view(mean, x)) * _channel_view(invstd, x)
        if weight is not None:
            out = out * _channel_view(weight, x) + _channel_view(bias, x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.process_set, ctx.reduce_dims = total, process_set, reduce_dims
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        xmu = x - _channel_view(mean, x)
        sum_dy = grad_out.sum(ctx.reduce_dims)
        sum_dy_xmu = (grad_out * xmu).sum(ctx.reduce_dims)
        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        if ctx.needs_input_grad[0]:
            sums = hvd.allreduce_(torch.cat([sum_dy, sum_dy_xmu]), op=hvd.Sum, name="SyncBatchNorm.grad_sums",
                                  process_set=ctx.process_set)
            mean_dy, mean_dy_xmu = (sums / ctx.total).chunk(2)
            scale = invstd if weight is None else invstd * weight
            grad_x = (grad_out - _channel_view(mean_dy, x)
                      - xmu * _channel_view(invstd * invstd * mean_dy_xmu, x)) * _channel_view(scale, x)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
