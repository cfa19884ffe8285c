"""The collectives ZeRO runs, on the torch API: every one is named, asynchronous, and over
the data-parallel process set.

A group's name is the same on every rank (it comes from the wrap order and the
group index), so the engine matches each rank's call with the others' by name
whatever order backward produced the gradients in.
"""
from __future__ import annotations

import torch

import psrt.torch as hvd
from psrt.topology import ProcessSet


def reduce_gradients(flat: torch.Tensor, name: str, num_shards: int, process_set: ProcessSet) -> int:
    """Average ``flat`` (a whole group's gradients) over the set; the handle's result is this
    rank's shard, or the whole averaged group where the group is not sharded (stage 0)."""
    if num_shards == 1:
        return hvd.allreduce_async_(flat, name=name, op=hvd.Average, process_set=process_set)
    return hvd.reducescatter_async(flat, name=name, op=hvd.Average, process_set=process_set)


def gather(shard: torch.Tensor, full: torch.Tensor, name: str, process_set: ProcessSet) -> int:
    """Start gathering every rank's ``shard`` into ``full``, in rank order."""
    return hvd.allgather_into_async(shard, full, name=name, process_set=process_set)


def wait(handle: int) -> torch.Tensor:
    return hvd.synchronize(handle)


def total_norm(partial: torch.Tensor, norm_type: float, sharded: bool, process_set: ProcessSet) -> torch.Tensor:
    """Combine this rank's partial norm statistic (sum of |g|^p, or max |g| for inf) over the set.

    Unsharded gradients (stage 0) are the same on every rank and are not combined.
    """
    if sharded:
        op = hvd.Max if norm_type == float("inf") else hvd.Sum
        partial = hvd.allreduce(partial, name="zero.grad_norm", op=op, process_set=process_set)
    return partial if norm_type == float("inf") else partial ** (1.0 / norm_type)


def any_rank(flag: bool, name: str, process_set: ProcessSet) -> bool:
    """True if ``flag`` is true on any rank of the set."""
    return bool(hvd.allreduce(torch.tensor([int(flag)]), name=name, op=hvd.Max, process_set=process_set))
