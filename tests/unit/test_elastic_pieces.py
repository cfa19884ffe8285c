"""Elastic training's pieces in one process, without MPI: the ElasticSampler's sharding and
resumption (ranks simulated by patching psrt.runtime), plan_batch, the read plan of a sharded
TP x PP commit, the CommitStore's commit directory, and psrun's side (slot groups, host
discovery, and the Supervisor driving a fake launch and fake jobs).  The same behaviour end to end under psrun is in
tests/parallel/test_elastic.py.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launcher import cli, contract, elastic
from launcher.blacklist import Blacklist, check_cooldown_range
from launcher.elastic import ElasticSettings, Supervisor, discover, rank_groups
from launcher.failures import Failure, FailureKind
from launcher.hostfile import Host, HostfileError, parse_discovery, parse_hostfile, parse_hosts
from launcher.monitor import JobResult
from psrt import runtime
from psrt.elastic import commits
from psrt.elastic.batch import plan_batch
from psrt.elastic.commits import CommitStore
from psrt.elastic.sampler import ElasticSampler
from psrt.elastic.shard_layout import BlockLayout, fill, pieces
from psrt.errors import ElasticError, InvalidArgumentError
from psrt.tp.sharding import Sharding

# ElasticSampler

def samplers(monkeypatch, length: int, size: int, state: dict | None = None) -> list[ElasticSampler]:
    """The sampler of each of ``size`` simulated ranks, restored from ``state`` if given."""
    result = []
    for rank in range(size):
        monkeypatch.setattr(runtime, "is_initialized", lambda: True)
        monkeypatch.setattr(runtime, "size", lambda: size)
        monkeypatch.setattr(runtime, "rank", lambda rank=rank: rank)
        sampler = ElasticSampler(range(length), seed=7)
        if state is not None:
            sampler.load_state_dict(state)
        result.append(sampler)
    return result


def resumed(monkeypatch, old: int, new: int, rank_batch: int, length: int = 36):
    """The samplers of ``old`` ranks that took 2 steps of ``rank_batch`` each, and those of the
    job relaunched on ``new`` ranks from their state."""
    before = samplers(monkeypatch, length, old)
    for batch in range(2):
        before[0].record_batch(batch, rank_batch)
    return before, samplers(monkeypatch, length, new, state=before[0].state_dict())


def step(ranks: list[ElasticSampler], batch: int, rank_batch: int) -> list[int]:
    """What all ranks read in one step, sorted."""
    return sorted(i for s in ranks for i in s.get_indices(batch, rank_batch))


@pytest.mark.parametrize("length, size", [(30, 3), (31, 3), (10, 4), (5, 1)])
def test_the_ranks_shards_cover_the_dataset_in_equal_counts(monkeypatch, length, size):
    """Every sample is read in an epoch and every rank takes as many steps; only the padding
    (to a multiple of the rank count) is read twice."""
    shards = [list(s) for s in samplers(monkeypatch, length, size)]
    assert [len(shard) for shard in shards] == [math.ceil(length / size)] * size
    assert set().union(*shards) == set(range(length))
    assert sum(map(len, shards)) - length == math.ceil(length / size) * size - length


def test_record_batch_counts_what_every_rank_read_in_that_batch(monkeypatch):
    """One rank records a step for all without communication; 20 over 3 ranks in batches of
    2 ends with a partial, padded batch.  After k batches a reset leaves exactly the samples
    no rank has read."""
    ranks = samplers(monkeypatch, 20, 3)
    recorder = samplers(monkeypatch, 20, 3)[1]
    read: set[int] = set()
    for batch in range(4):
        recorder.record_batch(batch, 2)
        read |= set(step(ranks, batch, 2))
        recorder.reset()
        assert recorder.processed_num == 6 * (batch + 1)
        assert set(recorder.remaining.tolist()) == set(range(20)) - read


def horovod_shards(length: int, seed: int, epoch: int, processed_num: int, size: int) -> list[list[int]]:
    """What each of ``size`` ranks reads under Horovod's ElasticSampler (horovod/torch/elastic/
    sampler.py), restated from its documented behaviour: ``range(length)`` shuffled by
    ``random.Random(seed + epoch)``, the first ``processed_num`` dropped, the rest padded with
    its own first samples to a multiple of ``size``, and rank r taking every size-th from r."""
    order = list(range(length))
    random.Random(seed + epoch).shuffle(order)
    remaining = order[processed_num:]
    total = math.ceil(len(remaining) / size) * size
    padded = remaining + remaining[:total - len(remaining)]
    return [padded[rank:total:size] for rank in range(size)]


def test_the_sampler_follows_horovods_processed_num_through_restore_and_resize(monkeypatch):
    """The issue's case: record_batch adds batch_size x num_replicas whatever the index, so the
    same calls after a restore leave Horovod's count and a resumed epoch reads what Horovod's
    would, at the same size and at another."""
    ranks = samplers(monkeypatch, 50, 3)
    ranks[0].set_epoch(2)
    for batch_idx in (0, 1):
        ranks[0].record_batch(batch_idx, 2)
    committed = ranks[0].state_dict()
    ranks[0].record_batch(2, 2)
    ranks[0].load_state_dict(committed)  # what restore() does
    for batch_idx in (2, 3):  # a script that keeps counting its batches across the restore
        ranks[0].record_batch(batch_idx, 2)
    assert ranks[0].processed_num == 4 * 2 * 3
    ranks[0].record_batch(0, 1)  # the index is not used
    assert ranks[0].processed_num == 4 * 2 * 3 + 3
    for size in (3, 2, 4):
        relaunched = samplers(monkeypatch, 50, size, state=ranks[0].state_dict())
        assert [list(sampler) for sampler in relaunched] == horovod_shards(50, 7, 2, 27, size)
        assert [len(sampler) for sampler in relaunched] == [math.ceil(23 / size)] * size


def test_a_horovod_sampler_state_loads(monkeypatch):
    """Horovod's state_dict has the epoch and processed_num only."""
    [sampler] = samplers(monkeypatch, 30, 1, state={"epoch": 4, "processed_num": 12})
    assert list(sampler) == horovod_shards(30, 7, 4, 12, 1)[0] and not sampler.processed.any()


