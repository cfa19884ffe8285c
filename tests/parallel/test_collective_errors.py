"""Bad arguments fail fast on the calling rank; mismatched ranks all raise; nothing hangs.

One job per rank count runs ``scripts/errors_check.py`` (see ``conftest.py``).
An argument error is made by one rank alone, and the ranks then run a
collective together, so an error raised after any communication would show up
as a failed or hung check.  A mismatch is made by every rank at once, each
with its own arguments.  The before-init test runs in this process.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import psrt
import psrt.torch as hvd

RANK_COUNTS = (2, 4)
MISMATCH_LIMIT_S = 5.0
JOB_LIMIT_S = 150.0  # start-up of 4 ranks on a loaded 2-core machine included

WRONG_TYPES = [
    "allreduce_list", "allreduce_numpy", "allreduce_inplace_float", "allreduce_async_none",
    "grouped_allreduce_tensor_not_list", "grouped_allreduce_member_not_tensor", "allgather_list",
    "broadcast_list", "alltoall_list", "reducescatter_list", "op_string", "op_float",
    "average_not_bool", "prescale_string", "postscale_none", "name_int", "broadcast_root_float",
    "broadcast_root_string",
]
BAD_VALUES = [
    "value/grouped_allreduce_empty_list", "value/op_unknown", "value/op_adasum_int",
    "value/grouped_op_adasum_int", "value/reducescatter_op_adasum", "value/reducescatter_op_unknown",
    "value/reducescatter_op_min",
    "value/op_and_average",
    "value/broadcast_root_out_of_range", "value/broadcast_root_negative",
    "value/broadcast_inplace_root_out_of_range", "value/broadcast_async_root_out_of_range",
    "value/alltoall_0d", "value/reducescatter_0d",
    "splits/sum_differs", "splits/wrong_length", "splits/negative", "splits/floats",
    "splits/float_tensor", "splits/none_with_indivisible_rows",
    "handle/synchronize_unknown", "handle/poll_unknown", "handle/synchronize_string",
]
BOOL_OPS = ["allreduce_sum", "allreduce_default_average", "allreduce_inplace_average",
            "grouped_allreduce_sum", "allreduce_prescale", "reducescatter"]
FORMS = ["allreduce", "allreduce_", "allreduce_async", "grouped_allreduce", "allgather",
         "broadcast", "broadcast_", "alltoall", "reducescatter"]
PROCESS_SET_MISUSE = ["unregistered", "unregistered_broadcast", "not_a_process_set",
                      "add_out_of_range", "add_duplicates", "add_empty", "add_non_int",
                      "add_registered_again", "remove_global", "removed"]
NON_MEMBER_FORMS = [
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "allgather", "allgather_async", "broadcast",
    "broadcast_", "broadcast_async", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "barrier",
]
MISMATCHES = [
    "allreduce_shape", "allreduce_dtype", "allreduce_op", "allreduce_prescale",
    "allreduce_inplace_shape", "allreduce_async_shape", "grouped_allreduce_shapes",
    "grouped_allreduce_dtypes", "allgather_trailing_shape", "allgather_dtype", "broadcast_root",
    "broadcast_shape", "alltoall_dtype", "reducescatter_op", "reducescatter_shape",
    "different_collectives", "add_process_set",
]


def errors(jobs, np: int):
    return jobs.get("errors_check.py", np)


def cases(values: list[str]) -> list:
    return [pytest.param(np, v, id=f"{np}-{v}") for np, v in itertools.product(RANK_COUNTS, values)]


def expected_checks() -> set[str]:
    return ({f"type/{n}" for n in WRONG_TYPES} | set(BAD_VALUES) | {f"bool/{n}" for n in BOOL_OPS}
            | {f"device/{f}_meta" for f in FORMS} | {f"dtype/{f}_complex64" for f in FORMS}
            | {"dtype/allreduce_sparse", "process_set/register_partial"}
            | {f"process_set/{n}" for n in PROCESS_SET_MISUSE}
            | {f"process_set/non_member/{f}" for f in NON_MEMBER_FORMS}
            | {f"mismatch/{n}" for n in MISMATCHES})


@pytest.mark.parallel
@pytest.mark.parametrize("np, case", cases(WRONG_TYPES))
def test_wrong_argument_type_raises_before_communication(parallel_jobs, np, case):
    errors(parallel_jobs, np).assert_ok(f"type/{case}")


@pytest.mark.parallel
@pytest.mark.parametrize("np, case", cases(BAD_VALUES))
def test_bad_argument_value_raises_before_communication(parallel_jobs, np, case):
    errors(parallel_jobs, np).assert_ok(case)


@pytest.mark.parallel
@pytest.mark.parametrize("np, form", cases(FORMS))
def test_meta_device_tensor_raises_unsupported_device(parallel_jobs, np, form):
    errors(parallel_jobs, np).assert_ok(f"device/{form}_meta")


@pytest.mark.parallel
@pytest.mark.parametrize("np, form", cases(FORMS))
def test_complex64_tensor_raises_unsupported_dtype(parallel_jobs, np, form):
    errors(parallel_jobs, np).assert_ok(f"dtype/{form}_complex64")


@pytest.mark.parallel
@pytest.mark.parametrize("np", RANK_COUNTS)
def test_sparse_tensor_raises_before_communication(parallel_jobs, np):
    errors(parallel_jobs, np).assert_ok("dtype/allreduce_sparse")


@pytest.mark.parallel
@pytest.mark.parametrize("np, case", cases(BOOL_OPS))
def test_sum_average_and_scaling_of_bool_raise(parallel_jobs, np, case):
    errors(parallel_jobs, np).assert_ok(f"bool/{case}")


@pytest.mark.parallel
@pytest.mark.parametrize("np, case", cases(PROCESS_SET_MISUSE))
def test_unregistered_or_malformed_process_set_raises(parallel_jobs, np, case):
    errors(parallel_jobs, np).assert_ok(f"process_set/{case}")


@pytest.mark.parallel
@pytest.mark.parametrize("np, form", cases(NON_MEMBER_FORMS))
def test_collective_on_a_process_set_without_the_caller_raises(parallel_jobs, np, form):
    report = errors(parallel_jobs, np)
    report.assert_ok("process_set/register_partial")
    report.assert_ok(f"process_set/non_member/{form}")


@pytest.mark.parallel
@pytest.mark.parametrize("np, case", cases(MISMATCHES))
def test_mismatched_arguments_raise_on_every_rank_naming_each_value(parallel_jobs, np, case):
    record = errors(parallel_jobs, np).assert_ok(f"mismatch/{case}")
    assert record["seconds"] < MISMATCH_LIMIT_S, (
        f"mismatch/{case} took {record['seconds']:.1f} s on the slowest rank")


@pytest.mark.parallel
@pytest.mark.parametrize("np", RANK_COUNTS)
def test_errors_job_reports_every_check_and_ends_quickly(parallel_jobs, np):
    report = errors(parallel_jobs, np)
    report.assert_complete(expected_checks())
    assert report.seconds < JOB_LIMIT_S, f"{report.label} took {report.seconds:.0f} s"


# -- before init (this process, no launcher) --------------------------------------------------
BEFORE_INIT = {
    "allreduce": lambda: hvd.allreduce(torch.ones(2)),
    "allreduce_": lambda: hvd.allreduce_(torch.ones(2)),
    "allreduce_async": lambda: hvd.allreduce_async(torch.ones(2)),
    "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(2)]),
    "allgather": lambda: hvd.allgather(torch.ones(2)),
    "broadcast": lambda: hvd.broadcast(torch.ones(2), root_rank=0),
    "broadcast_": lambda: hvd.broadcast_(torch.ones(2), root_rank=0),
    "alltoall": lambda: hvd.alltoall(torch.ones(2)),
    "reducescatter": lambda: hvd.reducescatter(torch.ones(2)),
    "barrier": lambda: hvd.barrier(),
    "rank": hvd.rank, "size": hvd.size, "local_rank": hvd.local_rank,
    "local_size": hvd.local_size, "cross_rank": hvd.cross_rank, "cross_size": hvd.cross_size,
    "add_process_set": lambda: hvd.add_process_set([0]),
}


@pytest.mark.parametrize("call", list(BEFORE_INIT))
def test_call_before_init_raises_not_initialized(call):
    if hvd.is_initialized():
        pytest.skip("another test in this process left psrt initialised")
    with pytest.raises(psrt.NotInitializedError, match="init"):
        BEFORE_INIT[call]()
