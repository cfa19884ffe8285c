"""Stage 3's units, as a plain value: which modules gather their parameters together.

A unit is a module and the parameters it gathers around its forward and backward (and frees
after them).  Which modules are units is ``ZeroOptimizer``'s ``units=``:

``"blocks"`` (the default)
    The model's repeated blocks, as FSDP2 is applied per transformer block (torchtitan's
    ``for block in model.layers: fully_shard(block)`` then ``fully_shard(model)``): in every
    ``nn.ModuleList``, ``nn.ModuleDict`` and ``nn.Sequential``, each child whose class occurs
    at least twice among that container's children.  The outermost ones: a block's own lists
    are not searched.  Every parameter outside the blocks belongs to the root unit, the whole
    model, gathered around the model's whole forward (embeddings, final norm, head).
``"modules"``
    Each module that registers parameters itself (``nn.Linear``, ``nn.LayerNorm``...): the
    granularity of DeepSpeed's ZeRO-3 hooks.  The least memory gathered at a time, and the
    most hooks per step.
a list of modules of the model
    Those modules (as calls of ``fully_shard`` on each), plus the root unit for the rest.

A unit holds the parameters registered in its module's subtree outside any unit nested in
it.  A parameter registered twice (tied input and output embeddings) belongs to the first
unit that reaches it in registration order; a module of another unit that also registers it
uses it there: it gathers that unit around its own forward and again before its own
backward.  A unit around the using module (the root around a block) is gathered then
anyway, so such a use needs nothing.

What the caller guarantees: a unit's forward runs every use of its parameters (a unit's
module calls its submodules within its own ``forward``), as FSDP2 requires.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import nn

from psrt.errors import ArgumentTypeError, InvalidArgumentError

BLOCKS, MODULES = "blocks", "modules"
#: What ``units=`` takes.
UnitsOption = Union[str, Sequence[nn.Module]]
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class UnitPlan:
    """The units in the order they first hold a parameter (registration order), each a module
    and its parameters (indices into the parameter list, registration order); and each use of
    a unit's parameter by a module outside it: (module, unit index)."""

    units: tuple[tuple[nn.Module, tuple[int, ...]], ...]
    shared_uses: tuple[tuple[nn.Module, int], ...]


def check_units_option(model: nn.Module, option: object) -> None:
    """Raise, naming what to change, unless ``option`` is a valid ``units=`` for ``model``."""
    if isinstance(option, str):
        if option not in (BLOCKS, MODULES):
            raise InvalidArgumentError(f"units must be 'blocks', 'modules' or a list of the model's modules, "
                                       f"got {option!r}")
        return
    if not isinstance(option, (list, tuple)) or not option:
        raise ArgumentTypeError(f"units must be 'blocks', 'modules' or a non-empty list of the model's modules, "
                                f"got {option!r:.200}")
    members = {id(module) for module in model.modules()}
    seen: set[int] = set()
    for position, module in enumerate(option):
        if not isinstance(module, nn.Module):
            raise ArgumentTypeError(f"units[{position}] must be a torch.nn.Module of the model, "
                                    f"got {type(module).__name__}")
        if id(module) not in members:
            raise InvalidArgumentError(f"units[{position}] ({type(module).__name__}) is not a module of the model")
        if id(module) in seen:
            raise InvalidArgumentError(f"units[{position}] ({type(module).__name__}) is listed twice")
        seen.add(id(module))


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost children of a ``ModuleList``/``ModuleDict``/``Sequential`` whose class
    occurs at least twice among that container's children (``units="blocks"``)."""
    blocks: list[nn.Module] = []
    seen: set[int] = set()

    def search(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        children = list(module.children())
        counts = Counter(type(child) for child in children) if isinstance(module, _CONTAINERS) else Counter()
        for child in children:
            if counts[type(child)] >= 2:
                if id(child) not in seen:
                    seen.add(id(child))
                    blocks.append(child)
            else:
                search(child)

    search(model)
    return blocks


def plan_units(model: nn.Module, params: Sequence[torch.Tensor], option: UnitsOption = BLOCKS) -> UnitPlan:
    """The units of ``model`` whose trainable parameters are ``params`` (registration order),
    for ``units=option`` (checked by :func:`check_units_option`).  Units without a trainable
    parameter are left out."""
    every = option == MODULES
    chosen = set() if every else {id(module) for module in
                                  (repeated_blocks(model) if option == BLOCKS else option)} | {id(model)}
    index_of = {id(param): index for index, param in enumerate(params)}
    holder_of: dict[int, int] = {}          # parameter index -> id of the module of the unit holding it
    members: dict[int, list[int]] = {}      # unit module id -> its parameters, in order of first holding one
    modules: dict[int, nn.Module] = {}
    uses: list[tuple[nn.Module, int]] = []  # (module, id of the holding unit's module)
    seen: set[int] = set()

    def visit(module: nn.Module, owner: nn.Module, around: frozenset[int]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if every or id(module) in chosen:
            owner, around = module, around | {id(module)}
        used: list[int] = []
        for param in module.parameters(recurse=False):
            index = index_of.get(id(param))
            if index is None:
                continue
            holder = holder_of.get(index)
            if holder is None:
                holder_of[index] = id(owner)
                modules[id(owner)] = owner
                members.setdefault(id(owner), []).append(index)
            elif holder not in around:
                used.append(holder)
        uses.extend((module, holder) for holder in dict.fromkeys(used))
        for child in module.children():
            visit(child, owner, around)

    visit(model, model, frozenset())
    position = {key: unit for unit, key in enumerate(members)}
    return UnitPlan(tuple((modules[key], tuple(indices)) for key, indices in members.items()),
                    tuple((module, position[holder]) for module, holder in uses))
