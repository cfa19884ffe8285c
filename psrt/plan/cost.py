"""Modelled step time of a layout: compute from FLOPs over measured FLOP/s, communication from
its volume over measured bandwidths, and the pipeline's bubble.

A step of 1F1B on p stages with m micro-batches lasts (m + p − 1) times the slowest stage's
time per micro-batch (its bubble is the (p − 1)/(m + p − 1) share); that time is the
stage's forward and backward (a third forward with full recomputation, the attention core
again with selective: products and attention at their measured FLOP/s, plus each block's
measured fixed cost and elementwise work), its tensor-parallel collectives (4 per block: 2
forward, 2 backward; with sequence parallelism the same volume as all-gathers and
reduce-scatters), its ring hops (context parallelism) and its two pipeline messages.  After the last backward come
the data-parallel reductions over the dp × cp ranks and the optimizer step over this rank's
shard.  Nothing is assumed to overlap: communication is added to compute, which is what a
CPU that also runs the transport sees, and pessimistic where a GPU overlaps them.

Collectives over n ranks: an allreduce moves 2(n − 1)/n of its bytes, an all-gather or a
reduce-scatter (n − 1)/n, at the measured bus bandwidth, plus a latency each.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields

from psrt.plan.layout import Layout, Precision
from psrt.plan.machine import Link, Machine
from psrt.plan.memory import REDUCE_BUCKET_SIZE, block_activations
from psrt.plan.model import Model, Transformer, padded

#: Modules owning parameters in psrt's blocks: what ZeRO-3 gathers one at a time.
_UNITS = {"layer": 6, "embedding": 2, "head": 2, "dense": 1}


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step, by where they go (the slowest pipeline stage's view)."""

    compute: float
    bubble: float
    tp_comm: float
    cp_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def communication(self) -> float:
        return self.tp_comm + self.cp_comm + self.pp_comm + self.dp_comm


def allreduce(link: Link, nbytes: float, ranks: int) -> float:
    return 0.0 if ranks == 1 else link.seconds(2 * (ranks - 1) / ranks * nbytes)


def gather(link: Link, nbytes: float, ranks: int) -> float:
    """An all-gather (or reduce-scatter) whose whole result is ``nbytes``."""
    return 0.0 if ranks == 1 else link.seconds((ranks - 1) / ranks * nbytes)


