"""Jobs where one rank stops taking part in tensor- or pipeline-parallel traffic
(``psrun -np 2 python tp_pp_failures.py MODE``), run with PSRT_STALL_CHECK_TIME and
PSRT_STALL_SHUTDOWN_TIME set: the job must end on its own, naming what waited.

``tp_stall``  rank 1 never runs the tensor-parallel layer; rank 0 waits in its all-reduce.
``pp_stall``  rank 1's stage never finishes its forward; rank 0 waits for the gradient.
"""
from __future__ import annotations

import sys
import time

import torch

import psrt.torch as hvd
from psrt import pp, tp
from psrt.grid import ProcessGrid


class _StuckOnRankOne(torch.nn.Module):
    def forward(self, x):
        if hvd.rank() == 1:
            time.sleep(120)
        return x * 2


def tp_stall() -> None:
    grid = ProcessGrid(tp=2)
    layer = tp.RowParallelLinear(4, 4, process_set=grid.tp_set)
    if hvd.rank() == 1:
        time.sleep(120)
    layer(torch.ones(2, 4))
    print("RESULT the stalled layer returned", flush=True)


def pp_stall() -> None:
    grid = ProcessGrid(pp=2)
    stage = pp.PipelineStage([torch.nn.Linear(4, 4), _StuckOnRankOne()], grid.pp_set)
    pipe = pp.Pipeline(stage, lambda out, target: (out - target).pow(2).sum(), microbatches=2)
    pipe.step(torch.ones(4, 4) if grid.is_first_stage else None, torch.ones(4, 4) if grid.is_last_stage else None)
    print("RESULT the stalled step returned", flush=True)


if __name__ == "__main__":
    hvd.init()
    {"tp_stall": tp_stall, "pp_stall": pp_stall}[sys.argv[1]]()
