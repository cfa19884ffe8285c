"""The whole model's single-process ``state_dict`` from any layout, in one call, and back.

A model spread over a grid holds, on each rank, its pipeline stage's blocks, its TP block
of each split parameter and its EP share of the experts; under ZeRO-3 even those are
sharded over the data-parallel ranks.  :func:`full_state_dict` undoes all of it:
ZeRO-3's parameters are gathered, TP blocks joined (:func:`psrt.tp.full_state_dict`),
then the entries of the EP ranks and of the pipeline stages merged, so every rank gets
the dictionary one process training the same model would have (keys and values).
:func:`load_full_state_dict` is the inverse: each rank takes its own entries and TP blocks
from such a dictionary (no communication).

:func:`full_state_dict` is collective over the grid.  The merge sends each rank's entries
to the others of its EP and PP sets, so every rank holds the whole model in host memory for
a moment.
"""
from __future__ import annotations

import contextlib
from typing import Mapping

import torch
from torch import nn

import psrt.torch as hvd
from psrt import tp
from psrt.errors import InvalidArgumentError
from psrt.grid import ProcessGrid


def full_state_dict(module: nn.Module, grid: ProcessGrid | None = None, optimizer: object = None
                    ) -> dict[str, torch.Tensor]:
    """The single-process ``state_dict`` of the model ``module`` is this rank's part of, on every
    rank (host tensors).  ``grid`` is the layout (None: one process, or plain data parallelism);
    ``optimizer`` the ZeroOptimizer wrapping ``module``, if any (stage 3 gathers through it).

    Collective: every rank of the world calls it, in the same order (without a grid, every rank
    of the ZeRO optimizer's process set).
    """
    gathered = optimizer.gathered_parameters() if hasattr(optimizer, "gathered_parameters") else \
        contextlib.nullcontext()
    with gathered:
        entries = tp.full_state_dict(module, None if grid is None else grid.tp_set)
    entries = {name: tensor.detach().cpu().clone() for name, tensor in entries.items()}
    if grid is None:
        return entries
    for process_set in (grid.ep_set, grid.pp_set):
        if process_set is not None and process_set.size() > 1:
            entries = _merge(hvd.allgather_object(entries, name="psrt.full_state_dict", process_set=process_set))
    for copy, owner in getattr(module, "tied_aliases", {}).items():  # a shared parameter's other names
        entries[copy] = entries[owner]
    return entries


def _merge(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dictionary from every rank's: disjoint entries joined, shared ones (replicated
    parameters) taken once, after checking that the ranks agree on them."""
    merged: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for name, tensor in part.items():
            if name in merged and not torch.equal(merged[name], tensor):
                raise InvalidArgumentError(f"full_state_dict: {name!r} differs between the ranks that hold it (rank "
                                           f"{rank} of the set has another value): the replicas are out of step")
            merged.setdefault(name, tensor)
    return merged


def _block_of(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` or, for a TP-split parameter's copy, this rank's block of it."""
    sharding = tp.sharding.sharding_of(target)
    return full if sharding is None else sharding.shard(full)


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a single-process ``state_dict`` into this rank's part of the model: its stage's
    entries, its experts, its TP block of every split parameter.  Every entry the rank holds
    must be there (extra ones belong to other ranks).  With ZeRO, load before wrapping.  No
    communication: each rank may call it on its own."""
    own = module.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state_dict))
    if missing:
        raise InvalidArgumentError(f"load_full_state_dict: this rank's part of the model needs {missing[:5]}"
                                   f"{' and more' if len(missing) > 5 else ''}, which the state_dict lacks")
    tp.load_full_state_dict(module, {name: state_dict[name] for name in own}, strict=True)
    with torch.no_grad():  # a pipeline's copies of parameters owned by another stage
        for tie in getattr(module, "ties", ()):
            for name in tie.names:
                tie.tensor.copy_(_block_of(tie.tensor, state_dict[name]))
