"""A layout (how a job splits the model, the batch and the optimizer over its ranks) and the
precision it trains in, as plain values the memory and cost models read."""
from __future__ import annotations

from dataclasses import dataclass

from psrt.errors import InvalidArgumentError

#: Recomputation modes, as psrt's blocks and pipeline stages name them ("none" is psrt's None).
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """dp × tp × pp × cp ranks, ZeRO ``zero`` over the dp × cp ranks, ``micro_batches``
    micro-batches of ``micro_batch`` sequences per data-parallel replica and step (gradient
    accumulation, or the pipeline's micro-batches: 1F1B), ``recompute`` and, with tp > 1,
    ``sequence_parallel``."""

    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    micro_batch: int
    micro_batches: int
    recompute: str = "none"
    sequence_parallel: bool = False

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks holding the same parameters, over which gradients are reduced (ZeRO shards)."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        cp = f" cp{self.cp}" if self.cp > 1 else ""
        sp = "+sp" if self.sequence_parallel and self.tp > 1 else ""
        return (f"dp{self.dp} tp{self.tp}{sp} pp{self.pp}{cp} zero{self.zero} "
                f"mb{self.micro_batch}x{self.micro_batches} {self.recompute}")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a rank holds: compute parameters and gradients, an fp32 master
    copy (0 where the parameters are the master), the optimizer's state per element, and
    activations.  The presets are what psrt's optimizers hold: :data:`PRECISIONS`."""

    name: str
    param: int
    grad: int
    master: int
    state: int
    activation: int


#: ``fp32``: psrt's default (no ``compute_dtype``): Adam(W) keeps two fp32 moments beside fp32
#: parameters and gradients, ZeRO's 4 + 4 + 8.  ``bf16``/``fp16``: ``ZeroOptimizer(compute_dtype=...)``
#: computes in 16 bits and keeps fp32 masters and moments on the owning shard, ZeRO's 2 + 2 + 12.
PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, master=0, state=8, activation=4),
    "bf16": Precision("bf16", param=2, grad=2, master=4, state=8, activation=2),
    "fp16": Precision("fp16", param=2, grad=2, master=4, state=8, activation=2),
}

#: Optimizer state per element of the master dtype (fp32).
OPTIMIZER_STATE = {"adam": 8, "sgd-momentum": 4, "sgd": 0}


def precision(name: str, optimizer: str = "adam") -> Precision:
    """The preset ``name`` with ``optimizer``'s state (Adam's two moments by default)."""
    if name not in PRECISIONS:
        raise InvalidArgumentError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    if optimizer not in OPTIMIZER_STATE:
        raise InvalidArgumentError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE)}, got {optimizer!r}")
    preset = PRECISIONS[name]
    return Precision(f"{name} {optimizer}", preset.param, preset.grad, preset.master, OPTIMIZER_STATE[optimizer],
                     preset.activation)
