"""The training API (DistributedOptimizer, broadcasts, object helpers, SyncBatchNorm) at 2 and 4
ranks, each against the same training done in a single process on the concatenated batch.

One job per rank count runs ``scripts/training_check.py`` (all checks; see ``conftest.py``);
each test asserts one check.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

RANK_COUNTS = (2, 4)

OPTIMIZER = [
    "sgd_momentum_matches_single_process", "adam_matches_single_process",
    "backward_passes_per_step_2_matches_single_process", "gradient_predivide_factor_matches_single_process",
    "op_sum_sums_gradients", "fp16_compression_is_close_to_single_process", "overlap_on_equals_overlap_off",
    "overlap_starts_allreduces_during_backward", "groups_match_single_process",
    "clip_between_synchronize_and_step", "unused_parameter_matches_single_process",
    "model_zero_grad_set_to_none", "views_with_accumulation_zero_grad_and_an_unused_parameter",
    "process_set_of_all_but_the_last_rank", "wrapper_is_the_optimizers_class",
    "names_must_be_unique_and_complete", "misuse_raises_horovods_errors",
]
BROADCAST = [
    "broadcast_parameters/state_dict_from_root_0", "broadcast_parameters/named_parameters_from_last_rank",
    "broadcast_optimizer_state/adam_from_last_rank", "broadcast_optimizer_state/root_without_state",
    "broadcast_object/from_rank_1", "allgather_object/objects_of_every_size",
]
SYNC_BATCH_NORM = ["1d_unequal_batches", "1d_sequence_input", "2d_unequal_batches", "2d_cumulative_average",
                   "rank_with_empty_batch"]
EXPECTED = ({f"optimizer/{name}" for name in OPTIMIZER} | set(BROADCAST)
            | {f"sync_batch_norm/{name}" for name in SYNC_BATCH_NORM})


def training(jobs, np: int):
    return jobs.get("training_check.py", np)


def cases(names: list[str]) -> list:
    return [pytest.param(np, name, id=f"{np}-{name}") for np in RANK_COUNTS for name in names]


@pytest.mark.parametrize("np, check", cases(OPTIMIZER))
def test_distributed_optimizer_matches_single_process(parallel_jobs, np, check):
    training(parallel_jobs, np).assert_ok(f"optimizer/{check}")


@pytest.mark.parametrize("np, check", cases(BROADCAST))
def test_broadcasts_give_every_rank_the_roots_state(parallel_jobs, np, check):
    training(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(SYNC_BATCH_NORM))
def test_sync_batch_norm_matches_batch_norm_on_the_concatenated_batch(parallel_jobs, np, check):
    training(parallel_jobs, np).assert_ok(f"sync_batch_norm/{check}")


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_training_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    training(parallel_jobs, np).assert_complete(EXPECTED)


FUSION_THRESHOLDS = ("0", "1024")  # fusion off, and a threshold smaller than one bucket
FUSION_SENSITIVE = ["sgd_momentum_matches_single_process", "adam_matches_single_process",
                    "backward_passes_per_step_2_matches_single_process", "groups_match_single_process",
                    "overlap_on_equals_overlap_off"]


@pytest.mark.parametrize("threshold", FUSION_THRESHOLDS)
@pytest.mark.parametrize("check", FUSION_SENSITIVE)
def test_training_is_unchanged_by_the_fusion_threshold(parallel_jobs, threshold, check):
    """The default threshold (128 MiB) is covered above; fusion off and 1 KiB must agree too."""
    parallel_jobs.get("training_check.py", 2, {"PSRT_FUSION_THRESHOLD": threshold}).assert_ok(
        f"optimizer/{check}")
