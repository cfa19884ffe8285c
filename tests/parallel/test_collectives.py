"""Every collective, op and dtype at 2 and 4 ranks, element-wise against numpy.

Three jobs per rank count run ``scripts/collectives_check.py`` (all checks),
the same with ``--ring`` under a tiny ring threshold and segment, and are
launched once each (see ``conftest.py``); each test asserts one check.  Every
rank checks its own output against a numpy reference built from the same
deterministic per-rank inputs.
"""
from __future__ import annotations

import itertools
import os

import pytest

pytestmark = pytest.mark.parallel

RANK_COUNTS = (2, 4)

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32",
          "int64", "bool"]
NUMERIC = DTYPES[:-1]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
RING_ENV = {"PSRT_RING_THRESHOLD": "64", "PSRT_RING_SEGMENT": "64"}


def ops_for(dtype: str) -> list[str]:
    return ["Min", "Max", "Product"] if dtype == "bool" else OPS


def collectives(jobs, np: int):
    return jobs.get("collectives_check.py", np)


def ring(jobs, np: int):
    return jobs.get("collectives_check.py", np, RING_ENV, ("--ring",))


def cases(*axes) -> list:
    """pytest params: every rank count times the product of ``axes`` (each a list or a
    function of the rank count); ids read ``2-float32-Sum``."""
    params = []
    for np in RANK_COUNTS:
        lists = [axis(np) if callable(axis) else axis for axis in axes]
        for combo in itertools.product(*lists):
            flat = [part for item in combo
                    for part in (item if isinstance(item, tuple) else (item,))]
            params.append(pytest.param(np, *flat, id="-".join(map(str, (np, *flat)))))
    return params


# Check names, by test; used both to parametrize and to know what the job must report.
ALLREDUCE = [(d, op) for d in DTYPES for op in ops_for(d)]
SCALED = [(d, op) for d in NUMERIC for op in ("Sum", "Average")]
INPLACE_NONCONTIGUOUS = ["float32", "bfloat16", "int64", "bool"]
ZERO_D = ["float32", "float16", "int64", "bool"]
EMPTY = ["float32", "int32", "float16"]
ALLREDUCE_VARIANTS = ["allreduce_noncontiguous", "allreduce_inplace_slice",
                      "allreduce_default_op_is_average", "allreduce_compression_fp16"]
LARGE = [("allreduce", "float32", "Sum"), ("allreduce", "float64", "Sum"),
         ("allreduce", "float32", "Average"), ("allreduce", "bfloat16", "Average"),
         ("allreduce", "int32", "Max"), ("allreduce_", "float32", "Sum"),
         ("allreduce_async", "float64", "Average")]
ALLGATHER_VARIANTS = ["allgather_1d/float32", "allgather_0d/float32",
                      "allgather_noncontiguous/float32", "allgather_all_empty/int32"]
BROADCAST_FORMS = ["broadcast", "broadcast_inplace"]
BROADCAST_VARIANTS = ["broadcast_0d/int64", "broadcast_empty/float32",
                      "broadcast_inplace_0d/int64", "broadcast_inplace_empty/float32",
                      "broadcast_inplace_noncontiguous/float32"]
ALLTOALL_VARIANTS = ["alltoall_splits_tensor/int32", "alltoall_noncontiguous/float32",
                     "alltoall_one_rank_sends_nothing/float64"]
REDUCESCATTER_ROWS = ["zero", "fewer_than_ranks", "even", "remainder_size_minus_1"]
REDUCESCATTER_VARIANTS = ["reducescatter_scaled/float32", "reducescatter_scaled/float16",
                          "reducescatter_scaled/int32", "reducescatter_noncontiguous/float32",
                          "reducescatter_default_op_is_average/float32"]
PROCESS_SET = ["register", "membership", "allreduce", "grouped_allreduce", "allgather",
               "broadcast", "alltoall", "reducescatter", "barrier_and_async",
               "explicit_global_set", "non_members_raise"]
