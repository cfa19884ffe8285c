"""Cross-entropy on logits split along the vocabulary, without gathering them.

Three all-reduces over the TP set of ``[tokens]``-sized tensors (the max, the
target's logit, the sum of exponentials) replace an all-gather of
``[tokens, vocabulary]`` logits; the backward needs no communication.
"""
from __future__ import annotations

import torch

from psrt.autograd import skips_without_gradient
from psrt.comm.base import ElementwiseOp
from psrt.errors import InvalidArgumentError
from psrt.topology import ProcessSet
from psrt.tp import comm


@skips_without_gradient
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, process_set, vocab_size):
        ctx.input_dtype = logits.dtype
        local_vocab = logits.shape[-1]
        start = comm.group_rank(process_set) * local_vocab
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits.clone()
        padded = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        if padded.any():
            logits.masked_fill_(padded, float("-inf"))
        maximum = logits.amax(dim=-1)
        comm.all_reduce_(maximum, process_set, ElementwiseOp.MAX)
        logits.sub_(maximum.unsqueeze(-1))
        outside = (target < start) | (target >= start + local_vocab)
        local_target = torch.where(outside, 0, target - start)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce_(target_logit, process_set)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce_(sum_exp, process_set)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (~outside).to(grad.dtype).unsqueeze(-1).neg())
        return grad.mul_(grad_loss.unsqueeze(-1)).to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, process_set: ProcessSet | None,
                                 *, vocab_size: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``target`` (class ids over the full vocabulary) under logits whose
    last dimension is this rank's block of the vocabulary (a ColumnParallelLinear output).

    ``vocab_size`` is the real vocabulary when it was padded to a multiple of the TP
    size: padded columns take no probability.  ``reduction`` is "mean", "sum" or "none",
    as in ``torch.nn.functional.cross_entropy``.  Half-precision logits are handled in
    float32, and the loss stays float32 (as Megatron's does).

    Collective: every rank of ``process_set`` (the TP set) calls it, in the same order, and
    runs backward through it.
    """
    if logits.shape[:-1] != target.shape:
        raise InvalidArgumentError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                                   f"{tuple(target.shape)}: expected logits of shape [*target.shape, vocab]")
    if reduction not in ("mean", "sum", "none"):
        raise InvalidArgumentError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    full = logits.shape[-1] * comm.group_size(process_set)
    vocab_size = full if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full:
        raise InvalidArgumentError(f"vocab_size {vocab_size} does not fit the {full} columns of the split logits")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise InvalidArgumentError(f"targets must lie in [0, {vocab_size}), got values in "
                                   f"[{int(target.min())}, {int(target.max())}]")
    losses = _VocabParallelCrossEntropy.apply(logits, target, process_set, vocab_size)
    return losses.mean() if reduction == "mean" else losses.sum() if reduction == "sum" else losses
