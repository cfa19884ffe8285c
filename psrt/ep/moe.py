"""A mixture-of-experts layer whose experts are sharded over an expert-parallel (EP) set.

Each token goes to the ``top_k`` experts its router scores highest, weighted by their
router probabilities (renormalised over the k when k > 1, as Mixtral does; top-1 keeps
the probability, as Switch does).  Routing happens on the token's own rank; the
token rows then travel to the ranks holding their experts in one all-to-all (dispatch,
uneven splits), each expert runs on every row it received, and a second all-to-all brings
the results back (combine), where they are weighted and summed per token.

- *Capacity:* with ``capacity_factor`` c each expert takes at most ⌈c · T · k / E⌉ of a
  rank's T tokens' k·T assignments, first come first served in token order (GShard's local
  groups); the rest are dropped (that part of the token's output is zero, the residual
  stream carries the token on) and counted in ``dropped``.  ``capacity_factor=None`` is
  dropless: every assignment is kept.
- *Load balancing:* ``aux_loss`` (set by every forward) is Switch/GShard's
  E · Σₑ fₑ · Pₑ over this rank's tokens, fₑ the share of assignments routed to expert e
  and Pₑ its mean router probability; 1 when balanced.  With ``aux_loss_coef`` > 0 its
  gradient joins backward as if ``aux_loss_coef × aux_loss`` had been added to the loss
  (Megatron's way: no change to the training loop or the pipeline's loss).  In a pipeline
  of m micro-batches each micro-batch's term carries ``aux_loss_coef / m`` (Megatron's
  1/num_microbatches), so the step adds ``aux_loss_coef ×`` the micro-batches' mean aux
  loss, whichever ``loss_reduction`` it uses (:func:`aux_loss_share`).
- *Sharding:* every rank builds all E experts in order (one seed gives every layout the
  single-process weights) and keeps its E / ep consecutive ones, named by their global
  index, so ``state_dict()`` keys are the single-process model's.  ``expert`` builds one
  expert (default: Linear, GELU, Linear), e.g. a :class:`~psrt.tp.ParallelMLP` to split
  every expert over TP as well.

Expert parameters see the tokens of every rank of the EP set; a data-parallel optimizer
must reduce them only over the ranks holding the same experts (``grid.edp_set``) and the
rest of the model over the whole DP set (see :func:`expert_parameters`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from psrt.autograd import skips_without_gradient
from psrt.comm.buffers import dtype_code, dtype_of
from psrt.ep.comm import all_to_all, exchange
from psrt.errors import ArgumentTypeError, CollectiveMismatchError, InvalidArgumentError
from psrt.topology import ProcessSet


@skips_without_gradient
class _AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output whose backward also sends ``coef`` into the aux loss."""

    @staticmethod
    def forward(ctx, output, aux_loss, coef):
        ctx.coef, ctx.shape = coef, aux_loss.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, ctx.coef, dtype=grad.dtype, device=grad.device), None