ASYNC = ["allreduce_async", "allreduce_async_", "allreduce_async_/noncontiguous",
         "allreduce_async/float16_average", "allreduce_async/scaled_average",
         "allreduce_async/int_average", "allreduce_async/bool_min", "grouped_allreduce_async",
         "grouped_allreduce_async_", "allgather_async", "broadcast_async", "broadcast_async_",
         "alltoall_async", "reducescatter_async", "many_outstanding"]
SEGMENT_BOUNDARY = "large_allreduce/allreduce/float32/Sum/4MiB_plus_1"


def expected_collectives(np: int) -> set[str]:
    names = {"topology/single_host", "barrier/waits_for_every_rank", SEGMENT_BOUNDARY, CROWDED}
    names |= {"startup/no_zombie_child"} if os.path.isdir("/proc/self/task") else set()
    names |= {f"allreduce/{d}/{op}" for d, op in ALLREDUCE}
    names |= {f"allreduce_scaled/{d}/{op}" for d, op in SCALED}
    names |= {f"allreduce_inplace/{d}" for d in DTYPES}
    names |= {f"allreduce_inplace_noncontiguous/{d}" for d in INPLACE_NONCONTIGUOUS}
    names |= {f"allreduce_0d/{d}" for d in ZERO_D} | {f"allreduce_empty/{d}" for d in EMPTY}
    names |= set(ALLREDUCE_VARIANTS)
    names |= {f"grouped_allreduce/{op}" for op in OPS}
    names |= {f"grouped_allreduce_scaled/{op}" for op in ("Sum", "Average")}
    names |= {f"grouped_allreduce_inplace/{op}" for op in ("Sum", "Max")}
    names |= {f"large_allreduce/{form}/{d}/{op}" for form, d, op in LARGE}
    names |= {f"allgather/{d}" for d in DTYPES} | set(ALLGATHER_VARIANTS)
    names |= {f"{form}/{d}/root{r}" for form in BROADCAST_FORMS for d in DTYPES for r in range(np)}
    names |= set(BROADCAST_VARIANTS)
    names |= {f"alltoall/{d}" for d in DTYPES} | {f"alltoall_even/{d}" for d in DTYPES}
    names |= set(ALLTOALL_VARIANTS)
    names |= {f"reducescatter/{d}/{op}" for d in NUMERIC for op in ("Sum", "Average")}
    names |= {f"reducescatter_rows/{label}" for label in REDUCESCATTER_ROWS}
    names |= set(REDUCESCATTER_VARIANTS)
    names |= {f"process_set/{name}" for name in PROCESS_SET} | {f"async/{name}" for name in ASYNC}
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
@pytest.mark.parametrize("np", RANK_COUNTS)
def test_a_rank_keeps_no_zombie_child_from_its_start_up(parallel_jobs, np):
    collectives(parallel_jobs, np).assert_ok("startup/no_zombie_child")


# -- allreduce ----------------------------------------------------------------------------
@pytest.mark.parametrize("np", RANK_COUNTS)
def test_one_host_has_local_size_equal_to_size_and_one_cross_rank(parallel_jobs, np):
    collectives(parallel_jobs, np).assert_ok("topology/single_host")


@pytest.mark.parametrize("np, dtype, op", cases(ALLREDUCE))
def test_allreduce_matches_numpy(parallel_jobs, np, dtype, op):
    collectives(parallel_jobs, np).assert_ok(f"allreduce/{dtype}/{op}")


@pytest.mark.parametrize("np, dtype, op", cases(SCALED))
def test_allreduce_applies_prescale_and_postscale(parallel_jobs, np, dtype, op):
    collectives(parallel_jobs, np).assert_ok(f"allreduce_scaled/{dtype}/{op}")


@pytest.mark.parametrize("np, dtype", cases(DTYPES))
def test_allreduce_inplace_reduces_into_the_same_tensor(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"allreduce_inplace/{dtype}")


