"""Data-parallel training benchmark: psrt's DistributedOptimizer against what a user would
otherwise write (DDP over gloo, hand-written mpi4py loops), same run, same machine.

Run under a launcher with 2 ranks (or ``make bench-train``)::

    psrun -np 2 python benchmarks/train_dp.py            # both parts, under 2 minutes
    psrun -np 2 python benchmarks/train_dp.py --train    # training throughput only
    psrun -np 2 python benchmarks/train_dp.py --fusion   # fusion and engine overhead only

Training part.  For an MLP 784-1024-1024-10 (1.86 M parameters) and a small CNN on
1x28x28 inputs: samples per second of SGD on synthetic data, batch 64 per rank, one
torch thread per rank, for

  single  one process, no communication.  It runs on rank 0 inside the same job while
          the other ranks sleep in a polled non-blocking barrier (MPI's blocking barrier
          spins and would take a core), so it has the machine to itself as it would alone;
  no_comm every rank runs that same loop at once, without communicating: the ceiling for
          data parallelism on this machine (ranks contend for memory bandwidth and, on a
          small VM, for shared physical cores), so efficiency below 1 splits into what
          the machine costs (no_comm) and what communication costs (the rest);
  psrt    ``hvd.DistributedOptimizer`` as shipped: it overlaps allreduces with backward only
          where that can pay (GPU gradients, or spare cores; not on a 2-core box with 2 ranks);
  psrt_overlap  the same with ``Bucketing(overlap=True)``: allreduces start during backward,
          which shows what overlapping communication with backward gains or costs here;
  psrt_inplace  ``psrt`` with the loop zeroing gradients in place (``zero_grad(set_to_none=False)``,
          as the flat loop does): gradients are then views of the bucket buffers and each
          bucket is one allreduce of its buffer, with no copy (see psrt.dp.reducer);
  ddp     ``torch.nn.parallel.DistributedDataParallel`` over gloo;
  mpi4py  after backward, ``comm.Allreduce(MPI.IN_PLACE, ...)`` on a numpy view of each
          gradient, then divide by the ranks;
  flat    every gradient is a view of one flat buffer, reduced by one mpi4py Allreduce
          after backward (the best a loop that communicates only after backward can do;
          psrt's buckets are such buffers too, one allreduce each, with the average folded
          into the reduction).

The implementations take turns: each round gives every one a few untimed warm-up steps
and then one timed window, so drift on a busy box hits all alike.  A window starts
after a barrier and its time is the slowest rank's; the figure is the median over the
rounds.  Efficiency = samples/s / (ranks x single); the ratios psrt/ddp, psrt/flat and
psrt/no_comm compare samples/s.  After timing, the parameters of each data-parallel model
are compared across ranks (``in_sync``): identical initial weights plus averaged
gradients must keep them bit-identical.

Fusion part (``--fusion``).  200 float32 tensors of 10k elements (8 MB in all), each
submitted with ``hvd.allreduce_async_`` under its own name, then all synchronized; once
as views into one flat buffer submitted in memory order (an engine that fuses can reduce
the span in place) and once as 200 separate tensors (fusing needs a copy in and out);
then the same two lists in one ``hvd.grouped_allreduce_`` call (one submission, one
negotiation entry, one message).  References: one ``hvd.allreduce_`` of a 2M-element tensor, one raw mpi4py Allreduce of
2M floats, and 200 mpi4py Allreduces of 10k (no fusion at all).  Also the engine's
fixed cost per training step: ``allreduce_async_`` + ``synchronize`` of 6 tiny tensors
(the MLP has 6 parameter tensors) against 6 and 1 tiny mpi4py Allreduces.  Each call is
timed after a barrier; the figure is the median over calls of the slowest rank's time.

Rank 0 prints a table per model and per part, then one JSON line with every figure.
Figures are reported, never asserted.  The training part also draws
benchmarks/plots/dp_scaling.png from this run and the earlier runs of other rank counts
(kept in benchmarks/plots/dp_scaling.json).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import psrt.torch as hvd
from psrt.torch.optimizer import Bucketing

from _gloo import init_gloo  # noqa: E402
from _timing import median_call_seconds  # noqa: E402
import _plots  # noqa: E402
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI  # noqa: E402

BATCH = 64
LR = 1e-3
IMPLS = ("single", "no_comm", "psrt", "psrt_overlap", "psrt_inplace", "ddp", "mpi4py", "flat")
DATA_PARALLEL = ("psrt", "psrt_overlap", "psrt_inplace", "ddp", "mpi4py", "flat")
PSRT_VARIANTS = ("psrt", "psrt_overlap", "psrt_inplace")
FUSION_TENSORS, FUSION_NUMEL = 200, 10_000
TINY_TENSORS, TINY_NUMEL = 6, 4

comm = MPI.COMM_WORLD.Dup()   # our barriers and baselines never interleave with psrt's messages


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


# -- models and data ---------------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, 10))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}


def synthetic_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch per rank, different on each rank, so that averaging gradients matters."""
    gen = torch.Generator().manual_seed(1000 + comm.rank)
    return torch.randn(BATCH, 1, 28, 28, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


# -- one training step per implementation --------------------------------------------
def plain_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor,
               set_to_none: bool = True) -> Callable[[], None]:
    """The user's loop; single, no_comm, psrt and ddp differ only in what wraps the model or optimizer."""
    def step() -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def mpi4py_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in params:
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        torch._foreach_mul_([p.grad for p in params], 1.0 / comm.size)
        optimizer.step()
    return step


