"""Ring attention over a context-parallel (CP) group.

Every rank holds its part of the sequence (zig-zag placed, :mod:`psrt.cp.zigzag`) for q, k
and v.  Forward: the k/v blocks travel once around the ring; each rank attends its queries
to every block as it passes and merges the partial results with the online softmax (each
partial output weighted by its log-sum-exp), so no rank ever holds the whole sequence's
keys or the full score matrix.  Backward: the k/v blocks travel around again, each with a
gradient accumulator that every rank adds its share to, and a last hop brings each block's
finished key and value gradients home.  Under a causal mask the zig-zag placement lets a
rank skip exactly the chunk pairs that the mask hides, the same amount on every rank.

Blocks are sent as one tensor per hop, to the next rank, while the previous rank's arrives
(a non-blocking send and a blocking receive, over the CP set's direct group); a block whose
shape differs from the sender's local one is an error naming both ranks.  CUDA tensors are
staged through host memory, as pipeline activations are.
"""
from __future__ import annotations

import math
import time

import torch

from psrt.autograd import skips_without_gradient
from psrt.comm.stats import CommStats
from psrt.cp import zigzag
from psrt.errors import ArgumentTypeError, CommunicationError, InvalidArgumentError
from psrt.runtime import Runtime, given
from psrt.topology import ProcessSet

_LABEL = "context-parallel"


def stats(runtime: Runtime | None = None) -> CommStats:
    """The ring hops ``runtime`` (default: the current one) has run since the last ``reset()``
    and the seconds spent in them, for tests and the benchmark."""
    return given(runtime).stats[_LABEL]


FORWARD_TAG, BACKWARD_TAG = 21, 22