def _forward_seconds(model: Model, kind: str, params: int, layout: Layout, machine: Machine) -> tuple[float, float]:
    """(matrix products, attention core) of one block's forward for one micro-batch."""
    t, s = layout.tp, model.sequence_length // layout.cp
    tokens = layout.micro_batch * s
    if not isinstance(model, Transformer):
        return machine.matmul_seconds(tokens, 1, params), 0.0
    h, f = model.hidden, model.ffn_hidden
    if kind == "embedding":
        return 0.0, 0.0
    if kind == "head":
        return machine.matmul_seconds(tokens, h, padded(model.vocab, t) // t), 0.0
    qkv = h + 2 * h // model.heads * (model.kv_heads or model.heads)  # q, and k and v of the key/value heads
    products = ((h, qkv // t), (h // t, h), (h, (model.mlp_matrices - 1) * f // t), (f // t, h))
    dense = sum(machine.matmul_seconds(tokens, k, n) for k, n in products)
    # q kᵀ and its product with v per local head, 2·s·kv·d FLOPs each; causal: half of the pairs
    heads, d, kv = model.heads // t, h // model.heads, model.sequence_length
    core = machine.attention_seconds(layout.micro_batch * heads * 2 * s * kv * d, d)
    return dense, core


def block_seconds(model: Model, kind: str, params: int, layout: Layout, precision: Precision,
                  machine: Machine) -> float:
    """One block's forward and backward on one micro-batch, with what recomputation runs
    again: products (backward twice the forward's FLOPs), the block's fixed cost (a
    transformer layer's, scaled by the modules the block holds) and its elementwise work (in
    proportion to the activation bytes it would keep without recomputation)."""
    dense, core = _forward_seconds(model, kind, params, layout, machine)
    again = dense + core if layout.recompute == "full" else core if layout.recompute == "selective" else 0.0
    scale = 4 / 3 if layout.recompute == "full" else 1.0  # a third forward
    fixed = machine.layer_overhead_s * _UNITS[kind] / _UNITS["layer"]
    elementwise = block_activations(model, kind, layout, precision.activation, "none") * machine.elementwise_s_per_byte
    return 3 * (dense + core) + again + scale * (fixed + elementwise)


def _compute_per_microbatch(model: Model, blocks: range, layout: Layout, precision: Precision,
                            machine: Machine) -> float:
    """Forward and backward of the stage's blocks for one micro-batch."""
    kinds, sizes = model.block_kinds(), model.block_params(layout.tp)
    return sum(count * block_seconds(model, kind, params, layout, precision, machine)
               for (kind, params), count in Counter((kinds[i], sizes[i]) for i in blocks).items())  # layers alike


def _tp_per_microbatch(model: Model, blocks: range, layout: Layout, precision: Precision, machine: Machine) -> float:
    """Each layer's collectives over the TP set: 4 activations' volume (2 forward, 2 backward; 6
    with a full recomputation), as all-reduces or, with sequence parallelism, as all-gathers and
    reduce-scatters; their fixed costs and the TP layers' own are the measured extra of a tiny
    TP block over a local one.  The embedding's forward and the head's backward all-reduce and
    the cross-entropy's 3 small ones are charged latency and volume."""
    t = layout.tp
    if t == 1 or not isinstance(model, Transformer):
        return 0.0
    link, kinds = machine.group_link(machine.direct_allreduce, t, 1), model.block_kinds()
    nbytes = layout.micro_batch * model.sequence_length // layout.cp * model.hidden * precision.activation
    volume = 2 * (t - 1) / t * nbytes / link.bandwidth  # one all-reduce's, or an all-gather's and a reduce-scatter's
    layer_fixed = machine.sp_layer_overhead_s if layout.sequence_parallel else machine.tp_layer_overhead_s
    small = allreduce(link, 4 * layout.micro_batch, t)
    seconds = 0.0
    for i in blocks:
        if kinds[i] == "layer":
            again = layout.recompute == "full"
            seconds += (6 if again else 4) * volume + layer_fixed * (4 / 3 if again else 1.0)
        elif kinds[i] == "embedding":
            seconds += link.latency_s + volume
        else:
            seconds += link.latency_s + volume + 3 * small
    return seconds


def _cp_per_microbatch(model: Model, blocks: range, layout: Layout, precision: Precision, machine: Machine) -> float:
    """Ring attention: k and v go once around the ring forward (cp − 1 hops); backward they go
    around again with their gradients and a last hop brings the gradients home (cp hops)."""
    c = layout.cp
    if c == 1:
        return 0.0
    kv_width = model.hidden // model.heads * (model.kv_heads or model.heads)
    block = layout.micro_batch * model.sequence_length // c * kv_width // layout.tp * precision.activation
    kinds, link = model.block_kinds(), machine.group_link(machine.p2p, c, layout.tp, messages=True)
    layers = sum(1 for i in blocks if kinds[i] == "layer")
    forward = (c - 1) * link.seconds(2 * block)
    backward = c * link.seconds(4 * block)
    again = forward if layout.recompute == "full" else 0.0
    return layers * (forward + backward + again)


def _pp_per_microbatch(model: Model, layout: Layout, precision: Precision, machine: Machine) -> float:
    """One activation in and one gradient out (or the reverse) per micro-batch on a stage (for
    a model known only by its parameter counts, their latency only)."""
    if layout.pp == 1:
        return 0.0
    link = machine.group_link(machine.p2p, layout.pp, layout.tp * layout.cp * layout.dp, messages=True)
    if not isinstance(model, Transformer):
        return 2 * link.latency_s
    r = layout.tp if layout.sequence_parallel else 1
    nbytes = layout.micro_batch * model.sequence_length // layout.cp * model.hidden // r * precision.activation
    return 2 * link.seconds(nbytes)


def _dp_seconds(model: Model, blocks: range, params: int, layout: Layout, precision: Precision,
                machine: Machine) -> float:
    """Gradient reduction and parameter gathering over the dp × cp ranks, per step.

    Stage 0: one allreduce of the gradients (after the last micro-batch); stage 1: a
    reduce-scatter and, after the step, an all-gather of the updated parameters; stage 2: psrt
    reduce-scatters after every backward, so once per micro-batch; stage 3: per micro-batch,
    each module's parameters gathered before its forward and again before its backward, and
    its gradient reduce-scattered.  Each bucket of gradients is also copied once."""
    n = layout.data_ranks
    link = machine.group_link(machine.engine_allreduce, n, layout.tp)
    if n == 1:
        return 0.0
    grads, weights = params * precision.grad, params * precision.param
    buckets = max(1, -(-params // REDUCE_BUCKET_SIZE))
    copy = grads / machine.memcpy_bandwidth
    m = layout.micro_batches
    if layout.zero == 0:
        return buckets * allreduce(link, grads / buckets, n) + copy
    if layout.zero == 1:
        return buckets * (gather(link, grads / buckets, n) + gather(link, weights / buckets, n)) + copy
    if layout.zero == 2:
        return m * (buckets * gather(link, grads / buckets, n) + copy) + buckets * gather(link, weights / buckets, n)
    kinds = model.block_kinds()
    units = sum(_UNITS[kinds[i]] for i in blocks)
    return m * (units * (2 * gather(link, weights / units, n) + gather(link, grads / units, n)) + copy)


def step_time(model: Model, stages: Sequence[tuple[range, tuple]], layout: Layout, precision: Precision,
              machine: Machine) -> StepTime:
    """Modelled seconds of one training step of ``layout``; ``stages`` holds each pipeline stage's
    blocks and :func:`psrt.plan.model.stage_key` (stages alike are costed once)."""
    sizes = model.block_params(layout.tp)
    per_stage, alike = [], {}
    for blocks, key in stages:
        if key in alike:
            per_stage.append(alike[key])
            continue
        params = sum(sizes[i] for i in blocks)
        per_stage.append(alike.setdefault(key, (
            _compute_per_microbatch(model, blocks, layout, precision, machine),
            _tp_per_microbatch(model, blocks, layout, precision, machine),
            _cp_per_microbatch(model, blocks, layout, precision, machine),
            _pp_per_microbatch(model, layout, precision, machine),
            _dp_seconds(model, blocks, params, layout, precision, machine),
            params / (layout.data_ranks if layout.zero else 1) * machine.optimizer_s_per_param,
        )))
    compute, tp, cp, pp, _, _ = max(per_stage, key=lambda s: sum(s[:4]))
    m, p = layout.micro_batches, layout.pp
    slowest_microbatch = compute + tp + cp + pp
    return StepTime(compute=m * compute, bubble=(p - 1) * slowest_microbatch, tp_comm=m * tp, cp_comm=m * cp,
                    pp_comm=m * pp, dp_comm=max(s[4] for s in per_stage), optimizer=max(s[5] for s in per_stage))
