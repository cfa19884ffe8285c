"""A rank that is alive but frozen, or that never starts, ends the job naming it.

A rank is frozen from outside with SIGSTOP once training is under way (a node stuck in
I/O, a hung driver: its process exists, its peers' collectives wait on it forever).
Every job runs with PSRT_STALL_CHECK_TIME=3 and PSRT_STALL_SHUTDOWN_TIME=8 and must end
within the shutdown time and a margin for probing and the abort, with one stall report
that names the rank that does not respond, and with no process of it left behind.
"""
from __future__ import annotations

import re
import signal

import pytest

from conftest import launch
from faults import run_with_fault

pytestmark = pytest.mark.parallel

CHECK_S, SHUTDOWN_S = 3, 8
ENV = {"PSRT_STALL_CHECK_TIME": str(CHECK_S), "PSRT_STALL_SHUTDOWN_TIME": str(SHUTDOWN_S)}
# probing (answers within 2 s), the abort, and 4 ranks sharing 2 cores
MARGIN_S = 8


def test_a_frozen_rank_in_data_parallel_training_is_named_and_the_job_ends():
    job = run_with_fault("frozen_training.py", 2, ("dp",), ENV, after="step 3", rank=1, signum=signal.SIGSTOP)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + MARGIN_S, job.diagnosis()
    summary = job.stderr.strip().splitlines()[-1]
    # The frozen rank headlines the job.  Rank 0 waits in a negotiation round, or in the
    # gradients' allreduce if rank 1 froze between the two (as in the test below).
    assert re.match(r"psrun: rank 1 is to blame: stopped answering while rank 0's (engine negotiation round|"
                    r"allreduce of tensor).* \(reported by rank 0\)$", summary), job.diagnosis()
    assert "rank 1 does not respond" in job.stderr, job.diagnosis()
    assert f"PSRT_STALL_SHUTDOWN_TIME={SHUTDOWN_S} s" in job.all_stderr, job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def test_a_frozen_rank_0_is_named_by_one_other_rank_only():
    job = run_with_fault("frozen_training.py", 4, ("dp",), ENV, after="step 3", rank=0, signum=signal.SIGSTOP)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + MARGIN_S, job.diagnosis()
    assert "rank 0 does not respond" in job.stderr, job.diagnosis()
    # Rank 1 waits in a negotiation round, or in the gradients' allreduce if rank 0 froze
    # between the two (the round and the collective run on the caller's thread, back to back).
    assert re.search(r"psrun: rank 0 is to blame: stopped answering while rank 1's (engine negotiation round|"
                     r"allreduce of tensor).* \(reported by rank 1\)", job.stderr), job.diagnosis()
    reports = re.findall(r"psrt: stall: rank (\d+)'s", job.all_stderr)
    assert set(reports) == {"1"}, f"stall reports by ranks {reports}, expected rank 1 only\n{job.diagnosis()}"
    assert not job.left_behind, job.diagnosis()


def test_a_frozen_parameter_server_is_named_by_its_workers_and_the_job_ends():
    job = run_with_fault("frozen_training.py", 3, ("ps",), {**ENV, "PSRT_NUM_SERVERS": "1"}, after="step 3",
                         rank=2, signum=signal.SIGSTOP)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + MARGIN_S, job.diagnosis()
    summary = job.stderr.strip().splitlines()[-1]
    assert summary.startswith("psrun: rank 2 (parameter server 0) is to blame: stopped answering while "
                              "worker 0's"), job.diagnosis()
    assert "to parameter server 0 waited" in summary and summary.endswith("(reported by rank 0)"), job.diagnosis()
    assert "rank 2 (parameter server 0) does not respond" in job.stderr, job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def test_a_frozen_parameter_server_worker_is_blamed_through_the_server_that_waits_for_it():
    """Worker 0 waits for the server, which waits for worker 1's pushes: the rank to blame is
    one further than the rank waited on."""
    job = run_with_fault("frozen_training.py", 3, ("ps",), {**ENV, "PSRT_NUM_SERVERS": "1"}, after="step 3",
                         rank=1, signum=signal.SIGSTOP)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + MARGIN_S, job.diagnosis()
    assert "psrun: rank 1 (worker 1) is to blame: stopped answering" in job.stderr, job.diagnosis()
    assert "rank 1 (worker 1), which rank 2 (parameter server 0) waits for, does not respond" in job.all_stderr
    assert not job.left_behind, job.diagnosis()


def test_a_killed_rank_ends_the_job_at_once_naming_it():
    job = run_with_fault("frozen_training.py", 2, ("dp",), ENV, after="step 3", rank=1, signum=signal.SIGKILL)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < 10, job.diagnosis()
    assert job.stderr.strip().splitlines()[-1] == "psrun: rank 1 failed first: killed by signal 9 (SIGKILL)", \
        job.diagnosis()
    assert not job.left_behind, job.diagnosis()


@pytest.mark.parametrize(("late", "speaker"), [(1, 0), (0, 1)])
def test_a_rank_that_never_calls_init_is_named(late, speaker):
    report = launch("frozen_training.py", 2, ENV, args=("late_init", str(late)), timeout_s=90)
    assert report.returncode not in (0, None), report.diagnosis()
    assert report.seconds < 60, report.diagnosis()
    expected = (f"psrun: rank {speaker} failed first: stall: psrt.init() on rank {speaker} waiting for rank {late} "
                "to call psrt.init()")
    assert expected in report.stderr, report.diagnosis()
