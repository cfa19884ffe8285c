"""Checkpoint files are checked before anything in them is unpickled, and never run code.

Single-process: the shared file checks, a parameter server's file (its save and load
functions, without messaging), a one-rank ZeRO checkpoint and ``psrt zero-to-full``.
The same faults across ranks and servers are in tests/parallel/test_checkpoint_faults.py.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import psrt.checkpoint
import psrt.torch as hvd
from psrt.checkpoint import files as checkpoint_files
from psrt.errors import InvalidArgumentError, ParameterServerError
from psrt.ps import checkpoint as ps_checkpoint
from psrt.ps.protocol import Mode
from psrt.ps.shard import ChunkMeta, Consistency, OptimizerSpec, Shard
from psrt.ps.store import Store
from psrt.zero import ZeroOptimizer

REPO = Path(__file__).resolve().parents[2]


class Payload:
    """Unpickling this creates ``marker``: proof that a loader ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def plant_payload(path: Path, marker: Path) -> checkpoint_files.FileRecord:
    """Replace ``path`` by a torch file that runs code when unpickled unsafely; returns its
    record, as an attacker who can also rewrite the commit record would."""
    torch.save({"save_id": "x", "format": "x", "payload": Payload(marker)}, path)
    return checkpoint_files.fingerprint(str(path))


# -- the shared checks ---------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, checkpoint_files.FileRecord]:
    path = tmp_path / "part.pt"
    return path, checkpoint_files.save_tensors({"w": torch.arange(64.0), "step": 3}, str(path))


def load(path: Path, record: checkpoint_files.FileRecord | None) -> object:
    return checkpoint_files.load_tensors(str(path), record, InvalidArgumentError)


def test_a_saved_file_loads_back_and_its_record_is_what_is_on_disk(saved):
    path, record = saved
    assert record == checkpoint_files.fingerprint(str(path)) and record.size == path.stat().st_size
    assert not path.with_name("part.pt.tmp").exists()
    document = load(path, record)
    assert torch.equal(document["w"], torch.arange(64.0)) and document["step"] == 3


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(b""), "is empty (0 bytes)"),
    (truncate, "were saved: it was cut short after it was saved"),
    (flip_middle_byte, "was modified after it was saved, or belongs to another save (sha256 mismatch"),
    (lambda p: p.write_bytes(os.urandom(p.stat().st_size)), "sha256 mismatch"),
    (lambda p: p.unlink(), "is missing"),
])
def test_a_damaged_file_is_refused_naming_it_and_the_problem(saved, damage, problem):
    path, record = saved
    damage(path)
    with pytest.raises(InvalidArgumentError) as refused:
        load(path, record)
    assert str(path) in str(refused.value) and problem in str(refused.value)
    assert "restore it from a backup or save again" in str(refused.value)


def test_without_a_record_garbage_is_refused_before_unpickling(tmp_path):
    path = tmp_path / "part.pt"
    path.write_bytes(b"\x80\x04garbage" * 50)
    with pytest.raises(ParameterServerError, match="is not a valid safetensors file"):
        checkpoint_files.load_tensors(str(path), None, ParameterServerError)


def test_a_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload-ran"
    zipped, raw = tmp_path / "zipped.pt", tmp_path / "raw.pt"
    record = plant_payload(zipped, marker)
    raw.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InvalidArgumentError) as refused:
        load(zipped, record)  # its record matches: only weights_only stands in the way
    message = str(refused.value)
    assert str(zipped) in message and "refused without running anything" in message, message
    assert "os.makedirs" in message and "weights_only" not in message, "torch's advice to load unsafely"
    with pytest.raises(InvalidArgumentError, match="is not a valid safetensors file"):
        load(raw, None)
    assert not marker.exists(), "the payload ran"


