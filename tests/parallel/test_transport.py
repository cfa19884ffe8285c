"""The transport layer at 2 and 4 ranks: point-to-point messages of every dtype,
communicator splits, and psrt's ring allreduce on odd sizes
and every op, against numpy (``scripts/transport_check.py``, one job per rank count)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

CHECKS = [
    "blocking_send_recv_around_the_ring",
    "nonblocking_send_recv_of_every_dtype",
    "persistent_receive_takes_each_message_in_turn",
    "split_gives_each_color_its_own_group",
    "ring_allreduce_matches_numpy_for_odd_sizes_and_all_ops",
    "segmented_allreduce_matches_numpy_for_odd_sizes_and_all_ops",
    "ring_reduce_scatter_leaves_each_rank_its_block_and_keeps_the_input",
]


@pytest.mark.parametrize("np", [2, 4])
@pytest.mark.parametrize("check", CHECKS)
def test_transport_check_passes_on_every_rank(parallel_jobs, np, check):
    parallel_jobs.get("transport_check.py", np).assert_ok(check)


@pytest.mark.parametrize("np", [2, 4])
def test_transport_job_reports_every_check_and_exits_cleanly(parallel_jobs, np):
    parallel_jobs.get("transport_check.py", np).assert_complete(CHECKS)
