"""Activation recomputation: keep a function's inputs, run it again in backward.

Built on ``torch.utils.checkpoint`` (non-reentrant), which already replays torch's
default generators; this adds the tensor-parallel streams of
:func:`psrt.tp.random.rng_tracker`, so every dropout mask of the recomputation equals
the forward's.  Collectives inside the function (a TP block's all-reduces) run again in
the recomputation, on every rank of the set in the same order.

``RECOMPUTE_MODES`` are the choices layers and pipeline stages accept: ``None`` keeps
every activation, ``"full"`` keeps only a block's input, ``"selective"`` recomputes only
the attention core (the scores, softmax and dropout, whose size grows with the square of
the sequence), as Megatron-LM and the Ultra-Scale Playbook recommend.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils import checkpoint as torch_checkpoint

from psrt.errors import InvalidArgumentError
from psrt.tp.random import rng_tracker

RECOMPUTE_MODES = (None, "full", "selective")


def check_mode(recompute: object, allowed: tuple = RECOMPUTE_MODES) -> str | None:
    if recompute not in allowed:
        raise InvalidArgumentError(f"recompute must be one of {', '.join(map(repr, allowed))}, got {recompute!r}")
    return recompute


class _Record(contextlib.AbstractContextManager):
    """Entered around the forward: records the tracker's states."""

    def __init__(self) -> None:
        self.states: dict = {}

    def __enter__(self) -> None:
        self.states = rng_tracker().get_states()

    def __exit__(self, *exc) -> None:
        return None


class _Replay(contextlib.AbstractContextManager):
    """Entered around each recomputation (one per backward that needs it: a split backward
    recomputes twice): runs with the recorded states and puts the current ones back."""

    def __init__(self, record: _Record) -> None:
        self.record, self.current = record, None

    def __enter__(self) -> None:
        self.current = rng_tracker().get_states()
        rng_tracker().set_states(self.record.states)

    def __exit__(self, *exc) -> None:
        rng_tracker().set_states(self.current)


def _tracker_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The forward's context and the recomputation's, sharing what the first records."""
    record = _Record()
    return record, _Replay(record)


def checkpoint(function: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """``function(*args)``, keeping only ``args`` for backward when gradients are on."""
    if not torch.is_grad_enabled():
        return function(*args)
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                       context_fn=_tracker_contexts)
