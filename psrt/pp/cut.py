"""Pipeline parallelism for a model psrt did not write: cut it into this rank's stage at
block boundaries.

A decoder model is three parts: the modules before its list of blocks (embeddings), the
blocks, and the modules after them (final norm, output head).  :func:`split` makes one
*piece* per block (the first also runs the embeddings, the last the head) and hands the
pieces to :class:`~psrt.pp.stage.PipelineStage`, so every schedule, recomputation, tied
embeddings and the data-parallel optimizers work unchanged.  A piece holds the model's own
submodules at their own paths, so the stage's ``state_dict`` keys are the model's.

How a block is called (positions, rotary tables, attention masks, recomputed on every
stage from the activation's shape) is the model family's business: a
:class:`~psrt.models.stage_layout.StageLayout` that :mod:`psrt.models` provides for the families
it knows, or that the caller describes by naming the parts (each block then gets the hidden
states alone).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from psrt import models
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.models.stage_layout import StageLayout
from psrt.pp.partition import balanced_split
from psrt.pp.stage import PipelineStage
from psrt.topology import ProcessSet

def named_layout(before: Sequence[str], blocks: str, after: Sequence[str]) -> StageLayout:
    """The layout of a model described by its parts: the ``before`` modules run in order on
    the input, each block on the hidden states alone, the ``after`` modules in order."""
    def in_order(paths):
        return lambda piece, x: _chain(piece, paths, x)
    return StageLayout(tuple(before), blocks, tuple(after), in_order(before),
                       lambda piece, block, x, length: block(x), in_order(after))


def _chain(piece: nn.Module, paths: Sequence[str], x: torch.Tensor) -> torch.Tensor:
    for path in paths:
        x = piece.get_submodule(path)(x)
    return x


class _Piece(nn.Module):
    """One block of the model with what runs around it, holding the model's submodules at
    their paths in the model (``state_dict`` keys are the model's)."""

    def __init__(self, model: nn.Module, paths: Sequence[str], run: Callable[[nn.Module, torch.Tensor], torch.Tensor]
                 ) -> None:
        super().__init__()
        for path in paths:
            node = self
            *parents, leaf = path.split(".")
            for name in parents:
                if name not in node._modules:
                    node.add_module(name, nn.Module())
                node = node._modules[name]
            node.add_module(leaf, model.get_submodule(path))
        self._run = run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(self, x)


class SplitStage(PipelineStage):
    """A :class:`PipelineStage` of a model cut by :func:`split`: its ``state_dict`` uses the
    model's own keys (this rank's entries), and so do ``full_state_dict`` and checkpoints."""

    def __init__(self, pieces: Sequence[_Piece], process_set: ProcessSet, **options) -> None:
        super().__init__(pieces, process_set, **options)
        self._indexed = {_unindexed(indexed): indexed for indexed in super().state_dict(keep_vars=True)}
        self.tied_aliases = {_unindexed(copy): _unindexed(owner) for copy, owner in self.tied_aliases.items()}
        for tie in self.ties:
            tie.names = [_unindexed(name) for name in tie.names]
        self._register_state_dict_hook(_model_keys)
        self._register_load_state_dict_pre_hook(self._indexed_keys)

    def _indexed_keys(self, state_dict, prefix, *_):
        for name, indexed in self._indexed.items():
            if prefix + name in state_dict:
                state_dict[prefix + indexed] = state_dict.pop(prefix + name)


def _unindexed(key: str) -> str:
    return key.split(".", 1)[1]


def _model_keys(module, state_dict, prefix, local_metadata) -> None:
    """A state_dict hook: ``{prefix}{piece}.{key}`` becomes ``{prefix}{key}`` (in place: a
    parent module's ``state_dict`` keeps the dictionary it passed down)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + _unindexed(key[len(prefix):])] = state_dict.pop(key)


def split(model: nn.Module, process_set: ProcessSet, *, chunks: int = 1, split: Sequence[int] | None = None,
          balance: str | Sequence[float] = "parameters", sample: torch.Tensor | None = None,
          recompute: str | None = None, blocks: str | None = None, before: Sequence[str] = (),
          after: Sequence[str] = ()) -> SplitStage:
    """This rank's pipeline stage of ``model``: its share of the blocks (with ``chunks`` > 1,
    its interleaved virtual stages), the embeddings on the first stage, the final norm and the
    head on the last.  Run it with :class:`psrt.pp.Pipeline`: token ids go in on the first
    stage, ``loss_fn`` gets the head's output on the last.

    The model families :func:`psrt.tp.parallelize` knows need nothing more; for another model
    name its block list (``blocks="encoder.layers"``) and the modules before and after it,
    each then called on one tensor.  Every rank builds (or loads, or leaves on the meta
    device) the whole model first; ``tp.parallelize`` comes before ``split``.

    The cut: ``split`` gives the number of blocks per virtual stage; otherwise ``balance``
    evens out the blocks' parameter counts (``"parameters"``), costs you give (one number
    per block, the same on every rank), or ``"measured"`` ones: every rank times each
    block's forward and backward on ``sample`` (a batch of token ids) and all take world
    rank 0's times.  The stages check that they cut alike at the pipeline's first step.

    Collective with ``balance="measured"``: every rank of the world calls it, in the same
    order.  Otherwise ``split`` does not communicate.
    """
    if not isinstance(process_set, ProcessSet):
        raise ArgumentTypeError(f"process_set must be the pipeline ProcessSet, got {type(process_set).__name__}")
    if blocks is not None:
        layout = named_layout(before, blocks, after)
    else:
        family = models.family_of(model)
        if family is None:
            raise InvalidArgumentError(f"pp.split does not know this model ({type(model).__name__}): name its parts, "
                                       "e.g. pp.split(model, pp_set, blocks='layers', before=['embed'], "
                                       f"after=['norm', 'head']); psrt knows {', '.join(models.known())}")
        layout = family.layout(model)
    block_list = _block_list(model, layout)
    virtual = process_set.size() * chunks if isinstance(chunks, int) else 0
    if len(block_list) < virtual:
        raise InvalidArgumentError(f"the model has {len(block_list)} blocks ({layout.blocks}), fewer than the "
                                   f"{process_set.size()} pipeline stages × {chunks} chunks it would fill")
    tp = getattr(model, "psrt_tp", None)
    sequence_parts = tp.size if tp is not None and tp.sequence_parallel else 1
    pieces = [_piece(model, layout, index, len(block_list), sequence_parts) for index in range(len(block_list))]
    if not (isinstance(balance, str) and balance == "parameters"):
        if split is not None:
            raise InvalidArgumentError("give split (blocks per stage) or balance, not both")
        costs = _costs(balance, pieces, sample, process_set)
        split = [len(r) for r in balanced_split(costs, virtual)]
    return SplitStage(pieces, process_set, chunks=chunks, split=split, recompute=recompute)


def _costs(balance: str | Sequence[float], pieces: Sequence[_Piece], sample: torch.Tensor | None,
           process_set: ProcessSet) -> list[float]:
    """One cost per block: given, or measured here and taken from world rank 0 (over the world's
    direct group, from the topology the pipeline set is registered with)."""
    if isinstance(balance, str):
        if balance != "measured":
            raise InvalidArgumentError(f"balance must be 'parameters', 'measured' or one cost per block, got {balance!r}")
        if not isinstance(sample, torch.Tensor):
            raise InvalidArgumentError("balance='measured' needs sample=, a batch of token ids to time the blocks on")
        topology = process_set.topology
        world = topology.direct(topology.process_set(0))
        return world.allgather_object(_measure(pieces, sample), label="psrt.pp.split.costs")[0]
    costs = list(balance)
    if len(costs) != len(pieces) or not all(isinstance(c, (int, float)) and c >= 0 for c in costs):
        raise InvalidArgumentError(f"balance needs one non-negative cost per block ({len(pieces)}), got {balance!r}")
    return costs


def _measure(pieces: Sequence[_Piece], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each block's fastest forward and backward of ``repeats``, on the previous block's output."""
    costs, x = [], sample
    for piece in pieces:
        x = x.detach().requires_grad_(x.is_floating_point())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = piece(x)
            y.sum().backward()
            times.append(time.perf_counter() - start)
        costs.append(min(times))
        x = y
    for piece in pieces:
        for param in piece.parameters():
            param.grad = None
    return costs


