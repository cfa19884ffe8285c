"""Data parallelism on a crowded host: psrt against gloo when the ranks share their cores.

Run under a launcher (or ``make bench-crowded``)::

    psrun -np 2 python benchmarks/crowded.py

Training with data-loader workers, a tokenizer or a second job beside the ranks leaves
more runnable processes than cores.  A rank that waits by spinning then takes the core
that the rank it waits for (or the other work) needs; gloo waits in the kernel.  This
benchmark runs the same steps on an idle host and then with each rank starting
``--busy`` processes of its own that spin in pure Python (default one per rank: as many
busy processes again as ranks), and compares, in the same job:

  ddp/psrt  ``DistributedDataParallel`` on ``train_dp.py``'s MLP (1.86 M parameters,
            batch 64 per rank) over the ``"psrt"`` backend;
  ddp/gloo  the same over a gloo group of the same ranks;
  hvd       ``hvd.DistributedOptimizer`` on the same model and data (psrt's own API).

At the end of each phase every rank says whether psrt found the host crowded
(``psrt.comm.crowding``), the verdict that decides how its waits go, and the JSON line has
the share of the phase that rank 0's training thread spent waiting for a core.

One step is forward, backward and ``optimizer.step()`` (SGD), one torch thread per rank.
The three take turns for ``--rounds`` rounds (the first rotating), each a few untimed
steps, a barrier and a window whose time is the slowest rank's
(``_timing.timed_window``); the figures are medians.  ``gloo/psrt`` and ``gloo/hvd`` above
1: psrt is faster.  Every model's parameters must stay equal across ranks (checked after
timing).  Rank 0 prints a table per phase and one JSON line; nothing is asserted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import psrt.torch as hvd
from psrt.comm import crowding

# isort: off
from _timing import timed_window
from train_dp import mlp, synthetic_batch
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI
# isort: on

LR = 1e-3
comm = MPI.COMM_WORLD.Dup()  # our barriers and gathers never interleave with psrt's messages
Step = Callable[[], None]


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


def step_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> Step:
    x, y = synthetic_batch()

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def build(groups: dict[str, dist.ProcessGroup]) -> tuple[dict[str, Step], dict[str, nn.Module]]:
    """The three steps, each on its own copy of the same initial model."""
    steps, models = {}, {}
    for name, group in groups.items():
        torch.manual_seed(0)
        models[name] = DistributedDataParallel(mlp(), process_group=group)
        steps[name] = step_of(models[name], torch.optim.SGD(models[name].parameters(), lr=LR))
    torch.manual_seed(0)
    models["hvd"] = mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(models["hvd"].parameters(), lr=LR),
                                         named_parameters=models["hvd"].named_parameters())
    steps["hvd"] = step_of(models["hvd"], optimizer)
    return steps, models


def in_sync(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    everyone = comm.allgather(flat)
    return all((other == everyone[0]).all() for other in everyone)


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes that spin in pure Python for the block's duration."""
    made = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if made else 0)  # let the scheduler spread them before timing
        yield
    finally:
        for process in made:
            process.kill()
            process.wait()


def phase(name: str, steps: dict[str, Step], args: argparse.Namespace) -> dict:
    probe = timed_window(comm, steps["ddp/gloo"], 2, warmup=1)
    per_window = max(2, round(args.window_s / probe))
    order = list(steps)
    windows: dict[str, list[float]] = {impl: [] for impl in order}
    cpu_start, wall_start = time.process_time(), time.monotonic()
    waited_start = crowding._main_thread_times()
    for round_ in range(args.rounds):
        shift = round_ % len(order)
        for impl in order[shift:] + order[:shift]:
            windows[impl].append(timed_window(comm, steps[impl], per_window, args.warmup))
    ms = {impl: statistics.median(times) * 1e3 for impl, times in windows.items()}
    paired = {impl: sorted(g / p for p, g in zip(windows[impl], windows["ddp/gloo"]))
              for impl in ("ddp/psrt", "hvd")}
    verdicts = comm.allgather(crowding.crowded())
    waited = crowding._main_thread_times()
    waiting = None if waited is None else (waited[1] - waited_start[1]) / 1e9 / (time.monotonic() - wall_start)
    return {"phase": name, "step_ms": ms, "steps_per_window": per_window, "crowded_verdicts": verdicts,
            "main_thread_waiting_share": waiting,
            "gloo_over_psrt": ms["ddp/gloo"] / ms["ddp/psrt"], "gloo_over_hvd": ms["ddp/gloo"] / ms["hvd"],
            "per_round": {impl: [r[0], statistics.median(r), r[-1]] for impl, r in paired.items()},
            "cpu_s": time.process_time() - cpu_start}


def table(rows: list[dict], args: argparse.Namespace) -> None:
    say(f"\n## {comm.size} ranks, median of {args.rounds} windows; gloo/x above 1: x is faster than DDP over gloo")
    say("| phase | ddp/psrt ms | ddp/gloo ms | hvd ms | gloo/psrt (per round min / median / max) | "
        "gloo/hvd (per round) | ranks that found the host crowded |")
    say("| --- | ---: | ---: | ---: | --- | --- | ---: |")
    for r in rows:
        ms, pr = r["step_ms"], r["per_round"]
        say(f"| {r['phase']} | {ms['ddp/psrt']:.1f} | {ms['ddp/gloo']:.1f} | {ms['hvd']:.1f} | "
            f"{r['gloo_over_psrt']:.2f} ({' / '.join(f'{v:.2f}' for v in pr['ddp/psrt'])}) | "
            f"{r['gloo_over_hvd']:.2f} ({' / '.join(f'{v:.2f}' for v in pr['hvd'])}) | "
            f"{sum(r['crowded_verdicts'])} of {comm.size} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=int, default=1, help="busy processes each rank starts for the crowded phase")
    p.add_argument("--rounds", type=int, default=7, help="timed windows per implementation and phase")
    p.add_argument("--window-s", type=float, default=0.6, help="about how long a window lasts")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each window")
    p.add_argument("--phases", nargs="+", choices=("idle", "crowded"), default=["idle", "crowded"])
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("psrt")
    groups = {"ddp/psrt": dist.group.WORLD, "ddp/gloo": dist.new_group(backend="gloo")}
    steps, models = build(groups)
    rows = []
    for name in args.phases:
        with busy_processes(args.busy if name == "crowded" else 0):
            rows.append(phase(name, steps, args))
    synced = {name: in_sync(model) for name, model in models.items()}
    table(rows, args)
    say(f"parameters equal on every rank: {synced}")
    say(json.dumps({"benchmark": "crowded", "ranks": comm.size, "busy_per_rank": args.busy,
                    "cores": len(os.sched_getaffinity(0)), "rows": rows, "in_sync": synced}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
