"""Ranks that block in psrt calls the others never make, or that leave early
(``psrun -np N python deadlock_job.py MODE``).  Every rank prints ``BLOCKED <rank> <time>``
just before the call it blocks in (``time.time()``), so the test can time how the job ends.

``zero_save``     ZeRO-2: rank 0 alone calls ``opt.save()`` (the Horovod habit ``if rank == 0``);
                  the others go on to the next step's reduce-scatters (the engine path).
``tp_vs_engine``  in every tensor-parallel pair, the first rank runs a row-parallel layer
                  (a direct all-reduce) while the second calls ``hvd.allreduce`` (the direct
                  path against the engine's).
``exit_vs_tp``    rank 0 reaches the end of the script; the others wait in a tensor-parallel
                  all-reduce that needs it (the exit against the direct path).
``exit_vs_busy``  rank 0 reaches the end of the script while the others compute for long in
                  their own code: a stall (they may still come), reported naming them and
                  where they are, and ended at the stall shutdown time.
``busy_after_shutdown``  as ``exit_vs_busy``, but the others call ``hvd.shutdown()`` first:
                  rank 0 then waits in MPI's finalisation, after psrt's own exit.
"""
from __future__ import annotations

import sys
import tempfile
import time

import torch

import psrt.torch as hvd
from psrt import tp
from psrt.grid import ProcessGrid
from psrt.zero import ZeroOptimizer


def blocked() -> None:
    print(f"BLOCKED {hvd.rank()} {time.time():.3f}", flush=True)


def zero_save() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = ZeroOptimizer(model, torch.optim.Adam, stage=2, lr=0.01)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    blocked()
    if hvd.rank() == 0:
        opt.save(tempfile.mkdtemp())  # the bug: a collective on one rank
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()


def tp_vs_engine() -> None:
    grid = ProcessGrid(dp=hvd.size() // 2, tp=2)
    layer = tp.RowParallelLinear(4, 4, process_set=grid.tp_set, input_is_parallel=True)
    blocked()
    if grid.coords.tp == 0:
        layer(torch.ones(3, 2))
    else:
        hvd.allreduce(torch.ones(2), name="loss")


def exit_vs_tp() -> None:
    grid = ProcessGrid(tp=hvd.size())
    layer = tp.RowParallelLinear(4 * hvd.size(), 4, process_set=grid.tp_set, input_is_parallel=True)
    blocked()
    if hvd.rank() != 0:
        layer(torch.ones(3, 4))


def exit_vs_busy() -> None:
    hvd.allreduce(torch.ones(2), name="warm_up")
    blocked()
    if hvd.rank() != 0:
        time.sleep(120)  # computing, as far as psrt can tell


def busy_after_shutdown() -> None:
    hvd.allreduce(torch.ones(2), name="warm_up")
    blocked()
    if hvd.rank() != 0:
        hvd.shutdown()
        time.sleep(120)


if __name__ == "__main__":
    hvd.init()
    {"zero_save": zero_save, "tp_vs_engine": tp_vs_engine, "exit_vs_tp": exit_vs_tp,
     "exit_vs_busy": exit_vs_busy, "busy_after_shutdown": busy_after_shutdown}[sys.argv[1]]()
    print(f"rank {hvd.rank()} reached the end", flush=True)
