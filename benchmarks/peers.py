"""psrt against the PyTorch-native peers on the same small GPT, same run: ZeRO against
DistributedOptimizer, DDP and FSDP, and psrt's 1F1B pipeline against torch's Schedule1F1B.

Run under a launcher with 2 ranks (or ``make bench-peers``)::

    psrun -np 2 python benchmarks/peers.py                      # 1.5 min on 2 idle cores, 4-5 busy
    psrun -np 2 python benchmarks/peers.py --rounds 3 --steps 2 # quicker, noisier

Model: a decoder-only GPT in plain torch (``_peers_gpt.py``: 4 pre-norm blocks of dim 256,
8 heads, vocabulary 128, 128 positions; 3.26 M parameters), AdamW (lr 1e-3), synthetic
token ids, one torch thread per rank.  torch.distributed runs over gloo on the same ranks,
set up after ``hvd.init()`` (``_gloo.init_gloo``).

Data parallelism (``--rows`` sequences per rank, different on each rank):

  hvd     ``hvd.DistributedOptimizer`` (the baseline of issue 14's first target);
  zero1, zero2, zero3  ``psrt.zero.ZeroOptimizer(stage=1, 2, 3)``;
  ddp     ``torch.nn.parallel.DistributedDataParallel``;
  fsdp2   ``torch.distributed.fsdp.fully_shard`` on every block, then on the whole model,
          over a CPU device mesh of the gloo ranks;
  fsdp1   (``--dp ... fsdp1``, and in fsdp2's place if FSDP2 fails to build or to step)
          ``FullyShardedDataParallel`` wrapping the same blocks, ``device_id=cpu`` (without
          it FSDP1 refuses to run: "FSDP needs a non-CPU accelerator device").

Pipeline (as many stages as ranks, the block list cut evenly; ``--pp-rows`` sequences per
step in ``--microbatches`` micro-batches; each stage runs AdamW on its own parameters):

  psrt_1f1b   ``psrt.pp.Pipeline(schedule="1f1b")`` on ``ProcessGrid(dp=1, tp=1, pp=ranks)``;
  torch_1f1b  ``torch.distributed.pipelining``: ``PipelineStage`` of the same blocks and
              ``Schedule1F1B`` with the same number of micro-batches.

Correctness first: every implementation is built from the same seed and runs
``--check-steps`` steps on the same batches; the loss of each step (averaged over the data-
parallel ranks; the pipeline's mean over micro-batches) must match the reference's (hvd;
psrt_1f1b) within ``--tolerance``, else the timing compares different computations.  A peer
that fails to build or to step is reported with its exact error and left out.

Timing: the implementations of a part take turns, the first one rotating each round; each
gets ``--warmup`` untimed steps, then a barrier, then a window of ``--steps`` steps whose
time is the slowest rank's.  Figures are medians over ``--rounds`` rounds; ``psrt/peer`` is
the ratio of median step times (below 1: psrt is faster); ``per round`` gives the median
and range of the ratio of each round's two windows, which shows how far the noise reaches.
The 1-minute load average is printed at the start and the end: other jobs on the machine
slow some windows more than others.  Rank 0 prints the tables and one JSON line.  Nothing
is asserted: a target is reported met or missed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import psrt.torch as hvd
from psrt import pp
from psrt.grid import ProcessGrid
from psrt.zero import ZeroOptimizer

# isort: off
from _gloo import init_gloo
from _timing import timed_window
from _peers_gpt import Block, Embedding, GPTConfig, Head, build_blocks, loss_fn, synthetic_batch
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI
# isort: on

LR = 1e-3
DP_IMPLS = ("hvd", "zero1", "zero2", "zero3", "ddp", "fsdp2")
FSDP_FALLBACK = "fsdp1"
#: (psrt implementation, peer, the most psrt/peer step time allowed): issue 14's targets.
DP_TARGETS = (("zero1", "hvd", 1.05), ("zero2", "hvd", 1.05), ("zero3", "fsdp2", 1.0), ("zero2", "ddp", 1.0))
PP_TARGETS = (("psrt_1f1b", "torch_1f1b", 1.0),)

Step = Callable[[], "float | None"]  # one training step; returns the step's loss where this rank has it

comm = MPI.COMM_WORLD.Dup()  # our barriers and loss sums never interleave with psrt's messages


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


# -- data parallelism --------------------------------------------------------------------
def dp_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> Step:
    def step() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step


def build_dp(impl: str, config: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> Step:
    """``impl``'s step on its own copy of the model (every copy from the same seed)."""
    model = nn.Sequential(*build_blocks(config))
    if impl == "hvd":
        optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                             named_parameters=model.named_parameters())
    elif impl.startswith("zero"):
        optimizer = ZeroOptimizer(model, torch.optim.AdamW, stage=int(impl[-1]), lr=LR)
    else:
        model = wrap_peer(impl, model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return dp_step(model, optimizer, x, y)


def wrap_peer(impl: str, model: nn.Sequential) -> nn.Module:
    if impl == "ddp":
        return DistributedDataParallel(model)
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (comm.size,))
        for block in model:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Embedding, Block, Head}),
                                        device_id=torch.device("cpu"))
    raise ValueError(f"unknown data-parallel implementation {impl!r}")


