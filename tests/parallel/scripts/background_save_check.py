"""Background saves on 2 ranks: ``python background_save_check.py ROOT``.

An elastic commit and a ZeRO save written in the background while training goes on (each
rank's steps run their collectives on the training thread while the writers agree on theirs)
are the synchronous ones, file for file or value for value, and the ZeRO save is the state of
one process trained on every rank's rows; a write that fails on rank 1 fails the save on both
ranks, at the handle's wait() or at the next save, and leaves the previous commit.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch

import psrt.torch as hvd
from launcher.contract import ENV_ELASTIC_DIR
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic import commits
from psrt.errors import CheckpointError, ElasticError
from psrt.zero import ZeroOptimizer, consolidate

import _harness
from _training_common import expect_raises
from _zero_common import ZNet, batch, loss_of, mine, reference_step

INJECTED = "no space left on device (injected)"


class Training:
    """ZNet trained on this rank's rows with ``optimizer`` (a DistributedOptimizer's Adam or ZeRO)."""

    def __init__(self, key: str, zero: bool) -> None:
        self.key, self.steps = key, 0
        self.model = ZNet(key)
        self.optimizer = (ZeroOptimizer(self.model, torch.optim.Adam, stage=2, lr=0.01) if zero else
                          hvd.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=0.01),
                                                   named_parameters=self.model.named_parameters()))

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            self.optimizer.zero_grad()
            x, y = batch(self.key, self.steps, 0)
            loss_of(self.model, mine(x), mine(y), 1).backward()
            self.optimizer.step()
            self.steps += 1

    def values(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.model.state_dict().items()}


def state_in(directory: str, training: Training) -> hvd.elastic.TorchState:
    """A TorchState committing to ``directory`` (the variable psrun sets, for this state only)."""
    os.environ[ENV_ELASTIC_DIR] = directory
    try:
        return hvd.elastic.TorchState(training.model, training.optimizer, step=training.steps)
    finally:
        del os.environ[ENV_ELASTIC_DIR]


def latest(directory: str) -> dict:
    with open(os.path.join(directory, commits.LATEST)) as f:
        return json.load(f)


def assert_equal(ours: object, theirs: object, where: str) -> None:
    """Documents of tensors and plain data equal bit for bit."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{where}: {ours!r:.200} vs {theirs!r:.200}"
        for key, value in theirs.items():
            assert_equal(ours[key], value, f"{where}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for index, value in enumerate(theirs):
            assert_equal(ours[index], value, f"{where}[{index}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} vs {theirs!r}"


def check_elastic_background_commit_is_the_synchronous_one(name: str, root: str) -> None:
    training = Training("background-elastic", zero=False)
    training.step(2)
    synchronous, background = state_in(os.path.join(root, "sync"), training), \
        state_in(os.path.join(root, "background"), training)
    committed = training.values()
    synchronous.commit()
    written = threading.Event()  # rank 0's writer waits for this rank's steps: the write spans them
    original = commits.CommitStore.save

    def save_after_the_steps(store, document, number, file_name):
        if hvd.rank() == 0:
            written.wait(20)
        return original(store, document, number, file_name)

    commits.CommitStore.save = save_after_the_steps
    try:
        handle = background.commit(background=True)
        assert hvd.rank() != 0 or not handle.done(), "commit(background=True) waited for the write"
        training.step(3)  # allreduces on the training thread while the writers agree on theirs
        written.set()
        handle.wait()
    finally:
        commits.CommitStore.save = original
    theirs, ours = latest(os.path.join(root, "sync")), latest(os.path.join(root, "background"))
    assert ours["commit"] == theirs["commit"] == 1 and ours["files"].keys() == theirs["files"].keys()
    for file_name in ours["files"]:  # safetensors orders a file's metadata as it likes: compare what it holds
        assert_equal(*(checkpoint_files.load_tensors(os.path.join(root, which, "commit-000001", file_name), None,
                                                     CheckpointError) for which in ("background", "sync")),
                     file_name)
    fresh = Training("background-elastic-other-init", zero=False)
    resumed = state_in(os.path.join(root, "background"), fresh)
    assert resumed._resume() and resumed.restored_from == 1 and resumed.step == 2
    for key, value in committed.items():
        assert torch.equal(fresh.model.state_dict()[key], value), f"{key} was not restored exactly"


def check_zero_background_save_is_the_synchronous_one_and_one_process(name: str, root: str) -> None:
    training = Training("background-zero", zero=True)
    training.step(2)
    training.optimizer.save(os.path.join(root, "zero-sync"), extra={"step": 2})
    handle = training.optimizer.save(os.path.join(root, "zero-background"), extra={"step": 2}, background=True)
    training.step(2)
    handle.wait()
    synchronous, background = consolidate(os.path.join(root, "zero-sync")), \
        consolidate(os.path.join(root, "zero-background"))
    assert background["extra"] == {"step": 2}
    for key, value in synchronous["model"].items():
        assert torch.equal(background["model"][key], value), f"model {key} differs from the synchronous save's"
    for index, state in synchronous["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(background["optimizer"]["state"][index][key], value), f"state {index}.{key} differs"
    reference = ZNet("background-zero")
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for step in range(2):
        reference_step(reference, optimizer, "background-zero", step, 1)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(background["model"][key], value, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, k=key: f"{k} vs one process: {m}")


def check_a_commit_that_fails_on_rank_1_fails_on_every_rank(name: str, root: str) -> None:
    training = Training("background-failure", zero=False)
    directory = os.path.join(root, "failing")
    state = state_in(directory, training)
    state.commit(background=True).wait()
    original = commits.CommitStore.save

    def failing(store, document, number, file_name):
        if hvd.rank() == 1:
            raise OSError(INJECTED)
        return original(store, document, number, file_name)

    commits.CommitStore.save = failing
    try:
        handle = state.commit(background=True)
        training.step(2)
        expect_raises(ElasticError, handle.wait, f"commit 2 failed, the previous commit stays: rank 1: OSError: "
                      f"{INJECTED}", "the handle")
    finally:
        commits.CommitStore.save = original
    assert latest(directory)["commit"] == 1
    state.commit()  # the error was told: the next commit goes ahead
    assert latest(directory)["commit"] == 2


def check_a_zero_save_that_failed_unseen_is_raised_at_the_next_save(name: str, root: str) -> None:
    training = Training("background-zero-failure", zero=True)
    training.step(1)
    original = checkpoint_files.save_tensors

    def failing(document, path):
        if hvd.rank() == 1:
            raise OSError(INJECTED)
        return original(document, path)

    checkpoint_files.save_tensors = failing
    try:
        training.optimizer.save(os.path.join(root, "zero-failing"), background=True)  # its handle is dropped
        training.step(1)
        expect_raises(CheckpointError, lambda: training.optimizer.save(os.path.join(root, "zero-next"),
                                                                       background=True),
                      f"failed, its zero_meta.json was not written: rank 1: OSError: {INJECTED}", "the next save")
    finally:
        checkpoint_files.save_tensors = original
    assert not os.path.exists(os.path.join(root, "zero-failing", "zero_meta.json"))
    training.optimizer.save(os.path.join(root, "zero-next"), background=True).wait()
    assert consolidate(os.path.join(root, "zero-next"))["model"].keys()


CHECKS = {
    "elastic/background_commit_is_the_synchronous_one": check_elastic_background_commit_is_the_synchronous_one,
    "zero/background_save_is_the_synchronous_one_and_one_process":
        check_zero_background_save_is_the_synchronous_one_and_one_process,
    "errors/a_commit_that_fails_on_rank_1_fails_on_every_rank": check_a_commit_that_fails_on_rank_1_fails_on_every_rank,
    "errors/a_zero_save_that_failed_unseen_is_raised_at_the_next_save":
        check_a_zero_save_that_failed_unseen_is_raised_at_the_next_save,
}


def main(root: str) -> None:
    hvd.init()
    checks = _harness.Checks()
    for name, check in CHECKS.items():
        checks.add(name, check, root)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
