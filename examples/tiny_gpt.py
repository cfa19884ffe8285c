"""A tiny character-level GPT built from psrt's tensor-parallel layers, as a list of
blocks a pipeline can cut: [embedding, transformer block × layers, head].

With ``process_set=None`` the same code is the single-process reference model.
The text is the source of Python's own ``textwrap`` module, so nothing needs a
download.
"""
from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

import psrt.torch as hvd
from psrt import cp, ep, pp, tp
from psrt.grid import ProcessGrid
from psrt.topology import ProcessSet
from psrt.torch.optimizer import Bucketing
from psrt.zero import ZeroOptimizer


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    sequence_length: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    sequence_parallel: bool = False
    dropout: float = 0.0  # on the attention probabilities and on each residual branch
    recompute: str | None = None  # "full": each block's input is all a stage keeps; "selective": attention core
    experts: int = 0  # > 0: every MLP is a mixture of this many experts (sharded over the grid's EP set)
    top_k: int = 2
    capacity_factor: float | None = None  # None: dropless routing
    aux_loss_coef: float = 0.0  # weight of the load-balancing loss
    tie_embeddings: bool = False  # the output projection uses the token embedding's weight (GPT-2)


class Embedding(nn.Module):
    """Token (vocab-parallel) plus position embeddings; with sequence parallelism each
    rank leaves with its block of the sequence.  With context parallelism the ids are this
    rank's zig-zag part of the sequence, and each token gets its position in the whole."""

    def __init__(self, config: GPTConfig, process_set: ProcessSet | None,
                 context_parallel: ProcessSet | None = None) -> None:
        super().__init__()
        self.process_set, self.sequence_parallel = process_set, config.sequence_parallel
        self.context_parallel = context_parallel
        self.tokens = tp.VocabParallelEmbedding(config.vocab_size, config.dim, process_set=process_set,
                                                sequence_parallel=config.sequence_parallel)
        self.positions = nn.Embedding(config.sequence_length, config.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(ids)
        where = torch.arange(ids.shape[1], device=ids.device)
        if self.context_parallel is not None:
            ring = self.context_parallel
            where = cp.positions(ids.shape[1] * ring.size(), ring.rank(), ring.size(), device=ids.device)
        if not self.sequence_parallel:
            return hidden + self.positions(where)  # called, so ZeRO-3 gathers the table first
        (weight,) = tp.sequence_parallel_parameters(self.process_set, self.positions.weight)
        rows = hidden.shape[1]  # this rank's block of the sequence
        return hidden + weight[where[rows * tp.comm.group_rank(self.process_set):][:rows]]


class Head(nn.Module):
    """Final LayerNorm and the vocab-parallel output projection (logits stay split)."""

    def __init__(self, config: GPTConfig, process_set: ProcessSet | None) -> None:
        super().__init__()
        options = dict(process_set=process_set, sequence_parallel=config.sequence_parallel)
        self.norm = tp.LayerNorm(config.dim, **options)
        self.out = tp.ColumnParallelLinear(config.dim, config.vocab_size, bias=False, pad_out_features=True,
                                           **options)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(hidden))


def build_blocks(config: GPTConfig, process_set: ProcessSet | None = None,
                 context_parallel: ProcessSet | None = None, expert_parallel: ProcessSet | None = None
                 ) -> list[nn.Module]:
    """The model as a list of blocks; the same seed gives the same weights at any TP, CP or EP size."""
    blocks: list[nn.Module] = [Embedding(config, process_set, context_parallel)]
    for _ in range(config.layers):
        blocks.append(tp.ParallelTransformerBlock(
            config.dim, config.heads, process_set=process_set, sequence_parallel=config.sequence_parallel,
            dropout=config.dropout, attention_dropout=config.dropout,
            recompute="selective" if config.recompute == "selective" else None, context_parallel=context_parallel,
            mlp=moe(config, process_set, expert_parallel) if config.experts else None))
    blocks.append(Head(config, process_set))
    if config.tie_embeddings:  # one Parameter in the first and the last block, as in one process
        blocks[-1].out.weight = blocks[0].tokens.weight
    return blocks


def moe(config: GPTConfig, process_set: ProcessSet | None, expert_parallel: ProcessSet | None) -> ep.MoE:
    """The MoE variant of a block's MLP: experts sharded over the EP set, each split over TP
    (``ParallelTransformerBlock`` refuses it with sequence parallelism over TP > 1)."""
    hidden = 4 * config.dim
    return ep.MoE(config.dim, hidden, config.experts, top_k=config.top_k, capacity_factor=config.capacity_factor,
                  aux_loss_coef=config.aux_loss_coef, process_set=expert_parallel,
                  expert=lambda: tp.ParallelMLP(config.dim, hidden, process_set=process_set))


