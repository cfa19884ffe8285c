"""A background elastic commit SIGKILLed at each stage of its write, for
tests/parallel/test_background_save.py.

``python background_save_kill.py write STAGE`` (one process, ``PSRT_ELASTIC_DIR`` set) trains
a small model, commits synchronously (commit 1), trains on, commits in the background (commit
2) and keeps training until the process SIGKILLs itself at ``STAGE`` of that commit: psrt's
own functions are wrapped here, none of psrt's code knows of the test.  ``python
background_save_kill.py verify DIR...`` is the relaunch: one process resumes each directory
in turn, compares what it restored with the same training recomputed, commits again, and
prints one JSON line per directory.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import psrt.torch as hvd
from launcher.contract import ENV_ELASTIC_DIR
from psrt import background_save
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic import commits

#: Each stage, and the commit a relaunch must resume from after a kill there.
STAGES = {
    "staging": 1,  # the copies staged, the writer not started
    "writing_a_file": 1,  # replicated.pt.tmp written, not renamed
    "files_written": 1,  # every file in place, the commit record not begun
    "writing_the_record": 1,  # latest.json.tmp written, not renamed
    "record_written": 2,  # latest.json names commit 2; commit 1's directory not yet removed
}
STEPS = {1: 2, 2: 3}  # the steps trained at each commit


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(stage: str) -> None:
    """Wrap the psrt function at whose ``stage`` the process dies."""
    if stage == "staging":
        stage_copies = background_save.BackgroundSaver.stage
        background_save.BackgroundSaver.stage = lambda saver, document: (stage_copies(saver, document), die())
    elif stage == "writing_a_file":
        write_file = checkpoint_files.save_file
        checkpoint_files.save_file = lambda tensors, path, metadata=None: (write_file(tensors, path, metadata), die())
    elif stage == "files_written":
        checkpoint_files.write_json = lambda document, path: die()
    elif stage == "writing_the_record":
        rename = os.replace
        checkpoint_files.os.replace = lambda src, dst: die() if dst.endswith(commits.LATEST) else rename(src, dst)
    elif stage == "record_written":
        commits.shutil.rmtree = lambda path, ignore_errors=False: die()
    else:
        raise SystemExit(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")


def trained(steps: int, model: torch.nn.Module | None = None):
    """The model and Adam optimizer after ``steps`` steps on fixed data (fresh ones if none given)."""
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        train_step(model, optimizer, step)
    return model, optimizer


def train_step(model, optimizer, step: int) -> None:
    data = torch.Generator().manual_seed(100 + step)
    optimizer.zero_grad()
    model(torch.randn(6, 8, generator=data)).pow(2).mean().backward()
    optimizer.step()


def write(stage: str) -> None:
    model, optimizer = trained(STEPS[1])
    state = hvd.elastic.TorchState(model, optimizer, step=STEPS[1])
    state.commit()
    for step in range(STEPS[1], STEPS[2]):
        train_step(model, optimizer, step)
    state.step = STEPS[2]
    kill_at(stage)
    state.commit(background=True)
    deadline = time.monotonic() + 60
    step = STEPS[2]
    while time.monotonic() < deadline:  # training goes on while the writer writes, until the kill
        train_step(model, optimizer, step)
        step += 1
        time.sleep(0.01)
    print(f"stage {stage}: the process was never killed", flush=True)
    sys.exit(1)


def verify(directory: str) -> dict:
    listing = sorted(os.path.relpath(os.path.join(where, name), directory)
                     for where, folders, names in os.walk(directory) for name in folders + names)
    os.environ[ENV_ELASTIC_DIR] = directory
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = hvd.elastic.TorchState(model, optimizer, step=-1)
    state._resume()
    number = state.restored_from
    expected, expected_optimizer = trained(STEPS.get(number, 0))
    differ = [name for name, value in expected.state_dict().items() if not torch.equal(model.state_dict()[name], value)]
    mine, theirs = optimizer.state_dict()["state"], expected_optimizer.state_dict()["state"]
    differ += [f"optimizer {index}.{key}" for index in theirs for key in theirs[index]
               if not torch.equal(mine[index][key], theirs[index][key])]
    state.commit(background=True).wait()  # the relaunch goes on committing over what the kill left
    with open(os.path.join(directory, commits.LATEST)) as f:
        next_commit = json.load(f)["commit"]
    return {"directory": directory, "left": listing, "restored_from": number, "step": state.step, "differ": differ,
            "next_commit": next_commit}


def main() -> None:
    hvd.init()
    if sys.argv[1] == "write":
        write(sys.argv[2])
    for directory in sys.argv[2:]:
        print(json.dumps(verify(directory)), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