def dp_setups(config: GPTConfig, args: argparse.Namespace) -> tuple[dict[str, Step], dict[str, list[float]], dict]:
    """Each implementation's step after ``--check-steps`` steps, their losses, and the peers left out."""
    x, y = synthetic_batch(config, args.rows, seed=1000 + comm.rank)
    steps, losses, failed = {}, {}, {}
    for impl in args.dp:
        got = checked(lambda impl=impl: build_dp(impl, config, x, y), args.check_steps, mean_over_ranks=True,
                      peer=impl in ("ddp", "fsdp2", "fsdp1"))
        if isinstance(got, str) and impl == "fsdp2":
            failed[impl] = got
            impl = FSDP_FALLBACK
            got = checked(lambda impl=impl: build_dp(impl, config, x, y), args.check_steps, mean_over_ranks=True,
                          peer=True)
        if isinstance(got, str):
            failed[impl] = got
            continue
        steps[impl], losses[impl] = got
    return steps, losses, failed


# -- pipeline -----------------------------------------------------------------------------
def stage_ranges(blocks: int, stages: int) -> list[range]:
    """The block list cut into ``stages`` consecutive ranges, the first ones one longer."""
    sizes = [blocks // stages + (s < blocks % stages) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def build_psrt_pipeline(config: GPTConfig, grid: ProcessGrid, m: int, x: torch.Tensor, y: torch.Tensor) -> Step:
    blocks = build_blocks(config)
    split = [len(r) for r in stage_ranges(len(blocks), grid.shape.pp)]
    stage = pp.PipelineStage(blocks, grid.pp_set, split=split)
    pipeline = pp.Pipeline(stage, loss_fn, microbatches=m, schedule="1f1b")
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)

    def step() -> float:
        loss = pipeline.step(x if grid.is_first_stage else None, y if grid.is_last_stage else None)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step


