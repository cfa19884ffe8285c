"""Checkpoint saves: how long training is held up by a synchronous save and by a background
one (``background=True``: the save returns once its state is copied, a thread writes it).

Run under a launcher with 2 ranks::

    psrun -np 2 python benchmarks/checkpoint_save.py

Model: an MLP of ``--layers`` square ``--width`` linear layers (default 6 x 2048: 25.2 M
parameters, 101 MB in fp32), Adam, 32 rows per rank, one torch thread per rank.  Two kinds
of save, each synchronous and in the background:

  commit  an elastic commit (``hvd.elastic.TorchState`` with ``hvd.DistributedOptimizer``):
          rank 0 writes the model and the Adam state whole (302 MB), each rank its RNG states;
  zero    ``ZeroOptimizer(stage=2).save(directory)``: each rank writes its shard of the fp32
          masters and Adam moments (151 MB per rank), rank 0 the metadata.

Each round gives every (kind, way) and a window of plain steps a turn, in rotating order:
two untimed steps, a barrier, then the save and ``--steps`` steps, then (background) the
wait for what is left of the write.  Each figure is the slowest rank's, the median over
``--rounds`` rounds:

  step      ms per step of the plain window (no save in flight);
  held      how long the save call held the training thread: a synchronous save's whole
            write, a background save's copies;
  slower    how much longer the window's steps took than those of the same round's plain
            window: what the writer thread took from training (cores, memory bandwidth, the
            GIL); after a synchronous save it shows the noise (negative: noise too);
  wait      what was left of a background write when the window ended;
  cost      held + slower + wait of each save (the median of those sums): what one save adds
            to training; ``vs sync`` divides it by the synchronous save's.

Saves go to ``--dir`` (default: a fresh directory under the system's temporary directory,
removed at the end), fsynced as every psrt checkpoint is.  Before timing, a background save
of each kind is checked against a synchronous one of the same state (the same tensors).
Rank 0 prints a table and one JSON line.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import psrt.torch as hvd
from launcher.contract import ENV_ELASTIC_DIR
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic import commits
from psrt.errors import CheckpointError
from psrt.zero import ZeroOptimizer, consolidate

from mpi4py import MPI  # after psrt: its bootstrap starts MPI

ROWS = 32
KINDS = ("commit", "zero")
WAYS = ("sync", "background")
comm = MPI.COMM_WORLD.Dup()  # the benchmark's barriers and timings never meet psrt's messages


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


class Trainer:
    """The MLP with its optimizer, and the save of one kind into ``root``."""

    def __init__(self, kind: str, args: argparse.Namespace, root: str) -> None:
        torch.manual_seed(0)
        self.kind, self.root, self.saves = kind, root, 0
        self.model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
        self.x, self.y = torch.randn(ROWS, args.width), torch.randn(ROWS, args.width)
        if kind == "zero":
            self.optimizer = ZeroOptimizer(self.model, torch.optim.Adam, stage=2, lr=1e-4)
        else:
            self.optimizer = hvd.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=1e-4),
                                                      named_parameters=self.model.named_parameters())
            os.environ[ENV_ELASTIC_DIR] = root
            self.state = hvd.elastic.TorchState(self.model, self.optimizer)
            del os.environ[ENV_ELASTIC_DIR]

    def step(self) -> None:
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.x), self.y).backward()
        self.optimizer.step()

    def save(self, background: bool):
        """Save now; returns the background save's handle (None for a synchronous one)."""
        if self.kind == "commit":
            return self.state.commit(background=background)
        self.saves += 1  # a directory per save, the one before last removed (outside the timing)
        return self.optimizer.save(self.zero_directory(self.saves), background=background)

    def zero_directory(self, number: int) -> str:
        return os.path.join(self.root, f"zero-{number:04d}")

    def tidy(self) -> None:
        """Remove ZeRO saves but the last (rank 0; collective)."""
        if self.kind == "commit":
            self.state.wait()
        comm.Barrier()
        if comm.rank == 0 and self.kind == "zero":
            for number in range(1, self.saves):
                shutil.rmtree(self.zero_directory(number), ignore_errors=True)
        comm.Barrier()


def window(trainer: Trainer, way: str | None, steps: int) -> dict[str, float]:
    """One timed window (``way`` None: plain steps); this rank's seconds."""
    trainer.step()
    trainer.step()
    comm.Barrier()
    held = wait = 0.0
    handle = None
    if way is not None:
        start = time.perf_counter()
        handle = trainer.save(background=way == "background")
        held = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step()
    stepping = time.perf_counter() - start
    if handle is not None:
        start = time.perf_counter()
        handle.wait()
        wait = time.perf_counter() - start
    return {"held": held, "stepping": stepping, "wait": wait}


