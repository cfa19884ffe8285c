"""Context-parallel benchmark: ring attention (``psrt.cp.ring_attention``) at CP = n, the
job's world size, against full attention of the whole sequence on one rank, forward +
backward, in one job.

Run under a launcher (CP size = the number of ranks; every ``--seq`` must divide by 2n)::

    psrun -np 2 python benchmarks/cp.py
    psrun -np 4 python benchmarks/cp.py --seq 1024,4096 --masks causal,none

The problem: q, k, v of ``[--batch, --heads, seq, --head-dim]`` in ``--dtype`` (the same
seeded tensors on every rank), loss = mean square of the output, no model around it.
``full``: every rank runs torch SDPA on the whole sequence by itself, at the same time
(n replicas, so it shares the cores exactly as the ring does); its time is the slowest
replica's.  ``ring``: ``ProcessGrid(cp=n)``, each rank holds its zig-zag part
(``cp.split``) and calls ``ring_attention`` over ``grid.cp_set``.  ``--masks`` picks
causal and/or non-causal (``none``) attention.  Step time: all setups are built up front;
after ``--warmup`` untimed steps each they take turns, every round timing one window of
``--steps`` steps per setup after a barrier and taking the slowest rank; the figure is the
median over ``--repeats`` rounds.  ``ring / full`` divides the ring's step time by full
attention's for the same sequence and mask.  ``comm share`` = ``cp.stats().seconds`` (time in
ring hops: the sends, receives and any wait for a slower peer) / step time, mean over ranks;
hops are per step and rank.  ``max diff``: largest |ring output - the matching part of full
attention's| over ranks, a sanity check.

Work per rank, counted from the zig-zag chunk pairs ring attention visits (2n chunks of
s/2n tokens; rank i keeps chunks i and 2n-1-i): ``useful`` = the score entries the mask
keeps, as a share of the whole sequence's (1/n on every rank, the point of zig-zag);
``executed`` = the entries ring attention computes, diagonal chunk pairs in full then
masked, as a share of the whole sequence's useful entries ((2n+1)/2n^2 causal: 0.625 at
n = 2, 0.28 at n = 4).  Both are the largest over ranks.  Bytes per rank and step: forward
n-1 hops of k and v (2E elements, E = b*h*(s/n)*d), backward n-1 hops of k, v and their
gradient accumulators (4E) plus one hop bringing dk, dv home (2E): (6n-4)E elements.
Minimum: each rank must receive every other rank's k/v chunks that its queries attend to
once (forward) and send its dk/dv contributions to them once (backward), keeping the k/v it
received for backward (mean over ranks; without the mask 4(n-1)E, an all-gather plus a
reduce-scatter); a scheme that does not keep them gathers them again.

On this 2-core host -np 4 oversubscribes the cores: four busy ranks share two cores, full
attention as four replicas too, so ``ring / full`` still compares like with like, but both
times are about twice a lone rank's and the job's real gain over one process alone is about
half of what 1 / ratio suggests; each hop also waits for peers that are descheduled, which
inflates the comm share.  What carries over to a real machine is the work share, the hop
count and the bytes.  Rank 0 prints a table and one JSON line.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import psrt.torch as hvd
from psrt import cp
from psrt.cp import zigzag
from psrt.grid import ProcessGrid

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def work_shares(n: int, seq: int, causal: bool) -> tuple[float, float]:
    """(useful, executed) score entries of the busiest rank, as shares of the whole
    sequence's useful entries, from the chunk pairs the ring visits."""
    if not causal:  # every rank attends its s/n queries to all s keys
        return 1 / n, 1 / n
    m, total = seq // (2 * n), seq * (seq + 1) / 2  # tokens per chunk, useful entries of the whole
    useful, executed = [], []
    for rank in range(n):
        pairs = [(qa, kb) for qa in zigzag.chunks_of(rank, n) for owner in range(n)
                 for kb in zigzag.chunks_of(owner, n) if kb <= qa]
        useful.append(sum(m * (m + 1) / 2 if qa == kb else m * m for qa, kb in pairs))
        executed.append(len(pairs) * m * m)
    return max(useful) / total, max(executed) / total


def ring_and_minimum_elements(n: int, elements: int, causal: bool) -> tuple[int, float]:
    """Elements each rank sends per step in ring attention, and the minimum (see the module
    docstring); ``elements`` = E, one of k or v on one rank."""
    ring = (n - 1) * 2 * elements + (n - 1) * 4 * elements + 2 * elements if n > 1 else 0
    needed = []  # chunks of other ranks' k/v each rank's queries attend to
    for rank in range(n):
        last_query = max(zigzag.chunks_of(rank, n))
        needed.append(sum(1 for owner in range(n) if owner != rank for chunk in zigzag.chunks_of(owner, n)
                          if chunk <= last_query or not causal))
    # a chunk of k + v is b*h*(s/2n)*d*2 = E elements; it comes in once and its gradient goes back once
    return ring, 2 * statistics.fmean(needed) * elements


def step(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for t in (q, k, v):
        t.grad = None
    attend(q, k, v).float().pow(2).mean().backward()


def slowest(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name=name))


