"""The direct layer across processes: agreement, its check setting, 16-bit reductions and
messages, on 2 ranks in one job."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

CHECKS = ["agreement/disagreeing_dtypes_named_on_every_rank", "agreement/check_setting_on_one_rank_fails_alike",
          "collectives/bfloat16_matches_one_process", "messages/header_rebuilds_the_tensor"]


@pytest.mark.parametrize("check", CHECKS)
def test_direct_layer_check_passes_on_every_rank(parallel_jobs, check):
    parallel_jobs.get("direct_check.py", 2).assert_ok(check)


def test_direct_job_reports_every_check_and_ends_cleanly(parallel_jobs):
    parallel_jobs.get("direct_check.py", 2).assert_complete(CHECKS)
