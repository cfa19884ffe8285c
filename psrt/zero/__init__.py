"""ZeRO stages 1, 2 and 3 over a data-parallel process set (DeepSpeed's ZeRO, FSDP's layout).

``ZeroOptimizer(model, optimizer_class, stage=..., **optimizer_kwargs)`` (or :func:`wrap`)
shards optimizer state, gradients and parameters; :mod:`psrt.zero.checkpoint` saves and
loads sharded checkpoints and consolidates them into an ordinary ``state_dict``;
:mod:`psrt.zero.dcp` gives ``torch.distributed.checkpoint`` the same state under FSDP2's keys.
"""
from psrt.zero.checkpoint import consolidate, load, save
from psrt.zero.optimizer import ALLGATHER_BUCKET_SIZE, REDUCE_BUCKET_SIZE, ZeroOptimizer
from psrt.zero.partition import ParamInfo, Partition, Piece, expected_bytes


def wrap(model, optimizer_class, *, stage: int = 2, **kwargs) -> ZeroOptimizer:
    """``ZeroOptimizer(model, optimizer_class, stage=stage, **kwargs)``.

    Collective: every rank of the optimizer's process set calls it, in the same order.

    :param model: as for :class:`ZeroOptimizer`.
    :param optimizer_class: as for :class:`ZeroOptimizer`.
    :param stage: 0, 1, 2 (the default) or 3.
    :param kwargs: :class:`ZeroOptimizer`'s other keyword arguments and the optimizer's options.
    """
    return ZeroOptimizer(model, optimizer_class, stage=stage, **kwargs)


__all__ = ["ALLGATHER_BUCKET_SIZE", "REDUCE_BUCKET_SIZE", "ParamInfo", "Partition", "Piece",
           "ZeroOptimizer", "consolidate", "expected_bytes", "load", "save", "wrap"]
