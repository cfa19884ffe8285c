"""Tensor (and sequence) parallelism applied to a model psrt did not write.

:func:`parallelize` rewrites the planned submodules of an existing model in place into
psrt's tensor-parallel layers, each keeping this rank's slice of the weights the module
already holds, so ``model.state_dict()`` keeps its keys (with this rank's slices as
values) and the model is called as before.  Which module becomes what is a plan
(:mod:`psrt.models.tp_styles`); ``plan="auto"`` takes it from the model family
(:mod:`psrt.models`).  Every check runs before anything changes and before any
communication, so a bad plan or layout raises the same error on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from psrt import models
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.models.tp_styles import (ColumnWise, RowWise, SequenceGather, SequenceParallel, SequenceScatter, Style,
                                   TpPlan, VocabEmbedding, describe, resolve)
from psrt.tp import comm, regions
from psrt.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from psrt.tp.random import replicated_dropout
from psrt.tp.sharding import sharding_of
from psrt.topology import ProcessSet


@dataclass(frozen=True)
class TensorParallelism:
    """What :func:`parallelize` did to a model (``model.psrt_tp``): the TP set, whether the
    residual stream is split along the sequence, the resolved plan, the family it knew."""

    process_set: ProcessSet | None
    sequence_parallel: bool
    styles: dict[str, Style]
    family: str | None

    @property
    def size(self) -> int:
        return comm.group_size(self.process_set)


def parallelize(model: nn.Module, process_set: ProcessSet | None, plan: TpPlan | str = "auto", *,
                sequence_parallel: bool = False, loss_parallel: bool = False) -> nn.Module:
    """Split ``model``'s planned modules over the TP set ``process_set``, in place; returns it.

    Every rank of the set must start from the same weights (same seed, or the same checkpoint;
    a model on the meta device is split as it is and filled by
    :func:`psrt.pretrained.load_pretrained`).  With ``plan="auto"`` the family is recognised from
    ``config.model_type`` and the module names (GPT-2; the Llama layout: Llama, Mistral,
    Qwen2); the output head then returns
    full-vocabulary logits, or this rank's split of them with ``loss_parallel`` (for
    :func:`psrt.tp.vocab_parallel_cross_entropy`).  Call it on the whole model, before
    :func:`psrt.pp.split`.

    Collective when run: every rank of ``process_set`` runs the rewritten model's forward and
    backward in the same order.  ``parallelize`` itself does not communicate.
    """
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise ArgumentTypeError(f"process_set must be the tensor-parallel ProcessSet, got {type(process_set).__name__}")
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "psrt_tp", None) is not None:
        raise InvalidArgumentError("the model was already parallelized; build a fresh model to use another layout")
    size = comm.group_size(process_set)
    family = None
    if isinstance(plan, str):
        if plan != "auto":
            raise InvalidArgumentError(f"plan must be 'auto' or a mapping of module patterns to styles, got {plan!r}")
        family = models.detect(model)
        if family is None:
            raise InvalidArgumentError(f"plan='auto' does not know this model ({type(model).__name__}): psrt knows "
                                       f"{', '.join(models.known())}; {describe(model)}")
        family.check_heads(model, size)
        plan = family.tp_plan(loss_parallel=loss_parallel)
    elif loss_parallel:
        raise InvalidArgumentError("loss_parallel applies to plan='auto'; in your own plan, give the output head "
                                   "ColumnWise(gather_output=False, pad=True)")
    styles = resolve(model, plan)
    built, split = _build(model, styles, process_set, sequence_parallel)  # every check, before anything changes
    _check_no_stale_ties(model, split, built)
    for name, layer in built.items():
        _install(model, name, layer)
    if sequence_parallel and size > 1:
        _add_sequence_hooks(model, styles, process_set)
    if family is not None:
        family.after_tp(model, size)
    model.psrt_tp = TensorParallelism(process_set, sequence_parallel and size > 1, styles,
                                      None if family is None else family.name)
    return model


def _build(model: nn.Module, styles: dict[str, Style], process_set: ProcessSet | None,
           sequence_parallel: bool) -> tuple[dict[str, nn.Module], dict[int, str]]:
    """The TP layer replacing each split module, holding this rank's slices of its weights
    (parameters tied between modules stay one parameter); and the split parameters, by id,
    with the first module holding each."""
    adopted: dict[int, nn.Parameter] = {}
    built, split = {}, {}
    for name, style in styles.items():
        module = model.get_submodule(name)
        make = _MAKERS.get(type(style))
        if make is not None:
            try:
                built[name] = make(module, style, process_set, sequence_parallel, adopted)
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"{name} ({type(module).__name__}): {exc}") from None
            for param in module.parameters(recurse=False):
                if sharding_of(adopted.get(id(param))) is not None:
                    split.setdefault(id(param), name)
        elif sequence_parallel and isinstance(style, SequenceParallel) and isinstance(module, nn.Dropout):
            built[name] = _SequenceParallelDropout(module.p, process_set)
    return built, split


def _weight_of(module: nn.Module, kind: str) -> torch.Tensor:
    weight = getattr(module, "weight", None)
    if kind == "linear":
        ok = type(module) is nn.Linear or _is_conv1d(module)
    else:
        ok = type(module) is nn.Embedding
    if not ok or not isinstance(weight, torch.Tensor):
        wanted = "a Linear (or transformers' Conv1D)" if kind == "linear" else "an Embedding"
        subclass = (" (a subclass, whose forward may do more than the split layer would: leave it out of the plan)"
                    if isinstance(module, (nn.Linear, nn.Embedding)) else "")
        raise InvalidArgumentError(f"the plan makes it {wanted}'s split, but it is a {type(module).__name__}"
                                   f"{subclass}")
    return weight


def _is_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``: a linear layer whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _adopt(layer: nn.Module, attribute: str, full: torch.Tensor | None, adopted: dict[int, nn.Parameter],
           *, split: bool = True) -> None:
    """Give ``layer`` this rank's slice of an existing weight (or, ``split=False``, the weight
    itself): the one parameter already made for it if the model ties it to another module."""
    if full is None:
        return
    sharding = sharding_of(getattr(layer, attribute)) if split else None
    if id(full) in adopted:
        param = adopted[id(full)]
        if sharding_of(param) != sharding:
            raise InvalidArgumentError(f"its {attribute} is tied to another planned module that splits it "
                                       f"differently ({sharding_of(param)} against {sharding}); plan both alike")
    elif sharding is None:
        param = full if isinstance(full, nn.Parameter) else nn.Parameter(full)
    else:
        param = nn.Parameter(sharding.shard(full.detach()).clone(), requires_grad=full.requires_grad)
        param.tp_sharding = sharding
    adopted[id(full)] = param
    setattr(layer, attribute, param)


def _column(module, style: ColumnWise, process_set, sequence_parallel, adopted) -> ColumnParallelLinear:
    weight = _weight_of(module, "linear")
    conv = _is_conv1d(module)
    in_features, out_features = weight.shape if conv else weight.shape[::-1]
    layer = ColumnParallelLinear(in_features, out_features, module.bias is not None, process_set=process_set,
                                 gather_output=style.gather_output, stride=style.stride,
                                 pad_out_features=style.pad, transposed=conv, input_is_gathered=sequence_parallel,
                                 device="meta", dtype=weight.dtype)
    _adopt(layer, "weight", weight, adopted)
    _adopt(layer, "bias", module.bias, adopted)
    return layer


def _row(module, style: RowWise, process_set, sequence_parallel, adopted) -> RowParallelLinear:
    weight = _weight_of(module, "linear")
    conv = _is_conv1d(module)
    in_features, out_features = weight.shape if conv else weight.shape[::-1]
    layer = RowParallelLinear(in_features, out_features, module.bias is not None, process_set=process_set,
                              input_is_parallel=True, sequence_parallel=sequence_parallel, transposed=conv,
                              device="meta", dtype=weight.dtype)
    _adopt(layer, "weight", weight, adopted)
    _adopt(layer, "bias", module.bias, adopted, split=False)
    return layer


def _embedding(module, style: VocabEmbedding, process_set, sequence_parallel, adopted) -> VocabParallelEmbedding:
    weight = _weight_of(module, "embedding")
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        raise InvalidArgumentError("a split embedding supports neither max_norm, scale_grad_by_freq nor sparse")
    layer = VocabParallelEmbedding(module.num_embeddings, module.embedding_dim, process_set=process_set,
                                   padding_idx=module.padding_idx, device="meta", dtype=weight.dtype)
    _adopt(layer, "weight", weight, adopted)
    return layer


_MAKERS: dict[type, Callable] = {ColumnWise: _column, RowWise: _row, VocabEmbedding: _embedding}


def _install(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, layer)


def _check_no_stale_ties(model: nn.Module, split: dict[int, str], built: dict[str, nn.Module]) -> None:
    """A parameter the plan split that an unplanned module still uses whole would silently
    train two different tensors: refuse it (before anything changed)."""
    for name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            owner = split.get(id(param))
            if owner is not None and name not in built:
                raise InvalidArgumentError(f"{name}.{leaf} is the same parameter as {owner}'s, which the plan "
                                           f"splits; plan {name} the same way as {owner}")


class _SequenceParallelDropout(nn.Module):
    """``nn.Dropout`` inside the sequence-split region: the mask of the whole sequence is drawn
    alike on every TP rank and each keeps its block."""

    def __init__(self, p: float, process_set: ProcessSet | None) -> None:
        super().__init__()
        self.p, self.process_set = p, process_set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return replicated_dropout(x, self.p, self.process_set, sequence_parallel=True, training=self.training)


def _add_sequence_hooks(model: nn.Module, styles: dict[str, Style], process_set: ProcessSet) -> None:
    """Where the sequence-split region starts and ends (forward hooks), and the gradient sums
    of the parameters used inside it (tensor hooks)."""
    for name, style in styles.items():
        module = model.get_submodule(name)
        if isinstance(style, SequenceScatter):
            module.register_forward_pre_hook(_on_input(_scatter_sequence, process_set), with_kwargs=True)
        elif isinstance(style, SequenceGather):
            module.register_forward_pre_hook(_on_input(regions.gather_from_sequence_parallel_region, process_set),
                                             with_kwargs=True)
        elif isinstance(style, SequenceParallel):
            module.register_forward_pre_hook(_sums_gradients(process_set))
            if style.gather_output:
                module.register_forward_hook(_on_output(regions.gather_from_sequence_parallel_region, process_set))


def _on_input(region, process_set):
    """A pre-hook applying ``region`` to the module's hidden states (its first positional
    argument, or ``hidden_states=`` as Hugging Face layers pass it)."""
    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": region(kwargs["hidden_states"], process_set)}
        return (region(args[0], process_set), *args[1:]), kwargs
    return hook


def _scatter_sequence(hidden: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    """The sequence-split region starts: this rank's block of the sequence, with the reason a
    length the TP size does not divide cannot be split (generation feeds one token at a time)."""
    size = comm.group_size(process_set)
    if hidden.shape[1] % size:
        raise InvalidArgumentError(
            f"sequence parallelism splits the sequence over the {size} TP ranks, so its length must be a "
            f"multiple of {size}, got {hidden.shape[1]}; to generate one token at a time, parallelize without "
            "sequence_parallel")
    return regions.scatter_to_sequence_parallel_region(hidden, process_set)


def _on_output(region, process_set):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (region(output[0], process_set), *output[1:])
        return region(output, process_set)
    return hook


def _sums_gradients(process_set: ProcessSet):
    """A pre-hook making sure each of the module's own parameters has its gradient summed over
    the TP set (each rank saw its block of the sequence).  Looked at on every forward, since a
    parameter may be replaced after ``parallelize`` (a meta model filled by ``load_pretrained``)
    and a tensor hook stays with the object it was put on."""
    def sum_over_set(grad: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_(grad.contiguous().clone(), process_set)

    def hook(module, args):
        for param in module.parameters(recurse=False):
            if param.requires_grad and getattr(param, "_psrt_summed_over", None) is not process_set:
                param.register_hook(sum_over_set)
                param._psrt_summed_over = process_set
    return hook

