"""Context and expert parallelism at 2 and 4 ranks.

CP: ring attention against full attention (causal and not), a block with CP × TP against
one process, the grid's CP sets, bad sequences and layouts.  EP: the MoE layer against one
process on every rank's tokens (top-1/2, dropless and with capacity), with DP (expert
gradients over the expert-data-parallel set) and TP-split experts, MoE layers in a pipeline
of 1, 2 and 4 micro-batches (the aux loss shared out over them), and bad input (MoE with
sequence parallelism over TP > 1 refused).
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel


def cp_checks(n: int) -> list[str]:
    return (["grid/cp_sets"] + [f"ring/{kind}/tokens{length}" for kind in ("causal", "full")
                                for length in (2 * n, 8 * n)]
            + (["block/cp2_tp2_matches_one_process"] if n == 4 else []) + ["errors/bad_sequences_and_layouts"])


def ep_checks(n: int) -> list[str]:
    routing = [f"moe/top{k}/{mode}" for k in (1, 2) for mode in ("dropless", "capacity1", "capacity0.5")]
    four = ["moe/ep2_dp4/expert_gradients_over_edp", "moe/ep2_tp2/tensor_parallel_experts"] if n == 4 else []
    pipeline = [f"moe/pp2/aux_loss/microbatches{m}/{reduction}" for m in (1, 2, 4) for reduction in ("mean", "sum")]
    return routing + four + pipeline + ["errors/bad_layouts_and_inputs"]


@pytest.mark.parametrize("script,checks", [("cp_check.py", cp_checks), ("ep_check.py", ep_checks)])
@pytest.mark.parametrize("np", [2, 4])
def test_every_check_passes_on_every_rank(parallel_jobs, script, checks, np):
    job = parallel_jobs.get(script, np)
    for check in checks(np):
        job.assert_ok(check)
    job.assert_complete(checks(np))