@pytest.mark.parametrize("np, dtype", cases(INPLACE_NONCONTIGUOUS))
def test_allreduce_inplace_writes_back_into_a_noncontiguous_view(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"allreduce_inplace_noncontiguous/{dtype}")


@pytest.mark.parametrize("np, dtype", cases(ZERO_D))
def test_allreduce_of_a_0d_tensor_is_0d(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"allreduce_0d/{dtype}")


@pytest.mark.parametrize("np, dtype", cases(EMPTY))
def test_allreduce_of_an_empty_tensor_is_empty(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"allreduce_empty/{dtype}")


@pytest.mark.parametrize("np, check", cases(ALLREDUCE_VARIANTS))
def test_allreduce_variant_matches_numpy(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, op", cases(OPS))
def test_grouped_allreduce_of_mixed_dtypes_matches_numpy(parallel_jobs, np, op):
    collectives(parallel_jobs, np).assert_ok(f"grouped_allreduce/{op}")


@pytest.mark.parametrize("np, op", cases(["Sum", "Average"]))
def test_grouped_allreduce_applies_scale_factors(parallel_jobs, np, op):
    collectives(parallel_jobs, np).assert_ok(f"grouped_allreduce_scaled/{op}")


@pytest.mark.parametrize("np, op", cases(["Sum", "Max"]))
def test_grouped_allreduce_inplace_returns_and_fills_its_own_tensors(parallel_jobs, np, op):
    collectives(parallel_jobs, np).assert_ok(f"grouped_allreduce_inplace/{op}")


@pytest.mark.parametrize("np, form, dtype, op", cases(LARGE))
def test_large_allreduce_over_the_ring_threshold_matches_numpy(parallel_jobs, np, form, dtype, op):
    """3 MiB + one element: psrt's ring, with a count divisible by neither 2 nor 4."""
    collectives(parallel_jobs, np).assert_ok(f"large_allreduce/{form}/{dtype}/{op}")


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_large_allreduce_with_whole_segment_ring_blocks_matches_numpy(parallel_jobs, np):
    """4 MiB + one float32 at the default 1 MiB segment: each rank's ring block is a whole
    number of segments, plus one element for the first rank."""
    collectives(parallel_jobs, np).assert_ok(SEGMENT_BOUNDARY)


CROWDED = "waits/crowded_allreduces_nap_and_agree"


@pytest.mark.parametrize("np", RANK_COUNTS)
@pytest.mark.parametrize("job", ["collectives", "ring"])
def test_on_a_crowded_host_large_allreduces_nap_and_still_match_numpy(parallel_jobs, np, job):
    """Every rank takes its host as crowded: the ranks agree to wait for large allreduces by
    napping (MPI's or psrt's ring, by size), and the sums are those of an idle host."""
    (collectives if job == "collectives" else ring)(parallel_jobs, np).assert_ok(CROWDED)


# -- allgather, broadcast, alltoall, reducescatter, barrier ---------------------------------
@pytest.mark.parametrize("np, dtype", cases(DTYPES))
def test_allgather_concatenates_first_dims_that_differ_by_rank(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"allgather/{dtype}")


@pytest.mark.parametrize("np, check", cases(ALLGATHER_VARIANTS))
def test_allgather_variant_matches_numpy(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, form, dtype, root", cases(
    BROADCAST_FORMS, DTYPES, lambda np: [f"root{r}" for r in range(np)]))
def test_broadcast_gives_every_rank_the_roots_tensor(parallel_jobs, np, form, dtype, root):
    collectives(parallel_jobs, np).assert_ok(f"{form}/{dtype}/{root}")


