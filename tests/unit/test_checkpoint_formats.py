"""psrt's checkpoint files are safetensors with no pickle in them, and the checkpoints earlier
psrt wrote (``torch.save`` archives, in tests/unit/earlier_psrt, made by its make.py with psrt
as of ba57b04) still load: a ZeRO checkpoint, a parameter server's file and an elastic commit.
"""
from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import psrt.torch as hvd
from launcher import contract
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic import commits
from psrt.errors import InvalidArgumentError
from psrt.ps import checkpoint as ps_checkpoint
from psrt.ps.protocol import Mode
from psrt.ps.shard import ChunkMeta, Consistency, OptimizerSpec, Shard
from psrt.ps.store import Store
from psrt.zero import ZeroOptimizer

EARLIER = Path(__file__).resolve().parent / "earlier_psrt"
EXPECTED = json.loads((EARLIER / "expected.json").read_text())


@pytest.fixture
def world_of_one():
    hvd.init()
    yield
    hvd.shutdown()


def untrained_model() -> torch.nn.Module:
    torch.manual_seed(1)  # not the checkpoint's values
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def assert_model(model: torch.nn.Module, expected: dict) -> None:
    for name, value in model.state_dict().items():
        assert torch.equal(value, torch.tensor(expected[name])), name


def test_a_checkpoint_file_is_safetensors_with_its_structure_as_json(tmp_path):
    document = {"w": torch.arange(4.0), "state": {0: {"step": torch.tensor(2.0)}}, "betas": (0.9, 0.99),
                "dtype": torch.bfloat16, "name": "x"}
    path = tmp_path / "part.pt"
    record = checkpoint_files.save_tensors(document, str(path))
    assert not zipfile.is_zipfile(path), "a torch.save archive: pickle"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == checkpoint_files.FORMAT and len(list(f.keys())) == 2
        json.loads(f.metadata()["document"])
    loaded = checkpoint_files.load_tensors(str(path), record, InvalidArgumentError)
    assert loaded.keys() == document.keys() and loaded["betas"] == (0.9, 0.99) and loaded["dtype"] is torch.bfloat16
    assert torch.equal(loaded["state"][0]["step"], torch.tensor(2.0)) and torch.equal(loaded["w"], document["w"])


def test_tensors_are_named_by_their_place_and_files_naming_them_by_position_still_load(tmp_path):
    path = tmp_path / "part.pt"
    checkpoint_files.save_tensors({"model": {"body.weight": torch.ones(2)}, "state": [{"m": torch.zeros(3)}]},
                                  str(path))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["model.body.weight", "state.0.m"]
    earlier = tmp_path / "earlier.pt"  # as psrt wrote psrt-tensors/1 files until now: tensors "0", "1", ...
    save_file({"0": torch.ones(2), "1": torch.zeros(3)}, str(earlier), metadata={
        "format": checkpoint_files.FORMAT,
        "document": json.dumps({"model": {"body.weight": {"$tensor": "0"}}, "state": [{"m": {"$tensor": "1"}}]})})
    loaded = checkpoint_files.load_tensors(str(earlier), checkpoint_files.fingerprint(str(earlier)),
                                           InvalidArgumentError)
    assert torch.equal(loaded["model"]["body.weight"], torch.ones(2)) and torch.equal(loaded["state"][0]["m"],
                                                                                      torch.zeros(3))


def test_a_document_with_an_object_is_refused_naming_where(tmp_path):
    with pytest.raises(TypeError, match=r"\['opt'\]\[0\] is a object"):
        checkpoint_files.save_tensors({"opt": [object()]}, str(tmp_path / "x.pt"))
    assert not (tmp_path / "x.pt").exists()


def test_a_zero_checkpoint_of_earlier_psrt_loads(world_of_one, tmp_path):
    assert json.loads((EARLIER / "zero" / "zero_meta.json").read_text())["format"] == "psrt-zero/2"
    model = untrained_model()
    zero = ZeroOptimizer(model, torch.optim.Adam, stage=2, lr=0.01)
    assert zero.load(str(shutil.copytree(EARLIER / "zero", tmp_path / "zero"))) == {"step": 1}
    assert_model(model, EXPECTED["zero_model"])


def test_a_parameter_server_file_of_earlier_psrt_loads(tmp_path):
    directory = shutil.copytree(EARLIER / "ps", tmp_path / "ps")
    manifest = ps_checkpoint.read_manifest(str(directory))
    assert manifest["format"] == "psrt-ps-checkpoint-2", manifest
    store = Store((int(Mode.SYNC), 0, 0), Consistency(Mode.SYNC, 0, 1.0),
                  optimizer=OptimizerSpec("Adam", {"lr": 0.1, "betas": [0.9, 0.99]}))
    store.shards[0] = Shard(ChunkMeta(key="w", shape=(4,), dtype=torch.float32, offset=0, numel=4), 1,
                            store.consistency)
    store.shards[0].set_value(torch.zeros(4))
    store.shards[0].set_optimizer(store.optimizer)
    assert ps_checkpoint.load_server(str(directory), 0, 1, {0: store}, manifest["save_id"],
                                     files=manifest["files"]) == {"steps": {0: 1}}
    assert store.shards[0].value.tolist() == EXPECTED["ps_value"]


def test_an_elastic_commit_of_earlier_psrt_restores(world_of_one, tmp_path, monkeypatch):
    directory = shutil.copytree(EARLIER / "elastic", tmp_path / "elastic")
    assert json.loads((directory / commits.LATEST).read_text())["format"] == "psrt-elastic/1"
    monkeypatch.setenv(contract.ENV_ELASTIC_DIR, str(directory))
    model = untrained_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    assert state._resume() and state.epoch == 3
    assert_model(model, EXPECTED["model"])
    assert optimizer.state_dict()["state"][0]["exp_avg"].tolist() == EXPECTED["exp_avg"]
    state.commit()  # the next commit is of today's format, beside the earlier one's pointer
    record = json.loads((directory / commits.LATEST).read_text())
    assert record["format"] == commits.FORMAT and record["commit"] == 2
    assert not zipfile.is_zipfile(directory / "commit-000002" / commits.REPLICATED)
