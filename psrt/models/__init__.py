"""What psrt knows of the model families it parallelizes without a plan from the user.

A family is a small value (:class:`Family`): how to recognise it from module names, the
head counts tensor parallelism must divide, its tensor-parallel plan, the fix-ups its
modules need once split, and where its parts are for the pipeline.  The generic machinery
lives in :mod:`psrt.tp.rewrite` and :mod:`psrt.pp.cut`; a new family is a new module
here, not a new code path there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from psrt.models.stage_layout import StageLayout
from psrt.models.tp_styles import TpPlan


@dataclass(frozen=True)
class Family:
    name: str
    matches: Callable[[nn.Module], bool]
    check_heads: Callable[[nn.Module, int], None]   # raises before anything changes
    tp_plan: Callable[..., TpPlan]                    # tp_plan(loss_parallel=...)
    after_tp: Callable[[nn.Module, int], None]      # attributes the split modules' callers read
    layout: Callable[[nn.Module], StageLayout]


def _families() -> list[Family]:
    from psrt.models import gpt2, llama
    return [gpt2.FAMILY, llama.FAMILY]


def known() -> list[str]:
    return [family.name for family in _families()]


def detect(model: nn.Module) -> Family | None:
    """The family whose module layout ``model`` has, if psrt knows it."""
    return next((family for family in _families() if family.matches(model)), None)


def family_of(model: nn.Module) -> Family | None:
    """The family ``tp.parallelize`` recognised, or the one the model's modules show now."""
    tp = getattr(model, "psrt_tp", None)
    if tp is not None and tp.family is not None:
        return next(family for family in _families() if family.name == tp.family)
    return detect(model)


def has(model: nn.Module, *paths: str) -> bool:
    """Whether every one of ``paths`` names a submodule of ``model``."""
    names = dict(model.named_modules())
    return all(path in names for path in paths)


class BlockInputs:
    """What a decoder block needs besides the hidden states (positions, attention masks,
    rotary tables), recomputed on a pipeline stage from the activation's shape as the model's
    own forward computes them once per forward.  They hold no gradient and depend only on the
    shape, so each is made once per (kind, batch, length, dtype, device), not once per block."""

    _KEEP = 16  # shapes remembered; a training run uses one or two

    def __init__(self) -> None:
        self._made: dict[tuple, object] = {}

    def get(self, kind: str, hidden: torch.Tensor, length: int, make: Callable[[torch.Tensor], object]):
        """``make(positions)`` for this shape, made the first time it is asked for."""
        key = (kind, hidden.shape[0], length, hidden.dtype, hidden.device)
        if key not in self._made:
            if len(self._made) >= self._KEEP:
                self._made.clear()
            with torch.no_grad():
                self._made[key] = make(torch.arange(length, device=hidden.device).unsqueeze(0))
        return self._made[key]


def causal_mask(make_mask: Callable, config: object, hidden: torch.Tensor, length: int,
                positions: torch.Tensor) -> object:
    """The model's own causal mask (``transformers.masking_utils``) for ``length`` tokens
    without padding; None where its attention needs none."""
    return make_mask(config=config, inputs_embeds=hidden.new_empty((hidden.shape[0], length, 0)),
                     attention_mask=None, past_key_values=None, position_ids=positions)
