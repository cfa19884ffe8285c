"""The training job that ``benchmarks/elastic.py`` launches under ``psrun`` (elastic mode).

Two models, each in a ``TorchState`` with an ``ElasticSampler`` over fixed synthetic data,
one torch thread per rank:

  mlp   64-128-64-10 (examples/train_digits.py's size), SGD with momentum 0.9 through
        ``hvd.DistributedOptimizer``, 32 rows of 64 features per rank, cross-entropy;
  zero  benchmarks/zero.py's model, rebuilt here: 6 x Linear(1024, 1024) (6.30 M
        parameters), ``ZeroOptimizer`` stage 2 with Adam (lr 1e-4), 32 rows per rank,
        loss mean(out^2) as there.

``recovery``: trains ``--steps`` steps, committing every ``--commit-every``; on the first
launch rank ``--kill-rank`` SIGKILLs itself after step ``--kill-step``.  Every launch's
rank 0 prints ``elastic-bench LAUNCH EVENT UNIX_TIME`` lines: ``started`` (first line of
this file), ``imported`` (torch and psrt), ``initialized`` (after ``hvd.init()``),
``built`` (model, optimizer, state: just before calling the ``@hvd.elastic.run`` function,
which restores the last commit), ``entered`` (first line of that function) and ``stepped``
(its first step done).  The dying rank prints ``kill`` just before ``os.kill``.

``commits``: ``--warmup`` untimed rounds, then ``--rounds`` rounds of ``--round-steps``
steps and one ``state.commit()``, each timed on rank 0 with ``perf_counter``; rank 0 then
prints ``elastic-bench-commits {json}`` with the times and the bytes of the last commit's
directory (every rank's files).
"""
from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import psrt.torch as hvd  # noqa: E402
from psrt.elastic.commits import CommitStore  # noqa: E402
from psrt.zero import ZeroOptimizer  # noqa: E402

IMPORTED = time.time()
LAUNCH = os.environ.get("PSRT_ELASTIC_LAUNCH", "1")
ROWS = 32  # per rank and step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("mlp", "zero"), required=True)
    sub = p.add_subparsers(dest="measure", required=True)
    killed = sub.add_parser("recovery")
    killed.add_argument("--steps", type=int, default=8)
    killed.add_argument("--commit-every", type=int, default=4)
    killed.add_argument("--kill-step", type=int, default=6)
    killed.add_argument("--kill-rank", type=int, default=1)
    timed = sub.add_parser("commits")
    timed.add_argument("--warmup", type=int, default=2)
    timed.add_argument("--rounds", type=int, default=20)
    timed.add_argument("--round-steps", type=int, default=3)
    return p.parse_args()


def event(name: str, at: float | None = None) -> None:
    print(f"elastic-bench {LAUNCH} {name} {time.time() if at is None else at:.6f}", flush=True)


def build(model_name: str):
    """(state, step function) for ``model_name``; the same initial model on every rank."""
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    if model_name == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))
        x = torch.rand(1437, 64, generator=data)  # the size of train_digits.py's training set
        y = torch.randint(0, 10, (len(x),), generator=data)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                             named_parameters=model.named_parameters())

        def loss_of(rows):
            return F.cross_entropy(model(x[rows]), y[rows])
    else:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
        x = torch.randn(2048, 1024, generator=data)
        optimizer = ZeroOptimizer(model, torch.optim.Adam, stage=2, lr=1e-4)

        def loss_of(rows):
            return model(x[rows]).pow(2).mean()
    sampler = hvd.elastic.ElasticSampler(torch.utils.data.TensorDataset(x), shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, step=0)
    position = {"batch": 0}  # batches since the sampler's last reset (a relaunch starts at 0)

    def step() -> None:
        if (position["batch"] + 1) * ROWS > len(sampler):
            sampler.set_epoch(sampler.epoch + 1)
            position["batch"] = 0
        optimizer.zero_grad()
        loss_of(sampler.get_indices(position["batch"], ROWS)).backward()
        optimizer.step()
        sampler.record_batch(position["batch"], ROWS)
        position["batch"] += 1
        state.step += 1

    return state, step


def recovery(args: argparse.Namespace, state, step) -> None:
    @hvd.elastic.run
    def train(state):
        if hvd.rank() == 0:
            event("entered")
        first = True
        while state.step < args.steps:
            step()
            if first and hvd.rank() == 0:
                event("stepped")
            first = False
            if state.step == args.kill_step and hvd.rank() == args.kill_rank and LAUNCH == "1":
                event("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % args.commit_every == 0:
                state.commit()

    if hvd.rank() == 0:
        event("built")
    train(state)


def commit_bytes() -> int:
    """Bytes in the directory of the last commit (every rank's files)."""
    store = CommitStore.from_env()
    directory = store.directory(store.latest()["commit"])
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


def commits(args: argparse.Namespace, state, step) -> None:
    steps: list[list[float]] = []
    commit_s: list[float] = []

    @hvd.elastic.run
    def train(state):
        for round_ in range(args.warmup + args.rounds):
            times = []
            for _ in range(args.round_steps):
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            start = time.perf_counter()
            state.commit()
            if round_ >= args.warmup:
                steps.append(times)
                commit_s.append(time.perf_counter() - start)

    train(state)
    if hvd.rank() == 0:
        print("elastic-bench-commits " + json.dumps({"ranks": hvd.size(), "step_s": steps, "commit_s": commit_s,
                                                     "commit_bytes": commit_bytes()}), flush=True)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    initialized = time.time()
    if hvd.rank() == 0:
        for name, at in (("started", STARTED), ("imported", IMPORTED), ("initialized", initialized)):
            event(name, at)
    state, step = build(args.model)
    (recovery if args.measure == "recovery" else commits)(args, state, step)
    hvd.shutdown()


if __name__ == "__main__":
    main()
