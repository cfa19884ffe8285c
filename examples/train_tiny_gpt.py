"""Training a tiny character-level GPT on any DP × TP × PP layout.

Run with ``psrun -np 4 python examples/train_tiny_gpt.py --dp 1 --tp 2 --pp 2``
(``make demo-gpt``); the product of ``--dp --tp --pp --cp`` must equal the number
of ranks.  The text is the source of Python's ``textwrap`` module.  Every layout
starts from the same weights (one seed, whatever the split) and sees the same
global batches, so every layout follows the same loss curve as one process.
Rank 0 shows a progress bar with the loss and ends with a line such as
``dp=1 tp=2 pp=2 (1f1b, 4 micro-batches): loss 4.60 -> 2.35 in 100 steps``.
"""
from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

import psrt.torch as hvd
from psrt.grid import ProcessGrid
from tiny_gpt import GPTConfig, batch, build_trainer, corpus, train_step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: ranks / (tp × pp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (ring attention over the sequence)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides the DP size; needs --experts)")
    p.add_argument("--experts", type=int, default=0, help="make every MLP a mixture of this many experts")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--capacity-factor", type=float, default=None, help="expert capacity (default: dropless)")
    p.add_argument("--aux-loss-coef", type=float, default=0.01, help="weight of the load-balancing loss")
    p.add_argument("--schedule", default=None, choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                   help="default: interleaved with --chunks > 1, else 1f1b; zb-h1 splits each backward and "
                        "defers the weight half into the bubble")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved schedule)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--zero", action="store_true", help="ZeRO-1 over the DP set instead of allreduce")
    p.add_argument("--dropout", type=float, default=0.0, help="attention and residual dropout")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="the output projection uses the token embedding's weight (GPT-2), across stages too")
    p.add_argument("--recompute", choices=("full", "selective"), default=None,
                   help="activation recomputation: every block (full) or the attention core (selective)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--sequence-length", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    if args.ep > 1 and not args.experts:
        raise SystemExit("--ep shards experts: give --experts as well")
    dp = args.dp if args.dp is not None else max(1, hvd.size() // (args.tp * args.pp * args.cp))
    grid = ProcessGrid(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep)
    data, alphabet = corpus()
    config = GPTConfig(vocab_size=len(alphabet), sequence_length=args.sequence_length, dim=args.dim,
                       heads=args.heads, layers=args.layers, sequence_parallel=args.sequence_parallel,
                       dropout=args.dropout, recompute=args.recompute, experts=args.experts, top_k=args.top_k,
                       capacity_factor=args.capacity_factor, aux_loss_coef=args.aux_loss_coef,
                       tie_embeddings=args.tie_embeddings)
    trainer = build_trainer(config, grid, schedule=args.schedule, microbatches=args.microbatches,
                            chunks=args.chunks, zero=args.zero, lr=args.lr, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    layout = (f"dp={dp} tp={args.tp} pp={args.pp}" + (f" cp={args.cp}" if args.cp > 1 else "")
              + (f" ep={args.ep} ({args.experts} experts, top-{args.top_k})" if args.experts else ""))
    losses = []
    with tqdm(range(args.steps), desc=f"tiny GPT, {layout}", unit="step", disable=hvd.rank() != 0) as steps:
        for _ in steps:
            inputs, targets = batch(data, args.batch_size, args.sequence_length, generator)
            losses.append(train_step(trainer, inputs, targets))
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
    if hvd.rank() == 0:
        print(f"{layout} ({trainer.pipeline.schedule}, {args.microbatches} micro-batches): loss {losses[0]:.2f} -> "
              f"{losses[-1]:.2f} in {args.steps} steps")
    hvd.shutdown()


if __name__ == "__main__":
    main()
