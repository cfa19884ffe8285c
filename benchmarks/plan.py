"""Layout planner benchmark: the planner's predicted step times of several layouts of the tiny
GPT against their measured ones, on this machine, in one job.

Run under a launcher (``make bench-plan``)::

    psrun -np 2 python benchmarks/plan.py
    psrun -np 2 python benchmarks/plan.py --machine psrt-machine.json --rounds 9

Model: the tiny GPT (examples/tiny_gpt.py) with ``--layers`` blocks of ``--dim`` and
``--heads``, sequences of ``--seq`` characters, a global batch of ``--batch`` sequences,
AdamW, float32, one torch thread per rank.  Layouts on 2 ranks: data parallel (allreduce, or
ZeRO-1/2 over the two ranks), with gradient accumulation and with full recomputation;
tensor parallel with and without sequence parallelism; pipeline (1F1B) with two
micro-batch counts.  Every one trains the same global batch per step.

Prediction: ``psrt.plan.evaluate`` for each layout, on the machine figures of
``--machine``, or else of the probe (``psrt.plan.probe.measure``) run at the start of this
job, under the same conditions as the timed steps.  Measurement: every layout is built up
front; they take turns; each round gives every layout one untimed step, then times
``--steps`` steps after a barrier, taking the slowest rank; the figure is the median over
``--rounds`` rounds.  Reported: each layout's predicted and measured step time, their ratio,
both ranks, and Spearman's rank correlation between prediction and measurement (1: the same
order).  The 1-minute load average at the start and the end says whether other jobs shared
the cores (the TP layouts suffer most: every collective waits for a descheduled peer); the
probe and the timed steps both assume they did not.  Rank 0 prints a table and one JSON
line.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import psrt.torch as hvd
from psrt import plan, pp, tp
from psrt.grid import ProcessGrid
from psrt.plan import probe
from psrt.zero import ZeroOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tiny_gpt import GPTConfig, Trainer, batch, build_blocks, build_trainer, corpus, loss_function, train_step  # noqa: E402

#: name, dp, tp, pp, ZeRO stage, micro-batches, recompute, sequence parallelism
LAYOUTS = [
    ("dp2", 2, 1, 1, 0, 1, None, False),
    ("dp2 accumulate 4", 2, 1, 1, 0, 4, None, False),
    ("dp2 zero1", 2, 1, 1, 1, 1, None, False),
    ("dp2 zero2", 2, 1, 1, 2, 1, None, False),
    ("dp2 full recompute", 2, 1, 1, 0, 1, "full", False),
    ("tp2", 1, 2, 1, 0, 1, None, False),
    ("tp2+sp accumulate 4", 1, 2, 1, 0, 4, None, True),
    ("pp2 m4", 1, 1, 2, 0, 4, None, False),
    ("pp2 m8", 1, 1, 2, 0, 8, None, False),
]


def build(config: GPTConfig, dp: int, tp_size: int, pp_size: int, zero: int, microbatches: int) -> Trainer:
    """psrt's tiny GPT trainer; ZeRO-2 (which it does not offer) wraps the same stage here.  ZeRO-3
    cannot: the GPT's embedding reads its position table without calling that module, so the
    table is never gathered."""
    grid = ProcessGrid(dp=dp, tp=tp_size, pp=pp_size)
    if zero < 2:
        return build_trainer(config, grid, microbatches=microbatches, zero=zero == 1)
    tp.manual_seed(0, grid.tp_set)
    stage = pp.PipelineStage(build_blocks(config, grid.tp_set), grid.pp_set,
                             recompute="full" if config.recompute == "full" else None)
    pipeline = pp.Pipeline(stage, loss_function(config, grid.tp_set), microbatches=microbatches)
    optimizer = ZeroOptimizer(stage, torch.optim.AdamW, stage=zero, process_set=grid.dp_cp_set, lr=3e-3)
    return Trainer(grid, stage, pipeline, [optimizer])


def slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd.Max, name="bench.plan.time"))


def timed_window(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor, steps: int) -> float:
    train_step(trainer, inputs, targets)  # untimed: the turn's first step
    hvd.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        train_step(trainer, inputs, targets)
    return slowest((time.perf_counter() - start) / steps)


def ranks_of(values: list[float]) -> list[float]:
    """1 for the smallest; ties share their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks."""
    ra, rb = ranks_of(a), ranks_of(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per window")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--machine", help="a machine profile (default: probe this job's ranks first)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    load_before = os.getloadavg()[0]
    if hvd.size() != 2:
        raise SystemExit("benchmarks/plan.py runs its layouts on exactly 2 ranks: psrun -np 2")
    machine = plan.load_machine(args.machine) if args.machine else probe.measure()
    data, alphabet = corpus()
    inputs, targets = batch(data, args.batch, args.seq, torch.Generator().manual_seed(0))
    setups, predicted = {}, {}
    for name, dp, tp_size, pp_size, zero, m, recompute, sp in LAYOUTS:
        config = GPTConfig(vocab_size=len(alphabet), sequence_length=args.seq, dim=args.dim, heads=args.heads,
                           layers=args.layers, recompute=recompute, sequence_parallel=sp)
        setups[name] = build(config, dp, tp_size, pp_size, zero, m)
        layout = plan.Layout(dp=dp, tp=tp_size, pp=pp_size, cp=1, zero=zero, micro_batch=args.batch // dp // m,
                             micro_batches=m, recompute=recompute or "none", sequence_parallel=sp)
        predicted[name] = plan.evaluate(plan.from_config(config), layout, global_batch=args.batch, machine=machine,
                                        precision=plan.precision("fp32")).time.total
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, trainer in setups.items():
            times[name].append(timed_window(trainer, inputs, targets, args.steps))
    if hvd.rank() == 0:
        report(args, machine, predicted, {name: statistics.median(values) for name, values in times.items()},
               (load_before, os.getloadavg()[0]))
    hvd.shutdown()


def report(args: argparse.Namespace, machine: plan.Machine, predicted: dict[str, float],
           measured: dict[str, float], load: tuple[float, float]) -> None:
    names = list(predicted)
    rho = spearman([predicted[n] for n in names], [measured[n] for n in names])
    want, got = ranks_of([predicted[n] for n in names]), ranks_of([measured[n] for n in names])
    print(f"tiny GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, sequence {args.seq}, global batch "
          f"{args.batch}, fp32 AdamW, 2 ranks; measured: median of {args.rounds} rounds of {args.steps}-step windows")
    print(f"machine: {machine.name}; 1-minute load average {load[0]:.2f} at the start, {load[1]:.2f} at the end "
          "(it lags by a minute or so; this job's 2 ranks add about 2)")
    print("| layout | predicted ms | measured ms | predicted / measured | predicted rank | measured rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, n in enumerate(names):
        print(f"| {n} | {predicted[n] * 1e3:.1f} | {measured[n] * 1e3:.1f} | {predicted[n] / measured[n]:.2f} | "
              f"{want[i]:g} | {got[i]:g} |")
    print(f"Spearman's rank correlation: {rho:.2f} over {len(names)} layouts")
    print(json.dumps({"benchmark": "plan", "ranks": 2, "machine": machine.name, "load_average": load, "spearman": rho,
                      "layouts": {n: {"predicted_s": predicted[n], "measured_s": measured[n]} for n in names}}))


if __name__ == "__main__":
    main()
