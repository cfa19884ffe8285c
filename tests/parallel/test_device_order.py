"""The GPU data path's stream order, without a GPU (``scripts/device_order_check.py`` on the fake
device of ``tests/fake_device.py``): each step (DP, ZeRO 1-3, a 1F1B pipeline, DDP over the
"psrt" torch backend) waits for no host, every collective waits for its producer, every consumer
for its collective, no memory is freed early, and results equal one process's.  Two controls
break the order on purpose and must be caught."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

CHECKS = ["control/a_consumer_that_does_not_wait_is_seen", "control/a_collective_that_ignores_its_producer_is_seen",
          "dp/step", "zero1/step", "zero2/step", "zero3/step", "zero3/prefetches_before_compute", "pp/1f1b_step",
          "c10d/ddp_step", "c10d/a_mismatched_receive_names_both_ranks"]


@pytest.mark.parametrize("check", CHECKS)
def test_a_step_on_the_fake_device_keeps_the_stream_order_and_matches_one_process(parallel_jobs, check):
    parallel_jobs.get("device_order_check.py", 2).assert_ok(check)


def test_the_device_order_job_reports_every_check(parallel_jobs):
    parallel_jobs.get("device_order_check.py", 2).assert_complete(CHECKS)
