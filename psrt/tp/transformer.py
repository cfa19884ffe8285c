"""Tensor-parallel building blocks of a transformer: the MLP, multi-head attention and
a pre-norm block.  Per block and micro-batch they run 4 all-reduces (2 forward, 2
backward), or with sequence parallelism 4 all-gathers and 4 reduce-scatters plus, in
backward, one small all-reduce per sequence-parallel parameter group (2 LayerNorms,
2 row-parallel biases).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from psrt.errors import InvalidArgumentError
from psrt.tp.comm import group_size
from psrt.tp.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from psrt.topology import ProcessSet


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: fc1 column-parallel, fc2 row-parallel, so the hidden
    activation never leaves its rank."""

    def __init__(self, dim: int, hidden: int, *, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, process_set=process_set, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(hidden, dim, process_set=process_set, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split over the TP set: a fused
    column-parallel q/k/v projection, attention on the local heads, a row-parallel
    output projection."""

    def __init__(self, dim: int, heads: int, *, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        size = group_size(process_set)
        if dim % heads:
            raise InvalidArgumentError(f"model dimension ({dim}) is not divisible by the number of heads ({heads})")
        if heads % size:
            raise InvalidArgumentError(f"number of attention heads ({heads}) is not divisible by the "
                                       f"tensor-parallel size ({size})")
        self.local_heads, self.head_dim = heads // size, dim // heads
        self.qkv = ColumnParallelLinear(dim, 3 * dim, process_set=process_set, sequence_parallel=sequence_parallel,
                                        stride=3)
        self.out = RowParallelLinear(dim, dim, process_set=process_set, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [batch, sequence, 3 * local heads * head_dim]
        batch, sequence, _ = qkv.shape
        q, k, v = (t.view(batch, sequence, self.local_heads, self.head_dim).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, sequence, -1))


class ParallelTransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, *, mlp_ratio: int = 4, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        options = dict(process_set=process_set, sequence_parallel=sequence_parallel)
        self.ln1 = LayerNorm(dim, **options)
        self.attn = ParallelSelfAttention(dim, heads, **options)
        self.ln2 = LayerNorm(dim, **options)
        self.mlp = ParallelMLP(dim, mlp_ratio * dim, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
