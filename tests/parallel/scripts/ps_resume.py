"""Checkpoint, restart, resume: two jobs of ``python ps_resume.py PHASE DIR`` (1 server, 2 workers).

``first`` trains STEPS steps (Adam, two parameter groups), saves the servers to DIR/ckpt, writes the
parameters there and after STEPS more steps to DIR/first.pt (worker 0).
``second`` is a new job on a freshly (and differently) initialised model: it
loads DIR/ckpt, writes the parameters it got, trains the same STEPS more
steps, saves again to DIR/again, and writes everything to DIR/second.pt.  The
test compares the two files and the two checkpoints.  ``refused`` (a third job)
tries to load a directory without a finished save, and DIR/ckpt into a different
model, and writes the errors to DIR/refused.json.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import psrt.ps as ps
import psrt.torch as hvd

from _training_common import Mlp, global_batch, loss_of, my_rows

STEPS = 3


def train(model, optimizer, first_step: int) -> None:
    for step in range(first_step, first_step + STEPS):
        optimizer.zero_grad()
        x, y = global_batch("resume", step)
        loss_of(model, my_rows(x), my_rows(y)).backward()
        optimizer.step()


def snapshot(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def refusals(directory: str) -> dict:
    """The errors of two loads that must fail, before anything is restored."""
    errors = {}
    other = torch.nn.Linear(6, 5)  # not the checkpoint's model
    optimizer = ps.DistributedOptimizer(torch.optim.Adam(other.parameters(), lr=0.01),
                                        other.named_parameters(), mode="sync")
    for case, path in (("no_manifest", os.path.join(directory, "empty")),
                       ("other_model", os.path.join(directory, "ckpt"))):
        try:
            optimizer.load(path)
            errors[case] = None
        except ps.ParameterServerError as e:
            errors[case] = str(e)
    return errors


def main(phase: str, directory: str) -> None:
    hvd.init()
    if phase == "refused":
        errors = refusals(directory)
        if hvd.rank() == 0:
            with open(os.path.join(directory, "refused.json"), "w") as f:
                json.dump(errors, f)
        hvd.shutdown()
        return
    model = Mlp("resume" if phase == "first" else "a different start")
    # two parameter groups (a store each on the servers): the checkpoint holds both
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    optimizer = ps.DistributedOptimizer(torch.optim.Adam([{"params": biases, "lr": 0.02}, {"params": weights}],
                                                         lr=0.01), model.named_parameters(), mode="sync")
    record = {}
    if phase == "first":
        train(model, optimizer, 0)
        optimizer.save(os.path.join(directory, "ckpt"), extra={"epoch": 1})
        record["saved"] = snapshot(model)
        record["steps"] = STEPS
    else:
        assert optimizer.load(os.path.join(directory, "ckpt")) == {"epoch": 1}
        record["steps"] = optimizer.steps_restored
        record["saved"] = snapshot(model)
        optimizer.save(os.path.join(directory, "again"))
    train(model, optimizer, STEPS)
    record["final"] = snapshot(model)
    if hvd.rank() == 0:
        torch.save(record, os.path.join(directory, f"{phase}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
