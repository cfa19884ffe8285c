"""The whole model's single-process ``state_dict`` from any layout, in one call, and back.

A model spread over a grid holds, on each rank, its pipeline stage's blocks, its TP block
of each split parameter and its EP share of the experts; under ZeRO-3 even those are
sharded over the data-parallel ranks.  :func:`full_state_dict` undoes all of it:
ZeRO-3's parameters are gathered, TP blocks joined (:func:`psrt.tp.full_state_dict`),
then the entries of the EP ranks and of the pipeline stages merged, so every rank gets
the dictionary one process training the same model would have (keys and values).
:func:`load_full_state_dict` is the inverse: each rank takes its own entries and TP blocks
from such a dictionary (no communication).  :func:`full_optimizer_state_dict` and
:func:`load_full_optimizer_state_dict` do the same for an optimizer of the stage, its state
keyed by parameter name instead of position (positions differ from one layout to
another), and :class:`FullState` puts the two behind the state protocol
(:class:`psrt.stateful.Stateful`): what it saves on one grid it loads on any other.

:func:`full_state_dict` is collective over the grid.  The merge sends each rank's entries
to the others of its EP and PP sets, so every rank holds the whole model in host memory for
a moment.  That is why elastic commits no longer use it: they write each rank's own blocks
(:mod:`psrt.elastic.sharded_model`); :class:`FullState` still reads the commits of psrt that
did.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import nn

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
    entries = _merge_over_grid(entries, grid, "psrt.full_state_dict")
    for copy, owner in getattr(module, "tied_aliases", {}).items():  # a shared parameter's other names
        entries[copy] = entries[owner]
    return entries


def _merge_over_grid(entries: dict, grid: ProcessGrid | None, name: str, merge=None) -> dict:
    """The entries of every EP and PP rank holding a part of this rank's model, merged (by
    ``merge``, :func:`_merge` by default)."""
    if grid is None:
        return entries
    for process_set in (grid.ep_set, grid.pp_set):
        if process_set is not None and process_set.size() > 1:
            entries = (merge or _merge)(grid.runtime.channel(process_set).allgather_object(entries, name=name))
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


def full_optimizer_state_dict(module: nn.Module, optimizer: Any, grid: ProcessGrid | None = None) -> dict:
    """The state of ``optimizer`` (a torch optimizer, or ``hvd.DistributedOptimizer``, of
    ``module``'s parameters) as one process training the whole model would hold it, keyed by
    parameter name: ``{"state": {name: {key: value}}, "param_groups": [{options, "params":
    [names]}]}``, on every rank (host tensors).  A state tensor shaped like its TP-split
    parameter (Adam's moments) is gathered as the parameter is.

    Collective: every rank of the world calls it, in the same order (no communication
    without a grid).
    """
    names = _parameter_names(module, optimizer)
    saved = optimizer.state_dict()
    order = [param for group in optimizer.param_groups for param in group["params"]]
    tp_set = None if grid is None else grid.tp_set
    state = {}
    for index, param in enumerate(order):  # the same order on every TP rank
        state[names[id(param)]] = {
            key: tp.state.gather_block(value.detach().cpu(), _sharding_for(param, value), tp_set)
            if isinstance(value, torch.Tensor) else value
            for key, value in saved["state"].get(index, {}).items()}
    groups = [dict({key: value for key, value in options.items() if key != "params"},
                   params=[names[id(param)] for param in group["params"]])
              for options, group in zip(saved["param_groups"], optimizer.param_groups)]
    merged = _merge_over_grid({"state": state, "groups": {tuple(g["params"]): g for g in groups}}, grid,
                              "psrt.full_optimizer_state_dict", _merge_optimizer_parts)
    return {"state": merged["state"], "param_groups": list(merged["groups"].values())}


def _merge_optimizer_parts(parts: list[dict]) -> dict:
    """Every rank's parameters' states and groups; a parameter several ranks hold (replicated
    over EP ranks) is taken once."""
    state: dict[str, dict] = {}
    groups: dict[tuple, dict] = {}
    for part in parts:
        for name, entry in part["state"].items():
            state.setdefault(name, entry)
        groups.update(part["groups"])
    return {"state": state, "groups": groups}


def load_full_optimizer_state_dict(module: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> None:
    """Load what :func:`full_optimizer_state_dict` returned (on any grid) into ``optimizer`` of
    this rank's part ``module``: each parameter takes its entry (its TP block of a state tensor
    shaped like it), each parameter group the options of the saved group holding its first
    parameter.  No communication."""
    names = _parameter_names(module, optimizer)
    order = [param for group in optimizer.param_groups for param in group["params"]]
    entries: dict[int, dict] = {}
    for index, param in enumerate(order):
        saved = state["state"].get(names[id(param)])
        if saved is not None:
            entries[index] = {key: _block_of_state(param, value, names[id(param)], key)
                              for key, value in saved.items()}
    groups = groups_by_position(optimizer, state["param_groups"], lambda param: names[id(param)])
    optimizer.load_state_dict({"state": entries, "param_groups": groups})


def groups_by_position(optimizer: Any, saved: list[dict], name_of) -> list[dict]:
    """``optimizer``'s parameter groups as its ``state_dict`` holds them (parameters by
    position), each with the options of the ``saved`` group (parameters by name, as
    ``name_of(param)`` gives them) holding its first parameter."""
    groups, start = [], 0
    for group in optimizer.param_groups:
        first = name_of(group["params"][0])
        options = next((g for g in saved if first in g["params"]), None)
        if options is None:
            raise InvalidArgumentError(f"parameter {first!r} is in no parameter group of the saved optimizer state: "
                                       "it was saved for another model")
        groups.append(dict({key: value for key, value in options.items() if key != "params"},
                           params=list(range(start, start + len(group["params"])))))
        start += len(group["params"])
    return groups


def _parameter_names(module: nn.Module, optimizer: Any) -> dict[int, str]:
    names = {id(param): name for name, param in module.named_parameters()}
    stray = [tuple(param.shape) for group in optimizer.param_groups for param in group["params"]
             if id(param) not in names]
    if stray:
        raise InvalidArgumentError(f"the optimizer holds {len(stray)} parameter(s) that are not the module's (shapes "
                                   f"{stray[:3]}): pass the module the optimizer was built on")
    return names


def _sharding_for(param: torch.Tensor, value: torch.Tensor) -> tp.Sharding | None:
    """The layout of an optimizer state tensor: its parameter's when shaped like it."""
    return tp.sharding.sharding_of(param) if value.shape == param.shape else None