def test_commit_records_are_read_with_the_file_named(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text('{"format": "x", "files": {"a.pt": {"bytes": 3')
    with pytest.raises(InvalidArgumentError, match=f"cannot read {path}: .*not valid JSON"):
        checkpoint_files.read_json(str(path), InvalidArgumentError)
    path.write_text("[1, 2]")
    with pytest.raises(InvalidArgumentError, match="holds a JSON list"):
        checkpoint_files.read_json(str(path), InvalidArgumentError)
    with pytest.raises(InvalidArgumentError, match="meta.json records no size and sha256 for b.pt"):
        checkpoint_files.record_of({"a.pt": {"bytes": 3, "sha256": "00"}}, str(tmp_path / "b.pt"),
                                   "meta.json", InvalidArgumentError)


# -- a parameter server's file -------------------------------------------------------------------
def momentum_store() -> Store:
    store = Store((int(Mode.SYNC), 0, 0), Consistency(Mode.SYNC, 0, 1.0),
                  optimizer=OptimizerSpec("Adam", {"lr": 0.1, "betas": [0.9, 0.99]}))
    meta = ChunkMeta(key="w", shape=(4,), dtype=torch.float32, offset=0, numel=4)
    store.shards[0] = Shard(meta, 2, store.consistency)
    store.shards[0].set_value(torch.arange(4.0))
    store.shards[0].set_optimizer(store.optimizer)
    for worker in (0, 1):
        buffer = store.shards[0].expect_push(worker)
        buffer.fill_(1.0)
        store.shards[0].arrived(worker, buffer)
    store.shards[0].apply_ready()
    return store


def test_a_server_file_with_adam_state_loads_with_weights_only_and_checks_its_record(tmp_path):
    files = ps_checkpoint.save_server(str(tmp_path), 0, 1, {0: momentum_store()}, "id")
    assert set(files) == {"server-0-of-1.pt"} and files["server-0-of-1.pt"]["bytes"] > 0
    restored = momentum_store()
    restored.shards[0].value.zero_()
    assert ps_checkpoint.load_server(str(tmp_path), 0, 1, {0: restored}, "id", files=files) == {"steps": {0: 1}}
    assert torch.equal(restored.shards[0].value, momentum_store().shards[0].value)
    flip_middle_byte(tmp_path / "server-0-of-1.pt")
    with pytest.raises(ParameterServerError, match="server-0-of-1.pt was modified after it was saved"):
        ps_checkpoint.load_server(str(tmp_path), 0, 1, {0: restored}, "id", restore=False, files=files)


def test_a_server_file_that_would_run_code_is_refused(tmp_path):
    files = ps_checkpoint.save_server(str(tmp_path), 0, 1, {0: momentum_store()}, "id")
    marker = tmp_path / "payload-ran"
    files["server-0-of-1.pt"] = plant_payload(tmp_path / "server-0-of-1.pt", marker).to_json()
    with pytest.raises(ParameterServerError, match="server-0-of-1.pt cannot be loaded .* refused without"):
        ps_checkpoint.load_server(str(tmp_path), 0, 1, {0: momentum_store()}, "id", restore=False, files=files)
    assert not marker.exists()


def test_a_manifest_that_is_damaged_is_a_reason_not_an_exception(tmp_path):
    for text in ("", "[]", '{"format": "psrt-ps-checkpoint-2", "save_id": "a"}'):
        (tmp_path / "manifest.json").write_text(text)
        reason = ps_checkpoint.read_manifest(str(tmp_path))
        assert isinstance(reason, str) and "manifest.json" in reason, reason


def test_a_manifest_of_the_unchecked_format_still_loads(tmp_path):
    ps_checkpoint.save_server(str(tmp_path), 0, 1, {0: momentum_store()}, "id")
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": ps_checkpoint.UNCHECKED_FORMAT, "save_id": "id", "num_servers": 1}))
    manifest = ps_checkpoint.read_manifest(str(tmp_path))
    assert manifest.get("files") is None
    assert ps_checkpoint.load_server(str(tmp_path), 0, 1, {0: momentum_store()}, "id",
                                     files=manifest.get("files")) == {"steps": {0: 1}}


# -- a one-rank ZeRO checkpoint and zero-to-full ---------------------------------------------------
@pytest.fixture
def zero_checkpoint(tmp_path: Path):
    """A trained one-rank ZeRO stage-2 optimizer and a good save of it."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    zero.step()
    zero.save(str(tmp_path / "good"), extra={"step": 1})
    yield zero, tmp_path / "good"
    hvd.shutdown()


def values(zero) -> list[torch.Tensor]:
    return [p.detach().clone() for p in zero.model.parameters()]


def fresh_copy(good: Path, where: Path) -> Path:
    where.mkdir()
    for name in os.listdir(good):
        (where / name).write_bytes((good / name).read_bytes())
    return where


def rewrite_meta(directory: Path, change) -> None:
    meta = json.loads((directory / "zero_meta.json").read_text())
    change(meta)
    (directory / "zero_meta.json").write_text(json.dumps(meta))


def test_a_damaged_zero_checkpoint_is_refused_naming_the_file_and_changes_nothing(zero_checkpoint, tmp_path):
    zero, good = zero_checkpoint
    marker = tmp_path / "payload-ran"

    def malicious(d: Path) -> None:
        record = plant_payload(d / "shard_00000.pt", marker)
        rewrite_meta(d, lambda meta: meta["files"].update({"shard_00000.pt": record.to_json()}))
    cases = {
        "empty shard": (lambda d: (d / "shard_00000.pt").write_bytes(b""), "shard_00000.pt is empty (0 bytes)"),
        "truncated shard": (lambda d: truncate(d / "shard_00000.pt"), "shard_00000.pt has "),
        "flipped byte": (lambda d: flip_middle_byte(d / "shard_00000.pt"), "shard_00000.pt was modified"),
        "flipped extras": (lambda d: flip_middle_byte(d / "extras.pt"), "extras.pt was modified"),
        "truncated meta": (lambda d: truncate(d / "zero_meta.json"), "zero_meta.json: it is damaged"),
        "garbage meta": (lambda d: (d / "zero_meta.json").write_bytes(os.urandom(300)), "zero_meta.json: it is"),
        "meta without records": (lambda d: rewrite_meta(d, lambda meta: meta.pop("files")),
                                 "zero_meta.json is damaged: it lacks ['files']"),
        "malicious shard": (malicious, "shard_00000.pt cannot be loaded as a psrt checkpoint file"),
    }
    before = values(zero)
    for case, (damage, problem) in cases.items():
        directory = fresh_copy(good, tmp_path / case.replace(" ", "-"))
        damage(directory)
        with pytest.raises(InvalidArgumentError) as refused:
            zero.load(str(directory))
        assert problem in str(refused.value), f"{case}: {refused.value}"
        assert all(torch.equal(a, b) for a, b in zip(values(zero), before)), f"{case} changed the model"
    assert not marker.exists(), "the payload ran"
    with torch.no_grad():
        for p in zero.model.parameters():
            p.zero_()
    assert zero.load(str(good)) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(values(zero), before))


def test_a_zero_checkpoint_of_the_unchecked_format_still_loads(zero_checkpoint, tmp_path):
    zero, good = zero_checkpoint
    legacy = fresh_copy(good, tmp_path / "legacy")

    def to_old_format(meta: dict) -> None:
        meta.pop("files")
        meta["format"] = "psrt-zero/1"
    rewrite_meta(legacy, to_old_format)
    assert zero.load(str(legacy)) == {"step": 1}


def zero_to_full(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "psrt.cli", "zero-to-full", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_zero_to_full_refuses_a_damaged_shard_and_writes_one_safetensors_file(zero_checkpoint, tmp_path):
    _, good = zero_checkpoint
    damaged = fresh_copy(good, tmp_path / "damaged")
    flip_middle_byte(damaged / "shard_00000.pt")
    done = zero_to_full(str(damaged), str(tmp_path / "bad.safetensors"))
    assert done.returncode == 2 and "shard_00000.pt was modified after it was saved" in done.stderr, done.stderr
    assert not (tmp_path / "bad.safetensors").exists()
    done = zero_to_full(str(good), str(tmp_path / "full.safetensors"))
    assert done.returncode == 0 and "sha256" in done.stdout, done.stderr
    with safe_open(str(tmp_path / "full.safetensors"), framework="pt") as f:  # any safetensors reader
        assert {"model.0.weight", "model.1.bias"} <= set(f.keys())
    full = psrt.checkpoint.load_document(str(tmp_path / "full.safetensors"))
    assert set(full["model"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