def loss_function(config: GPTConfig, process_set: ProcessSet | None):
    """Mean next-character cross-entropy on vocab-parallel logits."""
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return tp.vocab_parallel_cross_entropy(logits, targets, process_set, vocab_size=config.vocab_size)
    return loss


def corpus() -> tuple[torch.Tensor, list[str]]:
    """The characters of Python's ``textwrap`` module as ids, and the alphabet."""
    text = inspect.getsource(textwrap)
    alphabet = sorted(set(text))
    index = {ch: i for i, ch in enumerate(alphabet)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), alphabet


def batch(data: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random windows of ``length`` characters, and the same windows shifted by one."""
    starts = torch.randint(0, data.numel() - length - 1, (rows,), generator=generator)
    windows = torch.stack([data[s:s + length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@dataclass
class Trainer:
    """One rank's share of the model, its pipeline and its data-parallel optimizer."""

    grid: ProcessGrid
    stage: pp.PipelineStage
    pipeline: pp.Pipeline
    optimizers: list  # the dense parameters' and, with experts, the experts' (reduced over other ranks)


def build_trainer(config: GPTConfig, grid: ProcessGrid, *, schedule: str | None = None, microbatches: int = 4,
                  chunks: int = 1, zero: bool = False, overlap: bool | None = None, lr: float = 3e-3,
                  seed: int = 0) -> Trainer:
    """The tiny GPT on ``grid``: TP layers over the TP set, ring attention over the CP set,
    experts over the EP set, stages over the PP set, and AdamW data-parallel over the DP × CP
    set (every rank holding the same parameters; allreduce after the step's last backward, or
    ZeRO-1).  Expert parameters are reduced over the ranks holding the same experts
    (``grid.edp_set``); each saw the tokens of ``ep`` DP ranks, so their gradients are first
    divided by ``ep``, which makes the average over ``edp_set`` the mean over every DP rank's
    loss, as for the dense parameters.  ``overlap`` is DistributedOptimizer's choice to
    all-reduce during that backward (default: when it pays; turn it off for CUDA with TP or
    PP, see the README)."""
    tp.manual_seed(seed, grid.tp_set)  # every rank draws the full model, then keeps its share
    stage = pp.PipelineStage(build_blocks(config, grid.tp_set, grid.cp_set, grid.ep_set), grid.pp_set,
                             chunks=chunks, recompute="full" if config.recompute == "full" else None)
    pipeline = pp.Pipeline(stage, loss_function(config, grid.tp_set), microbatches=microbatches,
                           schedule=schedule)
    experts, dense = ep.expert_parameters(stage)
    if zero:
        if experts:
            raise ValueError("the tiny GPT's ZeRO-1 option covers dense models only")
        return Trainer(grid, stage, pipeline,
                       [ZeroOptimizer(stage, torch.optim.AdamW, stage=1, process_set=grid.dp_cp_set, lr=lr)])
    if grid.ep_set is not None:
        for _, param in experts:
            param.register_hook(functools.partial(torch.mul, other=1.0 / grid.shape.ep))
    optimizers = [hvd.DistributedOptimizer(torch.optim.AdamW([p for _, p in named], lr=lr), named_parameters=named,
                                           backward_passes_per_step=microbatches, process_set=reduced_over,
                                           bucketing=Bucketing(overlap=overlap))
                  for named, reduced_over in ((dense, grid.dp_cp_set), (experts, grid.edp_set)) if named]
    return Trainer(grid, stage, pipeline, optimizers)


def train_step(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """One step on the global batch (each DP replica takes its rows, each CP rank its zig-zag
    part of every sequence); returns the global mean loss."""
    grid = trainer.grid
    if inputs.shape[0] % grid.shape.dp:
        raise ValueError(f"a global batch of {inputs.shape[0]} sequences does not split over dp={grid.shape.dp}")
    rows = inputs.shape[0] // grid.shape.dp
    mine = slice(grid.coords.dp * rows, (grid.coords.dp + 1) * rows)
    inputs, targets = inputs[mine], targets[mine]
    if grid.cp_set is not None:
        inputs, targets = (cp.split(t, 1, grid.coords.cp, grid.shape.cp) for t in (inputs, targets))
    loss = trainer.pipeline.step(inputs if grid.is_first_stage else None, targets if grid.is_last_stage else None)
    for optimizer in trainer.optimizers:
        optimizer.step()
        optimizer.zero_grad()
    return hvd.allreduce(loss.reshape(1), name="tiny_gpt.loss", process_set=grid.dp_cp_set).item()
