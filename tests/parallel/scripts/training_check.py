"""The training API against single-process references, in one job.

Run on every rank (``psrun -np N python training_check.py``): DistributedOptimizer,
the broadcast and object helpers, and SyncBatchNorm.  Each rank computes the
single-process reference itself, from the same seeds and the concatenated
batch; rank 0 prints one JSON line per check (see ``_harness``).
"""
from __future__ import annotations

import torch

import psrt.torch as hvd

import _harness
import _training_batch_norm
import _training_optimizer
import _training_state


def main() -> None:
    hvd.init()
    # The first optimizer imports torch._dynamo (about 10 s here): pay it before any check's clock starts.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    checks = _harness.Checks()
    _training_optimizer.add_checks(checks)
    _training_state.add_checks(checks)
    _training_batch_norm.add_checks(checks)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