def flat_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Gradients live in one buffer: autograd accumulates into existing ``.grad`` views in
    place, so the buffer is zeroed rather than the gradients set to None."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    for p, view in zip(params, flat.split([p.numel() for p in params])):
        p.grad = view.view_as(p)
    flat_np = flat.numpy()

    def step() -> None:
        flat.zero_()
        F.cross_entropy(model(x), y).backward()
        comm.Allreduce(MPI.IN_PLACE, flat_np, op=MPI.SUM)
        flat.mul_(1.0 / comm.size)
        optimizer.step()

    step()
    if any(p.grad.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr() for p in params):
        raise RuntimeError("autograd replaced a gradient view of the flat buffer; the flat "
                           "baseline would reduce stale gradients")
    return step


def build_steps(name: str) -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module], int]:
    """A step function per implementation, each on its own copy of one initial model."""
    torch.manual_seed(0)   # the same initial weights on every rank: no broadcast needed
    base = MODELS[name]()
    x, y = synthetic_batch()
    models = {impl: copy.deepcopy(base) for impl in IMPLS}
    sgd = {impl: torch.optim.SGD(models[impl].parameters(), lr=LR)
           for impl in ("single", "no_comm", *PSRT_VARIANTS, "ddp")}
    distributed = hvd.DistributedOptimizer(sgd["psrt"], named_parameters=models["psrt"].named_parameters())
    in_place = hvd.DistributedOptimizer(sgd["psrt_inplace"], named_parameters=models["psrt_inplace"].named_parameters())
    overlapping = hvd.DistributedOptimizer(sgd["psrt_overlap"],
                                           named_parameters=models["psrt_overlap"].named_parameters(),
                                           bucketing=Bucketing(overlap=True))
    steps = {
        "single": plain_step(models["single"], sgd["single"], x, y),
        "no_comm": plain_step(models["no_comm"], sgd["no_comm"], x, y),
        "psrt": plain_step(models["psrt"], distributed, x, y),
        "psrt_overlap": plain_step(models["psrt_overlap"], overlapping, x, y),
        "psrt_inplace": plain_step(models["psrt_inplace"], in_place, x, y, set_to_none=False),
        "ddp": plain_step(DistributedDataParallel(models["ddp"]), sgd["ddp"], x, y),
        "mpi4py": mpi4py_step(models["mpi4py"], x, y),
        "flat": flat_step(models["flat"], x, y),
    }
    return steps, models, sum(p.numel() for p in base.parameters())