@pytest.mark.parametrize("np, check", cases(BROADCAST_VARIANTS))
def test_broadcast_variant_matches_numpy(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, dtype", cases(DTYPES))
def test_alltoall_with_uneven_splits_delivers_each_block(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"alltoall/{dtype}")


@pytest.mark.parametrize("np, dtype", cases(DTYPES))
def test_alltoall_without_splits_divides_evenly(parallel_jobs, np, dtype):
    collectives(parallel_jobs, np).assert_ok(f"alltoall_even/{dtype}")


@pytest.mark.parametrize("np, check", cases(ALLTOALL_VARIANTS))
def test_alltoall_variant_matches_numpy(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, dtype, op", cases([(d, op) for d in NUMERIC for op in ("Sum", "Average")]))
def test_reducescatter_matches_numpy(parallel_jobs, np, dtype, op):
    collectives(parallel_jobs, np).assert_ok(f"reducescatter/{dtype}/{op}")


@pytest.mark.parametrize("np, rows", cases(REDUCESCATTER_ROWS))
def test_reducescatter_gives_the_first_ranks_the_extra_rows(parallel_jobs, np, rows):
    collectives(parallel_jobs, np).assert_ok(f"reducescatter_rows/{rows}")


@pytest.mark.parametrize("np, check", cases(REDUCESCATTER_VARIANTS))
def test_reducescatter_variant_matches_numpy(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_barrier_releases_no_rank_before_the_last_arrives(parallel_jobs, np):
    collectives(parallel_jobs, np).assert_ok("barrier/waits_for_every_rank")


# -- process sets and async handles -----------------------------------------------------------
@pytest.mark.parametrize("np, check", cases(PROCESS_SET))
def test_process_set_excluding_ranks(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(f"process_set/{check}")


@pytest.mark.parametrize("np, check", cases(ASYNC))
def test_async_form_polls_true_and_synchronizes_once(parallel_jobs, np, check):
    collectives(parallel_jobs, np).assert_ok(f"async/{check}")


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_collectives_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    collectives(parallel_jobs, np).assert_complete(expected_collectives(np))


# -- psrt's ring on small odd sizes (tiny PSRT_RING_THRESHOLD and PSRT_RING_SEGMENT) ----------
RING_VARIANTS = ["ring_allreduce_scaled/float32/Average", "ring_allreduce_scaled/float64/Average",
                 "ring_allreduce_scaled/float16/Average", "ring_allreduce_scaled/int32/Average",
                 "ring_allreduce_inplace_noncontiguous/float32", "ring_grouped_allreduce/Average"]
RING_SIZES = [("float32", n) for n in (16, 17, 33, 63, 65, 129, 1001)] + \
             [("float64", n) for n in (8, 9, 17, 33, 1001)] + \
             [("float16", n) for n in (16, 17, 65, 257)] + \
             [("int8", n) for n in (64, 65, 257)] + [("bool", n) for n in (64, 65, 257)]


def expected_ring(np: int) -> set[str]:
    return ({"ring/config_applied", CROWDED} | {f"ring_allreduce/{d}/{op}" for d, op in ALLREDUCE}
            | set(RING_VARIANTS) | {f"ring_allreduce_sizes/{d}/{n}" for d, n in RING_SIZES})


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_ring_job_reads_the_ring_settings_forwarded_by_psrun(parallel_jobs, np):
    ring(parallel_jobs, np).assert_ok("ring/config_applied")


@pytest.mark.parametrize("np, dtype, op", cases(ALLREDUCE))
def test_ring_allreduce_matches_numpy(parallel_jobs, np, dtype, op):
    ring(parallel_jobs, np).assert_ok(f"ring_allreduce/{dtype}/{op}")


@pytest.mark.parametrize("np, check", cases(RING_VARIANTS))
def test_ring_allreduce_variant_matches_numpy(parallel_jobs, np, check):
    ring(parallel_jobs, np).assert_ok(check)


@pytest.mark.parametrize("np, dtype, count", cases(RING_SIZES))
def test_ring_allreduce_of_small_odd_sizes_matches_numpy(parallel_jobs, np, dtype, count):
    ring(parallel_jobs, np).assert_ok(f"ring_allreduce_sizes/{dtype}/{count}")


@pytest.mark.parametrize("np", RANK_COUNTS)
def test_ring_job_reports_every_check_and_ends_cleanly(parallel_jobs, np):
    ring(parallel_jobs, np).assert_complete(expected_ring(np))
