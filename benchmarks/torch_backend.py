"""psrt as a ``torch.distributed`` backend against gloo, and against psrt's own API, same run.

Run under a launcher with 2 ranks (or ``make bench-torch-backend``)::

    psrun -np 2 python benchmarks/torch_backend.py                  # both parts
    psrun -np 2 python benchmarks/torch_backend.py --parts collectives

``dist.init_process_group("psrt")`` makes psrt the default group; ``dist.new_group(backend=
"gloo")`` makes a gloo group over the same ranks.  Code written against torch.distributed
changes one argument to move from gloo to psrt, so gloo is what psrt replaces, and psrt's own
API is what the backend should cost no more than (issue 29's targets).

Training (``--parts train``): one step is forward, backward and ``optimizer.step()`` (SGD),
one torch thread per rank, different data on each rank, the same initial weights for both
groups:

  ddp/mlp   ``DistributedDataParallel(process_group=...)`` on ``train_dp.py``'s MLP
            784-1024-1024-10 (1.86 M parameters), batch 64 per rank;
  ddp/gpt   the same on ``_peers_gpt.py``'s GPT (4 blocks, dim 256; 3.26 M), 4 x 128 tokens;
  fsdp2/gpt ``fully_shard`` on each block and then the root, mesh
            ``DeviceMesh.from_group(group, "cpu")``, same GPT and batch.

psrt's and gloo's losses over ``--check-steps`` steps (mean over ranks) must agree first.
``local`` is the same step on both ranks at once with no wrapper and no communication, so
``gloo/local`` bounds what any backend could gain over gloo; ``alone`` is the wrapper (DDP,
FSDP2) over a one-rank gloo group on each rank, its own copies and bookkeeping with no peer:
the floor of any backend that does not overlap communication with the step, so ``gloo/alone``
bounds the gain of one that runs its collectives on the caller's thread, as psrt's does,
and ``psrt - alone`` is what psrt's communication adds.  The four take turns for ``--rounds`` rounds (the first rotating), each a few untimed steps, a
barrier and a window whose time is the slowest rank's (``_timing.timed_window``).  The
figures are medians; ``gloo/psrt`` is the speed-up (above 1: psrt is faster).

Collectives (``--parts collectives``): all_reduce (sum), all_gather_into_tensor,
reduce_scatter_tensor, broadcast (root 0) and all_to_all_single of float32, the whole buffer
4 KiB to 16 MiB, through (i) torch.distributed on the psrt group, (ii) torch.distributed on
the gloo group and (iii) psrt's own API, all three on the same tensors: ``hvd.allreduce_`` (in place,
as ``dist.all_reduce`` is), ``hvd.allgather``, ``hvd.reducescatter``, ``hvd.broadcast_``,
``hvd.alltoall``, each under a name that repeats, so the engine's response cache serves
it (its fast path, what DistributedOptimizer's hooks get).  The three give the same bytes
first; then they take turns in blocks, each call after a barrier; the figure is the median
over calls of the slowest rank's time.  busbw follows nccl-tests: bytes of the whole buffer
/ time x 2(n-1)/n for all_reduce, (n-1)/n for the gather, the scatter and all-to-all, 1 for
broadcast.  Rank 0 prints the tables and one JSON line; targets are reported, not asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import psrt.torch as hvd

# isort: off
from _timing import median_call_seconds, timed_window
from _peers_gpt import GPTConfig, build_blocks, loss_fn, synthetic_batch as gpt_batch
from train_dp import mlp, synthetic_batch as mlp_batch
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI
# isort: on

LR = 1e-3
SIZES = {"4K": 4 << 10, "64K": 64 << 10, "1M": 1 << 20, "16M": 16 << 20}
CALLS = {"4K": 300, "64K": 300, "1M": 100, "16M": 30}  # timed calls per implementation
SPEEDUP_TARGET, OVERHEAD_TARGET = 1.5, 1.10

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed *_tensor calls
comm = MPI.COMM_WORLD.Dup()  # our barriers and gathers never interleave with psrt's messages
Step = Callable[[], float]


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


# -- training --------------------------------------------------------------------------------
def sgd_step(model: nn.Module, loss: Callable, x: torch.Tensor, y: torch.Tensor) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> float:
        value = loss(model(x), y)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        return value.item()
    return step


def ddp_mlp(group: dist.ProcessGroup | None) -> Step:
    """DDP over ``group``; without one, the same step with no communication (``local``)."""
    torch.manual_seed(0)
    model, (x, y) = mlp(), mlp_batch()
    return sgd_step(model if group is None else DistributedDataParallel(model, process_group=group),
                    F.cross_entropy, x, y)


def gpt(config: GPTConfig) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    return nn.Sequential(*build_blocks(config)), *gpt_batch(config, 4, seed=1000 + comm.rank)


def ddp_gpt(group: dist.ProcessGroup | None, config: GPTConfig) -> Step:
    model, x, y = gpt(config)
    return sgd_step(model if group is None else DistributedDataParallel(model, process_group=group),
                    loss_fn, x, y)


def fsdp2_gpt(group: dist.ProcessGroup | None, config: GPTConfig) -> Step:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    model, x, y = gpt(config)
    if group is not None:
        mesh = DeviceMesh.from_group(group, "cpu")
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return sgd_step(model, loss_fn, x, y)


def compare_training(name: str, build: Callable[[dist.ProcessGroup | None], Step], groups: dict,
                     alone: dist.ProcessGroup, args: argparse.Namespace) -> dict:
    """Build on both groups, on the one-rank group ``alone`` and without one (``local``),
    compare psrt's and gloo's losses over the check steps, then time the four in turns."""
    steps, losses = {"local": build(None), "alone": build(alone)}, {}
    for backend, group in groups.items():
        steps[backend] = build(group)
        losses[backend] = [comm.allreduce(steps[backend]()) / comm.size for _ in range(args.check_steps)]
    delta = max(abs(a - b) for a, b in zip(losses["psrt"], losses["gloo"]))
    probe = timed_window(comm, steps["psrt"], 2, warmup=1)
    per_window = max(2, round(args.window_s / probe))
    order = list(steps)
    windows: dict[str, list[float]] = {impl: [] for impl in order}
    for round_ in range(args.rounds):
        shift = round_ % len(order)
        for impl in order[shift:] + order[:shift]:
            windows[impl].append(timed_window(comm, steps[impl], per_window, args.warmup))
    ms = {impl: statistics.median(times) * 1e3 for impl, times in windows.items()}
    paired = [g / p for p, g in zip(windows["psrt"], windows["gloo"])]
    return {"name": name, "step_ms": ms, "speedup": ms["gloo"] / ms["psrt"], "ceiling": ms["gloo"] / ms["local"],
            "psrt_over_local": ms["psrt"] / ms["local"], "floor": ms["gloo"] / ms["alone"],
            "per_round": [min(paired), statistics.median(paired), max(paired)], "steps_per_window": per_window,
            "losses": losses, "max_loss_delta": delta, "agrees": delta <= args.tolerance,
            "met": ms["gloo"] / ms["psrt"] >= SPEEDUP_TARGET, "windows_s": windows}


def print_training(rows: list[dict], args: argparse.Namespace) -> None:
    say(f"\n## training: median of {args.rounds} windows each; gloo/psrt above 1: psrt is faster; "
        "local: the same step with no communication; alone: the wrapper on a one-rank group; gloo/local and "
        "gloo/alone: the most any backend could gain, and one that does not overlap")
    say("| model | local ms | alone ms | psrt ms | gloo ms | gloo/psrt | per round min / median / max | gloo/local | "
        "gloo/alone | psrt/local | loss diff (check steps) | >= 1.5 |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        low, middle, high = r["per_round"]
        ms = r["step_ms"]
        say(f"| {r['name']} | {ms['local']:.2f} | {ms['alone']:.2f} | {ms['psrt']:.2f} | {ms['gloo']:.2f} | "
            f"{r['speedup']:.2f} | {low:.2f} / {middle:.2f} / {high:.2f} | {r['ceiling']:.2f} | {r['floor']:.2f} | "
            f"{r['psrt_over_local']:.2f} | "
            f"{r['max_loss_delta']:.1e} ({'agrees' if r['agrees'] else 'DIFFERS'}) | {'yes' if r['met'] else 'no'} |")


# -- collectives -----------------------------------------------------------------------------
def busbw_factor(collective: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(collective, (n - 1) / n)


#: Each collective through torch.distributed on a group, and through psrt's own API, on the
#: same input ``src`` (and, for torch's, output ``out``; in place: ``src`` is ``out``)
TORCH_CALLS = {
    "all_reduce": lambda src, out, g: dist.all_reduce(src, group=g),
    "all_gather_into_tensor": lambda src, out, g: dist.all_gather_into_tensor(out, src, group=g),
    "reduce_scatter_tensor": lambda src, out, g: dist.reduce_scatter_tensor(out, src, group=g),
    "broadcast": lambda src, out, g: dist.broadcast(src, src=0, group=g),
    "all_to_all_single": lambda src, out, g: dist.all_to_all_single(out, src, group=g),
}
OWN_CALLS = {
    "all_reduce": lambda src, name: hvd.allreduce_(src, op=hvd.Sum, name=name),
    "all_gather_into_tensor": lambda src, name: hvd.allgather(src, name=name),
    "reduce_scatter_tensor": lambda src, name: hvd.reducescatter(src, op=hvd.Sum, name=name),
    "broadcast": lambda src, name: hvd.broadcast_(src, root_rank=0, name=name),
    "all_to_all_single": lambda src, name: hvd.alltoall(src, name=name),
}


def buffers(collective: str, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) for a whole buffer of ``numel`` float32, shared by the implementations."""
    part = numel // comm.size
    if collective in ("all_reduce", "broadcast"):
        t = torch.zeros(numel)
        return t, t
    return torch.zeros(part if collective == "all_gather_into_tensor" else numel), \
        torch.zeros(part if collective == "reduce_scatter_tensor" else numel)