def test_record_indices_marks_single_samples_which_every_rank_then_skips(monkeypatch):
    """psrt keeps Horovod's earlier record_indices: marked samples drop out of what remains,
    beside those record_batch counted."""
    [sampler] = samplers(monkeypatch, 20, 1)
    sampler.record_batch(0, 4)
    sampler.record_indices([sampler.indices[10], sampler.indices[11]])
    later = sampler.indices[4:10] + sampler.indices[12:]
    sampler.reset()
    assert sampler.indices == later


@pytest.mark.parametrize("size", [1, 3])
def test_a_relaunch_at_the_same_size_sees_exactly_the_batches_it_would_have(monkeypatch, size):
    before, after = resumed(monkeypatch, size, size, 2)
    remaining = len(before[0]) // 2 - 2
    assert len(after[0]) == remaining * 2
    for rank in range(size):
        for batch in range(remaining):
            assert after[rank].get_indices(batch, 2) == before[rank].get_indices(2 + batch, 2)


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)])
def test_after_a_resize_each_global_step_takes_the_same_samples(monkeypatch, old, new):
    """With the global batch kept (6 samples: 6/old per rank before, 6/new after), a resized
    job's optimisation sees the same samples per step as the uninterrupted one."""
    before, after = resumed(monkeypatch, old, new, 6 // old)
    for batch in range(36 // 6 - 2):
        assert step(after, batch, 6 // new) == step(before, 2 + batch, 6 // old)
        assert len(set(step(after, batch, 6 // new))) == 6


def test_set_epoch_clears_processed_and_takes_that_epochs_order():
    """psrt is not initialised here: the sampler is rank 0 of 1."""
    a, b = ElasticSampler(range(50), seed=5), ElasticSampler(range(50), seed=5)
    epoch0 = list(a)
    a.record_batch(0, 10)
    for sampler in (a, b):
        sampler.set_epoch(1)
    assert a.processed_num == 0 and len(a) == 50
    assert list(a) == list(b) == horovod_shards(50, 5, 1, 0, 1)[0]
    assert list(a) != epoch0


def test_a_state_of_another_dataset_and_a_batch_size_below_one_are_refused():
    sampler = ElasticSampler(range(10))
    with pytest.raises(InvalidArgumentError, match="covers 11 samples"):
        sampler.load_state_dict({"epoch": 0, "processed": torch.zeros(11, dtype=torch.bool)})
    for size in (0, -2):
        with pytest.raises(InvalidArgumentError, match="batch size must be > 0"):
            sampler.record_batch(0, size)
    assert sampler.processed_num == 0


# plan_batch

def test_keeping_the_global_batch_splits_it_over_the_ranks_if_it_can():
    plan = plan_batch(12, 3)
    assert (plan.global_batch, plan.rank_batch, plan.accumulation, plan.micro_batch, plan.lr_scale) == \
        (12, 4, 1, 4, 1.0)
    with pytest.raises(InvalidArgumentError, match=re.escape("sizes that work: [1, 2, 3, 4, 6, 12]")):
        plan_batch(12, 5)


@pytest.mark.parametrize("global_batch, size, limit, accumulation", [(64, 2, 5, 8), (48, 3, 16, 1), (14, 2, 3, 7)])
def test_max_micro_batch_takes_the_fewest_accumulation_steps_that_fit(global_batch, size, limit, accumulation):
    plan = plan_batch(global_batch, size, max_micro_batch=limit)
    assert plan.rank_batch == global_batch // size and plan.accumulation == accumulation
    assert plan.micro_batch * plan.accumulation == plan.rank_batch and plan.micro_batch <= limit


def test_keeping_the_rank_batch_scales_the_learning_rate_with_the_size():
    plan = plan_batch(32, 2, keep="rank", base_size=4)
    assert (plan.global_batch, plan.rank_batch, plan.lr_scale) == (16, 8, 0.5)
    assert plan_batch(32, 6, keep="rank", base_size=4).lr_scale == 1.5


@pytest.mark.parametrize("kwargs", [{"keep": "local"}, {"keep": "rank"}, {"keep": "rank", "base_size": 5}])
def test_a_bad_policy_or_base_size_is_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        plan_batch(32, 2, **kwargs)


# The read plan of a sharded TP x PP commit

def saved_blocks(full: torch.Tensor, split: tuple | None) -> list[tuple[torch.Tensor, BlockLayout]]:
    """``full`` as the blocks of ``split`` (parts, dim, stride; None: one whole copy), each with its layout."""
    if split is None:
        return [(full.clone(), BlockLayout(tuple(full.shape), None, "float32"))]
    parts, dim, stride = split
    shardings = [Sharding(dim=dim, parts=parts, index=i, full_size=full.shape[dim], stride=stride)
                 for i in range(parts)]
    return [(s.shard(full), BlockLayout(tuple(full.shape), s, "float32")) for s in shardings]


def planned_reads(saved: list, wanted: BlockLayout) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The wanted block filled by the plan's reads, and (saved block, rows read) per read."""
    block, rows = torch.zeros(wanted.block_shape), []
    for k, piece in pieces(wanted, [layout for _, layout in saved], "w"):
        dim, begin, end = piece.rows
        source = saved[k][0]
        part = source if dim is None else source.narrow(dim, begin, end - begin)
        rows.append((k, part.numel()))
        fill(block, part, piece)
    return block, rows


SPLITS = [None, (1, 0, 1), (2, 0, 1), (3, 1, 1), (4, 0, 1), (2, 0, 3), (4, 1, 3), (2, 1, 1)]


@pytest.mark.parametrize("saved_split", SPLITS)
@pytest.mark.parametrize("wanted_split", SPLITS)
def test_each_wanted_block_is_read_from_the_saved_blocks_it_overlaps(saved_split, wanted_split):
    """TP sizes changed either way, fused q/k/v (stride 3), an odd size padded to the TP size,
    blocks cut along another dimension, whole tensors: the block each rank wants, exactly."""
    full = torch.randn(9, 7)
    saved = saved_blocks(full, saved_split)
    for block, layout in saved_blocks(full, wanted_split):
        got, _ = planned_reads(saved, layout)
        assert torch.equal(got, block)


def test_a_rank_reads_only_the_rows_of_its_own_block():
    """TP 2 to TP 4: each wanted block is half of one saved block, and only that half is read."""
    full = torch.randn(8, 3)
    saved = saved_blocks(full, (2, 0, 1))
    for index, (block, layout) in enumerate(saved_blocks(full, (4, 0, 1))):
        got, rows = planned_reads(saved, layout)
        assert torch.equal(got, block) and rows == [(index // 2, block.numel())]


def test_a_plan_refuses_missing_blocks_and_another_models_shape_naming_the_tensor():
    full = torch.randn(8, 3)
    blocks = [layout for _, layout in saved_blocks(full, (4, 0, 1))]
    wanted = BlockLayout((8, 3), None, "float32")
    with pytest.raises(ElasticError, match=re.escape("w: the commit holds blocks [0, 1, 3] of 4")):
        pieces(wanted, blocks[:2] + blocks[3:], "w")
    with pytest.raises(ElasticError, match=re.escape("w: the commit holds it with full shape [8, 3], this rank's "
                                                     "model has [8, 4]")):
        pieces(BlockLayout((8, 4), None, "float32"), blocks, "w")


# CommitStore

def write_commit(store: CommitStore, number: int, document: dict) -> dict:
    """Commit ``number``'s files written, as every rank does before rank 0 publishes."""
    store.begin(number)
    return {"commit": number, "size": 1, "files": store.save(document, number, commits.REPLICATED)}


def test_a_published_commit_loads_and_replaces_the_previous_one(tmp_path):
    store = CommitStore(str(tmp_path))
    assert store.latest() is None and CommitStore(None).latest() is None
    store.publish(write_commit(store, 1, {"step": 1, "w": torch.arange(4.0)}), replaces=0)
    record = store.latest()
    assert (record["commit"], record["size"], record["format"]) == (1, 1, commits.FORMAT)
    document = store.load(record, commits.REPLICATED)
    assert document["step"] == 1 and torch.equal(document["w"], torch.arange(4.0))
    store.publish(write_commit(store, 2, {"step": 2}), replaces=1)
    assert not (tmp_path / "commit-000001").exists()
    assert CommitStore(str(tmp_path)).load(store.latest(), commits.REPLICATED) == {"step": 2}


def test_a_commit_killed_before_it_was_published_leaves_the_previous_one(tmp_path):
    store = CommitStore(str(tmp_path))
    store.publish(write_commit(store, 1, {"step": 1}), replaces=0)
    store.publish(write_commit(store, 2, {"step": 2}), replaces=1)
    write_commit(store, 3, {"step": 3})  # killed here
    relaunched = CommitStore(str(tmp_path))
    record = relaunched.latest()
    assert record["commit"] == 2 and relaunched.load(record, commits.REPLICATED) == {"step": 2}
    relaunched.publish(write_commit(relaunched, 3, {"step": 3.5}), replaces=2)  # the relaunch's commit 3 overwrites
    assert relaunched.load(relaunched.latest(), commits.REPLICATED) == {"step": 3.5}
    assert not (tmp_path / "commit-000002").exists()


def test_a_file_changed_after_its_commit_is_refused_by_name(tmp_path):
    store = CommitStore(str(tmp_path))
    store.publish(write_commit(store, 1, {"w": torch.arange(100.0)}), replaces=0)
    path = tmp_path / "commit-000001" / commits.REPLICATED
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ElasticError, match=re.escape(str(path))):
        store.load(store.latest(), commits.REPLICATED)
    with pytest.raises(ElasticError, match="records no size and sha256 for rank-00003.pt"):
        store.load(store.latest(), commits.rank_file(3))


@pytest.mark.parametrize("record", [{"format": "other/1", "commit": 1, "files": {}},
                                    {"format": commits.FORMAT, "commit": "1", "files": {}},
                                    {"format": commits.FORMAT, "commit": 1}])
def test_a_latest_json_that_psrt_did_not_write_is_refused(tmp_path, record):
    (tmp_path / commits.LATEST).write_text(json.dumps(record))
    with pytest.raises(ElasticError, match=f"not a psrt elastic commit record .format '{record['format']}'"):
        CommitStore(str(tmp_path)).latest()


def test_hosts_version_and_reset_request(tmp_path):
    store = CommitStore(str(tmp_path))
    assert store.hosts_version() == 0 and CommitStore(None).hosts_version() == 0
    (tmp_path / contract.HOSTS_FILE).write_text(json.dumps({"version": 3, "hosts": ["a:1"]}))
    assert store.hosts_version() == 3
    store.request_reset("the hosts changed")
    assert json.loads((tmp_path / contract.RESET_FILE).read_text()) == {"reason": "the hosts changed"}
    CommitStore(None).request_reset("nowhere to write: nothing happens")


# launcher: slot groups and discovery

A, B, C, L1 = Host("a", 1), Host("b", 1), Host("c", 1), Host("localhost", 1)


@pytest.mark.parametrize("groups, num_proc, expected", [
    ((L1, L1, L1), 3, [0, 1, 2]),
    ((Host("a", 2), B, A), 4, [0, 0, 2, 1]),  # mpirun fills host a's 3 slots first
    ((Host("a", 2), B, A), 3, [0, 0, 2]),
    ((Host("a", 2), B), 1, [0]),
])
def test_rank_groups_follow_mpiruns_filling_of_hosts(groups, num_proc, expected):
    assert rank_groups(groups, num_proc) == expected


def test_discovery_output_keeps_each_line_a_slot_group_and_refuses_bad_lines():
    output = "# from the scheduler\nnode1\n\nnode2:4  # the big one\n  node1:2\n"
    assert parse_discovery(output, "d.sh") == (Host("node1", 1), Host("node2", 4), Host("node1", 2))
    assert parse_discovery("", "d.sh") == ()  # no host usable now
    for line in ["host:x", "host:0"]:
        with pytest.raises(HostfileError, match=re.escape("host discovery script '/opt/h.sh', output line 3")):
            parse_discovery(f"a\n\n{line}\n", "/opt/h.sh")


def test_hostfile_lines_stay_apart_without_merging(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("localhost:1\nlocalhost:1\nb slots=2\nlocalhost:1\n")
    assert parse_hostfile(str(path), merge=False) == (L1, L1, Host("b", 2), L1)
    assert parse_hostfile(str(path)) == (Host("localhost", 3), Host("b", 2))
    assert parse_hosts("a:1,a:2", merge=False) == (A, Host("a", 2))


def script(tmp_path: Path, body: str, name: str = "discover.sh") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_discover_runs_the_script_and_reports_its_failure(tmp_path):
    assert discover(script(tmp_path, "echo a:2\necho b\n")) == (Host("a", 2), B)
    with pytest.raises(HostfileError, match="exited with code 3: cannot reach the scheduler"):
        discover(script(tmp_path, "echo 'cannot reach the scheduler' >&2\nexit 3\n", "bad.sh"))
    with pytest.raises(HostfileError, match="could not run"):
        discover(str(tmp_path / "missing.sh"))


# launcher: the Supervisor, with a fake launch and scripted jobs

SUCCESS = JobResult(0, None)


def killed(rank: int) -> JobResult:
    return JobResult(137, Failure(rank, "killed by signal 9 (SIGKILL)", FailureKind.EXIT))


def raised(rank: int) -> JobResult:
    return JobResult(1, Failure(rank, "raised ValueError: boom", FailureKind.MARKER))


def supervise(tmp_path, results, groups=(A, B, C), *, min_np=1, max_np=3, initial_np=None, restarts=3,
              timeout_s=1.0, discovery=None, directory=None, cooldown_s=None):
    """Run a Supervisor whose jobs end with ``results`` in turn (a callable gets the launch's
    environment and returns the result); returns its exit code, each launch's (hosts,
    num_proc), each launch's environment and the messages."""
    run, pending = SimpleNamespace(launches=[], envs=[], messages=[]), iter(results)

    def launch(hosts, num_proc, rank_env):
        run.launches.append((hosts, num_proc))
        run.envs.append(dict(rank_env))
        return ["job"]

    def run_job(command):
        result = next(pending)
        return result(run.envs[-1]) if callable(result) else result

    settings = ElasticSettings(min_np, max_np, initial_np, restarts, timeout_s, discovery,
                               directory or str(tmp_path), cooldown_s)
    supervisor = Supervisor(settings, None if discovery else tuple(groups), launch=launch, run_job=run_job,
                            say=run.messages.append)
    run.code = supervisor.run()
    return run


def test_a_job_that_succeeds_is_launched_once(tmp_path):
    run = supervise(tmp_path, [SUCCESS])
    assert run.code == 0 and run.launches == [((A, B, C), 3)]


def test_a_killed_rank_loses_its_slot_group(tmp_path):
    run = supervise(tmp_path, [killed(1), SUCCESS])
    assert run.code == 0 and run.launches == [((A, B, C), 3), ((A, C), 2)]
    assert any("rank 1 failed first: killed by signal 9 (SIGKILL)" in m and "dropped slot group b:1" in m
               for m in run.messages)


def test_a_rank_that_raised_is_relaunched_on_the_same_hosts(tmp_path):
    run = supervise(tmp_path, [raised(2), SUCCESS])
    assert run.code == 0 and run.launches == [((A, B, C), 3)] * 2
    assert not any("dropped" in m for m in run.messages)


def test_when_the_restarts_are_used_psrun_gives_up(tmp_path):
    run = supervise(tmp_path, [raised(0), raised(0), SUCCESS], restarts=1)
    assert run.code == 1 and len(run.launches) == 2 and "giving up" in run.messages[-1]
    run = supervise(tmp_path, [JobResult(3, None)], restarts=0)
    assert run.code == 3 and len(run.launches) == 1 and "mpirun exited with code 3; giving up" in run.messages[-1]


def test_too_few_static_slots_fail_at_once(tmp_path):
    run = supervise(tmp_path, [], groups=(A, B), min_np=3)
    assert run.code == 1 and run.launches == [] and "fewer than --min-np 3" in run.messages[-1]
    run = supervise(tmp_path, [killed(0), SUCCESS], min_np=3)
    assert run.code == 1 and len(run.launches) == 1 and "fewer than --min-np 3" in run.messages[-1]


def test_discovery_is_waited_for_up_to_the_elastic_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "DISCOVERY_INTERVAL_S", 0.05)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\n")
    discovery = script(tmp_path, f"cat {hosts}\n")
    started = time.monotonic()
    run = supervise(tmp_path, [], min_np=2, timeout_s=0.5, discovery=discovery)
    assert run.code == 1 and run.launches == [] and time.monotonic() - started >= 0.5
    assert "fewer than --min-np 2" in run.messages[-1] and "--elastic-timeout" in run.messages[-1]
    threading.Timer(0.2, lambda: hosts.write_text("a:1\nb:1\n")).start()
    run = supervise(tmp_path, [SUCCESS], min_np=2, timeout_s=5.0, discovery=discovery)
    assert run.code == 0 and run.launches == [((A, B), 2)]


def request_reset(env: dict) -> JobResult:
    """A job that stopped at a commit to be relaunched on new hosts (psrt.elastic.run)."""
    CommitStore(env[contract.ENV_ELASTIC_DIR]).request_reset("the hosts changed")
    return SUCCESS


def test_a_job_asking_to_be_relaunched_does_not_use_a_restart(tmp_path):
    run = supervise(tmp_path, [request_reset, SUCCESS], restarts=0)
    assert run.code == 0 and len(run.launches) == 2 and not (tmp_path / contract.RESET_FILE).exists()
    assert any("relaunch: the hosts changed" in m for m in run.messages)
    run = supervise(tmp_path, [request_reset, request_reset, raised(0), SUCCESS], restarts=1)
    assert run.code == 0 and len(run.launches) == 4


def test_each_launch_is_told_the_elastic_directory_and_its_number(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = supervise(tmp_path, [raised(0), raised(0), SUCCESS], directory="elastic")
    directories = [env[contract.ENV_ELASTIC_DIR] for env in run.envs]
    assert all(os.path.isabs(d) and os.path.samefile(d, tmp_path / "elastic") for d in directories)
    assert [env[contract.ENV_ELASTIC_LAUNCH] for env in run.envs] == ["1", "2", "3"]
    assert [env[contract.ENV_ELASTIC_HOSTS_VERSION] for env in run.envs] == ["0"] * 3


def test_every_launch_takes_every_usable_slot_up_to_max_np_as_horovod(tmp_path):
    """-np is not the first launch's size (Horovod starts on every available slot up to
    --max-np): three usable groups give three ranks at once; --max-np caps every launch."""
    run = supervise(tmp_path, [raised(1), SUCCESS], initial_np=2)
    assert run.code == 0 and run.launches == [((A, B, C), 3)] * 2
    run = supervise(tmp_path, [raised(1), SUCCESS], max_np=2)
    assert run.launches == [((A, B), 2)] * 2


def test_np_is_how_many_slots_the_first_launch_waits_for(tmp_path, monkeypatch):
    """With discovery, the first launch waits for -np slots (Horovod's driver.start(np)), then
    takes them all; later launches need only --min-np."""
    monkeypatch.setattr(elastic, "DISCOVERY_INTERVAL_S", 0.05)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\nb:1\n")
    threading.Timer(0.3, lambda: hosts.write_text("a:1\nb:1\nc:1\n")).start()
    run = supervise(tmp_path, [killed(2), SUCCESS], initial_np=3, timeout_s=10.0,
                    discovery=script(tmp_path, f"cat {hosts}\n"))
    assert run.code == 0 and run.launches == [((A, B, C), 3), ((A, B), 2)], run.messages
    assert "fewer than -np 3: waiting" in run.messages[0]


def test_a_lost_group_is_blacklisted_with_a_cooldown_and_the_job_grows_back_into_it(tmp_path, monkeypatch):
    """--blacklist-cooldown-range 1 1: the group that lost a rank stays out for 1 s; once it is
    usable again the running job is told (hosts.json) and relaunched on all three groups."""
    monkeypatch.setattr(elastic, "DISCOVERY_INTERVAL_S", 0.05)

    def waits_for_the_group_to_return(env: dict) -> JobResult:
        hosts = Path(env[contract.ENV_ELASTIC_DIR]) / contract.HOSTS_FILE
        deadline = time.monotonic() + 30
        while not hosts.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert json.loads(hosts.read_text())["hosts"] == ["a:1", "b:1", "c:1"]
        return request_reset(env)

    run = supervise(tmp_path, [killed(1), waits_for_the_group_to_return, SUCCESS], cooldown_s=(1.0, 1.0))
    assert run.code == 0 and run.launches == [((A, B, C), 3), ((A, C), 2), ((A, B, C), 3)], run.messages
    assert "dropped slot group b:1 for 1.0 s (--blacklist-cooldown-range)" in run.messages[1]
    assert "hosts changed to a:1, b:1, c:1" in run.messages[2]


def test_a_static_job_waits_for_a_blacklisted_group_to_come_back(tmp_path, monkeypatch):
    """Two groups, --min-np 2: after a loss the job cannot run until the cooldown ends; with
    no cooldown it fails at once, as before."""
    monkeypatch.setattr(elastic, "DISCOVERY_INTERVAL_S", 0.05)
    run = supervise(tmp_path, [killed(0), SUCCESS], groups=(A, B), min_np=2, timeout_s=30.0, cooldown_s=(1.0, 1.0))
    assert run.code == 0 and run.launches == [((A, B), 2)] * 2, run.messages
    run = supervise(tmp_path, [killed(0), SUCCESS], groups=(A, B), min_np=2, timeout_s=30.0)
    assert run.code == 1 and len(run.launches) == 1 and "fewer than --min-np 2" in run.messages[-1]


@pytest.mark.parametrize("low, high, jitter, expected", [
    (2.0, 30.0, 0.0, [4.0, 8.0, 16.0, 30.0, 30.0]),  # LOW * 2**n, capped at HIGH
    (2.0, 30.0, 0.5, [5.0, 9.0, 17.0, 30.0, 30.0]),  # plus a random share of LOW
    (5.0, 5.0, 0.9, [5.0] * 5),  # never above HIGH, never below LOW
])
def test_the_blacklist_cooldown_doubles_with_each_loss_within_its_range(low, high, jitter, expected):
    now = [100.0]
    blacklist = Blacklist((low, high), clock=lambda: now[0], jitter=lambda: jitter)
    for seconds in expected:
        assert blacklist.add("b") == pytest.approx(seconds)
        assert blacklist.excludes("b") and blacklist.returns_later() and not blacklist.excludes("a")
        now[0] += seconds - 0.01
        assert blacklist.excludes("b")
        now[0] += 0.02
        assert not blacklist.excludes("b") and not blacklist.returns_later()


def test_without_a_cooldown_range_a_lost_group_stays_out_for_good():
    now = [0.0]
    blacklist = Blacklist(None, clock=lambda: now[0])
    assert blacklist.add("b") == math.inf
    now[0] = 1e9
    assert blacklist.excludes("b") and not blacklist.returns_later()


@pytest.mark.parametrize("low, high", [(0.5, 10), (5, 4), (1, 3601), (float("nan"), 2), (1, float("inf"))])
def test_a_cooldown_range_outside_horovods_bounds_is_refused(low, high):
    assert "--blacklist-cooldown-range" in check_cooldown_range(low, high)
    assert check_cooldown_range(1, 3600) is None


def restore_fails(reason: str):
    """A launch whose job could not restore its commit (psrt.elastic's State._resume)."""
    def job(env: dict) -> JobResult:
        CommitStore(env[contract.ENV_ELASTIC_DIR]).report_restore_failure(reason)
        return raised(0)
    return job


def test_a_commit_that_fails_to_restore_the_same_way_twice_is_not_relaunched_again(tmp_path):
    damaged = "cannot resume from commit 3: rank 0: .../replicated.pt was modified after it was saved"
    run = supervise(tmp_path, [restore_fails(damaged)] * 4, restarts=3)
    assert run.code == 1 and len(run.launches) == 2, run.messages
    assert "giving up: launches 1 and 2 could not restore the last commit, both for the same reason" \
        in run.messages[-1] and damaged in run.messages[-1]
    assert not (tmp_path / contract.RESTORE_FAILED_FILE).exists()


def test_restore_failures_that_differ_or_are_not_in_a_row_use_the_restarts(tmp_path):
    run = supervise(tmp_path, [restore_fails("a transient read error"), restore_fails("another"), SUCCESS])
    assert run.code == 0 and len(run.launches) == 3
    run = supervise(tmp_path, [restore_fails("x"), raised(0), restore_fails("x"), SUCCESS])
    assert run.code == 0 and len(run.launches) == 4


# Bugs found while writing these tests, fixed since.

def test_a_second_lost_group_of_a_repeated_host_is_dropped_too(tmp_path):
    """``localhost:1`` three times rehearses losing hosts on one machine: losing two leaves one."""
    run = supervise(tmp_path, [killed(0), killed(0), SUCCESS], groups=(L1, L1, L1), restarts=2)
    assert [num_proc for _, num_proc in run.launches] == [3, 2, 1]


def test_psrt_elastic_imports_on_its_own():
    """``import psrt.elastic`` first, in a fresh interpreter (it builds on psrt.torch, which
    offers it as hvd.elastic: a circular import once)."""
    done = subprocess.run([sys.executable, "-c", "import psrt.elastic; import psrt.torch as hvd; hvd.elastic.run"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


def test_a_micro_batch_limit_below_one_is_refused():
    with pytest.raises(InvalidArgumentError, match="max_micro_batch=0"):
        plan_batch(8, 2, max_micro_batch=0)


def test_an_exit_before_any_launch_leaves_no_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic.tempfile, "tempdir", str(tmp_path))
    messages = []
    supervisor = Supervisor(ElasticSettings(2, 2, None, 0, 0.0, None, None), (Host("localhost", 1),),
                            launch=None, run_job=None, say=messages.append)
    assert supervisor.run() == 1 and "fewer than --min-np 2" in messages[-1]
    assert list(tmp_path.iterdir()) == []


# psrun's elastic flags (main() in-process, against a fake mpirun that records being run)

def recording_mpirun(tmp_path: Path) -> tuple[str, Path]:
    """A fake Open MPI mpirun that answers --version and otherwise writes its arguments to a file."""
    ran = tmp_path / "mpirun-ran"
    path = tmp_path / "mpirun"
    path.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 5.0.11'; exit 0; fi\n"
                    f"echo \"$@\" >> {ran}\n")
    path.chmod(0o755)
    return str(path), ran


def test_dry_run_with_elastic_flags_prints_the_first_launch_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(elastic.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    mpirun, ran = recording_mpirun(tmp_path)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\nlocalhost:1\nlocalhost:1\n")
    code = cli.main(["--mpirun", mpirun, "--dry-run", "--hostfile", str(hosts), "--min-np", "2", "--max-np", "2",
                     "--elastic-dir", str(tmp_path / "job"), "python", "train.py"])
    out, err = capsys.readouterr()
    assert code == 0 and not ran.exists(), err
    command = shlex.split(out)
    assert command[0] == mpirun and command[command.index("-np") + 1] == "2" and command[-2:] == ["python", "train.py"]
    assert f"{contract.ENV_ELASTIC_DIR}={tmp_path / 'job'}" in command and f"{contract.ENV_ELASTIC_LAUNCH}=1" in command
    assert "dry run: launch 1 would run 2 ranks on localhost:1, localhost:1" in err
    assert not (tmp_path / "job").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_dry_run_does_not_wait_for_discovery(tmp_path, capsys):
    """Too few slots now: the dry run says the job would wait, prints no command line and exits 1."""
    mpirun, ran = recording_mpirun(tmp_path)
    started = time.monotonic()
    code = cli.main(["--mpirun", mpirun, "--dry-run", "--host-discovery-script", script(tmp_path, "echo a:1\n"),
                     "--min-np", "2", "python", "train.py"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and not ran.exists() and time.monotonic() - started < 30
    assert "1 usable slot(s) now (a:1), fewer than --min-np 2: the job would wait up to 600 s" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "soon"])
def test_elastic_timeout_must_be_a_finite_positive_number_of_seconds(tmp_path, capsys, value):
    mpirun, ran = recording_mpirun(tmp_path)
    code = cli.main(["--mpirun", mpirun, "--min-np", "1", f"--elastic-timeout={value}", "python", "train.py"])
    assert code == 2 and not ran.exists()
    assert f"argument --elastic-timeout: {value!r}" in capsys.readouterr().err


def test_a_bad_blacklist_cooldown_range_is_refused_before_launching(tmp_path, capsys):
    mpirun, ran = recording_mpirun(tmp_path)
    code = cli.main(["--mpirun", mpirun, "--blacklist-cooldown-range", "10", "5", "python", "train.py"])
    assert code == 2 and not ran.exists()
    assert "psrun: error: --blacklist-cooldown-range 10 5: need 1 <= LOW <= HIGH <= 3600" in capsys.readouterr().err


@pytest.mark.parametrize("argv, error", [
    (["-H", "locahost:2"], "psrun: error: unknown host 'locahost'"),
    (["-np", "1", "--", "train.py"], "psrun: error: 'train.py' is a Python script, not a program"),
    (["--dry-run", "-H", "127.200.0.9:2"], "hosts other than this machine need --elastic-dir"),
])
def test_an_elastic_job_that_cannot_launch_is_refused_up_front_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                                  argv, error):
    """Once a Python traceback (and a temporary directory left behind), or a dry run that
    approved what the run refuses."""
    monkeypatch.setattr(elastic.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    mpirun, ran = recording_mpirun(tmp_path)
    command = ["python", "-c", "pass"] if "--" not in argv else []
    code = cli.main(["--mpirun", mpirun, "--min-np", "1", *argv, *command])
    assert code == 2 and not ran.exists()
    assert error in capsys.readouterr().err
    assert list((tmp_path / "tmp").iterdir()) == []
