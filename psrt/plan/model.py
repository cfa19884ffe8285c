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

Build one from figures, from the tiny GPT's config (:func:`from_config`), or
from a ``torch.nn.Module`` (:func:`from_module`).
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
    of ``mlp_ratio`` × hidden, a token embedding over ``vocab`` and learned positions up to
    ``sequence_length``, and an untied output projection (``tied_embeddings`` drops it).

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
    mlp_ratio: int = 4
    dropout: bool = False
    tied_embeddings: bool = False
    kv_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "sequence_length", "mlp_ratio"):
            _positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise InvalidArgumentError(f"hidden size ({self.hidden}) is not divisible by the number of heads "
                                       f"({self.heads})")
        if self.kv_heads is not None and (_positive_int("kv_heads", self.kv_heads) > self.heads
                                          or self.heads % self.kv_heads):
            raise InvalidArgumentError(f"kv_heads ({self.kv_heads}) must divide the number of heads ({self.heads})")

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

    def layer_params(self, tp: int = 1) -> int:
        """One block's parameters on one of ``tp`` ranks: q/k/v, fc1 and their biases and the
        weights of the two row-parallel projections are split; LayerNorms and the
        row-parallel biases are replicated."""
        h, f = self.hidden, self.mlp_ratio * self.hidden
        split = self._qkv * h + self._qkv + h * h + f * h + f + h * f
        return split // tp + 2 * h + h + 2 * h + h

    def embedding_params(self, tp: int = 1) -> int:
        return padded(self.vocab, tp) // tp * self.hidden + self.sequence_length * self.hidden

    def head_params(self, tp: int = 1) -> int:
        projection = 0 if self.tied_embeddings else padded(self.vocab, tp) // tp * self.hidden
        return 2 * self.hidden + projection

    def block_params(self, tp: int = 1) -> list[int]:
        """Parameters of each block on one of ``tp`` ranks, in pipeline order."""
        return [self.embedding_params(tp)] + [self.layer_params(tp)] * self.layers + [self.head_params(tp)]

    def largest_unit(self, tp: int = 1) -> int:
        """Parameters of the largest module owning parameters directly (what ZeRO-3 gathers at once)."""
        h, f, v = self.hidden, self.mlp_ratio * self.hidden, padded(self.vocab, tp) // tp
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
        if self.mlp_ratio * self.hidden % tp:
            return f"tp={tp} does not divide the MLP width ({self.mlp_ratio * self.hidden})"
        return None

    def cp_problem(self, cp: int) -> str | None:
        """Why the sequence cannot be split over ``cp`` ranks (zig-zag: 2·cp parts), or None."""
        if cp > 1 and self.sequence_length % (2 * cp):
            return f"cp={cp} needs a sequence length divisible by {2 * cp} (zig-zag halves), got {self.sequence_length}"
        return None

    def describe(self) -> str:
        tied = ", tied embeddings" if self.tied_embeddings else ""
        dropout = ", dropout" if self.dropout else ""
        return (f"transformer: {self.params / 1e6:.3g} M parameters, {self.layers} layers, hidden {self.hidden}, "
                f"{self.heads} heads, vocabulary {self.vocab}, sequence {self.sequence_length}{tied}{dropout}")