# -- timing ---------------------------------------------------------------------------
def idle_barrier() -> None:
    """A barrier that sleeps instead of spinning, so a waiting rank leaves its core free."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def timed_window(step: Callable[[], None], steps: int, warmup: int, alone: bool) -> float:
    """Seconds for ``steps`` steps after ``warmup`` untimed ones: the slowest rank's time,
    or, ``alone``, rank 0's while the others sleep."""
    comm.Barrier()
    elapsed = 0.0
    if comm.rank == 0 or not alone:
        for _ in range(warmup):
            step()
        if not alone:
            comm.Barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        elapsed = time.perf_counter() - start
    if alone:
        idle_barrier()
        return comm.bcast(elapsed)
    return comm.allreduce(elapsed, op=MPI.MAX)


def steps_per_window(step: Callable[[], None], window_s: float) -> int:
    """Steps that make a window of about ``window_s`` seconds, from rank 0 alone."""
    per_step = timed_window(step, 3, warmup=2, alone=True) / 3
    return max(3, round(window_s / per_step))


def in_sync(model: nn.Module) -> bool:
    """Whether every rank holds bit-identical parameters."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    root = mine.copy()
    comm.Bcast(root, root=0)
    return bool(comm.allreduce(int(np.array_equal(mine, root)), op=MPI.MIN))


def bench_model(name: str, args: argparse.Namespace) -> dict:
    steps, models, nparams = build_steps(name)
    per_window = steps_per_window(steps["single"], args.window_s)
    windows: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            windows[impl].append(timed_window(steps[impl], per_window, warmup=2, alone=impl == "single"))
    record: dict = {"params": nparams, "steps_per_window": per_window, "windows": args.rounds}
    for impl in IMPLS:
        seconds = statistics.median(windows[impl])
        ranks = 1 if impl == "single" else comm.size
        record[impl] = {"samples_per_s": round(BATCH * ranks * per_window / seconds, 1),
                        "step_ms": round(seconds / per_window * 1e3, 3)}
    single = record["single"]["samples_per_s"]
    for impl in IMPLS[1:]:
        record[impl]["efficiency"] = round(record[impl]["samples_per_s"] / (comm.size * single), 3)
    for impl in DATA_PARALLEL:
        record[impl]["in_sync"] = in_sync(models[impl])
    for variant in PSRT_VARIANTS:
        for baseline in ("ddp", "flat", "no_comm"):
            record[f"{variant}_over_{baseline}"] = round(
                record[variant]["samples_per_s"] / record[baseline]["samples_per_s"], 3)
    return record


def model_table(name: str, record: dict) -> str:
    lines = [f"\n## {name}: {record['params'] / 1e6:.2f} M parameters, batch {BATCH} per rank, "
             f"{comm.size} ranks; median of {record['windows']} windows of {record['steps_per_window']} steps",
             f"{'impl':<12} {'samples/s':>10} {'step ms':>8} {'efficiency':>10} {'in sync':>7}"]
    for impl in IMPLS:
        r = record[impl]
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        sync = str(r["in_sync"]).lower() if "in_sync" in r else "-"
        lines.append(f"{impl:<12} {r['samples_per_s']:>10.1f} {r['step_ms']:>8.2f} {eff:>10} {sync:>7}")
    for variant in PSRT_VARIANTS:
        lines.append("   ".join(f"{variant}/{baseline} {record[f'{variant}_over_{baseline}']:.2f}"
                                for baseline in ("ddp", "flat", "no_comm")))
    return "\n".join(lines)


# -- fusion and per-step overhead ------------------------------------------------------
def time_calls(calls: dict[str, Callable[[], None]], iters: int, rounds: int = 10) -> dict[str, float]:
    """Median over ``iters`` calls of the slowest rank's microseconds, per call, in ``rounds`` blocks."""
    return {name: round(seconds * 1e6, 1) for name, seconds in median_call_seconds(comm, calls, iters, rounds).items()}


