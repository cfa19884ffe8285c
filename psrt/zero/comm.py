"""The collectives ZeRO runs, on its process set's engine channel (:mod:`psrt.engine.channel`):
every one is named, and the gradient reductions and gathers are asynchronous.

A group's name is the same on every rank (it comes from the wrap order and the
group index), so the engine matches each rank's call with the others' by name
whatever order backward produced the gradients in.
"""
from __future__ import annotations

import torch

from psrt.comm.base import ElementwiseOp
from psrt.engine import Channel, Work


def reduce_gradients(channel: Channel, flat: torch.Tensor, name: str, num_shards: int, wake: bool) -> Work:
    """Start averaging ``flat`` (a whole group's gradients, padded to a multiple of the shards)
    over the set; the work's output is this rank's shard, or the whole averaged group where the
    group is not sharded (stage 0).  ``wake``: see :meth:`Channel.start`."""
    if num_shards == 1:
        work = channel.allreduce([flat], name=name, scale=1.0 / channel.size, finish=lambda _: flat)
    else:
        shard = flat.numel() // channel.size
        out = torch.empty(shard, dtype=flat.dtype, device=flat.device)
        work = channel.reduce_scatter(flat, out, [shard] * channel.size, name=name, scale=1.0 / channel.size)
    return channel.start(work, wake)


def gather(channel: Channel, shard: torch.Tensor, full: torch.Tensor, name: str) -> Work:
    """Start gathering every rank's ``shard`` into ``full``, in rank order."""
    return channel.start(channel.allgather_into(shard, full, name=name))


def total_norm(channel: Channel, partial: torch.Tensor, norm_type: float, sharded: bool) -> torch.Tensor:
    """Combine this rank's partial norm statistic (sum of |g|^p, or max |g| for inf) over the set.

    Unsharded gradients (stage 0) are the same on every rank and are not combined.
    """
    if sharded:
        partial = partial.clone()
        op = ElementwiseOp.MAX if norm_type == float("inf") else ElementwiseOp.SUM
        channel.run(channel.allreduce([partial], name="zero.grad_norm", op=op))
    return partial if norm_type == float("inf") else partial ** (1.0 / norm_type)


def any_rank(channel: Channel, flags: list[torch.Tensor], name: str) -> bool:
    """True if any of ``flags`` (0-dim bool tensors, on the gradients' device) is true on any
    rank of the set: one small allreduce on the device, then one read of its result, the host
    wait a loss scaler needs to decide whether the step is taken (as torch's ``GradScaler``)."""
    value = torch.stack(flags).any().to(torch.int32).reshape(1) if flags else torch.zeros(1, dtype=torch.int32)
    channel.run(channel.allreduce([value], name=name, op=ElementwiseOp.MAX))
    return bool(value)
