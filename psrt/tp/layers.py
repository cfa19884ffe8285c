"""Megatron-style tensor-parallel layers.

Every layer takes the TP process set (``None``: one process, the plain layer)
and initialises its full weight exactly as the matching ``torch.nn`` layer
would, then keeps its own block: with the same seed on every rank, a TP model
starts equal to the single-process model.  Activations are batch-first,
``[batch, sequence, hidden]``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.tp import regions
from psrt.tp.comm import group_rank, group_size
from psrt.tp.sharding import Sharding, shard_parameter
from psrt.topology import ProcessSet


def _check_process_set(process_set: object) -> ProcessSet | None:
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise ArgumentTypeError(f"process_set must be a psrt ProcessSet or None, got {type(process_set).__name__}")
    return process_set


def _check_divisible(what: str, value: int, size: int) -> None:
    if value % size:
        raise InvalidArgumentError(f"{what} ({value}) is not divisible by the tensor-parallel size ({size})")


def _linear_init(out_features: int, in_features: int, bias: bool,
                 **factory) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight and bias, drawn as ``nn.Linear`` draws them (same RNG calls)."""
    weight = torch.empty(out_features, in_features, **factory)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if not bias:
        return weight, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return weight, torch.empty(out_features, **factory).uniform_(-bound, bound)


def _along(sharding: Sharding, dim: int) -> Sharding:
    return dataclasses.replace(sharding, dim=dim)


