"""Activation recomputation benchmark: activation bytes a ``tp.ParallelTransformerBlock``
keeps for backward, and the step time each recompute mode costs (None, "selective",
"full"), at TP size t = world size, with and without sequence parallelism.

Run under a launcher (t = the number of ranks; ``--heads`` and ``--seq`` must divide by it)::

    psrun -np 1 python benchmarks/recompute.py
    psrun -np 2 python benchmarks/recompute.py --sequence-parallel on

Every block has ``--dim``, ``--heads``, MLP 4 x dim, dropout ``--dropout`` on both branches
and ``--attention-dropout`` on the attention probabilities, in training mode, seeded with
``tp.manual_seed(0, tp_set)``; the global input is ``[--batch, --seq, --dim]`` and with
sequence parallelism each rank takes its 1/t of the sequence.

Kept bytes: one block in ``--dtype`` (bfloat16, the 16 bits the formula assumes), one
untimed forward, then ``torch.profiler`` (CPU, ``profile_memory=True``) around a second
forward only.  The net bytes it allocated (sum of ``cpu_memory_usage`` over top-level
events) minus the output (the next block's input, counted there) plus the input (kept
alive by the block for backward, though allocated before) are what the block holds until
backward; the figure is the largest over ranks.  Formula: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", Table 2) and the
Ultra-Scale Playbook, 16-bit activations and 1-byte dropout masks, per layer:
no recompute sbh(34 + 5as/h), selective 34sbh, full 2sbh (the input only); with TP t and
sequence parallelism each divided by t; with TP t alone sbh(10 + 24/t + 5as/(ht)) and
sbh(10 + 24/t), full 2sbh.

Step time: forward and backward (loss = mean square of the output, in float32) of
``--layers`` such blocks in ``--time-dtype``, no optimizer.  Every (sequence parallel,
mode) setup is built up front; after ``--warmup`` untimed steps each, the setups take
turns, every round timing one window of ``--steps`` steps per setup after a barrier and
taking the slowest rank; the figure is the median over ``--repeats`` rounds, and
``vs none`` divides it by the same row's no-recompute time (Megatron-LM reports about
+2-4 % for selective and +30 % for full on GPUs).  ``--time-dtype`` defaults to float32
because CPUs without bfloat16 units (this 2-core AVX2 host) emulate bfloat16 matmuls at
~1 GFLOP/s, 30-50x slower than float32: a bfloat16 step would time the emulation and take
minutes.  Ask for ``--time-dtype bfloat16`` on a CPU with AVX512-BF16 or AMX.

Kineto's USDT/STAGE lines on stderr are silenced by ``KINETO_LOG_LEVEL=6`` (set unless the
environment sets it; this also hides kineto's own error lines).  One c10 line per rank, "Memory
block of unknown size was allocated before the profiling started", remains: dropout swaps
the tracker's ~5 KB RNG state tensor, allocated before the profiled forward, which the
measurement therefore misses (negligible).
Rank 0 prints a table and one JSON line.  Nothing is asserted.
"""
from __future__ import annotations

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before torch loads kineto

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import psrt.torch as hvd
from psrt import tp
from psrt.grid import ProcessGrid

MODES = (None, "selective", "full")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def label(mode: str | None) -> str:
    return mode or "none"


def formula_bytes(args, t: int, sequence_parallel: bool, mode: str | None) -> float:
    """Korthikanti et al.'s 16-bit activation bytes of one layer on one rank."""
    s, b, h, a = args.seq, args.batch, args.dim, args.heads
    if mode == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    linear = 34 * s * b * h / t if sequence_parallel else (10 + 24 / t) * s * b * h
    return linear + (5 * a * s * s * b / t if mode is None else 0)


def build(args, grid: ProcessGrid, sequence_parallel: bool, mode: str | None, layers: int,
          dtype: torch.dtype) -> torch.nn.Module:
    tp.manual_seed(0, grid.tp_set)
    return torch.nn.Sequential(*[
        tp.ParallelTransformerBlock(args.dim, args.heads, process_set=grid.tp_set, sequence_parallel=sequence_parallel,
                                    dropout=args.dropout, attention_dropout=args.attention_dropout, recompute=mode)
        for _ in range(layers)]).to(dtype)


def local_input(x: torch.Tensor, grid: ProcessGrid, sequence_parallel: bool, dtype: torch.dtype) -> torch.Tensor:
    local = x.chunk(grid.tp_set.size(), dim=1)[grid.coords.tp] if sequence_parallel else x
    return local.to(dtype).contiguous().requires_grad_()


def nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def kept_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes one forward leaves allocated for backward: net allocation under the profiler,
    less the output, plus the input the autograd graph keeps alive."""
    block(x)  # untimed: one-off allocations stay out of the measurement
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = block(x)
    net = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_parent is None)
    return net - nbytes(y) + nbytes(x)


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).float().pow(2).mean().backward()


def slowest(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor([value], dtype=torch.float64), op=hvd.Max, name=name))


def window(args, model: torch.nn.Module, x: torch.Tensor) -> float:
    """Slowest rank's seconds per step over ``--steps`` steps."""
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(model, x)
    return slowest((time.perf_counter() - start) / args.steps, "bench.recompute.time")


def measure(args, sp_modes: list[bool], x: torch.Tensor) -> list[dict]:
    t = hvd.size()
    grid = ProcessGrid(dp=1, tp=t, pp=1)
    dtype, time_dtype = DTYPES[args.dtype], DTYPES[args.time_dtype]
    rows, setups = {}, {}
    for sp in sp_modes:
        for mode in MODES:
            kept = kept_bytes(build(args, grid, sp, mode, 1, dtype), local_input(x, grid, sp, dtype))
            formula = formula_bytes(args, t, sp, mode)
            rows[sp, mode] = {"tp": t, "sequence_parallel": sp, "recompute": label(mode),
                              "kept_bytes": slowest(kept, "bench.recompute.bytes"), "formula_bytes": formula}
            setups[sp, mode] = (build(args, grid, sp, mode, args.layers, time_dtype),
                                local_input(x, grid, sp, time_dtype))
    for model, local in setups.values():
        for _ in range(args.warmup):
            step(model, local)
    times: dict[tuple, list[float]] = {key: [] for key in setups}
    for _ in range(args.repeats):
        for key, (model, local) in setups.items():
            times[key].append(window(args, model, local))
    grid.free()
    for (sp, mode), row in rows.items():
        row["step_s"] = statistics.median(times[sp, mode])
        row["vs_none"] = row["step_s"] / statistics.median(times[sp, None])
        row["kept_vs_formula"] = row["kept_bytes"] / row["formula_bytes"]
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="blocks in the timed stack")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8, help="must divide by the TP size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512, help="must divide by the TP size")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="of the kept-bytes block")
    parser.add_argument("--time-dtype", choices=sorted(DTYPES), default="float32", help="of the timed stack")
    parser.add_argument("--sequence-parallel", choices=["off", "on", "both"], default="both",
                        help="with TP > 1 (TP 1 runs without)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per window")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    t = hvd.size()
    if args.heads % t or args.seq % t:
        parser.error(f"the TP size {t} must divide --heads ({args.heads}) and --seq ({args.seq})")
    sp_modes = {"off": [False], "on": [True], "both": [False, True]}[args.sequence_parallel] if t > 1 else [False]
    x = torch.randn(args.batch, args.seq, args.dim, generator=torch.Generator().manual_seed(1))
    rows = measure(args, sp_modes, x)
    if hvd.rank() == 0:
        sbh = args.seq * args.batch * args.dim
        print(f"TP {t}, blocks dim {args.dim} heads {args.heads}, input [{args.batch}, {args.seq}, {args.dim}], "
              f"dropout {args.dropout}/{args.attention_dropout}; kept bytes per block in {args.dtype} "
              f"(sbh = {sbh}); step of {args.layers} blocks in {args.time_dtype}, median of {args.repeats} rounds, "
              f"{args.steps}-step windows")
        print("| mode | recompute | kept MB | kept / sbh | formula MB | kept / formula | step ms | vs none |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            mode = f"tp {t} + sp" if r["sequence_parallel"] else f"tp {t}"
            print(f"| {mode} | {r['recompute']} | {r['kept_bytes'] / 1e6:.2f} | {r['kept_bytes'] / sbh:.1f} | "
                  f"{r['formula_bytes'] / 1e6:.2f} | {r['kept_vs_formula']:.2f} | {r['step_s'] * 1e3:.0f} | "
                  f"{r['vs_none']:.2f} |")
        print(json.dumps({"benchmark": "recompute", "ranks": t, "layers": args.layers, "dim": args.dim,
                          "heads": args.heads, "batch": args.batch, "seq": args.seq, "dropout": args.dropout,
                          "attention_dropout": args.attention_dropout, "dtype": args.dtype,
                          "time_dtype": args.time_dtype, "results": rows}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
