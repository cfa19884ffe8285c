"""Tensor and pipeline parallelism: each TP layer and each pipeline schedule against one
process at 2 and 4 ranks, the tiny GPT on DP × TP × PP layouts against one process, and its
elastic commit restored on another layout."""
from __future__ import annotations

import pytest

from conftest import launch

pytestmark = pytest.mark.parallel

TP_CHECKS = ["grid/coordinates_sets_and_neighbours"] + [
    f"{name}/gather_output_{gather}" for name in ("column",) for gather in (False, True)] + [
    "row/input_is_parallel_False", "row/input_is_parallel_True", "embedding/padded_vocabulary",
    "mlp/matches_torch_nn", "attention/matches_torch_nn", "block/matches_torch_nn",
    "column/sequence_parallel/gather_output_False", "row/sequence_parallel/input_is_parallel_True",
    "embedding/sequence_parallel/padded_vocabulary", "mlp/sequence_parallel/matches_torch_nn",
    "attention/sequence_parallel/matches_torch_nn", "block/sequence_parallel/matches_torch_nn",
    "block/without_shape_check/matches_torch_nn",
    "cross_entropy/padded_vocabulary_three_all_reduces", "errors/bad_layouts",
    "errors/mismatched_inputs_across_tp_ranks", "concurrency/engine_and_tp_share_a_set",
    "concurrency/tp_starts_while_the_engine_is_busy", "rng/tracker_streams_per_rank_inside_shared_outside",
    "errors/dropout_and_recompute_arguments"] + [
    f"{name}{suffix}" for suffix in ("", "/sequence_parallel") for name in (
        "rng/block_dropout_masks", "rng/residual_dropout_matches_single_process")] + [
    f"recompute/{mode}{suffix}/matches_keeping_activations" for mode in ("full", "selective")
    for suffix in ("", "/sequence_parallel")] + [
    f"recompute/full{suffix}/split_backward_recomputes_once_per_half" for suffix in ("", "/sequence_parallel")]


def pp_checks(p: int) -> list[str]:
    return ([f"match/{schedule}/m{m}" for schedule in ("gpipe", "1f1b", "zb-h1") for m in (1, 2, 3, 4, 8)]
            + [f"match/interleaved/v2/m{m}" for m in (p, 2 * p)]
            + ["match/1f1b/m4/recompute_full", "match/interleaved/v2/recompute_full",
               "memory/full_recompute_keeps_less"]
            + ["match/mean_loss", "match/frozen_first_block", "memory/activations_follow_in_flight",
               "split/explicit", "errors/bad_inputs", "errors/wrong_messages"])


GPT_CHECKS = ["gpt/dp1_tp2_pp2/1f1b", "gpt/dp2_tp1_pp2/gpipe", "gpt/dp2_tp2_pp1/1f1b", "gpt/dp1_tp1_pp4/1f1b",
              "gpt/dp1_tp2_pp2/1f1b/sequence_parallel", "gpt/dp2_tp2_pp1/zero1", "gpt/dp2_tp1_pp2/interleaved_v2",
              "gpt/dp2_tp2_pp1/overlapped_allreduce", "gpt/dp2_tp1_pp2/overlapped_allreduce",
              "gpt/dp1_tp2_pp2/interleaved_v2/sequence_parallel", "gpt/dp1_tp2_pp2/1f1b/recompute_full",
              "gpt/dp2_tp2_pp1/1f1b/recompute_selective/sequence_parallel", "gpt/dp1_tp2_pp2/zb-h1/sequence_parallel",
              "gpt/dp2_tp1_pp2/zb-h1/overlapped_allreduce", "gpt/dp1_tp2_pp2/zb-h1/recompute_full",
              "gpt/dp1_tp1_pp2_cp2/1f1b", "gpt/dp2_tp1_pp1_cp2/1f1b", "gpt/dp1_tp2_pp1_cp2/1f1b/sequence_parallel",
              "gpt/dp2_tp1_pp2_ep2/1f1b", "gpt/dp2_tp2_pp1_ep2/1f1b", "gpt/dp4_tp1_pp1_ep2/1f1b",
              "gpt/dp1_tp2_pp2/1f1b/tied_embeddings", "gpt/dp2_tp1_pp2/zb-h1/tied_embeddings/overlapped_allreduce",
              "gpt/dp1_tp1_pp4/gpipe/tied_embeddings", "gpt/dp2_tp1_pp2/interleaved_v2/tied_embeddings/zero1"]
COMMIT_CHECKS = ["checkpoint/sharded_commit/dp2_tp1_pp2_ep2_to_dp2_tp2_pp1/experts/tied_embeddings",
                 "checkpoint/sharded_commit/dp1_tp2_pp2_to_dp1_tp4_pp1/memory"]


@pytest.mark.parametrize("check", TP_CHECKS)
@pytest.mark.parametrize("np", [2, 4])
def test_tensor_parallel_matches_torch_nn(parallel_jobs, np, check):
    parallel_jobs.get("tp_check.py", np).assert_ok(check)


@pytest.mark.parametrize("check", pp_checks(2))
def test_pipeline_matches_unsplit_model_at_pp2(parallel_jobs, check):
    parallel_jobs.get("pp_check.py", 2).assert_ok(check)


@pytest.mark.parametrize("check", pp_checks(4))
def test_pipeline_matches_unsplit_model_at_pp4(parallel_jobs, check):
    parallel_jobs.get("pp_check.py", 4).assert_ok(check)


@pytest.mark.parametrize("check", GPT_CHECKS)
def test_tiny_gpt_follows_single_process_on_every_layout(parallel_jobs, check):
    parallel_jobs.get("gpt_check.py", 4).assert_ok(check)


@pytest.mark.parametrize("check", COMMIT_CHECKS)
def test_an_elastic_commit_of_the_gpt_restores_on_another_layout_holding_only_its_part(parallel_jobs, check):
    parallel_jobs.get("gpt_check.py", 4).assert_ok(check)


@pytest.mark.parametrize("script,np,expected", [
    ("tp_check.py", 2, TP_CHECKS), ("tp_check.py", 4, TP_CHECKS), ("pp_check.py", 2, pp_checks(2)),
    ("pp_check.py", 4, pp_checks(4)), ("gpt_check.py", 4, GPT_CHECKS + COMMIT_CHECKS)])
def test_jobs_report_every_check_and_end_cleanly(parallel_jobs, script, np, expected):
    parallel_jobs.get(script, np).assert_complete(expected)


@pytest.mark.parametrize("mode,waiting", [
    ("tp_stall", "tensor-parallel all_reduce on rank 0 over ProcessSet("),
    ("pp_stall", "pipeline rank 0's receive of micro-batch 0 from virtual stage 1 from pipeline rank 1")])
def test_a_stalled_peer_is_reported_and_ends_the_job(mode, waiting):
    report = launch("tp_pp_failures.py", 2, {"PSRT_STALL_CHECK_TIME": "1", "PSRT_STALL_SHUTDOWN_TIME": "3"},
                    args=(mode,), timeout_s=90)
    assert report.returncode not in (0, None), report.diagnosis()
    assert report.seconds < 60, f"the stalled job took {report.seconds:.0f} s to end"
    everything = report.stderr + report.log  # psrun shows the blamed rank; the reporter's report is in its log
    assert waiting in everything and "PSRT_STALL_SHUTDOWN_TIME=3 s" in everything, report.diagnosis()
    assert "psrun: rank 1 is to blame: answers but never came" in report.stderr, report.diagnosis()
    assert "RESULT" not in report.stdout, report.diagnosis()
