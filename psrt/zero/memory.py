"""What a ZeRO optimizer holds, in bytes, read from the actual tensors' storages.

Each storage is counted once, so a shard that is a view of a parameter buffer is
not counted twice; a released stage-3 buffer counts as zero.
"""
from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def report(zero) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes of ``zero`` (a ZeroOptimizer) on this rank.

    Parameters: the compute buffers (whole groups, or stage 3's shards plus whatever is
    gathered now).  Gradients: the parameters' ``.grad`` and the reduced shards (with the buffer
    stages 2 and 3 keep for them across steps).  Optimizer:
    its state and the master copies where they are not the compute shards.
    """
    seen: set[int] = set()
    params = storage_bytes((t for group in zero.groups for t in (group.shard, group.full)), seen)
    grads = storage_bytes((t for group in zero.groups for t in (group.grad, group.grad_buffer, group.master.grad,
                                                                *(p.grad for p in group.params))), seen)
    state = [value for per_param in zero.optimizer.state.values() for value in per_param.values()
             if isinstance(value, torch.Tensor)]
    optimizer = storage_bytes([group.master for group in zero.groups] + state, seen)
    return {"params": params, "grads": grads, "optimizer": optimizer}
