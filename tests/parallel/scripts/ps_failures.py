"""Parameter-server jobs that go wrong on purpose; ``test_ps.py`` checks how each ends.

``python ps_failures.py MODE`` with 1 server and 2 workers:

* ``stall``: worker 1 stops pushing in sync mode; the server reports it by name
  after ``PSRT_STALL_CHECK_TIME`` and ends the job after ``PSRT_STALL_SHUTDOWN_TIME``.
* ``early_exit``: worker 1 shuts down after one step; worker 0's next sync step
  fails with an error naming worker 1, which it prints as a JSON line.
* ``worker_dies``: worker 1's process exits in the middle of training.
* ``flush``: worker 1 starts three sync pushes and shuts down without waiting
  for them; worker 0's pull must still see all three steps applied.

``python ps_failures.py one_sided`` with 1 server and 3 workers, each of which prints
``BLOCKED <rank> <time>`` just before the call it blocks in: worker 0 alone calls
``opt.save`` (a collective of the workers), worker 2 alone ``opt.load``, and worker 1 goes on
training, so its sync step waits for pushes the others never send.  A deadlock, found
within seconds whatever the stall times, naming each worker, its call and its line (each
marked ``# one-sided: <call>`` for the test to find).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

import psrt.ps as ps
import psrt.torch as hvd


def one_sided() -> None:
    model = torch.nn.Linear(4, 2)
    opt = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(3, 4)).pow(2).mean().backward()
        opt.step()  # one-sided: step

    step()
    directory = tempfile.mkdtemp()
    print(f"BLOCKED {hvd.rank()} {time.time():.3f}", flush=True)
    if hvd.rank() == 0:
        opt.save(directory)  # one-sided: save
    elif hvd.rank() == 2:
        opt.load(directory)  # one-sided: load
    step()


def main(mode: str) -> None:
    hvd.init()
    if mode == "one_sided":
        return one_sided()
    kv = ps.KVStore("sync")
    kv.init("weights", torch.zeros(1000))
    kv.set_optimizer("SGD", lr=0.1)
    if mode == "flush":
        for _ in range(3):
            kv.push_async("weights", torch.ones(1000))
        if hvd.rank() == 0:
            print(json.dumps({"worker": 0, "value": kv.pull("weights")[:3].tolist()}), flush=True)
        hvd.shutdown()
        return
    for step in range(5):
        if hvd.rank() == 1 and step == 2:
            if mode == "stall":
                time.sleep(600)
            elif mode == "early_exit":
                hvd.shutdown()
                return
            elif mode == "worker_dies":
                sys.stdout.flush()
                os._exit(7)
        try:
            kv.push_pull("weights", torch.ones(1000))
        except ps.ParameterServerError as e:
            print(json.dumps({"worker": hvd.rank(), "step": step, "error": str(e)}), flush=True)
            break
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
