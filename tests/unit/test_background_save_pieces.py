"""Background saves in one process: a commit returns before its write, the next one waits for
it, a failure is raised once and leaves the previous commit, a restore reads the commit that
``save()``'s copies belong to, shutdown waits for a save and raises a failure nobody saw, and
staging orders a device tensor's copy between its producer and later writes (the fake device).
Equality with synchronous saves on 2 ranks and SIGKILLs at every stage of a write are in
tests/parallel/test_background_save.py."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

import psrt.torch as hvd
from launcher import contract
from psrt import background_save
from psrt.comm import streams
from psrt.elastic import commits
from psrt.errors import CheckpointError, ElasticError
from psrt.zero import ZeroOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_device  # tests/, as the engine pieces' fake-device test finds it


@pytest.fixture
def elastic_dir(tmp_path, monkeypatch):
    """A world of one whose commits go to the returned directory."""
    monkeypatch.setenv(contract.ENV_ELASTIC_DIR, str(tmp_path))
    hvd.init()
    yield tmp_path
    hvd.shutdown()


@pytest.fixture
def held_writes(monkeypatch):
    """Commit files wait for the returned event before they are written."""
    release = threading.Event()
    original = commits.CommitStore.save

    def save(store, document, number, name):
        assert release.wait(30), "the test never released the write"
        return original(store, document, number, name)

    monkeypatch.setattr(commits.CommitStore, "save", save)
    return release


def latest(directory: Path) -> int:
    return json.loads((directory / commits.LATEST).read_text())["commit"]


def test_a_commit_returns_before_its_write_and_the_next_one_waits_for_it(elastic_dir, held_writes):
    state = hvd.elastic.ObjectState(epoch=1)
    held_writes.set()
    state.commit()
    held_writes.clear()
    state.epoch = 2
    handle = state.commit(background=True)
    assert not handle.done() and latest(elastic_dir) == 1  # a relaunch now resumes commit 1
    threading.Timer(0.2, held_writes.set).start()
    state.epoch = 3
    state.commit()
    assert handle.done() and latest(elastic_dir) == 3
    resumed = hvd.elastic.ObjectState(epoch=0)
    assert resumed._resume() and resumed.epoch == 3


def test_a_failed_write_is_raised_once_and_leaves_the_previous_commit(elastic_dir, monkeypatch):
    state = hvd.elastic.ObjectState(epoch=1)
    state.commit()

    def full_disk(store, document, number, name):
        raise OSError("no space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(commits.CommitStore, "save", full_disk)
        state.epoch = 2
        state.commit(background=True)
        with pytest.raises(ElasticError, match="commit 2 failed, the previous commit stays: rank 0: OSError: no space"):
            state.commit()  # the next commit raises it, and commits nothing
    assert latest(elastic_dir) == 1
    state.commit()  # told once: the commit after goes ahead
    assert latest(elastic_dir) == 2 and hvd.elastic.ObjectState(epoch=0)._resume()


def test_a_restore_after_a_background_commit_loads_that_commits_sharded_checkpoint(elastic_dir, held_writes):
    """A ZeRO optimizer's state is restored from the commit directory: the one of the commit in
    flight, once it is written, not the one it replaces (which it removes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    zero = ZeroOptimizer(model, torch.optim.Adam, stage=2, lr=0.1)

    def step() -> None:
        zero.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        zero.step()

    state = hvd.elastic.TorchState(model, zero)
    step()
    held_writes.set()
    state.commit()
    held_writes.clear()
    step()
    committed = {key: value.clone() for key, value in model.state_dict().items()}
    state.commit(background=True)
    step()
    threading.Timer(0.2, held_writes.set).start()
    state.restore()
    assert all(torch.equal(model.state_dict()[key], value) for key, value in committed.items())
    assert latest(elastic_dir) == 2 and not (elastic_dir / "commit-000001").exists()


def test_shutdown_waits_for_a_background_commit_and_raises_a_failure_nobody_saw(tmp_path, monkeypatch, held_writes):
    monkeypatch.setenv(contract.ENV_ELASTIC_DIR, str(tmp_path))
    elastic_dir = tmp_path
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=1)
    state.commit(background=True)
    threading.Timer(0.2, held_writes.set).start()
    hvd.shutdown()
    assert latest(elastic_dir) == 1
    def disk_gone(store, document, number, name):
        raise OSError("disk gone")

    monkeypatch.setattr(commits.CommitStore, "save", disk_gone)
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=2)
    state.commit(background=True)  # fails, and nobody waits for it
    with pytest.raises(CheckpointError, match="no save or wait.*commit 2 failed.*OSError: disk gone"):
        hvd.shutdown()
    assert not hvd.is_initialized() and latest(elastic_dir) == 1


def test_staging_orders_a_device_tensors_copy_after_its_producer_and_before_later_writes():
    """On the fake device (host memory playing a GPU's): the copy runs on a side stream that
    waited for the producer's stream, the producer's stream waits for the copy before it
    writes the tensor again, and only the writer thread's host waits for the copy."""
    with streams.installed(fake_device.FakeCuda()) as cuda, fake_device.Recorder(cuda):
        saver = background_save.BackgroundSaver(group=None)  # staging needs no communication
        weight = torch.ones(64) * 3  # produced on the compute stream
        staged = saver.stage({"weight": weight, "step": 7, "shape": torch.Size([64])})
        weight.add_(1)  # the next step writes it
        document = staged.take()
    assert not cuda.unwaited and not cuda.unready, cuda.unwaited + cuda.unready
    assert cuda.host_waits == ["a background save writes its staged copy from host memory"]
    assert torch.equal(document["weight"], torch.full((64,), 3.0))
    assert document["weight"].data_ptr() != weight.data_ptr()
    assert document["step"] == 7 and document["shape"] == torch.Size([64])
