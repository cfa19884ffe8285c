"""Context parallelism: ring attention against full attention at CP 2 and 4, a block with
CP × TP against one process, the grid's CP sets and the errors a user can trigger."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.parallel


def cp_checks(n: int) -> list[str]:
    return (["grid/cp_sets"] + [f"ring/{kind}/tokens{length}" for kind in ("causal", "full")
                                for length in (2 * n, 8 * n)]
            + (["block/cp2_tp2_matches_one_process"] if n == 4 else []) + ["errors/bad_sequences_and_layouts"])


@pytest.mark.parametrize("np", [2, 4])
def test_context_parallel_checks_pass_on_every_rank(parallel_jobs, np):
    job = parallel_jobs.get("cp_check.py", np)
    for check in cp_checks(np):
        job.assert_ok(check)
    job.assert_complete(cp_checks(np))
