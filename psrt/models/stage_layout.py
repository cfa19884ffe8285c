"""Where a decoder model's parts are for the pipeline: the stage layout each model family
provides (:mod:`psrt.models`) and :func:`psrt.pp.split` cuts at block boundaries.

"Layout" here means where a model's own modules are (its embedding, block list, head);
how a job spreads over ranks is the layout planner's (:class:`psrt.plan.Layout`).  A
value, as a tensor-parallel plan is (:mod:`psrt.models.tp_styles`): the families are
written in this vocabulary and the generic pipeline machinery consumes it, so neither the
families nor this module depend on that machinery.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

RunPart = Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (piece, tensor) -> tensor


@dataclass(frozen=True)
class StageLayout:
    """Where a decoder model's parts are and how each runs on a stage.

    ``before``/``after``: module paths run before and after the blocks; ``blocks``: the path
    of the block list; ``shared``: modules every block needs that hold no persistent state
    (rotary tables).  ``embed(piece, ids)`` and ``head(piece, hidden)`` run the parts around
    the blocks; ``run_block(piece, block, hidden, length)`` one block, ``length`` being the
    whole sequence's (the hidden states may hold one block of it under sequence parallelism).
    """

    before: tuple[str, ...]
    blocks: str
    after: tuple[str, ...]
    embed: RunPart
    run_block: Callable[[nn.Module, nn.Module, torch.Tensor, int], torch.Tensor]
    head: RunPart
    shared: tuple[str, ...] = ()