def check_background_equals_synchronous(trainer: Trainer) -> bool:
    """A background save of the current state holds what a synchronous one does (the
    commit's model and optimizer document, or the consolidated ZeRO checkpoint)."""
    documents = []
    for background in (False, True):
        handle = trainer.save(background)
        if handle is not None:
            handle.wait()
        if trainer.kind == "zero":
            documents.append(consolidate(trainer.zero_directory(trainer.saves)))
        elif comm.rank == 0:
            record = checkpoint_files.read_json(os.path.join(trainer.root, commits.LATEST), CheckpointError)
            replicated = os.path.join(trainer.root, f"commit-{record['commit']:06d}", commits.REPLICATED)
            documents.append(checkpoint_files.load_tensors(replicated, None, CheckpointError))
    same = comm.rank != 0 or _equal(documents[0], documents[1])
    trainer.tidy()
    return all(comm.allgather(same))


def _equal(ours: object, theirs: object) -> bool:
    if isinstance(theirs, torch.Tensor):
        return isinstance(ours, torch.Tensor) and torch.equal(ours, theirs)
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(_equal(ours[key], value)
                                                                               for key, value in theirs.items())
    if isinstance(theirs, (list, tuple)):
        return len(ours) == len(theirs) and all(_equal(a, b) for a, b in zip(ours, theirs))
    return ours == theirs


def bench(args: argparse.Namespace, root: str) -> dict:
    trainers = {kind: Trainer(kind, args, os.path.join(root, kind)) for kind in KINDS}
    checked = {kind: check_background_equals_synchronous(trainer) for kind, trainer in trainers.items()}
    say(f"# background save == synchronous save: {checked}")
    turns = [(kind, way) for kind in KINDS for way in (None, *WAYS)]
    samples: dict[tuple, list[dict]] = {turn: [] for turn in turns}
    for round_index in range(args.rounds):
        shift = round_index % len(turns)
        for kind, way in turns[shift:] + turns[:shift]:
            mine = window(trainers[kind], way, args.steps)
            samples[kind, way].append({key: max(values) for key, values in
                                       zip(mine, zip(*(r.values() for r in comm.allgather(mine))))})
            trainers[kind].tidy()
    results = {}
    for kind in KINDS:
        step = statistics.median(s["stepping"] for s in samples[kind, None]) / args.steps
        results[kind] = {"step_ms": 1e3 * step, "checked": checked[kind]}
        for way in WAYS:
            runs = samples[kind, way]
            # against the same round's plain window (drift cancels), signed (noise cancels in the median)
            slower = [s["stepping"] - plain["stepping"] for s, plain in zip(runs, samples[kind, None])]
            results[kind][way] = {
                "held_ms": 1e3 * statistics.median(s["held"] for s in runs),
                "slower_ms": 1e3 * statistics.median(slower),
                "wait_ms": 1e3 * statistics.median(s["wait"] for s in runs),
                "cost_ms": 1e3 * statistics.median(s["held"] + extra + s["wait"] for s, extra in zip(runs, slower))}
        results[kind]["background_vs_sync"] = results[kind]["background"]["cost_ms"] / results[kind]["sync"]["cost_ms"]
    return results


def table(results: dict, megabytes: dict[str, float]) -> str:
    lines = ["| save | way | MB written | step ms | held ms | held / step | slower steps ms | wait ms | cost ms | "
             "vs sync |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, result in results.items():
        for way in WAYS:
            row = result[way]
            ratio = f"{row['cost_ms'] / result['sync']['cost_ms']:.2f}"
            lines.append(f"| {kind} | {way} | {megabytes[kind]:.0f} | {result['step_ms']:.0f} | {row['held_ms']:.0f} | "
                         f"{row['held_ms'] / result['step_ms']:.2f} | {row['slower_ms']:.0f} | {row['wait_ms']:.0f} | "
                         f"{row['cost_ms']:.0f} | {ratio} |")
    return "\n".join(lines)


def directory_megabytes(path: str) -> float:
    return sum(os.path.getsize(os.path.join(where, name)) for where, _, names in os.walk(path) for name in names) / 1e6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=6, help="steps timed after each save (default 6)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; figures are medians over them (default 5)")
    p.add_argument("--dir", default=None, help="where saves go (default: a temporary directory, removed after)")
    return p.parse_args()


def main() -> None:
    hvd.init()
    args = parse_args()
    if comm.size < 2:
        sys.exit("run this under a launcher with 2 ranks: psrun -np 2 python benchmarks/checkpoint_save.py")
    torch.set_num_threads(1)
    root = comm.bcast(args.dir or tempfile.mkdtemp(prefix="psrt-save-bench-") if comm.rank == 0 else None)
    numel = args.layers * (args.width * args.width + args.width)
    say(f"# checkpoint save benchmark: {comm.size} ranks, {numel / 1e6:.1f} M parameters, Adam, {ROWS} rows per rank, "
        f"{args.steps} steps after each save, {args.rounds} rounds, saves in {root}; load average "
        f"{os.getloadavg()[0]:.2f}")
    results = bench(args, root)
    megabytes = {"commit": directory_megabytes(os.path.join(root, "commit")),
                 "zero": directory_megabytes(os.path.join(root, "zero")) if comm.rank == 0 else 0.0}
    say(table(results, megabytes))
    say(json.dumps({"bench": "checkpoint_save", "ranks": comm.size, "params": numel, "steps": args.steps,
                    "rounds": args.rounds, "megabytes": megabytes, "load_average_end": os.getloadavg()[0], **results}))
    comm.Barrier()
    if comm.rank == 0 and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
