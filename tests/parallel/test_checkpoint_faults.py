"""Damaged or malicious checkpoints, parameter-server and ZeRO, across ranks: each is refused
on every rank with the file and the problem named, changes nothing, runs no code, and a good
save still loads afterwards in the same job.  One job per kind runs every case in turn."""
from __future__ import annotations

import pytest

from conftest import launch

pytestmark = pytest.mark.parallel

PS_CASES = ["malicious_pickle", "empty_file", "garbage_bytes", "truncated_file", "flipped_byte", "missing_file",
            "manifest_of_another_save", "truncated_manifest", "manifest_write_failure_reaches_every_worker",
            "good_and_unchecked_saves_load_after_the_refusals"]
ZERO_CASES = ["empty_shard", "truncated_shard", "flipped_byte_in_a_shard", "truncated_meta", "garbage_meta",
              "malicious_pickle_in_a_shard", "meta_rewritten_without_the_files", "shard_of_another_save",
              "shard_files_swapped", "good_save_loads_after_the_refusals"]


@pytest.fixture(scope="module")
def ps_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("ps-faults")
    return launch("checkpoint_faults.py", 3, {"PSRT_NUM_SERVERS": "1"}, args=("ps", str(root)))


@pytest.fixture(scope="module")
def zero_job(tmp_path_factory, parallel_jobs):
    root = tmp_path_factory.mktemp("zero-faults")
    return parallel_jobs.get("checkpoint_faults.py", 2, args=("zero", str(root)))


@pytest.mark.parametrize("case", PS_CASES)
def test_a_damaged_ps_checkpoint_is_refused_by_every_worker_and_changes_nothing(ps_job, case):
    ps_job.assert_ok(f"ps/{case}")


def test_the_ps_job_ran_every_case_and_its_servers_exit_cleanly(ps_job):
    ps_job.assert_complete(f"ps/{case}" for case in PS_CASES)


@pytest.mark.parametrize("case", ZERO_CASES)
def test_a_damaged_zero_checkpoint_is_refused_by_every_rank_and_changes_nothing(zero_job, case):
    zero_job.assert_ok(f"zero/{case}")


def test_the_zero_job_ran_every_case(zero_job):
    zero_job.assert_complete(f"zero/{case}" for case in ZERO_CASES)
