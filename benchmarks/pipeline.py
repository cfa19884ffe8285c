"""Pipeline benchmark: measured bubble fraction of the GPipe, 1F1B and ZB-H1 schedules against
the theoretical (p - 1) / (m + p - 1) (ZB-H1: (p - 1) / (3m + p - 1)), and peak activation
memory per stage, in one job.

Run under a launcher; the number of pipeline stages p is the world size::

    psrun -np 2 python benchmarks/pipeline.py
    psrun -np 4 python benchmarks/pipeline.py --microbatches 1,4,8,16 --repeats 5
    psrun -np 4 python benchmarks/pipeline.py --timeline 1f1b:8     # also draw one step

Stage compute (``--compute``):

  sleep  (default) each stage is one block whose forward sleeps ``--forward-ms`` per
         micro-batch and whose backward sleeps twice that (half on the input gradient's
         branch, half on the weight's, which ZB-H1 runs apart), so the schedule, not the CPU,
         sets the timing: sleeping ranks do not compete for cores, and 4 ranks on a 2-core
         host measure the same bubble as 4 hosts would.  The block carries a real
         activation of ``--batch`` x ``--width`` floats per step (saved for backward, sent
         to the next stage), so the activation memory is real.
  real   each stage runs ``--layers-per-stage`` Linear+ReLU layers of ``--width`` (real
         matrix products).  Without a spare core per rank (each rank also runs psrt's
         engine thread, and a rank waiting in a receive may poll) this measures CPU
         contention as much as the schedule: on a 2-core host it reads above the theory
         already at -np 2 and means little at -np 4.

Measured bubble = 1 - (forward and backward compute summed over ranks) / (p x step wall),
step wall being the slowest rank's (``Pipeline.profile``): the idle share of the step's
rank-time, the quantity (p - 1) / (m + p - 1) predicts; ``ratio`` = measured / theoretical,
above 1 by the messages' and Python's cost per micro-batch.  ``rank mean idle/wall``
averages each rank's own idle / wall instead; it reads below the theory because a rank's
wall ends at its last backward, and rank r's comes about r backwards before the step's
end.  Figures are medians over ``--repeats`` steps after ``--warmup``, the schedules taking
turns.  The sleep is per micro-batch whatever m, so a step lasts about
(m + p - 1) x 3 x ``--forward-ms``.

Peak activation is the most bytes autograd held for backward at once on each stage
(sleep: in-flight x one micro-batch's activation; the last stage also holds the loss's
saved tensors); in-flight is the most micro-batches held (1F1B: p - stage, GPipe: m, ZB-H1:
min(p, m) on every stage, from forward to weight half; it also keeps each deferred weight
half's output gradient).
Rank 0 prints a table and one JSON line.  Nothing is asserted.  It also draws one more step of
each schedule, measured against simulated, into benchmarks/plots/pipeline_timeline.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import psrt.torch as hvd
from psrt import pp
from psrt.grid import ProcessGrid

import _plots

SCHEDULES = ("gpipe", "1f1b", "zb-h1")


class _SleepForward(torch.autograd.Function):
    """Identity that sleeps ``ms`` in forward."""

    @staticmethod
    def forward(ctx, x, ms):
        time.sleep(ms / 1e3)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SleepBackward(torch.autograd.Function):
    """Identity that sleeps ``ms`` in backward."""

    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.ms / 1e3)
        return grad, None


class SleepBlock(torch.nn.Module):
    """``x * w``: forward sleeps ``ms``; backward sleeps ``ms`` on the input's branch and ``ms``
    on the weight's, so a whole backward takes 2 ms and ZB-H1's split halves take one each."""

    def __init__(self, forward_ms: float) -> None:
        super().__init__()
        self.forward_ms = forward_ms
        self.w = torch.nn.Parameter(torch.ones(1))  # so the first stage has something to differentiate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.requires_grad:  # the first stage's input branch costs what every stage's does
            x = x.detach().requires_grad_()
        ms = self.forward_ms
        product = _SleepBackward.apply(x, ms) * _SleepBackward.apply(self.w, ms)
        return _SleepForward.apply(product, ms)


def build_stage(args, grid: ProcessGrid, p: int) -> pp.PipelineStage:
    torch.manual_seed(0)
    if args.compute == "sleep":
        blocks = [SleepBlock(args.forward_ms) for _ in range(p)]
        return pp.PipelineStage(blocks, grid.pp_set, split=[1] * p)
    layers = args.layers_per_stage
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
              for _ in range(p * layers)]
    return pp.PipelineStage(blocks, grid.pp_set, split=[layers] * p)


def mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y - target).pow(2).mean()


def theoretical(schedule: str, p: int, m: int) -> float | None:
    """The bubble theory predicts, with backward = 2 x forward: (p - 1)/(m + p - 1) for GPipe and
    1F1B; for ZB-H1, whose weight half (1 forward) fills the cool-down, (p - 1)/(3m + p - 1)
    once m >= p (fewer micro-batches than stages: no closed form, see the simulated column)."""
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1) if m >= p else None
    return (p - 1) / (m + p - 1)


def gather(grid: ProcessGrid, value) -> list:
    """``value`` of every stage, indexed by stage."""
    return hvd.allgather_object(value, name="bench.pipeline.gather", process_set=grid.pp_set)


def run_step(pipe: pp.Pipeline, stage: pp.PipelineStage, x, y) -> pp.StepProfile:
    stage.zero_grad(set_to_none=True)
    pipe.step(x, y)
    return pipe.profile


def measure(args, grid: ProcessGrid, stage: pp.PipelineStage, p: int, m: int, x, y) -> dict[str, dict]:
    """Every schedule at ``m`` micro-batches, taking turns; rank-0 figures per schedule."""
    pipes = {s: pp.Pipeline(stage, mse, microbatches=m, schedule=s) for s in args.schedules}
    figures: dict[str, dict[str, list[float]]] = {s: {"step": [], "rank_mean": [], "wall": []} for s in pipes}
    peak = {s: 0 for s in pipes}
    held = {s: 0 for s in pipes}
    for _ in range(args.warmup):
        for pipe in pipes.values():
            run_step(pipe, stage, x, y)
    for _ in range(args.repeats):
        for s, pipe in pipes.items():
            prof = run_step(pipe, stage, x, y)
            per_rank = gather(grid, (prof.compute, prof.wall))
            wall = max(w for _, w in per_rank)
            figures[s]["step"].append(1 - sum(c for c, _ in per_rank) / (p * wall))
            figures[s]["rank_mean"].append(statistics.fmean(1 - c / w for c, w in per_rank))
            figures[s]["wall"].append(wall)
            peak[s] = max(peak[s], prof.peak_activation_bytes)
            held[s] = max(held[s], prof.in_flight)
    out = {}
    for s in pipes:
        median = {k: statistics.median(v) for k, v in figures[s].items()}
        theory = theoretical(s, p, m)
        plan = pp.build(s, p, m)
        simulated = pp.bubble_fraction(pp.simulate(plan, forward_time=1.0, backward_time=2.0, weight_time=1.0))
        out[s] = {"schedule": s, "p": p, "m": m, "measured": median["step"], "rank_mean_idle": median["rank_mean"],
                  "simulated": simulated, "theoretical": theory,
                  "ratio": median["step"] / theory if theory else None, "step_s": median["wall"],
                  "peak_activation_bytes": gather(grid, peak[s]), "in_flight": gather(grid, held[s]),
                  "in_flight_expected": [pp.in_flight(actions) for actions in plan]}
    return out


def timeline(args, grid: ProcessGrid, stage: pp.PipelineStage, p: int, x, y) -> str:
    name, m = args.timeline.split(":")
    pipe = pp.Pipeline(stage, mse, microbatches=int(m), schedule=name)
    run_step(pipe, stage, x, y)  # warm-up
    events = gather(grid, run_step(pipe, stage, x, y).events)
    return f"{name}, p = {p}, m = {m} (times from each rank's own step start):\n" + pp.render(events, width=100)


def plot_panels(args, grid: ProcessGrid, stage: pp.PipelineStage, p: int, m: int, x, y) -> dict[str, tuple]:
    """Per schedule, one measured step's events of every rank and the simulated ones."""
    panels = {}
    for name in args.schedules:
        pipe = pp.Pipeline(stage, mse, microbatches=m, schedule=name)
        run_step(pipe, stage, x, y)  # warm-up
        measured = gather(grid, run_step(pipe, stage, x, y).events)
        panels[name] = (measured, pp.simulate(pp.build(name, p, m), forward_time=1.0, backward_time=2.0,
                                              weight_time=1.0))
    return panels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", default="1,4,8,16", help="comma-separated m values")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated: gpipe, 1f1b, zb-h1")
    parser.add_argument("--compute", choices=["sleep", "real"], default="sleep")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="sleep: forward per micro-batch")
    parser.add_argument("--batch", type=int, default=64, help="rows per step (every m must divide it)")
    parser.add_argument("--width", type=int, default=1024, help="activation features (real: layer width)")
    parser.add_argument("--layers-per-stage", type=int, default=4, help="real compute only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeline", nargs="?", const="1f1b:8", metavar="SCHEDULE:M",
                        help="also draw one step of SCHEDULE with M micro-batches (default 1f1b:8)")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    microbatches = [int(m) for m in args.microbatches.split(",")]
    torch.set_num_threads(1)
    hvd.init()
    p = hvd.size()
    grid = ProcessGrid(dp=1, tp=1, pp=p)
    stage = build_stage(args, grid, p)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=data) if grid.is_first_stage else None
    y = torch.randn(args.batch, args.width, generator=data) if grid.is_last_stage else None
    rows = {f"{s}/m{m}": r for m in microbatches
            for s, r in measure(args, grid, stage, p, m, x, y).items()}
    drawing = timeline(args, grid, stage, p, x, y) if args.timeline else None
    plot_m = max([m for m in microbatches if m <= 2 * p] or [min(microbatches)])
    panels = plot_panels(args, grid, stage, p, plot_m, x, y)
    if hvd.rank() != 0:
        return
    compute = f"sleep {args.forward_ms:g} ms forward, {2 * args.forward_ms:g} ms backward per micro-batch" \
        if args.compute == "sleep" else f"real: {args.layers_per_stage} x Linear({args.width}) per stage"
    print(f"{p} stages, batch {args.batch} x {args.width} fp32 ({args.batch * args.width * 4 / 1e6:.2f} MB "
          f"per stage and step), {compute}; median of {args.repeats} steps")
    print("| schedule | p | m | bubble measured | rank mean idle/wall | theoretical | ratio | step ms | "
          "peak activation MB per stage | in-flight per stage |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows.values():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        theory = f"{r['theoretical']:.3f}" if r["theoretical"] is not None else f"({r['simulated']:.3f} sim.)"
        peaks = ", ".join(f"{b / 1e6:.2f}" for b in r["peak_activation_bytes"])
        print(f"| {r['schedule']} | {p} | {r['m']} | {r['measured']:.3f} | {r['rank_mean_idle']:.3f} | "
              f"{theory} | {ratio} | {r['step_s'] * 1e3:.0f} | [{peaks}] | {r['in_flight']} |")
    if drawing:
        print(drawing)
    print(json.dumps({"benchmark": "pipeline", "stages": p, "compute": args.compute,
                      "forward_ms": args.forward_ms, "batch": args.batch, "width": args.width,
                      "repeats": args.repeats, "results": rows}))
    print("# plot:", _plots.pipeline_timeline(panels, plot_m, f"{p} stages, {compute}"))


if __name__ == "__main__":
    main()