def psrt_many(tensors: list[torch.Tensor], prefix: str) -> Callable[[], None]:
    """Submit every tensor by name, as DistributedOptimizer's hooks do, then wait for all."""
    names = [f"{prefix}.{i}" for i in range(len(tensors))]

    def call() -> None:
        handles = [hvd.allreduce_async_(t, name=n, op=hvd.Sum) for t, n in zip(tensors, names)]
        for handle in handles:
            hvd.synchronize(handle)
    return call


def mpi4py_many(arrays: list[np.ndarray]) -> Callable[[], None]:
    def call() -> None:
        for a in arrays:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
    return call


def checked(calls: dict[str, Callable[[], None]], buffers: dict[str, list]) -> None:
    """Run each call once on ones and check every element is the rank count, then zero the
    buffers (zeros keep timed in-place sums finite)."""
    for name, call in calls.items():
        for b in buffers[name]:
            b[:] = 1
        call()
        if not all(bool((b == comm.size).all()) for b in buffers[name]):
            raise RuntimeError(f"{name} returned a wrong sum on rank {comm.rank}")
        for b in buffers[name]:
            b[:] = 0


def bench_fusion(iters: int) -> dict:
    total = FUSION_TENSORS * FUSION_NUMEL
    flat = torch.zeros(total)
    views = list(flat.split(FUSION_NUMEL))
    separate = [torch.zeros(FUSION_NUMEL) for _ in range(FUSION_TENSORS)]
    big, big_np = torch.zeros(total), np.zeros(total, dtype=np.float32)
    small_np = [np.zeros(FUSION_NUMEL, dtype=np.float32) for _ in range(FUSION_TENSORS)]
    tiny = [torch.zeros(TINY_NUMEL) for _ in range(TINY_TENSORS)]
    tiny_np = [np.zeros(TINY_NUMEL, dtype=np.float32) for _ in range(TINY_TENSORS)]
    calls = {
        "psrt_200_views": psrt_many(views, "bench.fusion.view"),
        "psrt_200_separate": psrt_many(separate, "bench.fusion.separate"),
        "psrt_grouped_views": lambda: hvd.grouped_allreduce_(views, name="bench.fusion.gview", op=hvd.Sum),
        "psrt_grouped_separate": lambda: hvd.grouped_allreduce_(separate, name="bench.fusion.gsep",
                                                                op=hvd.Sum),
        "psrt_one_2M": lambda: hvd.allreduce_(big, name="bench.fusion.one", op=hvd.Sum),
        "mpi4py_one_2M": lambda: comm.Allreduce(MPI.IN_PLACE, big_np, op=MPI.SUM),
        "mpi4py_200": mpi4py_many(small_np),
        "psrt_step_6_tiny": psrt_many(tiny, "bench.step"),
        "mpi4py_6_tiny": mpi4py_many(tiny_np),
        "mpi4py_1_tiny": mpi4py_many(tiny_np[:1]),
    }
    checked(calls, {"psrt_200_views": [flat], "psrt_200_separate": separate, "psrt_one_2M": [big],
                    "psrt_grouped_views": [flat], "psrt_grouped_separate": separate,
                    "mpi4py_one_2M": [big_np], "mpi4py_200": small_np, "psrt_step_6_tiny": tiny,
                    "mpi4py_6_tiny": tiny_np, "mpi4py_1_tiny": tiny_np[:1]})
    us = time_calls(calls, iters)
    return {"time_us": us, "iters": iters,
            "views_over_one": round(us["psrt_200_views"] / us["psrt_one_2M"], 3),
            "separate_over_one": round(us["psrt_200_separate"] / us["psrt_one_2M"], 3),
            "separate_over_views": round(us["psrt_200_separate"] / us["psrt_200_views"], 3),
            "grouped_views_over_one": round(us["psrt_grouped_views"] / us["psrt_one_2M"], 3),
            "grouped_separate_over_one": round(us["psrt_grouped_separate"] / us["psrt_one_2M"], 3),
            "views_over_mpi4py_one": round(us["psrt_200_views"] / us["mpi4py_one_2M"], 3),
            "one_over_mpi4py_one": round(us["psrt_one_2M"] / us["mpi4py_one_2M"], 3),
            "views_over_mpi4py_200": round(us["psrt_200_views"] / us["mpi4py_200"], 3),
            "step_overhead_us": round(us["psrt_step_6_tiny"] - us["mpi4py_6_tiny"], 1)}


