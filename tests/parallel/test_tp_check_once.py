"""Tensor-parallel calls checked once per call (scripts/tp_check_once.py): repeated layer calls
agree once and match one process; a rank whose call differs, new or known, ends with the
same CollectiveMismatchError on every rank within seconds (the script's checks time it; a
hang ends the job at the harness's deadline); PSRT_TP_CHECK_SHAPES=0 agrees nothing."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

CHECKED = ["repeats/agree_once_and_match_one_process", "mismatch/new_shape_at_a_known_call",
           "mismatch/known_shapes_that_differ"]
UNCHECKED = ["repeats/agree_once_and_match_one_process", "unchecked/nothing_is_agreed"]


@pytest.mark.parametrize("check", CHECKED)
@pytest.mark.parametrize("np", [2, 4])
def test_calls_checked_once_match_one_process_and_fail_alike_on_a_mismatch(parallel_jobs, np, check):
    parallel_jobs.get("tp_check_once.py", np).assert_ok(check)


@pytest.mark.parametrize("check", UNCHECKED)
def test_without_the_check_nothing_is_agreed(parallel_jobs, check):
    parallel_jobs.get("tp_check_once.py", 2, {"PSRT_TP_CHECK_SHAPES": "0"}).assert_ok(check)


@pytest.mark.parametrize("np,env,expected", [(2, {}, CHECKED), (4, {}, CHECKED),
                                             (2, {"PSRT_TP_CHECK_SHAPES": "0"}, UNCHECKED)])
def test_the_jobs_report_every_check_and_end_cleanly(parallel_jobs, np, env, expected):
    parallel_jobs.get("tp_check_once.py", np, env).assert_complete(expected)
