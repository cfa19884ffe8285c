"""psrt as a torch.distributed backend: every collective against gloo, and DDP, FSDP2,
DTensor, torch's pipelining, distributed checkpoints (with psrt's checksums too) and Lightning against one process, at 2
and 4 ranks (the checks are in ``scripts/torch_backend_check.py``), and transformers' Trainer against gloo at 2;
torchrun's variables that psrun sets name each rank's place; a rank that dies or freezes inside a DDP step ends the
job with a named error."""
from __future__ import annotations

import re
import signal

import pytest

from faults import run_with_fault

pytestmark = pytest.mark.parallel

COLLECTIVES = ["all_reduce/sum", "all_reduce/min", "all_reduce/max", "all_reduce/product", "all_reduce/avg",
               "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor/sum",
               "reduce_scatter_tensor/avg", "reduce_scatter_tensor/premul_sum", "reduce_scatter",
               "all_to_all_single/uneven", "all_to_all_single/zero_rows", "all_to_all_single/even_without_sizes",
               "non_contiguous_in_place", "all_to_all", "gather", "scatter", "reduce",
               "send_recv/batch_isend_irecv_ring", "async_op/wait", "coalescing_manager", "barrier_and_objects",
               "rooted_on_a_subgroup"]
CHECKS = [f"collectives/{name}" for name in COLLECTIVES] + [
    "errors/mismatched_shapes_name_the_ranks", "errors/different_collectives_name_the_ranks",
    "errors/unsupported_reduction", "errors/wrong_outputs_refused_before_communication",
    "errors/different_roots_and_a_lone_barrier_name_the_ranks", "process_group/over_a_process_set",
    "process_group/destroyed_groups_are_freed",
    "ddp/buckets_and_no_sync_match_single_process", "fsdp2/matches_single_process",
    "fsdp2/mixed_precision_matches_gloo", "dtensor/parallelize_module_matches_single_process_and_gloo",
    "pipelining/1f1b_matches_single_process_and_gloo", "dcp/saves_and_loads_here_and_in_one_process",
    "dcp/checksums_round_trip_and_refuse_a_flipped_byte",
    "dcp/fsdp2_checkpoint_continues_under_zero3_on_half_the_ranks",
    "dcp/zero3_checkpoint_continues_under_fsdp2_on_half_the_ranks",
    "launcher/torchrun_variables_name_each_ranks_place", "lightning/ddp_strategy_matches_single_process",
    "listeners/only_the_launcher_listens_beyond_loopback"]
# transformers' Trainer over psrt and over gloo, with accelerate's state checked: on 2 ranks only
TWO_RANKS_ONLY = ["hf_trainer/over_psrt_equals_gloo_and_accelerate_finds_the_ranks"]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("np", [2, 4])
def test_torch_distributed_on_psrt_matches_gloo_and_one_process(parallel_jobs, np, check):
    parallel_jobs.get("torch_backend_check.py", np).assert_ok(check)


def test_hf_trainer_over_psrt_equals_gloo_and_accelerate_finds_the_ranks(parallel_jobs):
    parallel_jobs.get("torch_backend_check.py", 2).assert_ok(TWO_RANKS_ONLY[0])


@pytest.mark.parametrize("np", [2, 4])
def test_torch_backend_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    parallel_jobs.get("torch_backend_check.py", np).assert_complete(CHECKS + (TWO_RANKS_ONLY if np == 2 else []))


CHECK_S, SHUTDOWN_S = 3, 8
STALL_ENV = {"PSRT_STALL_CHECK_TIME": str(CHECK_S), "PSRT_STALL_SHUTDOWN_TIME": str(SHUTDOWN_S)}
MARGIN_S = 8  # probing, the abort, start-up of the ranks' exit


def test_a_frozen_rank_inside_a_ddp_step_is_named_and_the_job_ends():
    """gloo would wait out its 30-minute timeout; psrt's watchdog names the rank DDP waits for."""
    job = run_with_fault("frozen_training.py", 2, ("ddp",), STALL_ENV, after="step 3", rank=1,
                         signum=signal.SIGSTOP)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + MARGIN_S, job.diagnosis()
    summary = job.stderr.strip().splitlines()[-1]
    assert re.match(r"psrun: rank 1 is to blame: stopped answering while torch\.distributed all_reduce on rank 0 "
                    r"over torch\.distributed group 0 of ranks \[0, 1\] waited \d+ s \(reported by rank 0\)$",
                    summary), job.diagnosis()
    assert "rank 1 does not respond" in job.stderr, job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def test_a_killed_rank_inside_a_ddp_step_ends_the_job_naming_it():
    job = run_with_fault("frozen_training.py", 2, ("ddp",), STALL_ENV, after="step 3", rank=1,
                         signum=signal.SIGKILL)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < 10, job.diagnosis()
    assert job.stderr.strip().splitlines()[-1] == "psrun: rank 1 failed first: killed by signal 9 (SIGKILL)", \
        job.diagnosis()
    assert not job.left_behind, job.diagnosis()