@dataclass(frozen=True)
class ParameterBlocks:
    """A model known only by the parameter count of each of its blocks (pipeline order) and of its
    largest module; one sample is one row (``sequence_length`` 1).  TP is not possible (how
    the blocks would split is unknown) and activations are not modelled."""

    sizes: tuple[int, ...]
    largest: int = 0

    def __post_init__(self) -> None:
        if not self.sizes:
            raise InvalidArgumentError("a model needs at least one block with parameters")
        for size in self.sizes:
            _positive_int("a block's parameter count", size)
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if not self.largest:
            object.__setattr__(self, "largest", max(self.sizes))

    @classmethod
    def uniform(cls, params: int, layers: int = 1) -> ParameterBlocks:
        """``params`` parameters cut into ``layers`` equal blocks."""
        _positive_int("params", params)
        _positive_int("layers", layers)
        if layers > params:
            raise InvalidArgumentError(f"{layers} layers cannot share {params} parameters")
        return cls(tuple(params // layers + (1 if i < params % layers else 0) for i in range(layers)))

    @property
    def layers(self) -> int:
        return len(self.sizes)

    @property
    def sequence_length(self) -> int:
        return 1

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
        return (f"{self.params / 1e6:.3g} M parameters in {len(self.sizes)} blocks "
                "(activations not modelled: give the architecture for them)")


Model = Union[Transformer, ParameterBlocks]


def stage_key(model: Model, tp: int, blocks: range) -> tuple:
    """What the memory and cost of a pipeline stage depend on: how many blocks of each kind and
    size it holds, and whether it holds the first or the last block (stages alike share it)."""
    kinds, sizes = model.block_kinds(), model.block_params(tp)
    counts = Counter((kinds[i], sizes[i]) for i in blocks)
    return tuple(sorted(counts.items())), blocks[0] == 0, blocks[-1] == len(kinds) - 1


def from_config(config: object) -> Transformer:
    """The tiny GPT's ``GPTConfig`` (``examples/tiny_gpt.py``), or any object with the same
    fields (``vocab_size``, ``sequence_length``, ``dim``, ``heads``, ``layers``)."""
    missing = [name for name in ("vocab_size", "sequence_length", "dim", "heads", "layers")
               if not hasattr(config, name)]
    if missing:
        raise ArgumentTypeError(f"a model config needs the fields vocab_size, sequence_length, dim, heads and "
                                f"layers; {type(config).__name__} lacks {', '.join(missing)}")
    if getattr(config, "experts", 0):
        raise InvalidArgumentError("the planner does not model mixture-of-experts layers (experts > 0)")
    return Transformer(layers=config.layers, hidden=config.dim, heads=config.heads, vocab=config.vocab_size,
                       sequence_length=config.sequence_length, dropout=getattr(config, "dropout", 0.0) > 0,
                       tied_embeddings=bool(getattr(config, "tie_embeddings", False)))


def from_hf_config(path: str, sequence_length: int) -> Transformer:
    """A ``transformers`` decoder's ``config.json`` (or the directory holding it), GPT-2's
    names or the Llama layout's.  A gated MLP (three matrices of ``intermediate_size``) is
    counted as the two-matrix MLP of the same parameters, the nearest this model has."""
    import json
    import os

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a transformers config from {path}: {exc}") from None
    def field(*names):
        found = next((config[n] for n in names if config.get(n) is not None), None)
        if found is None:
            raise InvalidArgumentError(f"{file} has none of {', '.join(names)}: not a decoder psrt plan can describe")
        return found
    hidden = field("hidden_size", "n_embd")
    gated = "intermediate_size" in config and config.get("model_type") != "gpt2"
    intermediate = config.get("intermediate_size") or config.get("n_inner") or 4 * hidden
    return Transformer(layers=field("num_hidden_layers", "n_layer"), hidden=hidden,
                       heads=field("num_attention_heads", "n_head"), vocab=field("vocab_size"),
                       sequence_length=sequence_length, mlp_ratio=max(1, round((3 if gated else 2) * intermediate
                                                                               / (2 * hidden))),
                       tied_embeddings=bool(config.get("tie_word_embeddings", True)),
                       kv_heads=config.get("num_key_value_heads"))


def from_module(module: object) -> ParameterBlocks:
    """A ``torch.nn.Module`` as parameter counts: one block per child of a ``Sequential`` or
    ``ModuleList`` at its top (the module itself otherwise), trainable parameters only, each
    shared parameter counted once.  For activations and TP, describe a transformer with
    :class:`Transformer` or :func:`from_config` instead."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ArgumentTypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    children = list(module) if isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList)) else [module]
    seen: set[int] = set()
    sizes = []
    for child in children:
        count = 0
        for param in child.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                count += param.numel()
        if count:
            sizes.append(count)
    if not sizes:
        raise InvalidArgumentError(f"{type(module).__name__} has no trainable parameters")
    largest = max(sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad) for m in module.modules())
    return ParameterBlocks(tuple(sizes), largest)


def as_model(model: object) -> Model:
    """Whatever :func:`psrt.plan.layouts` was given, as a model description."""
    if isinstance(model, (Transformer, ParameterBlocks)):
        return model
    if hasattr(model, "vocab_size") and hasattr(model, "dim"):
        return from_config(model)
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of psrt
        torch = None
    if torch is not None and isinstance(model, torch.nn.Module):
        return from_module(model)
    raise ArgumentTypeError(f"model must be a psrt.plan.Transformer, a psrt.plan.ParameterBlocks, the tiny GPT's "
                            f"GPTConfig or a torch.nn.Module, got {type(model).__name__}")