def build_torch_pipeline(config: GPTConfig, m: int, x: torch.Tensor, y: torch.Tensor) -> Step:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    blocks = build_blocks(config)
    rank, stages = comm.rank, comm.size
    part = nn.Sequential(*(blocks[i] for i in stage_ranges(len(blocks), stages)[rank]))
    schedule = Schedule1F1B(PipelineStage(part, rank, stages, torch.device("cpu")), m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(part.parameters(), lr=LR)

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == stages - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().item() if losses else None
    return step


def pp_setups(config: GPTConfig, args: argparse.Namespace) -> tuple[dict[str, Step], dict[str, list[float]], dict]:
    grid = ProcessGrid(dp=1, tp=1, pp=comm.size)
    x, y = synthetic_batch(config, args.pp_rows, seed=2000)  # the whole batch, the same on every rank
    builders = {"psrt_1f1b": lambda: build_psrt_pipeline(config, grid, args.microbatches, x, y),
                "torch_1f1b": lambda: build_torch_pipeline(config, args.microbatches, x, y)}
    steps, losses, failed = {}, {}, {}
    for impl, build in builders.items():
        got = checked(build, args.check_steps, mean_over_ranks=False, peer=impl == "torch_1f1b")
        if isinstance(got, str):
            failed[impl] = got
        else:
            steps[impl], losses[impl] = got
    return steps, losses, failed


# -- checking and timing ------------------------------------------------------------------
def checked(build: Callable[[], Step], check_steps: int, *, mean_over_ranks: bool,
            peer: bool) -> tuple[Step, list[float]] | str:
    """Build, then run ``check_steps`` steps; returns the step and each step's loss (the mean
    over ranks, or the last rank's), or, for a peer that raised, the error on every rank."""
    try:
        step = build()
        mine = [step() for _ in range(check_steps)]
        error = None
    except Exception as exc:  # a peer this torch build cannot run on CPU and gloo
        if not peer:
            raise
        step, mine, error = None, [], f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        return errors[0]
    if mean_over_ranks:
        return step, [comm.allreduce(loss) / comm.size for loss in mine]
    return step, comm.bcast(mine, root=comm.size - 1)


def measure(steps: dict[str, Step], args: argparse.Namespace) -> dict[str, list[float]]:
    """Per implementation, seconds per step of each round's window; the implementations take
    turns and the first of each round rotates."""
    names = list(steps)
    windows: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            windows[name].append(timed_window(comm, steps[name], args.steps, args.warmup))
    return windows


def compare(windows: dict[str, list[float]], targets, failed: dict) -> list[dict]:
    rows = []
    for ours, peer, limit in targets:
        stand_in = peer == "fsdp2" and peer not in windows and FSDP_FALLBACK in windows
        peer_ran = FSDP_FALLBACK if stand_in else peer
        if ours not in windows or (peer_ran not in windows and peer not in failed):
            continue  # not asked for
        if peer_ran not in windows:
            rows.append({"psrt": ours, "peer": peer, "limit": limit, "ratio": None, "note": failed[peer]})
            continue
        paired = [a / b for a, b in zip(windows[ours], windows[peer_ran])]
        ratio = statistics.median(windows[ours]) / statistics.median(windows[peer_ran])
        rows.append({"psrt": ours, "peer": peer_ran, "limit": limit, "ratio": ratio,
                     "per_round": [statistics.median(paired), min(paired), max(paired)], "met": ratio <= limit})
    return rows


# -- report -------------------------------------------------------------------------------
def part_record(windows: dict[str, list[float]], losses: dict[str, list[float]], reference: str,
                samples_per_step: int, tolerance: float) -> dict:
    record = {}
    for name, times in windows.items():
        seconds = statistics.median(times)
        delta = max(abs(a - b) for a, b in zip(losses[name], losses[reference])) if losses[name] else None
        record[name] = {"step_s": seconds, "samples_per_s": samples_per_step / seconds, "windows_s": times,
                        "losses": losses[name],
                        "max_loss_delta": delta, "agrees": delta is not None and delta <= tolerance}
    return record


def print_part(title: str, record: dict, reference: str, comparisons: list[dict], failed: dict) -> None:
    say(f"\n## {title}")
    say(f"| implementation | step ms | samples/s | losses of the check steps | max abs diff vs {reference} |")
    say("| --- | --- | --- | --- | --- |")
    for name, r in record.items():
        losses = ", ".join(f"{v:.5f}" for v in r["losses"])
        say(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['samples_per_s']:.1f} | {losses} | "
            f"{r['max_loss_delta']:.1e} ({'agrees' if r['agrees'] else 'DIFFERS'}) |")
    for name, error in failed.items():
        say(f"| {name} | did not run: {error} | | | |")
    say("\n| target | psrt ms | peer ms | psrt/peer | per round: median (min-max) | limit | met |")
    say("| --- | --- | --- | --- | --- | --- | --- |")
    for c in comparisons:
        if c["ratio"] is None:
            say(f"| {c['psrt']} vs {c['peer']} | - | - | - | - | <= {c['limit']:.2f} | not run: {c['note']} |")
            continue
        middle, low, high = c["per_round"]
        say(f"| {c['psrt']} vs {c['peer']} | {record[c['psrt']]['step_s'] * 1e3:.1f} | "
            f"{record[c['peer']]['step_s'] * 1e3:.1f} | {c['ratio']:.3f} | {middle:.2f} ({low:.2f}-{high:.2f}) | "
            f"<= {c['limit']:.2f} | {'yes' if c['met'] else 'no'} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="timed windows per implementation")
    p.add_argument("--steps", type=int, default=2, help="timed steps per window")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before each window")
    p.add_argument("--check-steps", type=int, default=3, help="steps whose losses are compared before timing")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest loss difference that agrees")
    p.add_argument("--rows", type=int, default=4, help="data parallel: sequences per rank and step")
    p.add_argument("--pp-rows", type=int, default=8, help="pipeline: sequences per step")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline: micro-batches per step")
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dp", nargs="+", choices=DP_IMPLS + (FSDP_FALLBACK,), default=list(DP_IMPLS),
                   help="data-parallel implementations to run")
    p.add_argument("--parts", nargs="+", choices=("dp", "pp"), default=["dp", "pp"])
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    if comm.size < 2:
        sys.exit("run this under a launcher with at least 2 ranks, e.g. psrun -np 2 python benchmarks/peers.py")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # training on one fixed batch drifts into slow denormal floats
    psrt_hook = sys.excepthook
    init_gloo(comm)
    # torch's hook runs psrt's with stderr captured and prints it afterwards, but psrt's ends
    # the job first: an uncaught error would leave no traceback
    sys.excepthook = psrt_hook
    config = GPTConfig(sequence_length=args.sequence_length, dim=args.dim, layers=args.layers)
    params = sum(p.numel() for b in build_blocks(config) for p in b.parameters())
    load = [os.getloadavg()[0]]
    say(f"# psrt vs PyTorch peers: {comm.size} ranks, torch {torch.__version__}, 1 thread per rank; GPT "
        f"{params / 1e6:.2f} M parameters ({config.layers} layers, dim {config.dim}, sequence "
        f"{config.sequence_length}), AdamW; median of {args.rounds} rounds of {args.steps} steps; "
        f"1-minute load average at the start {load[0]:.2f}")
    summary: dict = {"benchmark": "peers", "ranks": comm.size, "torch": torch.__version__, "params": params,
                     "config": vars(config), "rounds": args.rounds, "steps": args.steps}
    parts = {"dp": (dp_setups, DP_TARGETS, "hvd", args.rows * comm.size,
                    f"data parallel: {args.rows} x {args.sequence_length} tokens per rank"),
             "pp": (pp_setups, PP_TARGETS, "psrt_1f1b", args.pp_rows,
                    (f"pipeline: {comm.size} stages, {args.pp_rows} x {args.sequence_length} tokens per step "
                     f"in {args.microbatches} micro-batches"))}
    for part in args.parts:
        setups, targets, reference, samples, title = parts[part]
        steps, losses, failed = setups(config, args)
        windows = measure(steps, args)
        record = part_record(windows, losses, reference, samples, args.tolerance)
        comparisons = compare(windows, targets, failed)
        print_part(title, record, reference, comparisons, failed)
        summary[part] = {"title": title, "results": record, "targets": comparisons, "failed": failed}
    load.append(os.getloadavg()[0])
    say(f"\n1-minute load average at the end {load[1]:.2f} (this job alone adds {comm.size})")
    summary["load_average"] = load
    say(json.dumps(summary))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