def fusion_table(record: dict) -> str:
    us = record["time_us"]
    lines = [f"\n## fusion: {FUSION_TENSORS} x {FUSION_NUMEL} float32 (8 MB), op Sum, {comm.size} ranks; "
             f"median of {record['iters']} calls, slowest rank",
             f"{'call':<20} {'us':>10}"]
    lines += [f"{name:<20} {t:>10.1f}" for name, t in us.items()]
    lines.append(f"grouped: 200 views / one 2M {record['grouped_views_over_one']:.2f}   200 separate / one 2M "
                 f"{record['grouped_separate_over_one']:.2f}")
    lines.append(f"200 views / one 2M {record['views_over_one']:.2f}   200 separate / one 2M "
                 f"{record['separate_over_one']:.2f}   psrt one 2M / mpi4py one 2M {record['one_over_mpi4py_one']:.2f}"
                 f"   200 views / mpi4py 200 {record['views_over_mpi4py_200']:.2f}")
    lines.append(f"engine cost per step of {TINY_TENSORS} tiny tensors: {us['psrt_step_6_tiny']:.1f} us "
                 f"({record['step_overhead_us']:+.1f} us over {TINY_TENSORS} mpi4py allreduces)")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    part = p.add_mutually_exclusive_group()
    part.add_argument("--train", action="store_true", help="only the training throughput part")
    part.add_argument("--fusion", action="store_true", help="only the fusion and per-step overhead part")
    p.add_argument("--rounds", type=int, default=7, help="timed windows per implementation and model")
    p.add_argument("--window-s", type=float, default=0.5, help="target length of one timed window")
    p.add_argument("--fusion-iters", type=int, default=60, help="timed calls per fusion variant")
    return p.parse_args()


def main() -> None:
    hvd.init()
    args = parse_args()
    if comm.size < 2:
        sys.exit("run this under a launcher with at least 2 ranks, e.g. "
                 "psrun -np 2 python benchmarks/train_dp.py")
    torch.set_num_threads(1)
    # A model trained on one fixed batch drives its gradients towards denormal floats,
    # whose arithmetic is many times slower on x86; flushing them keeps step times steady.
    torch.set_flush_denormal(True)
    summary: dict = {"bench": "train_dp", "ranks": comm.size, "batch_per_rank": BATCH}
    say(f"# psrt data-parallel training benchmark: {comm.size} ranks, torch {torch.__version__}, "
        "1 thread per rank")
    if not args.fusion:
        init_gloo(comm)
        for name in MODELS:
            summary[name] = bench_model(name, args)
            say(model_table(name, summary[name]))
        dist.destroy_process_group()
        if comm.rank == 0:
            runs = _plots.remember("dp_scaling", str(comm.size), {"batch_per_rank": BATCH, "models": {
                name: {impl: summary[name][impl]["samples_per_s"] for impl in ("single", "no_comm", "psrt", "ddp")}
                for name in MODELS}})
            say("# plot:", _plots.dp_scaling(runs))
    if not args.train:
        summary["fusion"] = bench_fusion(args.fusion_iters)
        say(fusion_table(summary["fusion"]))
    say(json.dumps(summary))
    hvd.shutdown()


if __name__ == "__main__":
    main()
