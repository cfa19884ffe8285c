"""Bytes per rank of a layout: parameters, gradients, optimizer state, activations, buffers.

Model state follows ZeRO's accounting (Rajbhandari et al. 2020) applied to what psrt's
optimizers hold (:mod:`psrt.zero`): per element P bytes of parameters, G of gradients and K of
optimizer state (fp32 masters where separate, and the moments), with stage 1 dividing K,
stage 2 also G and stage 3 also P by the dp × cp ranks that share the parameters.

Activations are the tensors autograd keeps between a micro-batch's forward and its backward,
counted tensor by tensor for psrt's blocks (what :class:`psrt.pp.StepProfile` measures as
``peak_activation_bytes``).  In 16-bit, with dropout, a block keeps Korthikanti et al.'s
sbh(34 + 5as/h); without dropout torch's fused attention keeps no [s, s] tensor and there
are no masks, so 32sbh plus the log-sum-exp.  Full recomputation keeps each block's input
(2sbh); selective recomputation drops only the attention core's [s, s] tensors.  With TP t
the split tensors are divided by t; with sequence parallelism the residual stream's too,
but psrt's column-parallel layers keep their whole-sequence (all-gathered) input, so
2sbh per block are not divided (Megatron gathers it again in backward instead).

Buffers are what lives only for a moment but must fit too: the layer recomputed during its
backward, ZeRO-3's gathered parameters, the gradient bucket being reduced.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields

from psrt.plan.layout import Layout, Precision
from psrt.plan.model import Model, Transformer, padded

#: psrt.zero's defaults, in elements (importing psrt.zero would start torch's optimizers for nothing).
REDUCE_BUCKET_SIZE = 1_000_000
ALLGATHER_BUCKET_SIZE = 1_000_000
_FLOAT32, _INT64, _BOOL = 4, 8, 1


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state(params: int, layout: Layout, precision: Precision) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of a rank whose TP/PP share has ``params`` elements.

    psrt's ZeroOptimizer holds the compute parameters (sharded from stage 3), their gradients
    (the full ``.grad`` until the step in stages 0-1, a reduced shard from stage 2) and, on
    each rank's shard from stage 1, the fp32 master and the optimizer's moments."""
    shards = layout.data_ranks if layout.zero else 1
    per_param = -(-params // layout.data_ranks)
    return (precision.param * (per_param if layout.zero >= 3 else params),
            precision.grad * (per_param if layout.zero >= 2 else params),
            (precision.master + precision.state) * -(-params // shards))


def layer_activations(model: Transformer, layout: Layout, e: int, recompute: str) -> int:
    """Bytes one transformer block keeps for backward, per micro-batch on one rank."""
    t, b = layout.tp, layout.micro_batch
    s = model.sequence_length // layout.cp
    x = b * s * model.hidden  # elements of the residual stream for the micro-batch
    r = t if layout.sequence_parallel else 1  # the residual stream's split
    if recompute == "full":
        return x * e // r  # the block's input
    heads, kv = model.heads // t, model.kv_heads or model.heads
    stats = 1 if model.swiglu else 2  # RMSNorm keeps its reciprocal root mean square; LayerNorm also the mean
    kept = (2 * x * e // r                 # norm inputs
            + 2 * stats * b * s * _FLOAT32 // r  # their statistics
            + 2 * x * e                    # q/k/v and fc1 inputs: whole sequence (gathered with SP)
            + (2 * x + 2 * x * kv // model.heads) * e // t  # q, k, v; the output projection's input
            + model.mlp_matrices * b * s * model.ffn_hidden * e // t)  # GELU's input and output; gate, up, their product
    if model.dropout:
        kept += 2 * x * _BOOL // r  # the two residual dropout masks
        if recompute == "none":  # unfused attention: probabilities, their mask and the dropped-out copy
            kept += (2 * e + _BOOL) * b * heads * s * s + s * s * _BOOL
    elif recompute == "none":
        kept += b * heads * s * _FLOAT32  # the fused kernel's log-sum-exp
    return kept


def embedding_activations(model: Transformer, layout: Layout, recompute: str) -> int:
    """The token ids the vocabulary-parallel lookup keeps (local ids and their mask) and the
    positions' index; a recomputed embedding keeps only the ids."""
    b, s = layout.micro_batch, model.sequence_length // layout.cp
    if recompute == "full":
        return b * s * _INT64
    positions = s // layout.tp if layout.sequence_parallel else s
    return b * s * (_INT64 + _BOOL) + positions * _INT64


def head_activations(model: Transformer, layout: Layout, e: int, recompute: str) -> int:
    """The final LayerNorm and projection's inputs and the vocabulary-parallel cross-entropy's
    fp32 softmax, target ids and mask; recomputed, the head keeps its input only."""
    t, b, s = layout.tp, layout.micro_batch, model.sequence_length // layout.cp
    x = b * s * model.hidden
    r = t if layout.sequence_parallel else 1
    loss = b * s * padded(model.vocab, t) // t * _FLOAT32 + b * s * (_INT64 + _BOOL)
    if recompute == "full":
        return x * e // r + loss
    return x * e // r + 2 * b * s * _FLOAT32 // r + x * e + loss


def block_activations(model: Model, kind: str, layout: Layout, e: int, recompute: str) -> int:
    if not isinstance(model, Transformer):
        return 0
    if kind == "layer":
        return layer_activations(model, layout, e, recompute)
    if kind == "embedding":
        return embedding_activations(model, layout, recompute)
    return head_activations(model, layout, e, recompute)


def in_flight(stage: int, layout: Layout) -> int:
    """Micro-batches stage ``stage`` holds at once under 1F1B: p − stage, at most m."""
    return min(layout.pp - stage, layout.micro_batches)


def stage_activations(model: Model, blocks: range, stage: int, layout: Layout, precision: Precision) -> int:
    """Peak activation bytes of pipeline stage ``stage`` holding ``blocks``: each micro-batch in
    flight keeps its blocks' tensors and the stage's output (the loss on the last stage), and
    every stage but the first also holds the input gradient it is sending back while the next
    micro-batch runs.  Stage-level full recomputation keeps every block's input, as psrt's
    PipelineStage does."""
    if not isinstance(model, Transformer):
        return 0
    e, kinds = precision.activation, model.block_kinds()
    boundary = layout.micro_batch * model.sequence_length // layout.cp * model.hidden * e
    boundary //= layout.tp if layout.sequence_parallel else 1  # one activation between stages
    per_microbatch = sum(count * block_activations(model, kind, layout, e, layout.recompute)
                         for kind, count in Counter(kinds[i] for i in blocks).items())
    per_microbatch += _FLOAT32 if blocks[-1] == len(kinds) - 1 else boundary
    return in_flight(stage, layout) * per_microbatch + (boundary if blocks[0] > 0 else 0)


def stage_buffers(model: Model, blocks: range, params: int, layout: Layout, precision: Precision) -> int:
    """Short-lived bytes at the stage's peak: the block being recomputed in backward (its full
    activations), ZeRO-3's gathered parameters (the running module and the prefetch budget),
    and one gradient bucket on its way to the other data-parallel ranks."""
    kinds = model.block_kinds()
    total = 0
    if isinstance(model, Transformer) and layout.recompute != "none":
        e = precision.activation
        total += max(block_activations(model, kind, layout, e, "none")
                     - block_activations(model, kind, layout, e, layout.recompute) for kind in {kinds[i] for i in blocks})
    if layout.data_ranks > 1:
        if layout.zero >= 3:
            gathered = 2 * model.largest_unit(layout.tp) + ALLGATHER_BUCKET_SIZE
            total += precision.param * min(params, gathered)
        total += precision.grad * min(params, REDUCE_BUCKET_SIZE)
    return total


def stage_memory(model: Model, blocks: range, stage: int, layout: Layout, precision: Precision) -> MemoryBreakdown:
    """Everything one rank of pipeline stage ``stage`` holds at its peak."""
    sizes = model.block_params(layout.tp)
    params = sum(sizes[i] for i in blocks)
    weights, grads, optimizer = model_state(params, layout, precision)
    return MemoryBreakdown(weights, grads, optimizer, stage_activations(model, blocks, stage, layout, precision),
                           stage_buffers(model, blocks, params, layout, precision))