def window(args, attend, tensors) -> tuple[float, float, float]:
    """Slowest rank's seconds per step over ``--steps`` steps, mean comm share, hops per step."""
    hvd.barrier()
    cp.stats().reset()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(attend, *tensors)
    mine = (time.perf_counter() - start) / args.steps
    share = statistics.fmean(hvd.allgather_object(cp.stats().seconds / args.steps / mine, name="bench.cp.share"))
    return slowest(mine, "bench.cp.time"), share, cp.stats().counts["hop"] / args.steps


def measure(args, seqs: list[int], masks: list[bool]) -> list[dict]:
    """Every (sequence, mask, full or ring) setup, taking turns window by window."""
    n, rank = hvd.size(), hvd.rank()
    grid = ProcessGrid(cp=n)
    dtype = DTYPES[args.dtype]
    setups, diffs = {}, {}
    for seq in seqs:
        g = torch.Generator().manual_seed(seq)
        whole = [torch.randn(args.batch, args.heads, seq, args.head_dim, generator=g).to(dtype) for _ in range(3)]
        full_qkv = [t.clone().requires_grad_() for t in whole]
        ring_qkv = [cp.split(t, 2, rank, n).requires_grad_() for t in whole]
        for causal in masks:
            def full(q, k, v, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def ring(q, k, v, causal=causal):
                return cp.ring_attention(q, k, v, grid.cp_set, causal=causal)

            setups[seq, causal, "full"] = (full, full_qkv)
            setups[seq, causal, "ring"] = (ring, ring_qkv)
            with torch.no_grad():  # sanity: the ring's part against the same part of full attention
                expected = cp.split(full(*whole), 2, rank, n)
                diff = (ring(*ring_qkv) - expected).abs().max().item()
            diffs[seq, causal] = slowest(diff, "bench.cp.diff")
    for attend, tensors in setups.values():
        for _ in range(args.warmup):
            step(attend, *tensors)
    times: dict[tuple, list[float]] = {key: [] for key in setups}
    shares: dict[tuple, list[float]] = {key: [] for key in setups}
    hops: dict[tuple, float] = {}
    for _ in range(args.repeats):
        for key, (attend, tensors) in setups.items():
            seconds, share, hops[key] = window(args, attend, tensors)
            times[key].append(seconds)
            shares[key].append(share)
    grid.free()
    rows = []
    for seq, causal, kind in setups:
        key, elements = (seq, causal, kind), args.batch * args.heads * (seq // n) * args.head_dim
        useful, executed = work_shares(n, seq, causal) if kind == "ring" else (1.0, 1.0)
        ring_elements, minimum = ring_and_minimum_elements(n, elements, causal)
        size = torch.tensor([], dtype=dtype).element_size()
        rows.append({"seq": seq, "causal": causal, "attention": kind, "cp": n if kind == "ring" else 1,
                     "step_s": statistics.median(times[key]),
                     "ring_vs_full": statistics.median(times[key]) / statistics.median(times[seq, causal, "full"]),
                     "useful_share": useful, "executed_share": executed,
                     "comm_share": statistics.median(shares[key]) if kind == "ring" else 0.0,
                     "hops_per_step": hops[key], "bytes_per_step": ring_elements * size if kind == "ring" else 0,
                     "min_bytes_per_step": minimum * size if kind == "ring" else 0,
                     "max_diff": diffs[seq, causal] if kind == "ring" else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", default="4096", help="whole sequence lengths, comma separated; each must divide by 2n")
    parser.add_argument("--masks", default="causal", help="comma separated: causal, none")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    seqs = [int(s) for s in args.seq.split(",")]
    masks = [{"causal": True, "none": False}[m.strip()] for m in args.masks.split(",")]
    if any(s % (2 * n) for s in seqs):
        parser.error(f"every --seq ({args.seq}) must divide by 2 x CP size = {2 * n} (zig-zag chunks)")
    rows = measure(args, seqs, masks)
    if hvd.rank() == 0:
        print(f"CP {n}, q/k/v [{args.batch}, {args.heads}, seq, {args.head_dim}] {args.dtype}, forward + backward; "
              f"median of {args.repeats} rounds, {args.steps}-step windows; full = SDPA on the whole sequence, "
              f"one replica per rank")
        print("| seq | mask | attention | step ms | ring / full | useful / executed work per rank | comm share "
              "| hops per step | MB per rank per step (min) | max diff |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            mask = "causal" if r["causal"] else "none"
            if r["attention"] == "full":
                print(f"| {r['seq']} | {mask} | full, 1 rank | {r['step_s'] * 1e3:.0f} | 1.00 | 1 / 1 | - | - | - "
                      "| - |")
                continue
            print(f"| {r['seq']} | {mask} | ring, CP {n} | {r['step_s'] * 1e3:.0f} | {r['ring_vs_full']:.2f} | "
                  f"{r['useful_share']:.3f} / {r['executed_share']:.3f} | {r['comm_share'] * 100:.0f}% | "
                  f"{r['hops_per_step']:g} | {r['bytes_per_step'] / 1e6:.1f} ({r['min_bytes_per_step'] / 1e6:.1f}) | "
                  f"{r['max_diff']:.1e} |")
        print(json.dumps({"benchmark": "cp", "ranks": n, "batch": args.batch, "heads": args.heads,
                          "head_dim": args.head_dim, "dtype": args.dtype, "results": rows}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
