"""ZeRO stages 0-3: every stage x optimizer x accumulation against one process and allreduce DP
at 2 and 4 ranks, clipping, memory, mixed precision, bad input, and sharded checkpoints
saved at 4 ranks, consolidated, and resumed at 2; a 100 MB one saved at 2 ranks and restored
at 4 within each rank's shard plus the largest tensor of peak memory.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import psrt.checkpoint
from conftest import REPO, SCRIPTS, launch

pytestmark = pytest.mark.parallel

MATCH = [f"match/stage{stage}/{optimizer}/accumulate{accumulation}" for stage in (0, 1, 2, 3)
         for optimizer in ("sgd", "sgd_momentum", "adam") for accumulation in (1, 3)]
OTHER = ["clip/norm_2", "clip/norm_inf", "memory/follows_the_formulas", "memory/stage3_gathers_only_what_runs",
         "recovery/a_backward_that_raised_leaves_no_trace",
         "precision/bf16_tracks_the_fp32_reference", "precision/fp16_overflow_skips_the_step_everywhere",
         "errors/bad_arguments", "errors/parameters_differ_across_ranks", "errors/bad_param_groups",
         "models/stage3_trains_the_tiny_gpt"] + [
         f"tied/stage{stage}/matches_torch" for stage in (1, 2, 3)] + [f"param_groups/stage{stage}/match_torch_and_resume" for stage in (1, 2, 3)]
FOUR_RANKS_ONLY = ["process_sets/two_sets_train_independently"]


def _expected(np: int) -> list[str]:
    return MATCH + OTHER + (FOUR_RANKS_ONLY if np == 4 else [])


@pytest.mark.parametrize("check", MATCH + OTHER)
@pytest.mark.parametrize("np", [2, 4])
def test_zero_check_passes_on_every_rank(parallel_jobs, np, check):
    parallel_jobs.get("zero_check.py", np).assert_ok(check)


def test_zero_over_two_process_sets_at_once(parallel_jobs):
    parallel_jobs.get("zero_check.py", 4).assert_ok(FOUR_RANKS_ONLY[0])


@pytest.mark.parametrize("np", [2, 4])
def test_zero_job_reports_every_check(parallel_jobs, np):
    parallel_jobs.get("zero_check.py", np).assert_complete(_expected(np))


SAVE_CHECKS = ["save/stage1", "save/stage2", "save/stage3", "load/refuses_mismatched_checkpoints",
               "load/two_ranks_save_four_load", "load/fp16_loss_scale_survives_a_resume",
               "load/restore_reads_only_own_slices"]
LOAD_CHECKS = ["load/stage1", "load/stage2", "load/stage3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, parallel_jobs):
    """Sharded checkpoints of stages 1-3 saved by a 4-rank job, and that job's report."""
    root = tmp_path_factory.mktemp("zero-checkpoints")
    return root, parallel_jobs.get("zero_resume.py", 4, args=("save", str(root)))


@pytest.fixture(scope="module")
def resumed(checkpoints):
    """The 2-rank job that loads them and trains on."""
    root, _ = checkpoints
    return launch("zero_resume.py", 2, args=("load", str(root)))


@pytest.mark.parametrize("check", SAVE_CHECKS)
def test_checkpoint_saved_at_4_ranks_consolidates_to_the_live_model_and_the_reference(checkpoints, check):
    checkpoints[1].assert_ok(check)


def test_the_save_job_reports_every_check(checkpoints):
    checkpoints[1].assert_complete(SAVE_CHECKS)


@pytest.mark.parametrize("check", LOAD_CHECKS)
def test_checkpoint_loaded_at_2_ranks_continues_like_the_uninterrupted_reference(resumed, check):
    resumed.assert_ok(check)


def test_the_load_job_reports_every_check(resumed):
    resumed.assert_complete(LOAD_CHECKS)


def test_zero_to_full_writes_an_ordinary_state_dict(checkpoints, tmp_path):
    root, _ = checkpoints
    out = tmp_path / "full.safetensors"
    done = subprocess.run([sys.executable, "-m", "psrt.cli", "zero-to-full", str(root / "stage3"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4 shards, stage 3" in done.stdout, done.stdout
    full = psrt.checkpoint.load_document(str(out))
    sys.path.insert(0, str(SCRIPTS))
    from _zero_common import ZNet
    model = ZNet("any")
    model.load_state_dict(full["model"])  # strict: every entry, right shapes
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.load_state_dict(full["optimizer"])
    assert optimizer.param_groups[0]["weight_decay"] == 0.01 and len(optimizer.state) == 5


def test_zero_to_full_names_a_directory_that_is_not_a_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "psrt.cli", "zero-to-full", str(tmp_path), str(tmp_path / "x.pt")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "zero_meta.json is missing" in done.stderr, done.stderr


GPT2_CHECKS = ["gpt2/stage3/save_consolidate_matches_one_process", "gpt2/stage3/released_parameters_refuse_reads",
               "gpt2/stage3/save_pretrained_writes_each_rank_s_own_parameters"]


@pytest.mark.parametrize("check", GPT2_CHECKS)
def test_zero3_on_hugging_face_gpt2_with_tied_embeddings(parallel_jobs, check):
    """Stage 3 saves the tied GPT-2 and consolidates it like one process, and writes it with
    save_pretrained from the shards for from_pretrained; a released parameter refuses reads by
    name instead of reading freed memory (a segfault before)."""
    report = parallel_jobs.get("zero_gpt2_check.py", 2)
    report.assert_ok(check)
    report.assert_complete(GPT2_CHECKS)
