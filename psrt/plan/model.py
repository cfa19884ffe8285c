"""What the planner knows of a model: its blocks, in the order a pipeline cuts them.

psrt's pipeline cuts a model given as a list of blocks (the tiny GPT's is
``[embedding, layer × L, head]``), so the planner describes a model the same
way.  Two descriptions:

* :class:`Transformer`: a GPT-style decoder built from psrt's tensor-parallel
  blocks (:class:`psrt.tp.ParallelTransformerBlock`, the tiny GPT's embedding
  and head).  Its shapes give parameter counts at any TP size, activation bytes
  and FLOPs.
* :class:`ParameterBlocks`: any other model, known only by the parameter count
  of each block.  It cannot be split over TP ranks, and its activations are not
  modelled (reported as zero, and said so).

Build one from figures, or with :mod:`psrt.plan.readers` from the tiny GPT's config, a
``transformers`` config or a ``torch.nn.Module``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Union

from psrt.errors import ArgumentTypeError, InvalidArgumentError


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be at least 1, got {value}")
    return value


def padded(size: int, parts: int) -> int:
    """``size`` rounded up to a multiple of ``parts`` (psrt pads a vocabulary the TP size does not divide)."""
    return -(-size // parts) * parts


@dataclass(frozen=True)
class Transformer:
    """A decoder of ``layers`` pre-norm blocks of width ``hidden`` with ``heads`` heads and an MLP
    of ``ffn_hidden`` (default ``mlp_ratio`` × hidden), a token embedding over ``vocab``, and
    an untied output projection (``tied_embeddings`` drops it).

    Two kinds of block.  GPT's (psrt's :class:`psrt.tp.ParallelTransformerBlock`): LayerNorm,
    biases, a GELU MLP of two matrices, learned positions up to ``sequence_length``.  With
    ``swiglu``, Llama's: RMSNorm, no biases, a SwiGLU MLP of three matrices (gate, up, down),
    rotary positions (no table).  ``swiglu`` left None means SwiGLU exactly when
    ``ffn_hidden`` is given or ``mlp_ratio`` is not a whole number (Llama 3's 14336 = 3.5 ×
    4096); ``ffn_hidden``, ``mlp_ratio`` and ``swiglu`` then hold the resolved values.

    ``kv_heads`` (default: ``heads``) is the number of key/value heads of grouped-query
    attention: k and v project to ``kv_heads`` heads, and TP must divide them too.
    ``dropout`` says whether the blocks drop out (the tiny GPT's ``dropout`` > 0: on the
    attention probabilities and on both residual branches).  Then psrt computes attention
    unfused and keeps the [batch, heads, sequence, sequence] probabilities and their mask for
    backward; without, torch's fused kernel keeps only q, k, v, the output and the log-sum-exp.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    sequence_length: int
    mlp_ratio: float = 4
    dropout: bool = False
    tied_embeddings: bool = False
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    swiglu: bool | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "sequence_length"):
            _positive_int(name, getattr(self, name))
        self._resolve_mlp()
        if self.hidden % self.heads:
            raise InvalidArgumentError(f"hidden size ({self.hidden}) is not divisible by the number of heads "
                                       f"({self.heads})")
        if self.kv_heads is not None and (_positive_int("kv_heads", self.kv_heads) > self.heads
                                          or self.heads % self.kv_heads):
            raise InvalidArgumentError(f"kv_heads ({self.kv_heads}) must divide the number of heads ({self.heads})")

    def _resolve_mlp(self) -> None:
        ratio = self.mlp_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
            raise InvalidArgumentError(f"mlp_ratio must be a positive number, got {ratio!r}")
        if self.ffn_hidden is None:
            if (ratio * self.hidden) % 1:
                raise InvalidArgumentError(f"mlp_ratio {ratio} × hidden {self.hidden} is not a whole MLP width: give "
                                           "ffn_hidden (--ffn-hidden)")
            ffn = int(ratio * self.hidden)
        else:
            ffn = _positive_int("ffn_hidden", self.ffn_hidden)
        swiglu = self.swiglu
        if swiglu is None:
            swiglu = self.ffn_hidden is not None or float(ratio) != int(ratio)
        if not isinstance(swiglu, bool):
            raise ArgumentTypeError(f"swiglu must be a bool or None, got {type(swiglu).__name__}")
        ratio = ffn / self.hidden
        object.__setattr__(self, "ffn_hidden", ffn)
        object.__setattr__(self, "swiglu", swiglu)
        object.__setattr__(self, "mlp_ratio", int(ratio) if ratio == int(ratio) else ratio)

    @property
    def _qkv(self) -> int:
        """Output features of the q, k and v projections together."""
        kv = self.hidden // self.heads * (self.kv_heads or self.heads)
        return self.hidden + 2 * kv

    @property
    def block_names(self) -> list[str]:
        return ["embedding"] + [f"layer {i}" for i in range(self.layers)] + ["head"]

    def block_kinds(self) -> list[str]:
        return ["embedding"] + ["layer"] * self.layers + ["head"]

    @property
    def mlp_matrices(self) -> int:
        """Matrices of the MLP: fc1 and fc2, or gate, up and down."""
        return 3 if self.swiglu else 2

    def layer_params(self, tp: int = 1) -> int:
        """One block's parameters on one of ``tp`` ranks: the projections (and, in GPT's block,
        the column-parallel biases) are split; the norms (and the row-parallel biases) are
        replicated."""
        h, f = self.hidden, self.ffn_hidden
        if self.swiglu:
            return (self._qkv * h + h * h + 3 * f * h) // tp + 2 * h
        split = self._qkv * h + self._qkv + h * h + f * h + f + h * f
        return split // tp + 2 * h + h + 2 * h + h

    def embedding_params(self, tp: int = 1) -> int:
        positions = 0 if self.swiglu else self.sequence_length * self.hidden
        return padded(self.vocab, tp) // tp * self.hidden + positions

    def head_params(self, tp: int = 1) -> int:
        projection = 0 if self.tied_embeddings else padded(self.vocab, tp) // tp * self.hidden
        return (1 if self.swiglu else 2) * self.hidden + projection

    def block_params(self, tp: int = 1) -> list[int]:
        """Parameters of each block on one of ``tp`` ranks, in pipeline order."""
        return [self.embedding_params(tp)] + [self.layer_params(tp)] * self.layers + [self.head_params(tp)]

    def largest_unit(self, tp: int = 1) -> int:
        """Parameters of the largest module owning parameters directly (what ZeRO-3 gathers at once)."""
        h, f, v = self.hidden, self.ffn_hidden, padded(self.vocab, tp) // tp
        if self.swiglu:
            return max(self._qkv * h // tp, h * h // tp, f * h // tp, v * h)
        return max((self._qkv * h + self._qkv) // tp, h * h // tp + h, (f * h + f) // tp, h * f // tp + h, v * h,
                   self.sequence_length * h)

    @property
    def params(self) -> int:
        return sum(self.block_params(1))

    def tp_problem(self, tp: int) -> str | None:
        """Why the blocks cannot be split over ``tp`` ranks, or None."""
        if self.heads % tp:
            return f"tp={tp} does not divide the {self.heads} attention heads"
        if (self.kv_heads or self.heads) % tp:
            return f"tp={tp} does not divide the {self.kv_heads} key/value heads"
        if self.ffn_hidden % tp:
            return f"tp={tp} does not divide the MLP width ({self.ffn_hidden})"
        return None

    def cp_problem(self, cp: int) -> str | None:
        """Why the sequence cannot be split over ``cp`` ranks (zig-zag: 2·cp parts), or None."""
        if cp > 1 and self.sequence_length % (2 * cp):
            return f"cp={cp} needs a sequence length divisible by {2 * cp} (zig-zag halves), got {self.sequence_length}"
        return None

    def describe(self) -> str:
        tied = ", tied embeddings" if self.tied_embeddings else ""
        dropout = ", dropout" if self.dropout else ""
        kv = f" ({self.kv_heads} key/value)" if self.kv_heads not in (None, self.heads) else ""
        mlp = f"{'SwiGLU' if self.swiglu else 'GELU'} MLP {self.ffn_hidden}"
        return (f"transformer: {self.params / 1e6:.4g} M parameters, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads{kv}, {mlp}, vocabulary {self.vocab}, sequence {self.sequence_length}{tied}"
                f"{dropout}")


@dataclass(frozen=True)
class ParameterBlocks:
    """A model known only by the parameter count of each of its blocks (pipeline order) and of its
    largest module.  One sample is ``sequence_length`` tokens (1: a row), each of which
    passes through every parameter: 6 FLOPs per parameter and token forward and backward.
    TP is not possible (how the blocks would split is unknown) and activations are not
    modelled."""

    sizes: tuple[int, ...]
    largest: int = 0
    sequence_length: int = 1

    def __post_init__(self) -> None:
        if not self.sizes:
            raise InvalidArgumentError("a model needs at least one block with parameters")
        for size in self.sizes:
            _positive_int("a block's parameter count", size)
        _positive_int("sequence_length", self.sequence_length)
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if not self.largest:
            object.__setattr__(self, "largest", max(self.sizes))

    @classmethod
    def uniform(cls, params: int, layers: int = 1, sequence_length: int = 1) -> ParameterBlocks:
        """``params`` parameters cut into ``layers`` equal blocks, samples of ``sequence_length`` tokens."""
        _positive_int("params", params)
        _positive_int("layers", layers)
        if layers > params:
            raise InvalidArgumentError(f"{layers} layers cannot share {params} parameters")
        return cls(tuple(params // layers + (1 if i < params % layers else 0) for i in range(layers)),
                   sequence_length=sequence_length)

    @property
    def layers(self) -> int:
        return len(self.sizes)

    @property
    def block_names(self) -> list[str]:
        return [f"block {i}" for i in range(len(self.sizes))]

    def block_kinds(self) -> list[str]:
        return ["dense"] * len(self.sizes)

    def block_params(self, tp: int = 1) -> list[int]:
        return list(self.sizes)

    def largest_unit(self, tp: int = 1) -> int:
        return self.largest

    @property
    def params(self) -> int:
        return sum(self.sizes)

    def tp_problem(self, tp: int) -> str | None:
        return None if tp == 1 else (f"tp={tp}: the model is known only by its parameter counts, so how its "
                                     "layers would split over TP ranks is unknown (describe it as a transformer)")

    def cp_problem(self, cp: int) -> str | None:
        return None if cp == 1 else f"cp={cp}: the model has no sequence to split (describe it as a transformer)"

    def describe(self) -> str:
        tokens = f", samples of {self.sequence_length} tokens" if self.sequence_length > 1 else ""
        return (f"{self.params / 1e6:.4g} M parameters in {len(self.sizes)} blocks{tokens} "
                "(activations not modelled: give the architecture for them)")


Model = Union[Transformer, ParameterBlocks]


def stage_key(model: Model, tp: int, blocks: range) -> tuple:
    """What the memory and cost of a pipeline stage depend on: how many blocks of each kind and
    size it holds, and whether it holds the first or the last block (stages alike share it)."""
    kinds, sizes = model.block_kinds(), model.block_params(tp)
    counts = Counter((kinds[i], sizes[i]) for i in blocks)
    return tuple(sorted(counts.items())), blocks[0] == 0, blocks[-1] == len(kinds) - 1
