"""Expert parallelism: the MoE layer against one process at EP 2 and 4, with DP (expert
gradients over the expert-data-parallel set) and with TP-split experts, and bad input."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel


def ep_checks(n: int) -> list[str]:
    routing = [f"moe/top{k}/{mode}" for k in (1, 2) for mode in ("dropless", "capacity1", "capacity0.5")]
    four = ["moe/ep2_dp4/expert_gradients_over_edp", "moe/ep2_tp2/tensor_parallel_experts"] if n == 4 else []
    return routing + four + ["errors/bad_layouts_and_inputs"]


@pytest.mark.parametrize("np", [2, 4])
def test_expert_parallel_checks_pass_on_every_rank(parallel_jobs, np):
    job = parallel_jobs.get("ep_check.py", np)
    for check in ep_checks(np):
        job.assert_ok(check)
    job.assert_complete(ep_checks(np))