def calls(collective: str, src: torch.Tensor, out: torch.Tensor, groups: dict,
          name: str) -> dict[str, Callable[[], torch.Tensor]]:
    """One call per implementation, each returning its result."""
    made: dict[str, Callable[[], torch.Tensor]] = {
        backend: lambda g=group: (TORCH_CALLS[collective](src, out, g), out)[1] for backend, group in groups.items()}
    made["own"] = lambda: OWN_CALLS[collective](src, name)
    return made


def bench_collective(collective: str, groups: dict) -> list[dict]:
    """Per size: check that the three give the same result (small integers, different on each
    rank), then time them on zeros (repeated in-place sums stay finite)."""
    rows = []
    for tag, nbytes in SIZES.items():
        src, out = buffers(collective, nbytes // 4)
        made = calls(collective, src, out, groups, name=f"bench.{collective}.{tag}")
        results = {}
        for impl, call in made.items():
            src.copy_(torch.arange(src.numel()) % 251 + 1000 * comm.rank)
            results[impl] = call().clone()
        if not all(torch.equal(results[impl], results["gloo"]) for impl in results):
            raise RuntimeError(f"{collective} of {tag}: the implementations disagree on rank {comm.rank}")
        src.zero_()
        seconds = median_call_seconds(comm, made, CALLS[tag], blocks=6)
        bus = {impl: nbytes * busbw_factor(collective, comm.size) / s / 1e9 for impl, s in seconds.items()}
        rows.append({"collective": collective, "size": tag, "us": {k: v * 1e6 for k, v in seconds.items()},
                     "busbw_GBps": bus, "psrt_over_own": seconds["psrt"] / seconds["own"],
                     "gloo_over_psrt": seconds["gloo"] / seconds["psrt"]})
    return rows


def print_collectives(rows: list[dict]) -> None:
    say("\n## collectives, float32, µs per call (median of the slowest rank), busbw GB/s; "
        "psrt = torch.distributed on psrt, own = psrt's own API")
    say("| collective | size | psrt µs | psrt busbw | gloo µs | gloo busbw | own µs | own busbw | "
        "psrt/own | gloo/psrt |")
    say("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        us, bw = r["us"], r["busbw_GBps"]
        say(f"| {r['collective']} | {r['size']} | {us['psrt']:.1f} | {bw['psrt']:.2f} | {us['gloo']:.1f} | "
            f"{bw['gloo']:.2f} | {us['own']:.1f} | {bw['own']:.2f} | {r['psrt_over_own']:.2f} | "
            f"{r['gloo_over_psrt']:.2f} |")
    over = [r for r in rows if r["size"] != "4K" and r["psrt_over_own"] > OVERHEAD_TARGET]
    say(f"psrt/own <= {OVERHEAD_TARGET} from 64K: " + ("met" if not over else "missed at " + ", ".join(
        f"{r['collective']} {r['size']} ({r['psrt_over_own']:.2f})" for r in over)))


# -- main ------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", choices=("train", "collectives"), default=["train", "collectives"])
    p.add_argument("--rounds", type=int, default=7, help="timed windows per implementation and model")
    p.add_argument("--window-s", type=float, default=0.6, help="about how long a training window lasts")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each window")
    p.add_argument("--check-steps", type=int, default=3, help="steps whose losses are compared first")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest loss difference that agrees")
    p.add_argument("--collectives", nargs="+", choices=list(TORCH_CALLS), default=list(TORCH_CALLS))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("psrt")  # rank and size from MPI; starts psrt's runtime too
    if comm.size < 2:
        sys.exit("run under a launcher with 2 ranks: psrun -np 2 python benchmarks/torch_backend.py")
    groups = {"psrt": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    alone, _ = dist.new_subgroups(group_size=1, backend="gloo")  # this rank's own one-rank group
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    load = [os.getloadavg()[0]]
    say(f"# torch.distributed on psrt against gloo: {comm.size} ranks, torch {torch.__version__}, "
        f"1 thread per rank; 1-minute load average at the start {load[0]:.2f}")
    summary: dict = {"benchmark": "torch_backend", "ranks": comm.size, "torch": torch.__version__}
    if "train" in args.parts:
        config = GPTConfig()
        models = {"ddp/mlp": ddp_mlp, "ddp/gpt": lambda g: ddp_gpt(g, config),
                  "fsdp2/gpt": lambda g: fsdp2_gpt(g, config)}
        rows = [compare_training(name, build, groups, alone, args) for name, build in models.items()]
        print_training(rows, args)
        summary["train"] = rows
    if "collectives" in args.parts:
        rows = [row for collective in args.collectives for row in bench_collective(collective, groups)]
        print_collectives(rows)
        summary["collectives"] = rows
    load.append(os.getloadavg()[0])
    say(f"\n1-minute load average at the end {load[1]:.2f} (this job alone adds {comm.size})")
    summary["load_average"] = load
    say(json.dumps(summary))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
