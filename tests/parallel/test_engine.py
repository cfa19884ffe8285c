"""The engine across ranks: name matching, poll, fusion, cached mismatches, join, barrier,
timeline (``scripts/engine_check.py``), and what happens when ranks stall or one shuts
down (``scripts/engine_failures.py``).

The engine job runs at 2 and 4 ranks with the default fusion threshold, and
at 2 ranks with fusion off and with a 1 KiB threshold: every check compares
with an exact reference, so all thresholds must give identical results.
"""
from __future__ import annotations

import json

import pytest

from conftest import launch

pytestmark = pytest.mark.parallel

CHECKS = [
    "names_in_rank_dependent_order", "sync_call_while_other_async_pending",
    "poll_is_false_until_every_rank_submitted", "duplicate_pending_name_raises_at_once",
    "unnamed_ops_match_by_counter", "many_small_tensors_fused",
    "views_of_one_buffer_reduced_in_place", "average_and_postscale_in_fused_batches",
    "mismatch_after_the_name_was_cached", "join_with_uneven_steps",
    "join_refuses_other_collectives", "barrier_with_async_ops_outstanding",
    "remove_process_set_refuses_while_its_ops_are_pending",
    "timeline_records_each_phase", "mixed_blocking_and_async_in_random_orders",
    "quiet_engines_hold_no_rounds_and_wake_when_rung", "lone_cached_calls_meet_other_ranks_work",
    "a_late_member_is_left_to_compute", "express_calls_of_every_kind_are_exact",
]
# The no-fusion job also runs as on an MPI 3 library (Open MPI 4.1): without persistent
# collectives, so every negotiation round and direct-path agreement takes the fallback.
JOBS = [(2, {}, ()), (4, {}, ()), (2, {"PSRT_FUSION_THRESHOLD": "0"}, ("--without-persistent-collectives",)),
        (2, {"PSRT_FUSION_THRESHOLD": "1024"}, ())]
JOB_IDS = ["2-default", "4-default", "2-no-fusion-mpi3", "2-fusion-1KiB"]


@pytest.mark.parametrize("np, env, args", JOBS, ids=JOB_IDS)
@pytest.mark.parametrize("check", CHECKS)
def test_engine_check_passes_on_every_rank(parallel_jobs, np, env, args, check):
    parallel_jobs.get("engine_check.py", np, env, args).assert_ok(check)


@pytest.mark.parametrize("np, env, args", JOBS, ids=JOB_IDS)
def test_engine_job_reports_every_check_and_ends_cleanly(parallel_jobs, np, env, args):
    parallel_jobs.get("engine_check.py", np, env, args).assert_complete(CHECKS)


def _results(report) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in report.stdout.splitlines()
            if "RESULT " in line]


def test_a_stall_names_the_tensor_and_missing_rank_then_aborts_the_job():
    report = launch("engine_failures.py", 2, {"PSRT_STALL_CHECK_TIME": "1",
                                              "PSRT_STALL_SHUTDOWN_TIME": "3"},
                    args=("stall_abort",), timeout_s=90)
    assert report.returncode not in (0, None), report.diagnosis()
    assert report.seconds < 60, f"the stalled job took {report.seconds:.0f} s to end"
    assert "allreduce of tensor 'stuck_tensor'" in report.stderr, report.diagnosis()
    assert "missing ranks [1]" in report.stderr, report.diagnosis()
    assert "rank 1 answers but waits for nothing in psrt" in report.stderr, report.diagnosis()
    assert "psrun: rank 1 is to blame: answers but never came (busy in its own code) while allreduce of tensor " \
           "'stuck_tensor'" in report.stderr, report.diagnosis()
    assert not _results(report), "the stalled allreduce returned"


def test_a_late_join_is_reported_but_never_ends_the_job():
    report = launch("engine_failures.py", 2, {"PSRT_STALL_CHECK_TIME": "1",
                                              "PSRT_STALL_SHUTDOWN_TIME": "3"},
                    args=("join_stall",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    assert "stall: join, submitted by ranks [0] but not by missing ranks [1]" in report.stderr, report.diagnosis()
    assert "rank 1 answers but waits for nothing in psrt" in report.stderr, report.diagnosis()
    assert [r["last_to_join"] for r in _results(report)] == [1, 1], report.diagnosis()


def test_a_late_rank_gets_a_stall_warning_and_the_job_still_succeeds():
    report = launch("engine_failures.py", 2, {"PSRT_STALL_CHECK_TIME": "1"},
                    args=("stall_warning",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    assert "psrt: stall:" in report.stderr and "'late_tensor'" in report.stderr, report.diagnosis()
    assert "missing ranks [1]" in report.stderr, report.diagnosis()
    assert sorted(r["value"] for r in _results(report)) == [[2.0, 2.0], [2.0, 2.0]]


def test_shutdown_is_collective_and_sets_without_the_stopped_rank_keep_working():
    report = launch("engine_failures.py", 2, args=("shutdown_sets",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    results = {k: v for r in _results(report) for k, v in r.items() if k != "rank"}
    assert results.get("alone") == [1.0, 1.0], report.diagnosis()
    assert "'everyone'" in results["everyone"] and "shut down by rank 1" in results["everyone"], report.diagnosis()
    assert results.get("shut_down") is True, report.diagnosis()


def test_a_join_that_a_rank_which_shut_down_cannot_make_raises_naming_it():
    report = launch("engine_failures.py", 2, args=("join_shutdown",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    results = {k: v for r in _results(report) for k, v in r.items() if k != "rank"}
    assert results.get("join") and "shut down by rank 1" in results["join"], report.diagnosis()
    assert results.get("shut_down") is True, report.diagnosis()


@pytest.mark.parametrize("mode", ["shutdown", "shutdown_cached"])
def test_shutdown_on_one_rank_fails_the_others_pending_collective_naming_it(mode):
    report = launch("engine_failures.py", 2, args=(mode,), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    results = {k: v for r in _results(report) for k, v in r.items() if k != "rank"}
    assert results.get("kind") == "EngineStoppedError", report.diagnosis()
    assert "'orphan'" in results["error"] and "shut down by rank 1" in results["error"]
    assert "shut down by rank 1" in results["after"]


def test_a_failed_express_reduction_raises_naming_it_and_stops_the_engine():
    report = launch("engine_failures.py", 1, {"PSRT_ABORT_ON_EXCEPTION": "off"}, args=("express_failure",),
                    timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    results = {k: v for r in _results(report) for k, v in r.items() if k != "rank"}
    assert "allreduce of tensor 'doomed'" in results["doomed"], report.diagnosis()
    assert "injected transport failure" in results["doomed"], report.diagnosis()
    assert "injected transport failure" in results["later"], report.diagnosis()


def test_a_failed_express_reduction_aborts_the_job_rather_than_leave_a_rank_waiting():
    report = launch("engine_failures.py", 2, args=("express_failure",), timeout_s=90)
    assert report.returncode not in (0, None), report.diagnosis()
    assert report.seconds < 60, f"the failed job took {report.seconds:.0f} s to end"
    assert "psrt engine failed" in report.stderr and "injected transport failure" in report.stderr, \
        report.diagnosis()
    assert not any("doomed" in r for r in _results(report)), report.diagnosis()
