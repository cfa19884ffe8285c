"""psrt as a torch.distributed backend: every collective against gloo, and DDP, FSDP2,
DTensor, torch's pipelining, distributed checkpoints and Lightning against one process, at 2
and 4 ranks (the checks are in ``scripts/torch_backend_check.py``); a rank that dies or
freezes inside a DDP step ends the job with a named error."""
from __future__ import annotations

import pytest

from conftest import launch  # noqa: F401  (the fixture's launcher, for the fault tests below)

pytestmark = pytest.mark.parallel

COLLECTIVES = ["all_reduce/sum", "all_reduce/min", "all_reduce/max", "all_reduce/product", "all_reduce/avg",
               "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor/sum",
               "reduce_scatter_tensor/avg", "reduce_scatter", "all_to_all_single/uneven", "all_to_all", "gather",
               "scatter", "reduce", "send_recv/batch_isend_irecv_ring", "async_op/wait", "coalescing_manager",
               "barrier_and_objects"]
CHECKS = [f"collectives/{name}" for name in COLLECTIVES] + [
    "errors/mismatched_shapes_name_the_ranks", "errors/unsupported_reduction",
    "ddp/buckets_and_no_sync_match_single_process", "fsdp2/matches_single_process",
    "fsdp2/mixed_precision_matches_gloo", "dtensor/parallelize_module_matches_single_process",
    "pipelining/1f1b_matches_single_process", "dcp/saves_and_loads_here_and_in_one_process",
    "lightning/ddp_strategy_matches_single_process"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("np", [2, 4])
def test_torch_distributed_on_psrt_matches_gloo_and_one_process(parallel_jobs, np, check):
    parallel_jobs.get("torch_backend_check.py", np).assert_ok(check)


@pytest.mark.parametrize("np", [2, 4])
def test_torch_backend_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    parallel_jobs.get("torch_backend_check.py", np).assert_complete(CHECKS)