class MoE(nn.Module):
    """``E = num_experts`` experts of width ``hidden`` behind a top-k router, the experts
    split over ``process_set`` (the EP set; None: one process holds them all).

    Collective: every rank of ``process_set`` (the EP set) runs forward and backward through it,
    in the same order (tokens travel to their experts' ranks by all-to-all).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.0,
                 process_set: ProcessSet | None = None, expert: Callable[[], nn.Module] | None = None) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("hidden", hidden), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise InvalidArgumentError(f"top_k ({top_k}) is more than the {num_experts} experts")
        if capacity_factor is not None and not capacity_factor > 0:
            raise InvalidArgumentError(f"capacity_factor must be positive (or None: dropless), got {capacity_factor}")
        if process_set is not None and not isinstance(process_set, ProcessSet):
            raise ArgumentTypeError(f"process_set must be the EP ProcessSet or None, got {type(process_set).__name__}")
        size = 1 if process_set is None else process_set.size()
        if num_experts % size:
            raise InvalidArgumentError(f"{num_experts} experts do not split over the expert-parallel size {size}")
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.capacity_factor, self.aux_loss_coef, self.process_set = capacity_factor, float(aux_loss_coef), process_set
        self.router = nn.Linear(dim, num_experts, bias=False)
        make = expert or (lambda: nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)))
        self.local = num_experts // size
        self.first = (0 if process_set is None else process_set.rank()) * self.local
        built = [make() for _ in range(num_experts)]  # every rank draws them all: one seed, any layout
        self.experts = nn.ModuleDict({str(e): built[e] for e in range(self.first, self.first + self.local)})
        self.aux_loss: torch.Tensor | None = None
        self.dropped = 0
        self.aux_loss_share = 1.0  # the part of the step's aux term one forward carries (see aux_loss_share)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.dim)
        count, k, experts = tokens.shape[0], self.top_k, self.num_experts
        probabilities = torch.softmax(self.router(tokens), dim=-1)
        gate, chosen = probabilities.topk(k, dim=-1)
        if k > 1:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        expert_of = chosen.reshape(-1)  # assignments, token-major
        token_of = torch.arange(count, device=x.device).repeat_interleave(k)
        routed = torch.bincount(expert_of, minlength=experts)
        self.aux_loss = experts * (routed.to(probabilities.dtype) / max(1, count * k) * probabilities.mean(0)).sum()
        keep = self._within_capacity(expert_of, count)
        self.dropped = int(keep.numel() - keep.sum()) if keep is not None else 0
        gate = gate.reshape(-1)
        if keep is not None:
            expert_of, token_of, gate = expert_of[keep], token_of[keep], gate[keep]
        order = torch.argsort(expert_of, stable=True)  # rows leave grouped by expert
        rows = tokens[token_of[order]]
        per_expert = torch.bincount(expert_of, minlength=experts)
        results = self._run_experts(rows, per_expert)
        by_assignment = torch.zeros_like(results).index_copy(0, order, results)
        out = torch.zeros_like(tokens).index_add(0, token_of, by_assignment * gate.unsqueeze(-1))
        if self.aux_loss_coef and torch.is_grad_enabled():
            out = _AuxLossGradient.apply(out, self.aux_loss, self.aux_loss_coef * self.aux_loss_share)
        return out.view_as(x)

    def _within_capacity(self, expert_of: torch.Tensor, count: int) -> torch.Tensor | None:
        """Which assignments fit their expert's capacity (None: dropless)."""
        if self.capacity_factor is None:
            return None
        if count * self.top_k < self.num_experts:
            raise InvalidArgumentError(
                f"{count} tokens × top_k {self.top_k} give fewer assignments than the {self.num_experts} experts, "
                "so capacity-factor routing has nothing to share out; use a larger batch, or capacity_factor=None")
        capacity = math.ceil(self.capacity_factor * count * self.top_k / self.num_experts)
        one_hot = F.one_hot(expert_of, self.num_experts)
        place = (one_hot.cumsum(0) - 1).gather(1, expert_of.unsqueeze(1)).squeeze(1)  # place in its expert's queue
        return place < capacity

    def _run_experts(self, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
        """Every expert on its rows, wherever it lives; rows and results grouped by expert."""
        if self.process_set is None or self.process_set.size() == 1:
            return self._local_experts(rows, [per_expert.tolist()])
        size = self.process_set.size()
        counts = per_expert.view(size, self.local)  # row r: my rows for rank r's experts
        # one small exchange carries every count and what a row is, so the two all-to-alls of
        # tokens need no exchange of their own: row r of ``theirs``, rank r's rows for my experts
        row = torch.tensor([rows.shape[1], dtype_code(rows.dtype)], device=counts.device).expand(size, 2)
        theirs, _ = exchange(torch.cat([counts, row], dim=1), [1] * size, self.process_set)
        theirs, their_row = theirs[:, :self.local], theirs[:, self.local:]
        if not torch.equal(their_row, row):
            width, code = their_row[(their_row != row).any(1)][0].tolist()
            raise CollectiveMismatchError(
                f"expert-parallel ranks disagree on the tokens: this rank sends rows of {rows.shape[1]} "
                f"{rows.dtype}, another {width} {dtype_of(code)}: every rank of the EP set must run the same MoE")
        mine, incoming = counts.sum(1).tolist(), theirs.sum(1).tolist()
        arrived = all_to_all(rows, mine, incoming, self.process_set)
        done = self._local_experts(arrived, theirs.tolist())
        return all_to_all(done, incoming, mine, self.process_set)

    def _local_experts(self, rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
        """``rows`` come from each source in turn, grouped by local expert (``counts[source][j]``
        rows for expert j); run each expert on all of its rows and put the results back in place."""
        starts, at = [], 0
        for source in counts:
            starts.append([])
            for n in source:
                starts[-1].append(at)
                at += n
        indices, outputs = [], []
        for j in range(self.local):
            index = torch.cat([torch.arange(starts[s][j], starts[s][j] + counts[s][j], device=rows.device)
                               for s in range(len(counts))])
            if index.numel():  # the same on every TP rank of a TP-split expert: they route alike
                indices.append(index)
                outputs.append(self.experts[str(self.first + j)](rows[index]))
        if not outputs:
            return torch.zeros_like(rows)
        return torch.zeros_like(rows).index_copy(0, torch.cat(indices), torch.cat(outputs))


@contextlib.contextmanager
def aux_loss_share(module: nn.Module, share: float) -> Iterator[None]:
    """Within the block, every MoE layer of ``module`` weights its aux-loss gradient by
    ``share`` on top of its coefficient: a pipeline of m micro-batches runs its step with
    1/m, as the forwards of one step together make one aux term.  The weight is taken at
    forward, so a backward after the block keeps it."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    before = [layer.aux_loss_share for layer in layers]
    for layer in layers:
        layer.aux_loss_share = share
    try:
        yield
    finally:
        for layer, value in zip(layers, before):
            layer.aux_loss_share = value


def expert_parameters(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """``module``'s named parameters split into (expert parameters, the rest): the first are
    reduced over the expert-data-parallel set, the second over the whole data-parallel set."""
    experts = {id(p) for m in module.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
    named = list(module.named_parameters())
    return [(n, p) for n, p in named if id(p) in experts], [(n, p) for n, p in named if id(p) not in experts]
