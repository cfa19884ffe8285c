"""Model descriptions from what a user already has: the tiny GPT's config, a ``transformers``
config, a ``torch.nn.Module``, or whatever :func:`psrt.plan.layouts` was given."""
from __future__ import annotations

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.plan.model import Model, ParameterBlocks, Transformer


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
    names or the Llama layout's: a gated MLP of ``intermediate_size`` is a SwiGLU block,
    ``num_key_value_heads`` its key/value heads."""
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
                       sequence_length=sequence_length, ffn_hidden=intermediate, swiglu=gated,
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
