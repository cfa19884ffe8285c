"""psrt's own strategies reach MPI through the engine channel they were handed, never through
the Horovod-shaped facade: a ``DistributedOptimizer`` step and a ZeRO-3 step are traced on every
thread (``scripts/call_path_check.py``), with a control showing the trace sees the facade."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

CHECKS = ["control/the_detector_sees_the_facade", "dp/step_goes_through_its_channel",
          "zero3/step_goes_through_its_channel"]


@pytest.mark.parametrize("check", CHECKS)
def test_a_step_reaches_mpi_without_the_facade_a_handle_or_the_current_runtime(parallel_jobs, check):
    parallel_jobs.get("call_path_check.py", 2).assert_ok(check)


def test_the_call_path_job_reports_every_check(parallel_jobs):
    parallel_jobs.get("call_path_check.py", 2).assert_complete(CHECKS)