class ColumnParallelLinear(nn.Module):
    """``y = x Aᵀ + b`` with A's rows (output features) split over the TP set.

    The output stays split along the hidden dimension unless ``gather_output``.  With
    ``sequence_parallel`` the input arrives split along the sequence and is all-gathered
    (reduce-scattered backward) instead of copied.  ``stride`` > 1 declares fused outputs
    (q, k, v) that are split part by part.  ``pad_out_features`` pads the outputs up to a
    multiple of the TP size with zero-weight rows (an LM head over a vocabulary the size
    does not divide; pair it with ``vocab_parallel_cross_entropy(vocab_size=...)``).
    ``transposed`` stores the weight as ``[in, out]``, the layout of ``transformers``' ``Conv1D``
    (GPT-2), so that its ``state_dict`` keeps the shapes of the module it replaces.
    ``input_is_gathered`` says the input was all-gathered along the sequence before it came
    here (a sequence-parallel region ended at the module this layer belongs to, whose gather
    reduce-scatters the gradient): the layer takes it as it is, in both directions.

    Collective: every rank of ``process_set`` (the TP set) runs forward and backward through it,
    in the same order.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 process_set: ProcessSet | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, pad_out_features: bool = False,
                 transposed: bool = False, input_is_gathered: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.process_set = _check_process_set(process_set)
        size = group_size(self.process_set)
        if sequence_parallel and input_is_gathered:
            raise InvalidArgumentError("sequence_parallel gathers the input here; input_is_gathered says it "
                                       "already was: pass one of them")
        if out_features % stride:
            raise InvalidArgumentError(f"out_features ({out_features}) is not divisible by stride ({stride})")
        if not (pad_out_features and stride == 1):
            _check_divisible("out_features" if stride == 1 else f"each of the {stride} fused output parts",
                             out_features // stride, size)
        if gather_output and stride != 1:
            raise InvalidArgumentError("gather_output would interleave fused outputs; use stride=1")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.transposed, self.input_is_gathered = transposed, input_is_gathered
        weight, bias_full = _linear_init(out_features, in_features, bias, device=device, dtype=dtype)
        sharding = Sharding(dim=0, parts=size, index=group_rank(self.process_set), full_size=out_features,
                            stride=stride)
        self.weight = shard_parameter(weight.t() if transposed else weight, _along(sharding, int(transposed)))
        self.bias = None if bias_full is None else shard_parameter(bias_full, sharding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = regions.gather_from_sequence_parallel_region(x, self.process_set)
        elif not self.input_is_gathered:
            x = regions.copy_to_tensor_parallel_region(x, self.process_set)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight, self.bias)
        if not self.gather_output:
            return y
        return regions.gather_from_tensor_parallel_region(y, self.process_set)[..., :self.out_features]


class RowParallelLinear(nn.Module):
    """``y = x Aᵀ + b`` with A's columns (input features) split over the TP set.

    Each rank's product is partial and summed by an all-reduce (a reduce-scatter along
    the sequence with ``sequence_parallel``); the bias is added once, after the sum.
    ``input_is_parallel`` says the input is already split along the hidden dimension
    (the output of a ColumnParallelLinear), otherwise it is split here.  ``transposed``
    stores the weight as ``[in, out]`` (``transformers``' ``Conv1D``).

    Collective: every rank of ``process_set`` (the TP set) runs forward and backward through it,
    in the same order.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 process_set: ProcessSet | None = None, input_is_parallel: bool = False,
                 sequence_parallel: bool = False, transposed: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.process_set = _check_process_set(process_set)
        size = group_size(self.process_set)
        _check_divisible("in_features", in_features, size)
        if sequence_parallel and not input_is_parallel:
            raise InvalidArgumentError("sequence_parallel needs input_is_parallel=True (the input of a "
                                       "sequence-parallel RowParallelLinear comes from a ColumnParallelLinear)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.transposed = transposed
        weight, bias_full = _linear_init(out_features, in_features, bias, device=device, dtype=dtype)
        sharding = Sharding(dim=1, parts=size, index=group_rank(self.process_set), full_size=in_features)
        self.weight = shard_parameter(weight.t() if transposed else weight, _along(sharding, 1 - int(transposed)))
        self.bias = None if bias_full is None else nn.Parameter(bias_full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = regions.scatter_to_tensor_parallel_region(x, self.process_set)
        y = F.linear(x, self.weight.t() if self.transposed else self.weight)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence_parallel_region(y, self.process_set)
        else:
            y = regions.reduce_from_tensor_parallel_region(y, self.process_set)
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:
            (bias,) = regions.sequence_parallel_parameters(self.process_set, bias)
        return y + bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary (rows) is split over the TP set, padded up to a
    multiple of the set size; each rank looks up the ids it owns and the partial
    results are summed (reduce-scattered along the sequence with ``sequence_parallel``).
    ``padding_idx`` is ``nn.Embedding``'s: that row gets no gradient.

    Collective: every rank of ``process_set`` (the TP set) runs forward and backward through it,
    in the same order.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False, padding_idx: int | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.process_set = _check_process_set(process_set)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
        nn.init.normal_(full)
        sharding = Sharding(dim=0, parts=group_size(self.process_set), index=group_rank(self.process_set),
                            full_size=num_embeddings)
        self.weight = shard_parameter(full, sharding)
        rows = sharding.padded_size // sharding.parts
        self.vocab_start, self.vocab_end = sharding.index * rows, (sharding.index + 1) * rows
        self.padding_idx = padding_idx  # as in nn.Embedding: its row gets no gradient
        self._local_padding_idx = (padding_idx - self.vocab_start
                                   if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
                                   else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise InvalidArgumentError(f"token ids must lie in [0, {self.num_embeddings}), got values in "
                                       f"[{int(ids.min())}, {int(ids.max())}]")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        partial = F.embedding(local, self.weight, self._local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return regions.reduce_scatter_to_sequence_parallel_region(partial, self.process_set)
        return regions.reduce_from_tensor_parallel_region(partial, self.process_set)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that may run inside a sequence-parallel region, where each rank
    normalises its block of the sequence and the weight and bias gradients are summed
    over the TP set (the replicas stay equal).

    Collective with ``sequence_parallel``: every rank of ``process_set`` (the TP set) runs
    forward and backward through it, in the same order (backward sums the weight's gradients).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, *, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.process_set = _check_process_set(process_set)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = regions.sequence_parallel_parameters(self.process_set, weight, bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
