"""Tensor-parallel building blocks of a transformer: the MLP, multi-head attention and
a pre-norm block.  Per block and micro-batch they run 4 all-reduces (2 forward, 2
backward), or with sequence parallelism 4 all-gathers and 4 reduce-scatters plus, in
backward, one small all-reduce per sequence-parallel parameter group (2 LayerNorms,
2 row-parallel biases).  Recomputation runs the forward's collectives once more.

Dropout follows GPT-2 and Megatron: ``attention_dropout`` on the attention
probabilities (a tensor-parallel region: each rank's own mask, see
:mod:`psrt.tp.random`) and ``dropout`` on each branch before it joins the residual
stream (a replicated or sequence-parallel region: the single-process model's mask).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from psrt.cp.ring import ring_attention
from psrt.ep.moe import MoE
from psrt.errors import InvalidArgumentError
from psrt.tp.comm import group_size
from psrt.tp.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear
from psrt.tp.random import check_probability, replicated_dropout, tensor_parallel_dropout
from psrt.tp.recompute import check_mode, checkpoint
from psrt.topology import ProcessSet


class ParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: fc1 column-parallel, fc2 row-parallel, so the hidden
    activation never leaves its rank.

    Collective: every rank of ``process_set`` (the TP set) runs forward and backward
    through it, in the same order.
    """

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
    output projection.  ``recompute="selective"`` keeps only q, k and v of the attention
    core and recomputes its scores, softmax and dropout in backward.

    Collective: every rank of ``process_set`` (the TP set) (and, with
    ``context_parallel``, every rank of that CP set) runs forward and backward
    through it, in the same order.
    """

    def __init__(self, dim: int, heads: int, *, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False, attention_dropout: float = 0.0,
                 recompute: str | None = None, context_parallel: ProcessSet | None = None) -> None:
        super().__init__()
        self.recompute = check_mode(recompute, (None, "selective"))
        self.process_set, self.context_parallel = process_set, context_parallel
        self.attention_dropout = check_probability(attention_dropout, "attention_dropout")
        if context_parallel is not None and context_parallel.size() > 1 and self.attention_dropout:
            raise InvalidArgumentError("attention_dropout is not supported with context parallelism: ring attention "
                                       "never forms the whole probability matrix a mask would apply to")
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
        attended = checkpoint(self.core, q, k, v) if self.recompute == "selective" else self.core(q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, sequence, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``dropout(softmax(q kᵀ / √d + causal mask)) v`` on this rank's heads ([batch, heads,
        sequence, head_dim]); the fused kernel when there is no dropout to draw, ring attention
        over the context-parallel set (this rank's zig-zag part of the sequence) with one.

        Collective with ``context_parallel``: every rank of the CP set calls it, in the same order.
        """
        if not self.training or self.attention_dropout == 0.0:
            if self.context_parallel is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return ring_attention(q, k, v, self.context_parallel, causal=True)
        sequence = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * (self.head_dim ** -0.5)
        future = torch.ones(sequence, sequence, dtype=torch.bool, device=q.device).triu_(1)
        probabilities = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        return tensor_parallel_dropout(probabilities, self.attention_dropout, self.process_set) @ v


class ParallelTransformerBlock(nn.Module):
    """Pre-norm block: ``x + dropout(attn(ln1(x)))`` then ``x + dropout(mlp(ln2(x)))``.

    ``recompute="full"`` keeps only the block's input and runs the whole block again in
    backward; ``"selective"`` recomputes only the attention core (see
    :class:`ParallelSelfAttention`).  ``context_parallel`` is the CP set when the sequence is
    split over one (each rank holds its zig-zag part; attention runs as ring attention).
    ``mlp`` replaces the dense MLP, e.g. with a :class:`psrt.ep.MoE`; not with sequence
    parallelism over TP > 1, where each TP rank would route only its own part of the sequence
    while its TP-split experts and replicated router expect every rank to see the same tokens
    (refused).

    Collective: every rank of ``process_set`` (the TP set) (and, with
    ``context_parallel``, every rank of that CP set) runs forward and backward
    through it, in the same order.
    """

    def __init__(self, dim: int, heads: int, *, mlp_ratio: int = 4, process_set: ProcessSet | None = None,
                 sequence_parallel: bool = False, dropout: float = 0.0, attention_dropout: float = 0.0,
                 recompute: str | None = None, context_parallel: ProcessSet | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        _refuse_moe_with_sequence_parallelism(mlp, process_set, sequence_parallel)
        self.recompute = check_mode(recompute)
        self.process_set, self.sequence_parallel = process_set, sequence_parallel
        self.dropout = check_probability(dropout, "dropout")
        options = dict(process_set=process_set, sequence_parallel=sequence_parallel)
        self.ln1 = LayerNorm(dim, **options)
        self.attn = ParallelSelfAttention(dim, heads, attention_dropout=attention_dropout,
                                          recompute="selective" if recompute == "selective" else None,
                                          context_parallel=context_parallel, **options)
        self.ln2 = LayerNorm(dim, **options)
        self.mlp = ParallelMLP(dim, mlp_ratio * dim, **options) if mlp is None else mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x) if self.recompute == "full" else self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._dropout(self.attn(self.ln1(x)))
        return x + self._dropout(self.mlp(self.ln2(x)))

    def _dropout(self, branch: torch.Tensor) -> torch.Tensor:
        if not self.dropout:
            return branch
        return replicated_dropout(branch, self.dropout, self.process_set, sequence_parallel=self.sequence_parallel,
                                  training=self.training)


def _refuse_moe_with_sequence_parallelism(mlp: nn.Module | None, process_set: ProcessSet | None,
                                          sequence_parallel: bool) -> None:
    """An MoE behind a sequence-parallel norm would see a different 1/TP of the tokens on each
    TP rank: the router's gradients would differ between its replicas (which then drift apart)
    and a TP-split expert would combine different tokens' partial results."""
    size = group_size(process_set)
    if sequence_parallel and size > 1 and mlp is not None and any(isinstance(m, MoE) for m in mlp.modules()):
        raise InvalidArgumentError(
            f"a mixture of experts is not supported with sequence parallelism over a tensor-parallel size of {size}: "
            "each TP rank would route only its own part of the sequence; build the block with "
            "sequence_parallel=False (TP then all-reduces instead), or keep the MoE at TP = 1")
