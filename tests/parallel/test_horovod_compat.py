"""Horovod behaviours a script relies on after changing only its import line, at 2 and 4 ranks.

One job per rank count runs ``scripts/horovod_compat_check.py`` (see ``conftest.py``);
each test asserts one check: alltoall's return values and splits errors,
``sparse_allreduce_async``'s callable handle, ``join(device)`` and integer Average
rounded toward zero, broadcasts rooted outside rank 0's process set, optimizer state
broadcast before any step, ``DistributedOptimizer``'s parameter names and sparse
gradients, Adasum against a single-process reference, and the ``HOROVOD_*`` variables.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

RANK_COUNTS = (2, 4)

CHECKS = [
    "alltoall/without_splits_returns_the_tensor", "alltoall/with_splits_returns_the_pair",
    "alltoall/async_returns_the_pair_either_way", "alltoall/autograd_without_splits",
    "alltoall/float_splits_raise_value_error",
    "sparse_allreduce_async/handle_is_called",
    "join/takes_horovods_device_argument", "allreduce/integer_average_rounds_toward_zero",
    "join/integer_average_rounds_toward_zero_then_allgather_object",
    "broadcast_object/root_is_a_global_rank", "broadcast_optimizer_state/root_is_a_global_rank",
    "broadcast_optimizer_state/fresh_optimizer", "broadcast_optimizer_state/unused_parameter_and_none_entries",
    "optimizer/parameter_names_as_horovod", "optimizer/sparse_gradients_stay_sparse",
    "adasum/allreduce_matches_reference", "adasum/orthogonal_is_the_sum_and_equal_is_the_vector",
    "adasum/bit_identical_on_every_rank", "adasum/process_set",
    "adasum/unsupported_raises_value_and_runtime_error", "adasum/optimizer_matches_reference",
    "launcher/horovod_variables_name_each_ranks_place",
]


def compat(jobs, np: int):
    return jobs.get("horovod_compat_check.py", np)


@pytest.mark.parametrize("np, check", [pytest.param(np, c, id=f"{np}-{c}") for np in RANK_COUNTS for c in CHECKS])
def test_horovod_behaviour(parallel_jobs, np, check):
    compat(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_compat_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    compat(parallel_jobs, np).assert_complete(CHECKS)