def _block_list(model: nn.Module, layout: StageLayout) -> list[nn.Module]:
    for path in (*layout.before, layout.blocks, *layout.after, *layout.shared):
        try:
            model.get_submodule(path)
        except AttributeError:
            raise InvalidArgumentError(f"the model has no module {path!r}") from None
    found = model.get_submodule(layout.blocks)
    if not isinstance(found, (nn.ModuleList, nn.Sequential)) or not len(found):
        raise InvalidArgumentError(f"{layout.blocks!r} must be a non-empty ModuleList or Sequential of blocks, "
                                   f"got {type(found).__name__}")
    return list(found)


def _piece(model: nn.Module, layout: StageLayout, index: int, count: int, sequence_parts: int) -> _Piece:
    first, last = index == 0, index == count - 1
    block_path = f"{layout.blocks}.{index}"
    paths = [*(layout.before if first else ()), *layout.shared, block_path, *(layout.after if last else ())]

    def run(piece: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if first:
            x = layout.embed(piece, x)
        # past the first block, the hidden states hold one block of the sequence under sequence parallelism
        length = x.shape[1] * (1 if first else sequence_parts) if x.dim() > 1 else 0
        x = layout.run_block(piece, piece.get_submodule(block_path), x, length)
        return layout.head(piece, x) if last else x
    return _Piece(model, paths, run)
