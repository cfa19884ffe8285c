"""Hierarchical allreduce at 4 ranks (``scripts/hierarchical_check.py``, one job run with
``PSRT_HIERARCHICAL_ALLREDUCE=1``): on made-up hosts of 2+2 and 1+3 ranks it matches the
single-process reference for every op and for float16/bfloat16, other collectives stay
flat, and on the one real host the setting leaves allreduces flat.  Across real hosts:
``tests/multihost/test_hierarchical.py``."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

ENV = {"PSRT_HIERARCHICAL_ALLREDUCE": "1"}
LAYOUTS = ("2+2", "1+3")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32")
OPS = ("Sum", "Average", "Min", "Max", "Product")
REDUCTIONS = [f"hierarchical/{layout}/{dtype}/{op}" for layout in LAYOUTS for dtype in DTYPES for op in OPS
              if not (op == "Average" and dtype == "int32")]
OTHERS = ["hierarchical/other_collectives_go_flat", "hierarchical/no_gain_without_several_hosts_of_several_ranks",
          "hierarchical/one_host_stays_flat"]


def job(parallel_jobs):
    return parallel_jobs.get("hierarchical_check.py", 4, ENV)


@pytest.mark.parametrize("check", REDUCTIONS)
def test_hierarchical_allreduce_matches_single_process(parallel_jobs, check):
    job(parallel_jobs).assert_ok(check)


def test_hierarchical_communicator_leaves_other_collectives_flat(parallel_jobs):
    job(parallel_jobs).assert_ok("hierarchical/other_collectives_go_flat")


def test_hierarchical_needs_several_hosts_some_with_several_ranks(parallel_jobs):
    job(parallel_jobs).assert_ok("hierarchical/no_gain_without_several_hosts_of_several_ranks")


def test_hierarchical_setting_on_one_host_stays_flat(parallel_jobs):
    job(parallel_jobs).assert_ok("hierarchical/one_host_stays_flat")


def test_hierarchical_job_reports_every_check_and_exits_cleanly(parallel_jobs):
    job(parallel_jobs).assert_complete(REDUCTIONS + OTHERS)
