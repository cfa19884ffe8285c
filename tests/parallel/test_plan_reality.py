"""The layout planner against psrt's measurements at 2 ranks (one job): its bytes per rank
for the ZeRO benchmark model against ``memory_report()`` at every stage, for the tiny GPT on
DP, TP (with and without sequence parallelism), 1F1B pipelines, recomputation and dropout
against the pipeline's measured activation bytes and the stage's parameters, within 10 %;
and the machine probe behind ``psrt plan --measure``."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel

ZERO = [f"zero/stage{stage}/{dtype}/bytes_match_memory_report" for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
GPT = [f"gpt/{name}/bytes_match_the_pipeline_profile" for name in (
    "dp2", "tp2", "tp2_sequence_parallel", "tp2_sequence_parallel_selective", "pp2_1f1b", "pp2_1f1b_full_recompute",
    "dp2_dropout", "dp2_dropout_selective")]
CHECKS = ZERO + GPT + ["probe/measures_a_complete_profile"]


@pytest.mark.parametrize("check", CHECKS)
def test_planner_bytes_match_what_psrt_measures(parallel_jobs, check):
    parallel_jobs.get("plan_reality.py", 2).assert_ok(check)


def test_the_reality_job_ran_every_check(parallel_jobs):
    parallel_jobs.get("plan_reality.py", 2).assert_complete(CHECKS)
