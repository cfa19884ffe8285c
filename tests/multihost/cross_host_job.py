"""One small job of each kind, printing what it computed so that runs on one host and on two compare.

Run on every rank (``psrun -np 4 python cross_host_job.py dp,gpt``). Every rank
prints one JSON line per part, ``{"part": "dp", "rank": 0, "losses": [...],
"params": [...]}``, holding its losses and its own parameters after training;
the test compares them, rank by rank, with the same job on a single host
(each line also names the rank's host, to show where it ran, the values of the
environment variables psrun must forward to other hosts, and torchrun's variables as
``import psrt.torch`` left them and after ``init()``).
Parts:

- ``dp``: an MLP trained data-parallel with ``hvd.DistributedOptimizer``;
- ``gpt``: the tiny GPT of ``examples/tiny_gpt.py`` on a TP 2 x PP 2 grid (4 ranks);
- ``ps``: the MLP trained against parameter servers (launch with ``--num-servers``);
  ``rank`` is then the worker's index, which does not depend on where the server sits.

``--steps``, ``--step-sleep`` and ``--kill-rank``/``--kill-step`` make the ``dp``
part a long-running job for fault tests: rank 0 prints ``step N`` after every
step, and the rank to kill prints ``killing rank R at <time>`` before it sends
itself SIGKILL.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import psrt.ps
import psrt.torch as hvd
from launcher.contract import TORCH_VARIABLE_NAMES
from psrt.grid import ProcessGrid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "parallel", "scripts"))
import _listeners  # noqa: E402
from tiny_gpt import GPTConfig, batch, build_trainer, corpus, train_step  # noqa: E402

SEED, ROWS = 5, 32
# What a rank on another host only has if psrun forwarded it (the launch agent starts from
# a bare environment there).
FORWARDED = ("PATH", "PYTHONPATH", "PSRT_STALL_CHECK_TIME")
# torchrun's variables before init(): what psrun's rank wrapper or ``import psrt.torch`` set
AT_IMPORT = {name: os.environ.get(name) for name in TORCH_VARIABLE_NAMES}


def report(part: str, losses: list[float], params: list[torch.Tensor]) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)
    line = {"part": part, "rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
            "env": {name: os.environ.get(name) for name in FORWARDED},
            "torch_at_import": AT_IMPORT, "torch": {name: os.environ.get(name) for name in TORCH_VARIABLE_NAMES},
            "losses": losses, "params": [float(v) for v in flat]}
    print(json.dumps(line), flush=True)


def mlp() -> nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: every rank draws all of it and keeps its rows."""
    generator = torch.Generator().manual_seed(SEED * 1000 + step % 50)
    x = torch.randn(ROWS, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_mlp(part: str, optimizer_for: object, args: argparse.Namespace) -> None:
    model = mlp()
    optimizer = optimizer_for(model)
    rows = ROWS // hvd.size()
    mine = slice(hvd.rank() * rows, (hvd.rank() + 1) * rows)
    losses = []
    for step in range(args.steps):
        if hvd.rank() == args.kill_rank and step == args.kill_step:
            print(f"killing rank {hvd.rank()} at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = regression_batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
        losses.append(hvd.allreduce(loss.detach(), name=f"{part}.loss").item())
        if args.step_sleep:
            if hvd.rank() == 0:
                print(f"step {step}", flush=True)
            time.sleep(args.step_sleep)
    report(part, losses, list(model.parameters()))


def dp(args: argparse.Namespace) -> None:
    def wrap(model: nn.Module) -> torch.optim.Optimizer:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    train_mlp("dp", wrap, args)
    if hvd.rank() == 0 and _listeners.psrun_pid() is not None:  # every rank is still up: the next part needs them
        print(_listeners.snapshot_line(), flush=True)


def ps(args: argparse.Namespace) -> None:
    if psrt.ps.num_servers() == 0:
        raise SystemExit("the ps part needs parameter servers: launch with --num-servers 1")

    def wrap(model: nn.Module) -> torch.optim.Optimizer:
        return psrt.ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), mode="sync")
    train_mlp("ps", wrap, args)


def gpt(args: argparse.Namespace) -> None:
    data, alphabet = corpus()
    config = GPTConfig(vocab_size=len(alphabet), sequence_length=16, dim=16, heads=4, layers=2)
    grid = ProcessGrid(dp=1, tp=2, pp=2)
    trainer = build_trainer(config, grid, schedule="1f1b", microbatches=4, lr=1e-2, seed=SEED)
    generator, losses = torch.Generator().manual_seed(SEED), []
    for _ in range(min(args.steps, 3)):
        inputs, targets = batch(data, 8, config.sequence_length, generator)
        losses.append(train_step(trainer, inputs, targets))
    report("gpt", losses, list(trainer.stage.parameters()))
    grid.free()


PARTS = {"dp": dp, "gpt": gpt, "ps": ps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("parts", help="comma-separated parts to run, in order: " + ", ".join(PARTS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each dp step")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    args = p.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {sorted(PARTS)}")
    hvd.init()  # on a parameter server this serves until the workers are done, then exits
    torch.set_num_threads(1)
    for part in parts:
        PARTS[part](args)
    hvd.shutdown()


if __name__ == "__main__":
    main()
