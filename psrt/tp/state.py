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
from psrt.tp.sharding import sharding_of
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
    full = {}
    for name, tensor in entries.items():
        sharding = sharding_of(tensor)
        tensor = tensor.detach()
        if sharding is None or sharding.parts == 1:
            full[name] = tensor.clone() if sharding is None else sharding.unshard([tensor])
            continue
        blocks = comm.all_gather(tensor.unsqueeze(0), 0, process_set)
        full[name] = sharding.unshard(list(blocks.unbind(0)))
    return full
