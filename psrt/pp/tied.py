"""Parameters shared by blocks on different pipeline stages: tied input and output embeddings.

In one process a tied model uses the same ``Parameter`` in two blocks (GPT-2's token
embedding and its output projection).  Cut into stages, the two blocks land on different
ranks.  psrt keeps the parameter on the rank of the first virtual stage that uses it (the
*owner*: the optimizer, DP or ZeRO, sees it there only) and gives every other rank that
uses it a *copy*: a tensor with the same name and value but no place in the rank's
parameters.  Each step, the owner sends the parameter's value to the copies before the
first forward (after the last optimizer step), and each copy sends the gradient it
accumulated back once its schedule is done; the owner adds those gradients in just before
the backward that accumulates its last micro-batch, so the parameter's gradient is the
single-process one by the time a data-parallel optimizer's hook (or ZeRO) reduces it.

This is Megatron's embedding group with one owner instead of two replicas kept equal:
the same two messages per step (a value one way, a gradient the other), and no second
optimizer state.  It needs the owner to send nothing after that backward, which holds
for the first virtual stage under every schedule psrt builds; other layouts are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from psrt.errors import InvalidArgumentError
from psrt.pp.schedule import Op
from psrt.tp.sharding import sharding_of


@dataclass
class Tie:
    """One shared parameter as this rank sees it."""

    index: int              # position among the model's shared parameters: the message id
    owner: int              # PP rank holding the parameter
    chunk: int              # the owner's chunk that uses it
    peers: list[int]        # the owner: the ranks holding copies; a copy: [owner]
    tensor: torch.Tensor    # the parameter on the owner, this rank's copy elsewhere
    names: list[str] = field(default_factory=list)  # a copy's keys (the entries load_full_state_dict fills)

    @property
    def is_owner(self) -> bool:
        return isinstance(self.tensor, nn.Parameter)


def find_ties(blocks: Sequence[nn.Module], ranges: Sequence[range], stages: int, rank: int
              ) -> tuple[list[Tie], dict[str, str]]:
    """This rank's ties, after turning its uses of parameters owned elsewhere into copies;
    and, for the whole model, each copy's key with its owner's (``full_state_dict`` fills a
    copy's entry from its owner's)."""
    stage_of = {index: virtual for virtual, blocks_of in enumerate(ranges) for index in blocks_of}
    uses: dict[int, list[tuple[int, str]]] = {}  # parameter id -> (block, name in the block)
    params: dict[int, nn.Parameter] = {}
    for index, block in enumerate(blocks):
        for name, param in block.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                continue  # frozen: every rank's copy of it stays what the seed made
            uses.setdefault(id(param), []).append((index, name))
            params[id(param)] = param
    ties, aliases, shared = [], {}, 0
    for key, found in uses.items():
        virtual = sorted({stage_of[index] for index, _ in found})
        holders = sorted({v % stages for v in virtual})
        if len(holders) < 2:
            continue  # used on one rank only: an ordinary (possibly shared) parameter there
        number, shared = shared, shared + 1  # the same on every rank: they all see every block
        owner_stage = virtual[0]
        owner, chunk = owner_stage % stages, owner_stage // stages
        owner_key = next(f"{index}.{name}" for index, name in found if stage_of[index] == owner_stage)
        aliases.update({f"{index}.{name}": owner_key for index, name in found if stage_of[index] % stages != owner})
        if rank not in holders:
            continue
        param = params[key]
        mine = [(index, name) for index, name in found if stage_of[index] % stages == rank]
        if rank == owner:
            ties.append(Tie(number, owner, chunk, [r for r in holders if r != owner], param))
        else:
            copy = param.detach().clone().requires_grad_(param.requires_grad)
            if sharding_of(param) is not None:  # a TP block: the copy is the same block
                copy.tp_sharding = sharding_of(param)
            for index, name in mine:
                _replace(blocks[index], name, copy)
            ties.append(Tie(number, owner, chunk, [owner], copy, [f"{index}.{name}" for index, name in mine]))
    return ties, aliases


def _replace(block: nn.Module, name: str, copy: torch.Tensor) -> None:
    """Make ``block``'s parameter ``name`` a non-persistent buffer holding ``copy``."""
    *path, leaf = name.split(".")
    module = block.get_submodule(".".join(path)) if path else block
    del module._parameters[leaf]
    module.register_buffer(leaf, copy, persistent=False)


def check_schedule(ties: Sequence[Tie], actions: Sequence, rank: int, microbatches: int) -> dict[int, list[Tie]]:
    """Where in this rank's actions the owner takes its copies' gradients: before the first
    backward of the last micro-batch of the owning chunk, after which it must send nothing
    (the copies may still be working towards their last message then)."""
    backward = (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
    sends = (Op.SEND_FORWARD, Op.SEND_BACKWARD)
    points: dict[int, list[Tie]] = {}
    for tie in ties:
        if not tie.is_owner:
            continue
        at = next(i for i, a in enumerate(actions)
                  if a.op in backward and a.microbatch == microbatches - 1 and a.chunk == tie.chunk)
        if any(a.op in sends for a in actions[at:]):
            raise InvalidArgumentError(
                f"a parameter shared between pipeline ranks {[rank] + tie.peers} is owned by a stage that still "
                "sends after its last backward: psrt ties parameters to the first virtual stage that uses them "
                "(tied input and output embeddings); untie it or place its first use on the first stage")
        points.setdefault(at, []).append(tie)
    return points
