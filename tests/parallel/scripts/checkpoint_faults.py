"""Damaged checkpoints are refused on every rank, name the file and the problem, change
nothing, and run no code: ``python checkpoint_faults.py ps ROOT`` (1 server, 2 workers)
and ``python checkpoint_faults.py zero ROOT`` (2 ranks).

Each case copies a good save into a fresh directory under ROOT, damages it (worker 0 /
rank 0 only), and has every rank try to load it: every rank must raise the refusal, the
model and the servers' values (or the ZeRO master shards) must be as before, and a
malicious file's payload must not have run.  The last check loads the good save.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Callable

import torch

import psrt.ps as ps
import psrt.torch as hvd
from psrt.checkpoint import files as checkpoint_files
from psrt.errors import CheckpointError, InvalidArgumentError, ParameterServerError
from psrt.zero import ZeroOptimizer

import _harness
from _training_common import Mlp, expect_raises, global_batch, loss_of, my_rows
from _zero_common import ZNet

SERVER_FILE = "server-0-of-1.pt"
SHARD = "shard_00001.pt"  # rank 1's: only rank 1 reads it at load
# A ZeRO rank refuses a damaged file it reads with InvalidArgumentError naming it; a rank that
# does not read it raises CheckpointError, naming the rank that refused it and why.
ZERO_REFUSALS = (InvalidArgumentError, CheckpointError)
Damage = Callable[[str], None]


class Payload:
    """Unpickling this creates ``marker``: proof that a loader ran code from the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def marker(root: str) -> str:
    return os.path.join(root, "payload-ran")


# -- damage --------------------------------------------------------------------------------------
def emptied(name: str) -> Damage:
    return lambda d: open(os.path.join(d, name), "wb").close()


