"""A tensor-parallel plan: which submodules of an existing model become which kind of
tensor-parallel layer, as a plain value that can be printed, compared and tested before
:func:`psrt.tp.parallelize` applies it.

A plan maps module-name patterns (``fnmatch`` patterns over ``model.named_modules()``
names, ``*`` matching any run of characters) to a style.  The first pattern that matches a
module decides its style; a pattern that matches nothing is an error.

Sequence parallelism needs to know where the sequence-split region starts and ends, since
an existing model's ``forward`` decides how its modules are called: :class:`SequenceScatter`
splits a module's input along the sequence (the first block), :class:`SequenceGather` joins
a module's input back (the attention and the MLP, whose column-parallel layers then take the
joined input as it is), ``SequenceParallel(gather_output=True)`` a norm's output (the final
norm before the output head).
Without ``sequence_parallel`` those two styles do nothing.

The styles are the vocabulary the model families (:mod:`psrt.models`) write their plans in
and :mod:`psrt.tp` applies, so they sit here, below both: a family never imports the
machinery that applies it (``psrt.tp`` re-exports the styles, the names users write plans
with).  The type of a plan is :data:`TpPlan`; the layout planner's results
(:class:`psrt.plan.Plan`) are another thing.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Union

from torch import nn

from psrt.errors import InvalidArgumentError


@dataclass(frozen=True)
class ColumnWise:
    """A ``Linear`` (or ``transformers``' ``Conv1D``) whose output features are split.

    ``stride`` > 1: the outputs are that many fused parts (GPT-2's ``c_attn`` holds q, k and
    v: stride 3), each split on its own.  ``gather_output``: the full output is gathered
    (an output head whose logits the caller reads whole).  ``pad``: outputs the TP size does
    not divide are padded with zero rows (an output head over an odd vocabulary)."""

    stride: int = 1
    gather_output: bool = False
    pad: bool = False


@dataclass(frozen=True)
class RowWise:
    """A ``Linear`` (or ``Conv1D``) whose input features are split: it takes a column-wise
    layer's split output, and its partial products are summed (reduce-scattered along the
    sequence under sequence parallelism)."""


@dataclass(frozen=True)
class VocabEmbedding:
    """An ``Embedding`` whose vocabulary rows are split (padded up to a multiple of the TP size)."""


@dataclass(frozen=True)
class SequenceParallel:
    """A norm or dropout with replicated parameters.  Under sequence parallelism it runs on
    this rank's block of the sequence: a norm's weight gradients are summed over the TP set,
    a dropout draws the whole sequence's mask and keeps its block (equal to one process).
    ``gather_output``: the sequence-split region ends at its output, which is gathered (the
    final norm before the output head)."""

    gather_output: bool = False


@dataclass(frozen=True)
class SequenceScatter:
    """Under sequence parallelism, this module's input is split along the sequence here
    (the first block of the model: where the sequence-split region starts)."""


@dataclass(frozen=True)
class SequenceGather:
    """Under sequence parallelism, this module's input is gathered along the sequence (an
    attention or an MLP); the column-wise layers inside take it as it is."""


@dataclass(frozen=True)
class Replicated:
    """Left as it is: every TP rank holds and runs the whole module."""


Style = Union[ColumnWise, RowWise, VocabEmbedding, SequenceParallel, SequenceScatter, SequenceGather, Replicated]
TpPlan = Mapping[str, Style]
STYLES = (ColumnWise, RowWise, VocabEmbedding, SequenceParallel, SequenceScatter, SequenceGather, Replicated)


def resolve(model: nn.Module, plan: TpPlan) -> dict[str, Style]:
    """Each planned module's name and style, in the model's module order: the first pattern
    that matches decides.  A pattern matching no module, or a style that is not one of this
    module's, is an error naming it (before anything is changed)."""
    if not isinstance(plan, Mapping):
        raise InvalidArgumentError(f"plan must be 'auto' or a mapping of module-name patterns to styles, got "
                                   f"{type(plan).__name__}")
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in plan.items():
        if not isinstance(style, STYLES):
            raise InvalidArgumentError(f"plan entry {pattern!r}: {style!r} is not a style; use one of "
                                       f"{', '.join('tp.' + s.__name__ for s in STYLES)}")
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise InvalidArgumentError(f"plan entry {pattern!r} matches no module of the model; its modules "
                                       f"include {', '.join(_closest(pattern, names))}")
    styles = {}
    for name in names:
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is not None:
            styles[name] = style
    return styles


def _closest(pattern: str, names: list[str], count: int = 6) -> list[str]:
    """The module names sharing the longest dotted suffix with ``pattern``, for the error."""
    leaf = pattern.rsplit(".", 1)[-1]
    alike = [n for n in names if n.rsplit(".", 1)[-1] == leaf] or names
    return [repr(n) for n in alike[:count]]


def describe(model: nn.Module) -> str:
    """The model's ``Linear``, ``Conv1D`` and ``Embedding`` modules, and how to write a plan
    for them: the message of an unknown model given ``plan="auto"``."""
    kinds = (nn.Linear, nn.Embedding)
    rows = [f"  {name}: {type(m).__name__}{tuple(m.weight.shape)}" for name, m in model.named_modules()
            if isinstance(m, kinds) or type(m).__name__ == "Conv1D"]
    shown = rows[:12] + ([f"  ... and {len(rows) - 12} more"] if len(rows) > 12 else [])
    return ("its Linear/Embedding modules are:\n" + "\n".join(shown) + "\nwrite the plan yourself, for example "
            "plan={'layers.*.attn.q_proj': tp.ColumnWise(), 'layers.*.attn.out_proj': tp.RowWise(), "
            "'embed': tp.VocabEmbedding(), 'head': tp.ColumnWise(gather_output=True, pad=True)}")