class _Ring:
    """Hops of a block from each rank of the CP set to the next, on the set's direct group
    (from the topology the set is registered with)."""

    def __init__(self, process_set: ProcessSet) -> None:
        topology = process_set.topology
        self.group, self.stats = topology.direct(process_set), topology.stats[_LABEL]
        self.rank, self.size = process_set.rank(), process_set.size()

    def agree(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Every rank checks, in one small exchange before any block moves, that all hold the
        same shapes and dtype: a rank with another token count fails every rank alike."""
        mine = (tuple(q.shape), tuple(k.shape), str(q.dtype))
        everyone = self.group.allgather_object(mine, label=_LABEL)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                first = next(r for r, t in enumerate(everyone) if t != everyone[0])
                raise InvalidArgumentError(
                    f"context-parallel ranks disagree: rank 0 has q {everyone[0][0]} and k/v {everyone[0][1]} "
                    f"({everyone[0][2]}), rank {first} has q {everyone[first][0]} and k/v {everyone[first][1]} "
                    f"({everyone[first][2]}); every rank of the group must hold the same number of tokens")

    def hop(self, block: torch.Tensor, tag: int) -> torch.Tensor:
        """Send ``block`` to the next rank and return the previous rank's."""
        start = time.perf_counter()
        group, after, before = self.group, (self.rank + 1) % self.size, (self.rank - 1) % self.size
        sent = group.send(block.cpu() if block.is_cuda else block, after, tag)
        _, arrived = group.recv(before, tag, kind="a context-parallel block",
                                what=lambda: f"context-parallel rank {self.rank}'s receive of a k/v block from "
                                             f"rank {before} (world rank {group.ranks[before]})")
        group.wait(sent, "a context-parallel block", lambda: f"context-parallel rank {self.rank}'s send to "
                                                             f"rank {after}", (group.ranks[after],))
        if arrived.shape != block.shape or arrived.dtype != block.dtype:
            raise CommunicationError(
                f"context-parallel rank {self.rank} holds a block of shape {tuple(block.shape)} ({block.dtype}) but "
                f"rank {before} sent {tuple(arrived.shape)} ({arrived.dtype}): every rank of the context-parallel "
                "group must hold the same number of tokens")
        self.stats.add("hop", start)
        return arrived.to(block.device)


def _pairs(rank: int, owner: int, size: int, causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, diagonal) for each chunk pair that the mask does not hide;
    chunk indices are local (0 or 1), diagonal pairs need the triangular mask."""
    if not causal:
        return [(0, 0, False)]
    mine, theirs = zigzag.chunks_of(rank, size), zigzag.chunks_of(owner, size)
    return [(a, b, qa == kb) for a, qa in enumerate(mine) for b, kb in enumerate(theirs) if kb <= qa]


def _fused(q: torch.Tensor) -> bool:
    """Whether torch's fused CPU flash-attention kernels take these blocks: they return the
    log-sum-exp the merge needs, and their backward takes the merged output and log-sum-exp,
    which is exactly one block's share of the gradient."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and its log-sum-exp per query."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, diagonal, scale=scale)
    scores = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _block_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, scale: float, diagonal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the q, k and v gradients, from the merged output ``out`` and
    log-sum-exp ``lse`` (``delta`` = rowsum(dO ∘ O), the softmax backward's correction)."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, 0.0, diagonal, scale=scale)
    probabilities = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    grad_scores = probabilities * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return (grad_scores @ k) * scale, (grad_scores.transpose(-2, -1) @ q) * scale, \
        probabilities.transpose(-2, -1) @ grad_out


@skips_without_gradient
class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, causal: bool, scale: float):
        pieces = 2 if causal else 1
        queries = q.chunk(pieces, dim=2)
        outputs: list[torch.Tensor | None] = [None] * pieces
        lses: list[torch.Tensor | None] = [None] * pieces
        block = torch.stack([k, v])
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            keys, values = block[0].chunk(pieces, dim=2), block[1].chunk(pieces, dim=2)
            for a, b, diagonal in _pairs(ring.rank, owner, ring.size, causal):
                out, lse = _block_forward(queries[a], keys[b], values[b], scale, diagonal)
                if outputs[a] is None:
                    outputs[a], lses[a] = out, lse
                else:  # online softmax: weight each part by its share of the merged normaliser
                    merged = torch.logaddexp(lses[a], lse)
                    outputs[a] = (outputs[a] * torch.exp(lses[a] - merged).unsqueeze(-1)
                                  + out * torch.exp(lse - merged).unsqueeze(-1))
                    lses[a] = merged
            if step < ring.size - 1:
                block = ring.hop(block, FORWARD_TAG)
        out, lse = torch.cat(outputs, dim=2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale = ring, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        pieces = 2 if causal else 1
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)
        split = [t.chunk(pieces, dim=2) for t in (q, grad_out, out)]
        queries, grads_out, outs = ([c.contiguous() for c in chunks] for chunks in split)
        lses, deltas = [c.contiguous() for c in lse.chunk(pieces, dim=-1)], delta.chunk(pieces, dim=-1)
        grad_q = torch.zeros_like(q)
        grad_queries = grad_q.chunk(pieces, dim=2)
        block = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            keys, values = block[0].chunk(pieces, dim=2), block[1].chunk(pieces, dim=2)
            grad_keys, grad_values = block[2].chunk(pieces, dim=2), block[3].chunk(pieces, dim=2)
            for a, b, diagonal in _pairs(ring.rank, owner, ring.size, causal):
                dq, dk, dv = _block_backward(grads_out[a], queries[a], keys[b], values[b], outs[a], lses[a],
                                             deltas[a], scale, diagonal)
                grad_queries[a].add_(dq)
                grad_keys[b].add_(dk)
                grad_values[b].add_(dv)
            if step < ring.size - 1:
                block = ring.hop(block, BACKWARD_TAG)
        grads = block[2:] if ring.size == 1 else ring.hop(block[2:].contiguous(), BACKWARD_TAG)  # home
        return grad_q, grads[0], grads[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, process_set: ProcessSet | None, *,
                   causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · scale + mask) v`` over the whole sequence, each rank of the CP set
    holding its zig-zag part of q, k and v (``[batch, heads, local tokens, head_dim]``) and
    getting its part of the output.  ``process_set=None`` (or a set of one) is ordinary
    attention on the local tokens.  ``scale`` defaults to 1/√head_dim.

    Collective: every rank of ``process_set`` (the CP set) calls it, in the same order, and runs
    backward through it (the backward communicates).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ArgumentTypeError(f"{name} must be a [batch, heads, tokens, head_dim] tensor, got "
                                    f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise InvalidArgumentError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit "
                                   "one attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    ring = _Ring(process_set) if process_set is not None else None
    if ring is None or ring.size == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if causal and (q.shape[2] != k.shape[2] or q.shape[2] % 2):
        raise InvalidArgumentError(f"causal ring attention takes each rank's zig-zag part, two equal chunks of "
                                   f"queries and keys; got {q.shape[2]} queries and {k.shape[2]} keys")
    ring.agree(q, k)
    return _RingAttention.apply(q, k, v, ring, causal, scale)
