"""Moving between a full (single-process) ``state_dict`` and tensor-parallel modules.

Every rank of the TP set calls these with the same module structure; sharded
entries are recognised by their :class:`~psrt.tp.sharding.Sharding`, the rest
are replicated and copied as they are.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from psrt.errors import InvalidArgumentError
from psrt.tp import comm
from psrt.tp.sharding import Sharding, sharding_of
from psrt.topology import ProcessSet


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy a full model's ``state_dict`` into ``module``, each rank keeping its own block of
    the sharded parameters (no communication).  With ``strict`` the keys must match exactly."""
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if strict and (missing or unexpected):
        raise InvalidArgumentError(f"state_dict does not match the module: missing {missing[:5]}, "
                                   f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            if name not in state_dict:
                continue
            full = state_dict[name]
            sharding = sharding_of(target)
            value = full if sharding is None else sharding.shard(full.to(target.device))
            if value.shape != target.shape:
                raise InvalidArgumentError(f"{name}: expected shape {tuple(target.shape)} on this rank, the "
                                           f"state_dict gives {tuple(value.shape)}")
            target.copy_(value)


def full_state_dict(module: nn.Module, process_set: ProcessSet | None) -> dict[str, torch.Tensor]:
    """The full model's ``state_dict``, every sharded entry gathered over the TP set (every
    rank gets the whole dictionary).

    Collective: every rank of ``process_set`` (the TP set the module was built with) calls it,
    in the same order.
    """
    entries = module.state_dict(keep_vars=True)
    size, rank = comm.group_size(process_set), comm.group_rank(process_set)
    misplaced = next((f"{name} is block {s.index} of {s.parts}, but rank {rank} of {size} in {process_set!r} holds it"
                      for name, s in ((n, sharding_of(t)) for n, t in entries.items())
                      if s is not None and s.parts > 1 and (s.parts, s.index) != (size, rank)), None)
    problems = [p for p in comm.agree(process_set, misplaced) if p is not None]
    if problems:  # raised on every rank of the set alike
        raise InvalidArgumentError(f"{problems[0]}: pass the tensor-parallel process set the module was built with")
    return {name: gather_block(tensor.detach(), sharding_of(tensor), process_set) for name, tensor in entries.items()}


def gather_block(block: torch.Tensor, sharding: Sharding | None, process_set: ProcessSet | None) -> torch.Tensor:
    """The full tensor whose block ``block`` is on this rank, laid out by ``sharding`` (None: the
    tensor is replicated, and a copy of it is returned).  A parameter's, or a same-shaped
    optimizer state of it (Adam's moments).

    Collective over ``process_set`` when the tensor is split over more than one rank: every rank
    of the set calls it for the same tensor, in the same order.
    """
    if sharding is None:
        return block.clone()
    if sharding.parts == 1:
        return sharding.unshard([block])
    blocks = comm.all_gather(block.unsqueeze(0), 0, process_set)
    return sharding.unshard(list(blocks.unbind(0)))