def _block_of_state(param: torch.Tensor, value: object, name: str, key: str) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    sharding = tp.sharding.sharding_of(param)
    if value.shape == param.shape or sharding is None or value.dim() != param.dim():
        return value.clone()
    block = sharding.shard(value)
    if block.shape != param.shape:
        raise InvalidArgumentError(f"optimizer state {key!r} of {name}: shape {tuple(value.shape)} does not split "
                                   f"into this rank's block {tuple(param.shape)}")
    return block.clone()


class FullState:
    """A model (this rank's part of it on ``grid``) and its optimizer, saved and restored
    whole, as one process would hold them: :class:`psrt.stateful.Stateful`.  Its
    ``state_dict()`` is collective over the grid (see :func:`full_state_dict`);
    ``load_state_dict()`` takes one saved on any grid, or none, and is local."""

    def __init__(self, module: nn.Module, optimizer: Any = None, grid: ProcessGrid | None = None) -> None:
        self.module, self.optimizer, self.grid = module, optimizer, grid

    def state_dict(self) -> dict[str, Any]:
        """``{"model": full_state_dict(...), "optimizer": full_optimizer_state_dict(...)}``, on
        every rank.

        Collective: every rank of the world calls it, in the same order (no communication
        without a grid).
        """
        document: dict[str, Any] = {"model": full_state_dict(self.module, self.grid)}
        if self.optimizer is not None:
            document["optimizer"] = full_optimizer_state_dict(self.module, self.optimizer, self.grid)
        return document

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take this rank's part of what :meth:`state_dict` returned on any grid.  No
        communication."""
        load_full_state_dict(self.module, state_dict["model"])
        if self.optimizer is not None and "optimizer" in state_dict:
            load_full_optimizer_state_dict(self.module, self.optimizer, state_dict["optimizer"])
