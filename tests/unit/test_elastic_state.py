"""Elastic state objects in one process: what commit() keeps, in memory and on disk, and what
it refuses.  The multi-rank behaviour (relaunches, resharding, exact resume) is in
tests/parallel/test_elastic.py."""
from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

import psrt.torch as hvd
from launcher import contract
from psrt.elastic import commits
from psrt.elastic.commits import CommitStore
from psrt.errors import ArgumentTypeError, CheckpointError, ElasticError


@pytest.fixture
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.fixture
def elastic_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(contract.ENV_ELASTIC_DIR, str(tmp_path))
    return tmp_path


def trained(seed: int = 0):
    """A model and an Adam optimizer with state (created by its first step) and a sampler."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=3)
    return model, optimizer, sampler


def step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(5, 4)).pow(2).sum().backward()
    optimizer.step()


def test_horovod_names_are_where_horovod_scripts_look():
    for name in ("run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
                 "HostsUpdatedInterrupt"):
        assert hasattr(hvd.elastic, name), name
    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError


def test_restore_goes_back_to_the_last_commit_in_memory(world_of_one):
    model, optimizer, sampler = trained()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=1, history=[0.5])
    sampler.record_batch(0, 2)
    state.commit()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    kept_step = optimizer.state_dict()["state"][0]["step"].clone()
    step(model, optimizer)
    state.epoch, state.history = 2, [0.5, 0.4]
    sampler.record_batch(1, 2)
    state.restore()
    assert state.epoch == 1 and state.history == [0.5]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())
    assert torch.equal(optimizer.state_dict()["state"][0]["step"], kept_step)
    assert sampler.processed_num == 2


def test_a_commit_on_disk_restores_bit_identically_in_a_fresh_process_state(world_of_one, elastic_dir):
    """What a relaunched job does: new objects, the last commit read back, RNG states included."""
    model, optimizer, sampler = trained()
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=3)
    sampler.record_batch(1, 3)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state.commit()
    after_commit = (random.random(), np.random.rand(), torch.rand(1))
    step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh_model, fresh_optimizer, fresh_sampler = trained(seed=1)
    fresh_optimizer.state.clear()  # a new job has no optimizer state before its first step
    resumed = hvd.elastic.TorchState(fresh_model, fresh_optimizer, sampler=fresh_sampler, epoch=0)
    assert resumed._resume() and resumed.restored_from == 1 and resumed.epoch == 3
    assert (random.random(), np.random.rand(), torch.rand(1)) == after_commit
    sampler.reset()  # what the committing job's sampler reads once it is reset
    assert fresh_sampler.processed_num == sampler.processed_num == 3 and list(fresh_sampler) == list(sampler)
    step(fresh_model, fresh_optimizer)
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in expected.items())


def test_commit_refuses_values_that_are_not_plain_data(world_of_one, elastic_dir):
    class Opaque:
        pass

    state = hvd.elastic.ObjectState(epoch=0, thing=Opaque())
    with pytest.raises(ElasticError, match=r"\['thing'\] is a Opaque.*state_dict"):
        state.commit()
    assert commits.CommitStore(str(elastic_dir)).latest() is None


def test_a_damaged_commit_is_refused_naming_the_file(world_of_one, elastic_dir):
    state = hvd.elastic.ObjectState(epoch=7)
    state.commit()
    path = elastic_dir / "commit-000001" / commits.REPLICATED
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(ElasticError, match="replicated.pt.*sha256"):
        hvd.elastic.ObjectState(epoch=0)._resume()


def test_run_resumes_then_calls_the_reset_callbacks(world_of_one, elastic_dir):
    first = hvd.elastic.ObjectState(epoch=0)
    first.epoch = 4
    first.commit()
    calls = []
    state = hvd.elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append(state.epoch)])

    @hvd.elastic.run
    def train(state):
        return state.epoch

    assert train(state) == 4 and calls == [4]


def test_wrong_types_are_named():
    with pytest.raises(ArgumentTypeError, match="torch.nn.Module"):
        hvd.elastic.TorchState(model="not a model")
    with pytest.raises(ArgumentTypeError, match="optimizer"):
        hvd.elastic.TorchState(optimizer=object())

    @hvd.elastic.run
    def train(state):
        return state

    with pytest.raises(ArgumentTypeError, match="first argument of an elastic function"):
        train(42)


# A commit directory is never guessed at, nor cleaned of what the job did not write (issue 27).

def commits_in(directory) -> list[str]:
    return sorted(path.name for path in directory.glob("commit-*"))


@hvd.elastic.run
def two_commits(state):
    for _ in range(2):
        state.epoch += 1
        state.commit()
    return state.epoch


def test_commits_without_latest_json_are_refused_naming_them_and_kept(world_of_one, elastic_dir):
    """Deleting latest.json must not make the next launch start afresh and then delete the
    commit: it is an error naming the directory and its commits, and nothing is removed."""
    assert two_commits(hvd.elastic.ObjectState(epoch=0)) == 2 and commits_in(elastic_dir) == ["commit-000002"]
    (elastic_dir / commits.LATEST).unlink()
    expected = f"{elastic_dir} holds commit directories commit-000002 but no latest.json"
    with pytest.raises(ElasticError, match=expected):
        two_commits(hvd.elastic.ObjectState(epoch=0))
    with pytest.raises(ElasticError, match=expected):  # committing without elastic.run() is refused too
        hvd.elastic.ObjectState(epoch=5).commit()
    assert commits_in(elastic_dir) == ["commit-000002"] and (elastic_dir / "commit-000002" / commits.REPLICATED).exists()
    assert not (elastic_dir / commits.LATEST).exists()
    assert expected in json.loads((elastic_dir / contract.RESTORE_FAILED_FILE).read_text())["reason"]  # for psrun


@pytest.mark.parametrize("pointer", ["{not json", '{"format": "other/1", "commit": 2, "files": {}}'])
def test_a_damaged_or_foreign_latest_json_names_the_commits_found(world_of_one, elastic_dir, pointer):
    two_commits(hvd.elastic.ObjectState(epoch=0))
    (elastic_dir / commits.LATEST).write_text(pointer)
    with pytest.raises(ElasticError, match="commit directories commit-000002"):
        two_commits(hvd.elastic.ObjectState(epoch=0))
    assert commits_in(elastic_dir) == ["commit-000002"]


def test_a_job_removes_only_the_commit_it_replaces(world_of_one, elastic_dir):
    """A commit directory the job did not write (copied in, or left by another job) stays,
    whether the job resumes or commits without elastic.run()."""
    two_commits(hvd.elastic.ObjectState(epoch=0))
    foreign = elastic_dir / "commit-000009"
    foreign.mkdir()
    (foreign / commits.REPLICATED).write_bytes(b"someone else's")
    resumed = hvd.elastic.ObjectState(epoch=0)
    assert two_commits(resumed) == 4 and resumed.restored_from == 2
    assert commits_in(elastic_dir) == ["commit-000004", "commit-000009"]
    unresumed = hvd.elastic.ObjectState(epoch=100)
    unresumed.commit()  # numbered after the pointer, so it cannot land in a directory it did not write
    assert commits_in(elastic_dir) == ["commit-000004", "commit-000005", "commit-000009"]
    assert CommitStore(str(elastic_dir)).latest()["commit"] == 5
    assert (foreign / commits.REPLICATED).read_bytes() == b"someone else's"


def test_a_job_killed_inside_its_first_commit_starts_afresh(world_of_one, elastic_dir):
    """The pointer is written before the first commit directory, so the directory an unfinished
    first commit leaves is not mistaken for a commit whose pointer was lost."""
    first = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def killed_in_first_commit(state):
        state._store.begin(1)
        state._store.save({"rng": 0}, 1, commits.rank_file(0))  # the process dies here

    killed_in_first_commit(first)
    relaunched = hvd.elastic.ObjectState(epoch=0)
    assert two_commits(relaunched) == 2 and relaunched.restored_from is None
    assert commits_in(elastic_dir) == ["commit-000002"]


def test_without_a_commit_directory_run_keeps_commits_in_memory(world_of_one, monkeypatch):
    monkeypatch.delenv(contract.ENV_ELASTIC_DIR, raising=False)
    state = hvd.elastic.ObjectState(epoch=0)
    assert two_commits(state) == 2 and state.restored_from is None
    state.epoch = 7
    state.restore()
    assert state.epoch == 2


def test_a_restore_failure_is_reported_for_psrun(world_of_one, elastic_dir):
    two_commits(hvd.elastic.ObjectState(epoch=0))
    path = elastic_dir / "commit-000002" / commits.REPLICATED
    path.write_bytes(path.read_bytes()[:-4] + b"oops")
    with pytest.raises(ElasticError, match="cannot resume from commit 2") as caught:
        two_commits(hvd.elastic.ObjectState(epoch=0))
    reason = json.loads((elastic_dir / contract.RESTORE_FAILED_FILE).read_text())["reason"]
    assert reason == str(caught.value) and "sha256" in reason


def test_a_restore_that_fails_in_an_optimizer_checkpoint_is_reported_for_psrun_too(world_of_one, elastic_dir,
                                                                                    monkeypatch):
    """A ZeRO or parameter-server checkpoint inside the commit fails with its own error, not
    an ElasticError: psrun must still learn of it, or it relaunches --restarts times."""
    two_commits(hvd.elastic.ObjectState(epoch=0))
    fresh = hvd.elastic.ObjectState(epoch=0)

    def damaged(*args) -> None:
        raise CheckpointError("zero/meta.json: sha256 differs")
    monkeypatch.setattr(fresh, "_read", damaged)
    with pytest.raises(CheckpointError):
        two_commits(fresh)
    reason = json.loads((elastic_dir / contract.RESTORE_FAILED_FILE).read_text())["reason"]
    assert reason == "CheckpointError: zero/meta.json: sha256 differs"


def test_the_tp_rng_tracker_is_committed_so_tp_dropout_resumes_exactly(world_of_one, elastic_dir):
    from psrt import tp
    tp.manual_seed(11)
    state = hvd.elastic.TorchState(step=0)
    with tp.rng_tracker().fork():
        torch.rand(3)  # the stream moves on before the commit
    state.commit()
    with tp.rng_tracker().fork():
        after_commit = torch.rand(3)
    state.restore()
    with tp.rng_tracker().fork():
        assert torch.equal(torch.rand(3), after_commit)
    tp.manual_seed(11)  # what a relaunched job does before it resumes
    assert hvd.elastic.TorchState(step=0)._resume()
    with tp.rng_tracker().fork():
        assert torch.equal(torch.rand(3), after_commit)


def test_a_grid_commit_holds_each_block_once_and_restores_without_a_grid(world_of_one, elastic_dir):
    """A TP x PP stage's commit is its (TP, PP) coordinate's blocks of the model and optimizer
    in a file of their own, named by the single-process model's keys, so another layout, here
    none, restores it; the multi-rank case is in test_elastic."""
    from psrt.grid import ProcessGrid
    model, optimizer, _ = trained()
    hvd.elastic.TorchState(model, optimizer, grid=ProcessGrid(dp=1, tp=1, pp=1)).commit()
    record = CommitStore(str(elastic_dir)).latest()
    assert record["any_layout"] and record["layout"]["grid"]["tp"] == 1
    shards = CommitStore(str(elastic_dir)).load(record, commits.REPLICATED)["shards"]
    assert list(shards["files"]) == ["model-pp000-tp000-ep000.pt"]
    assert shards["files"]["model-pp000-tp000-ep000.pt"]["optimizer"]["weight"]["exp_avg"] == {
        "layout": {"shape": [3, 4], "dtype": "float32"}}
    fresh_model, fresh_optimizer, _ = trained(seed=1)
    fresh_optimizer.state.clear()
    assert hvd.elastic.TorchState(fresh_model, fresh_optimizer)._resume()
    torch.manual_seed(2)
    step(model, optimizer)
    torch.manual_seed(2)
    step(fresh_model, fresh_optimizer)
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_sharded_restore_keeps_a_copy_of_its_own_that_restore_goes_back_to(world_of_one, elastic_dir):
    """The restored optimizer state and the kept copy (written into the previous copy's
    tensors) are distinct: training on, then restore(), gives the commit back."""
    from psrt.grid import ProcessGrid
    model, optimizer, _ = trained()
    hvd.elastic.TorchState(model, optimizer, grid=ProcessGrid()).commit()
    fresh_model, fresh_optimizer, _ = trained(seed=1)  # with optimizer state, so the old copy has tensors to reuse
    state = hvd.elastic.TorchState(fresh_model, fresh_optimizer, grid=ProcessGrid())
    assert state._resume()
    committed = copy.deepcopy(optimizer.state_dict())
    step(fresh_model, fresh_optimizer)
    state.restore()
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh_optimizer.state_dict()["state"][0][key], committed["state"][0][key]), key


def test_a_parameter_under_two_names_is_committed_once_and_restored_under_both(world_of_one, elastic_dir):
    """Tied input and output embeddings in one module: one block in the commit, an alias for
    the second name, and the restored model still shares the one parameter."""
    from psrt.grid import ProcessGrid

    def tied(seed: int) -> torch.nn.Sequential:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        model[1].weight = model[0].weight
        return model
    model = tied(0)
    hvd.elastic.TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1), grid=ProcessGrid()).commit()
    store = CommitStore(str(elastic_dir))
    shards = store.load(store.latest(), commits.REPLICATED)["shards"]
    assert list(shards["files"]["model-pp000-tp000-ep000.pt"]["model"]) == ["0.weight"]
    assert shards["aliases"] == {"1.weight": "0.weight"}
    fresh = tied(1)
    assert hvd.elastic.TorchState(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))._resume()
    assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight, model[0].weight)


def test_a_damaged_shard_is_refused_by_name_before_anything_changes(world_of_one, elastic_dir):
    from psrt.grid import ProcessGrid
    model, optimizer, _ = trained()
    hvd.elastic.TorchState(model, optimizer, grid=ProcessGrid()).commit()
    (shard,) = elastic_dir.glob("commit-*/model-*.pt")
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    fresh_model, fresh_optimizer, _ = trained(seed=1)
    before = {key: value.clone() for key, value in fresh_model.state_dict().items()}
    with pytest.raises(ElasticError, match=f"rank 0: {shard} was modified after it was saved"):
        hvd.elastic.TorchState(fresh_model, fresh_optimizer, grid=ProcessGrid())._resume()
    assert all(torch.equal(fresh_model.state_dict()[key], value) for key, value in before.items())


def test_a_grid_commit_of_psrt_before_shards_restores(world_of_one, elastic_dir):
    """psrt before sharded commits gathered a TP x PP model whole into replicated.pt ("full"):
    such a commit still restores, on any grid."""
    from psrt.elastic.torch_state import _Rng
    from psrt.full_state import FullState
    from psrt.grid import ProcessGrid
    model, optimizer, _ = trained()
    store = CommitStore(str(elastic_dir))
    store.begin(1)
    files = store.save({"objects": {"epoch": 4}, "samplers": {}, "full": FullState(model, optimizer).state_dict()},
                       1, commits.REPLICATED)
    files.update(store.save({"rng": _Rng.capture()}, 1, commits.rank_file(0)))
    layout = {"size": 1, "grid": {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1}}
    store.publish({"commit": 1, "size": 1, "layout": layout, "any_layout": True, "files": files}, replaces=0)
    fresh_model, fresh_optimizer, _ = trained(seed=1)
    state = hvd.elastic.TorchState(fresh_model, fresh_optimizer, grid=ProcessGrid(), epoch=0)
    assert state._resume() and state.epoch == 4
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], exp_avg)


def test_optimizers_are_told_apart_by_the_state_protocol_not_their_type(world_of_one, elastic_dir):
    class Sharded:
        """A ShardedStateful: writes its own directory in each commit."""
        checkpoint_name = "mine"
        loaded: list = []

        def save(self, directory):
            import os
            os.makedirs(directory)

        def load(self, directory):
            self.loaded.append(directory)

    sharded = Sharded()
    state = hvd.elastic.TorchState(torch.nn.Linear(2, 2), sharded, epoch=1)
    state.commit()
    assert (elastic_dir / "commit-000001" / "mine").is_dir()
    state.restore()
    assert sharded.loaded == [str(elastic_dir / "commit-000001" / "mine")]
    with pytest.raises(ArgumentTypeError, match="state_dict\\(\\) and load_state_dict\\(\\).*got object"):
        hvd.elastic.TorchState(torch.nn.Linear(2, 2), object())