def truncated(name: str) -> Damage:
    def damage(d: str) -> None:
        path = os.path.join(d, name)
        os.truncate(path, os.path.getsize(path) // 2)
    return damage


def flipped(name: str) -> Damage:
    def damage(d: str) -> None:
        with open(os.path.join(d, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return damage


def garbage(name: str) -> Damage:
    def damage(d: str) -> None:
        path = os.path.join(d, name)
        size = os.path.getsize(path)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    return damage


def removed(name: str) -> Damage:
    return lambda d: os.remove(os.path.join(d, name))


def malicious(name: str, commit_record: str, root: str) -> Damage:
    """Replace ``name`` by a file whose unpickling runs code, and rewrite its record in the
    commit record to match, as someone who can write the directory could."""
    def damage(d: str) -> None:
        path = os.path.join(d, name)
        torch.save({"save_id": "x", "format": "x", "payload": Payload(marker(root))}, path)
        with open(os.path.join(d, commit_record)) as f:
            record = json.load(f)
        record["files"][name] = checkpoint_files.fingerprint(path).to_json()
        with open(os.path.join(d, commit_record), "w") as f:
            json.dump(record, f)
    return damage


def copied_from(source: str, name: str) -> Damage:
    return lambda d: shutil.copy(os.path.join(source, name), os.path.join(d, name))


def swapped(first: str, second: str) -> Damage:
    def damage(d: str) -> None:
        os.replace(os.path.join(d, first), os.path.join(d, "swap"))
        os.replace(os.path.join(d, second), os.path.join(d, first))
        os.replace(os.path.join(d, "swap"), os.path.join(d, second))
    return damage


def damaged_copy(good: str, root: str, case: str, damage: Damage) -> str:
    """A copy of ``good`` under ``root``, damaged by rank 0, ready on every rank."""
    directory = os.path.join(root, case)
    if hvd.rank() == 0:
        shutil.copytree(good, directory)
        damage(directory)
    hvd.barrier()
    return directory


# -- parameter servers ---------------------------------------------------------------------------
class PsJob:
    """A model trained one step against the servers, a good save of it, and a second save."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.model = Mlp("checkpoint-faults")
        self.optimizer = ps.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=0.01),
                                                 self.model.named_parameters(), mode="sync")
        self.step(0)
        self.good, self.other = os.path.join(root, "good"), os.path.join(root, "other")
        self.optimizer.save(self.good)
        self.saved = self.state()
        self.step(1)
        self.optimizer.save(self.other)

    def step(self, step: int) -> None:
        self.optimizer.zero_grad()
        x, y = global_batch("checkpoint-faults", step)
        loss_of(self.model, my_rows(x), my_rows(y)).backward()
        self.optimizer.step()

    def state(self) -> dict[str, torch.Tensor]:
        """The model's parameters and what the servers hold, by key."""
        model = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        return {**model, **{f"server:{key}": self.optimizer.store.pull(key) for key in model}}


def check_ps_refusal(name: str, job: PsJob, damage: Damage, problem: str) -> None:
    directory = damaged_copy(job.good, job.root, name.replace("/", "-"), damage)
    before = job.state()
    expect_raises(ParameterServerError, lambda: job.optimizer.load(directory), problem, name)
    for key, value in job.state().items():
        assert torch.equal(value, before[key]), f"{key} changed by the refused load"
    assert not os.path.exists(marker(job.root)), "the malicious file's payload ran"


def check_ps_manifest_write_failure_reaches_every_worker(name: str, job: PsJob) -> None:
    directory = os.path.join(job.root, "unwritable")
    if hvd.rank() == 0:
        os.makedirs(os.path.join(directory, "manifest.json"))  # a directory: the rename onto it fails
    hvd.barrier()
    expect_raises(ParameterServerError, lambda: job.optimizer.save(directory),
                  "writing its manifest.json failed", name)


def check_ps_good_and_unchecked_saves_load(name: str, job: PsJob) -> None:
    def unchecked(d: str) -> None:  # a manifest from before file records were kept
        path = os.path.join(d, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest.pop("files")
        manifest["format"] = "psrt-ps-checkpoint-1"
        with open(path, "w") as f:
            json.dump(manifest, f)
    for directory in (job.good, damaged_copy(job.good, job.root, "unchecked", unchecked)):
        job.step(2)
        assert job.optimizer.load(directory) is None and job.optimizer.steps_restored == 1
        for key, value in job.state().items():
            assert torch.equal(value, job.saved[key]), f"{key} not restored from {directory}"
    job.step(3)  # training goes on


def ps_checks(root: str) -> _harness.Checks:
    job = PsJob(root)
    checks = _harness.Checks()
    cases = {
        "malicious_pickle": (malicious(SERVER_FILE, "manifest.json", root), "refused without running anything"),
        "empty_file": (emptied(SERVER_FILE), f"{SERVER_FILE} is empty (0 bytes)"),
        "garbage_bytes": (garbage(SERVER_FILE), "(sha256 mismatch"),
        "truncated_file": (truncated(SERVER_FILE), "were saved: it was cut short"),
        "flipped_byte": (flipped(SERVER_FILE), f"{SERVER_FILE} was modified after it was saved"),
        "missing_file": (removed(SERVER_FILE), f"{SERVER_FILE} is missing"),
        "manifest_of_another_save": (copied_from(job.other, "manifest.json"), "belongs to another save"),
        "truncated_manifest": (truncated("manifest.json"), "manifest.json: it is damaged or was cut short"),
    }
    for case, (damage, problem) in cases.items():
        checks.add(f"ps/{case}", check_ps_refusal, job, damage, problem)
    checks.add("ps/manifest_write_failure_reaches_every_worker", check_ps_manifest_write_failure_reaches_every_worker,
               job)
    checks.add("ps/good_and_unchecked_saves_load_after_the_refusals", check_ps_good_and_unchecked_saves_load, job)
    return checks


# -- ZeRO ----------------------------------------------------------------------------------------
class ZeroJob:
    """A ZeRO stage-2 model trained one step, and a good save of it."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.model = ZNet("checkpoint-faults")
        self.zero = ZeroOptimizer(self.model, torch.optim.AdamW, stage=2, lr=0.01)
        self.step()
        self.good = os.path.join(root, "good")
        self.zero.save(self.good, extra={"step": 1})
        self.saved = self.state()
        self.step()
        self.other = os.path.join(root, "other")  # a later save, for files and records of another save
        self.zero.save(self.other, extra={"step": 2})

    def step(self) -> None:
        self.zero.zero_grad()
        self.model(torch.ones(4, 5, dtype=torch.float64)).pow(2).sum().backward()
        self.zero.step()

    def state(self) -> list[torch.Tensor]:
        """The model's parameters and this rank's master shards."""
        return ([p.detach().clone() for p in self.model.parameters()]
                + [group.master.detach().clone() for group in self.zero.groups])


def check_zero_refusal(name: str, job: ZeroJob, damage: Damage, problem: str) -> None:
    directory = damaged_copy(job.good, job.root, name.replace("/", "-"), damage)
    before = job.state()
    expect_raises(ZERO_REFUSALS, lambda: job.zero.load(directory), problem, name)
    assert all(torch.equal(a, b) for a, b in zip(job.state(), before)), "the refused load changed the model"
    assert not os.path.exists(marker(job.root)), "the malicious file's payload ran"


def check_zero_good_save_loads(name: str, job: ZeroJob) -> None:
    job.step()
    assert job.zero.load(job.good) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(job.state(), job.saved)), "not restored"
    job.step()


def zero_checks(root: str) -> _harness.Checks:
    job = ZeroJob(root)
    checks = _harness.Checks()
    cases = {
        "empty_shard": (emptied(SHARD), f"{SHARD} is empty (0 bytes)"),
        "truncated_shard": (truncated(SHARD), f"{SHARD} has "),
        "flipped_byte_in_a_shard": (flipped(SHARD), f"{SHARD} was modified after it was saved"),
        "truncated_meta": (truncated("zero_meta.json"), "zero_meta.json: it is damaged or was cut short"),
        "garbage_meta": (garbage("zero_meta.json"), "zero_meta.json: it is damaged or was cut short"),
        "malicious_pickle_in_a_shard": (malicious(SHARD, "zero_meta.json", root),
                                        f"{SHARD} cannot be loaded as a psrt checkpoint file"),
        "meta_rewritten_without_the_files": (copied_from(job.other, "zero_meta.json"),
                                             "was modified after it was saved, or belongs to another save"),
        "shard_of_another_save": (copied_from(job.other, SHARD), f"{SHARD} was modified after it was saved"),
        "shard_files_swapped": (swapped("shard_00000.pt", "shard_00001.pt"), "belongs to another save"),
    }
    for case, (damage, problem) in cases.items():
        checks.add(f"zero/{case}", check_zero_refusal, job, damage, problem)
    checks.add("zero/good_save_loads_after_the_refusals", check_zero_good_save_loads, job)
    return checks


def main(kind: str, root: str) -> None:
    hvd.init()
    _harness.run(ps_checks(root) if kind == "ps" else zero_checks(root))
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
