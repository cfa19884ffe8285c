"""Training that runs until something outside stops it: ``test_frozen_ranks.py`` freezes
one rank (SIGSTOP) or kills it once the job has printed ``step 3``, and checks how the job
ends.  ``python frozen_training.py MODE`` where MODE is:

``dp``         data-parallel training with DistributedOptimizer (every rank a worker);
``ps``         parameter-server training (launch with PSRT_NUM_SERVERS=1): ps.DistributedOptimizer;
``ddp``        torch's DistributedDataParallel on ``dist.init_process_group("psrt")``;
``late_init R``  as ``dp``, but rank R sleeps instead of calling ``hvd.init()`` (a rank stuck
                 before start-up).

Rank 0 prints ``step N`` after each step.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import psrt.torch as hvd


def main(mode: str, late_rank: str = "") -> None:
    if mode == "late_init" and os.environ.get("OMPI_COMM_WORLD_RANK") == late_rank:
        time.sleep(300)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if mode == "ddp":
        import torch.distributed as dist

        dist.init_process_group("psrt")
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    elif mode != "ps":
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
    else:
        import psrt.ps as ps

        opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters())
    data = torch.randn(64, 32)
    for step in range(100_000):
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
        if hvd.rank() == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.05)


if __name__ == "__main__":
    main(*sys.argv[1:])
