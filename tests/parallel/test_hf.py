"""Hugging Face GPT-2 and Llama-layout models split by ``tp.parallelize`` and ``pp.split``,
trained on (dp, tp, pp) layouts at 2 and 4 ranks, against the unmodified model in one
process; checkpoints moved between layouts and into ``transformers``; the errors made
before any communication (the checks are in ``scripts/hf_check.py``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from _hf_layouts import expected  # noqa: E402  (plain data: the names of the script's checks)

pytestmark = pytest.mark.parallel


@pytest.mark.parametrize("check", expected(2))
def test_split_hf_models_match_one_process_at_2_ranks(parallel_jobs, check):
    parallel_jobs.get("hf_check.py", 2).assert_ok(check)


@pytest.mark.parametrize("check", expected(4))
def test_split_hf_models_match_one_process_at_4_ranks(parallel_jobs, check):
    parallel_jobs.get("hf_check.py", 4).assert_ok(check)


@pytest.mark.parametrize("np", [2, 4])
def test_hf_jobs_report_every_check_and_end_cleanly(parallel_jobs, np):
    parallel_jobs.get("hf_check.py", np).assert_complete(expected(np))
