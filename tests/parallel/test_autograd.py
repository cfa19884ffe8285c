"""Differentiable collectives at 2 and 4 ranks: outputs and gradients match one process.

One job per rank count runs ``scripts/autograd_check.py`` (see ``conftest.py``);
each rank compares its output and its input's gradient with a float64
single-process reference built from every rank's inputs, weighted by
Horovod's convention for the collective (sum of the ranks' losses for
allreduce and alltoall, their mean for allgather and broadcast, size times
the sum for reducescatter).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

RANK_COUNTS = (2, 4)
LINEAR_OPS = ("Sum", "Average")


def autograd(jobs, np: int):
    return jobs.get("autograd_check.py", np)


def cases(checks) -> list:
    """pytest params: every rank count times ``checks`` (a list, or a function of np)."""
    return [pytest.param(np, check, id=f"{np}-{check}") for np in RANK_COUNTS
            for check in (checks(np) if callable(checks) else checks)]


ALLREDUCE = [f"{form}/{op}" for form in ("allreduce", "allreduce_scaled",
                                         "grouped_allreduce_scaled") for op in LINEAR_OPS]
ALLREDUCE += ["allreduce_unnamed", "allreduce_compression_fp16"]
ALLGATHER = ["allgather_uneven_rows", "allgather_0d", "allgather_unnamed",
             "grouped_allgather_uneven_rows", "grouped_allgather_unnamed"]
ALLTOALL = [f"alltoall/splits_{form}" for form in ("list", "tensor", "none")]
REDUCESCATTER = [f"{form}/{op}" for form in ("reducescatter_scaled",
                                             "reducescatter_fewer_rows_than_ranks",
                                             "grouped_reducescatter_scaled") for op in LINEAR_OPS]
REDUCESCATTER += ["reducescatter_compression_fp16"]
PROCESS_SET = ["process_set/allgather", "process_set/broadcast"]
GROUPED_ASYNC = ["grouped_async/allgather", "grouped_async/reducescatter"]
SPARSE = [f"sparse_allreduce_async/{op}/{layout}" for op in LINEAR_OPS
          for layout in ("rows", "coordinates")]
UNTRACKED = [f"untracked/{c}" for c in ("allreduce", "allgather", "broadcast", "alltoall",
                                        "reducescatter")]


def broadcast_checks(np: int) -> list[str]:
    return [f"broadcast/root{root}" for root in range(np)]


def expected(np: int) -> set[str]:
    return (set(ALLREDUCE) | set(ALLGATHER) | set(ALLTOALL) | set(REDUCESCATTER)
            | set(PROCESS_SET) | set(GROUPED_ASYNC) | set(SPARSE) | set(UNTRACKED)
            | set(broadcast_checks(np)) | {"allreduce_min_has_no_gradient"})


@pytest.mark.parametrize("np, check", cases(ALLREDUCE))
def test_allreduce_gradient_is_the_same_allreduce_of_the_upstream_gradients(parallel_jobs, np,
                                                                             check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_allreduce_with_min_raises_in_backward_instead_of_a_wrong_gradient(parallel_jobs, np):
    autograd(parallel_jobs, np).assert_ok("allreduce_min_has_no_gradient")


@pytest.mark.parametrize("np, check", cases(ALLGATHER))
def test_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient(parallel_jobs, np,
                                                                        check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(broadcast_checks))
def test_broadcast_gradient_reaches_only_the_root(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(ALLTOALL))
def test_alltoall_gradient_returns_along_the_received_splits(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(REDUCESCATTER))
def test_reducescatter_gradient_is_the_allgathered_scaled_gradient(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(PROCESS_SET))
def test_gradients_on_a_process_set_use_ranks_within_the_set(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(GROUPED_ASYNC))
def test_grouped_async_handle_synchronizes_to_the_list_once(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(SPARSE))
def test_sparse_allreduce_async_matches_the_dense_reduction(parallel_jobs, np, check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, check", cases(UNTRACKED))
def test_inputs_without_grad_give_untracked_outputs_of_the_plain_collective(parallel_jobs, np,
                                                                            check):
    autograd(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_autograd_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    autograd(parallel_jobs, np).assert_complete(expected(np))
