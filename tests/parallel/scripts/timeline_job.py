"""A short training-shaped job that records a timeline for ``psrt timeline-summary``.

Run on 2 ranks (``psrun -np 2 python timeline_job.py TRACE.json``): after a named broadcast,
each of ``STEPS`` steps submits three gradient-sized tensors with ``allreduce_async_``
(they reach one negotiation round and are fused), waits for them, then reduces a loss with
a blocking ``allreduce``.  Rank 0 writes the timeline and prints, besides the harness's
report, one JSON line ``{"submitted": {name: [collective, count]}}`` for the test to
compare with the summary.
"""
from __future__ import annotations

import json
import sys

import torch

import psrt
import psrt.torch as hvd

import _harness

STEPS = 4
GRADIENTS = {"grad.0": 1000, "grad.1": 3000, "grad.2": 200}


def timeline_written(key: str, path: str) -> None:
    hvd.start_timeline(path, mark_cycles=True)
    weights = hvd.broadcast(torch.arange(4.0) * (hvd.rank() + 1), root_rank=0, name="init.weights")
    for step in range(STEPS):
        grads = {name: torch.full((numel,), float(hvd.rank() + step)) for name, numel in GRADIENTS.items()}
        handles = [hvd.allreduce_async_(grad, name=name, op=hvd.Sum) for name, grad in grads.items()]
        for handle in handles:
            hvd.synchronize(handle)
        loss = hvd.allreduce(torch.tensor([float(step)]), name="loss")
        want = float(sum(rank + step for rank in range(hvd.size())))
        assert all(bool((g == want).all()) for g in grads.values()), f"{key}: step {step}: wrong gradient sums"
        assert float(loss) == step, f"{key}: step {step}: loss {float(loss)}"
    hvd.stop_timeline()
    assert torch.equal(weights, torch.arange(4.0)), f"{key}: broadcast gave {weights}"


def main() -> None:
    path = sys.argv[1]
    psrt.init()
    checks = _harness.Checks()
    checks.add("timeline_written", timeline_written, path)
    if hvd.rank() == 0:
        submitted = {"init.weights": ["BROADCAST", 1], "loss": ["ALLREDUCE", STEPS],
                     **{name: ["ALLREDUCE", STEPS] for name in GRADIENTS}}
        print(json.dumps({"submitted": submitted, "steps": STEPS}), flush=True)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
