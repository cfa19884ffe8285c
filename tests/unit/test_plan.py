"""The layout planner in one process: its formulas against the papers' and against psrt's own
accounting, the search, the explanations of bad input, the machine profile and the CLI.
(The measured comparisons at 2 ranks are tests/parallel/test_plan_reality.py.)"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import psrt.torch as hvd
from psrt import plan
from psrt.cli import main as psrt_main
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.plan import cli as plan_cli
from psrt.plan.cost import allreduce
from psrt.plan.memory import in_flight, layer_activations, model_state
from psrt.plan.units import format_bytes, parse_bytes
from psrt.zero import expected_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from tiny_gpt import GPTConfig, batch, build_blocks, build_trainer, corpus, train_step  # noqa: E402

GPT = plan.Transformer(layers=4, hidden=64, heads=4, vocab=88, sequence_length=64)
FP32, BF16 = plan.precision("fp32"), plan.precision("bf16")


def layout(**changes) -> plan.Layout:
    values = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "zero": 0, "micro_batch": 4, "micro_batches": 4}
    values.update(changes)
    return plan.Layout(**values)


def ideal_machine(**changes) -> plan.Machine:
    """Free compute and latency, 1 byte/s links: every second is a byte moved."""
    values = {"name": "ideal", "measured": False, "matmul": ((1, 1e30),), "attention": ((1, 1e30),),
              "layer_overhead_s": 0.0, "tp_layer_overhead_s": 0.0, "sp_layer_overhead_s": 0.0,
              "elementwise_s_per_byte": 0.0, "engine_allreduce": plan.Link(0.0, 1.0),
              "direct_allreduce": plan.Link(0.0, 1.0), "p2p": plan.Link(0.0, 1.0), "optimizer_s_per_param": 0.0,
              "memcpy_bandwidth": 1e30}
    values.update(changes)
    return plan.Machine(**values)


# -- the model's shapes against psrt's blocks ----------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_parameter_counts_match_the_tiny_gpts_blocks(tie):
    config = GPTConfig(vocab_size=88, sequence_length=64, dim=64, heads=4, layers=3, tie_embeddings=tie)
    blocks = build_blocks(config)
    model = plan.from_config(config)
    seen, counts = set(), []
    for block in blocks:
        counts.append(sum(p.numel() for p in block.parameters() if id(p) not in seen))
        seen.update(id(p) for p in block.parameters())
    assert model.block_params(1) == counts and model.params == sum(counts)


def test_a_module_is_known_by_its_blocks_parameter_counts():
    mlp = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)], torch.nn.ReLU())
    model = plan.from_module(mlp)
    assert model.sizes == (32 * 33,) * 3 and model.largest == 32 * 33 and model.params == 3 * 32 * 33


# -- memory: the papers' formulas, and what psrt holds -------------------------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name, p, g, k", [("fp32", 4, 4, 8), ("bf16", 2, 2, 12)])
def test_model_state_is_zeros_formula(stage, name, p, g, k):
    params, ranks = 6_000_000, 4
    want = expected_bytes(stage, params, ranks, param_bytes=p, grad_bytes=g, optimizer_bytes=k)
    got = model_state(params, layout(dp=ranks, zero=stage), plan.precision(name))
    assert got == (want["params"], want["grads"], want["optimizer"])


def test_sixteen_bit_layer_activations_with_dropout_are_korthikantis():
    """sbh(34 + 5as/h) without recomputation, 34sbh selective, 2sbh full (Korthikanti et al. 2022);
    psrt also keeps the LayerNorms' fp32 statistics (16bs bytes) and the causal mask (s² bytes)."""
    model = plan.Transformer(layers=1, hidden=256, heads=8, vocab=100, sequence_length=512, dropout=True)
    s, b, h, a = 512, 2, 256, 8
    lay = layout(micro_batch=b)
    stats, mask = 16 * b * s, s * s
    assert layer_activations(model, lay, 2, "none") == s * b * h * (34 + 5 * a * s / h) + stats + mask
    assert layer_activations(model, lay, 2, "selective") == 34 * s * b * h + stats
    assert layer_activations(model, lay, 2, "full") == 2 * s * b * h


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallelism_divides_all_but_the_gathered_linear_inputs(t):
    """Korthikanti's 34sbh/t with TP and SP, plus psrt's 2 whole-sequence linear inputs (2 × 2sbh
    in 16 bits) where Megatron keeps only the local block."""
    model = plan.Transformer(layers=1, hidden=256, heads=8, vocab=100, sequence_length=512, dropout=True)
    s, b, h = 512, 2, 256
    lay = layout(tp=t, micro_batch=b, sequence_parallel=True)
    want = 34 * s * b * h / t + 2 * 2 * s * b * h * (1 - 1 / t) + 16 * b * s / t
    assert layer_activations(model, lay, 2, "selective") == want


def test_without_dropout_the_fused_attention_keeps_only_its_log_sum_exp():
    s, b, a = 64, 4, 4
    lay = layout(micro_batch=b)
    none, selective = layer_activations(GPT, lay, 4, "none"), layer_activations(GPT, lay, 4, "selective")
    assert none - selective == b * a * s * 4


def test_1f1b_keeps_p_minus_stage_microbatches():
    lay = layout(pp=4, micro_batches=8)
    assert [in_flight(stage, lay) for stage in range(4)] == [4, 3, 2, 1]
    assert [in_flight(stage, layout(pp=4, micro_batches=2)) for stage in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("config", [{}, {"recompute": "full"}, {"recompute": "selective"},
                                    {"dropout": 0.1}, {"dropout": 0.1, "recompute": "selective"}])
def test_activations_match_a_one_stage_pipelines_profile(config):
    """In one process: the tiny GPT's Pipeline measures what the planner predicts, to the byte."""
    data, alphabet = corpus()
    cfg = GPTConfig(vocab_size=len(alphabet), sequence_length=32, dim=32, heads=4, layers=2, **config)
    hvd.init()
    try:
        grid = plan_grid()
        trainer = build_trainer(cfg, grid, microbatches=2)
        train_step(trainer, *batch(data, 8, cfg.sequence_length, torch.Generator().manual_seed(0)))
        measured = trainer.pipeline.profile.peak_activation_bytes
        grid.free()
    finally:
        hvd.shutdown()
    lay = layout(micro_batch=4, micro_batches=2, recompute=config.get("recompute") or "none")
    predicted = plan.evaluate(plan.from_config(cfg), lay, global_batch=8, machine=plan.default_machine(),
                              precision=FP32)
    assert measured == predicted.memory.activations


def plan_grid():
    from psrt.grid import ProcessGrid
    return ProcessGrid(dp=1, tp=1, pp=1)


# -- step time: the bubble and each strategy's communication volume --------------------------------
def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    machine = ideal_machine(matmul=((1, 1e9),), p2p=plan.Link(0.0, 1e30))
    for p, m in ((2, 4), (4, 8), (4, 1)):
        model = plan.ParameterBlocks.uniform(4_000_000, 8)
        time = plan.evaluate(model, layout(pp=p, micro_batch=1, micro_batches=m), global_batch=m, machine=machine,
                             precision=FP32).time
        assert time.bubble / (time.compute + time.bubble) == pytest.approx((p - 1) / (m + p - 1))


def test_data_parallel_volume_per_zero_stage():
    """Stage 0: one ring allreduce, 2(N-1)/N of the gradients; stage 1: reduce-scatter and
    all-gather, the same volume; stage 2: a reduce-scatter per micro-batch; stage 3: per
    micro-batch, two gathers of the parameters and a reduce-scatter of the gradients."""
    model, n, m = plan.ParameterBlocks.uniform(1_000_000, 1), 4, 3
    grads = 4 * 1_000_000
    ring = (n - 1) / n * grads
    want = {0: 2 * ring, 1: 2 * ring, 2: m * ring + ring, 3: m * 3 * ring}
    for stage, volume in want.items():
        time = plan.evaluate(model, layout(dp=n, zero=stage, micro_batch=1, micro_batches=m), global_batch=n * m,
                             machine=ideal_machine(), precision=FP32).time
        assert time.dp_comm == pytest.approx(volume), stage


def test_tensor_parallelism_runs_four_allreduces_per_layer_and_microbatch():
    t, b, m = 2, 4, 2
    activation = b * 64 * 64 * 4
    lay = layout(tp=t, micro_batch=b, micro_batches=m)
    time = plan.evaluate(GPT, lay, global_batch=b * m, machine=ideal_machine(), precision=FP32).time
    per_microbatch = (4 * GPT.layers + 2) * allreduce(plan.Link(0.0, 1.0), activation, t) \
        + 3 * allreduce(plan.Link(0.0, 1.0), 4 * b, t)  # the cross-entropy's 3 small ones
    assert time.tp_comm == pytest.approx(m * per_microbatch)
    full = plan.evaluate(GPT, layout(tp=t, micro_batch=b, micro_batches=m, recompute="full"), global_batch=b * m,
                         machine=ideal_machine(), precision=FP32).time
    assert full.tp_comm - time.tp_comm == pytest.approx(m * 2 * GPT.layers * allreduce(plan.Link(0.0, 1.0),
                                                                                        activation, t))


def test_full_recomputation_costs_a_third_forward():
    machine = ideal_machine(matmul=((1, 1e9),), attention=((1, 1e9),), elementwise_s_per_byte=1e-9)
    none = plan.evaluate(GPT, layout(), global_batch=16, machine=machine, precision=FP32).time.compute
    full = plan.evaluate(GPT, layout(recompute="full"), global_batch=16, machine=machine, precision=FP32).time.compute
    assert full / none == pytest.approx(4 / 3)


# -- the search ----------------------------------------------------------------------------------
def test_layouts_fit_and_come_fastest_first():
    plans = plan.layouts(GPT, global_batch=16, ranks=4, memory_per_rank="6MiB")
    assert plans and all(p.memory.total <= 6 << 20 for p in plans)
    shown = [float(f"{p.time.total:.3g}") for p in plans]  # equal as the table shows them: a tie
    assert shown == sorted(shown)
    assert all(a.memory.total <= b.memory.total for a, b, t, u in zip(plans, plans[1:], shown, shown[1:]) if t == u)
    assert all(p.layout.ranks == 4 and p.layout.dp * p.layout.micro_batch * p.layout.micro_batches == 16
               for p in plans)
    assert len({p.layout for p in plans}) == len(plans)


def test_pinned_choices_are_kept():
    plans = plan.layouts(GPT, global_batch=16, ranks=4, memory_per_rank="1GiB", tp=2, zero=1, recompute="full")
    assert plans and all((p.layout.tp, p.layout.zero, p.layout.recompute) == (2, 1, "full") for p in plans)


def test_context_parallelism_is_searched_only_when_asked():
    assert all(p.layout.cp == 1 for p in plan.layouts(GPT, global_batch=16, ranks=4, memory_per_rank="1GiB"))
    assert any(p.layout.cp > 1 for p in plan.layouts(GPT, global_batch=16, ranks=4, memory_per_rank="1GiB",
                                                     cp=None))


def test_a_tiny_gpt_config_and_a_module_are_accepted():
    config = GPTConfig(vocab_size=88, sequence_length=64, dim=64, heads=4, layers=4)
    assert plan.layouts(config, global_batch=16, ranks=2, memory_per_rank="1GiB")
    module = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    plans = plan.layouts(module, global_batch=8, ranks=2, memory_per_rank="1GiB")
    assert plans and all(p.layout.tp == 1 and p.memory.activations == 0 for p in plans)


# -- bad input: why nothing fits and what would ------------------------------------------------------
def test_a_tp_size_that_does_not_divide_the_heads_is_explained():
    with pytest.raises(plan.NothingFitsError, match=r"tp=3 does not divide the 4 attention heads") as caught:
        plan.layouts(GPT, global_batch=18, ranks=6, memory_per_rank="1GiB", tp=3)
    assert "Would run: without tp=3" in str(caught.value)


def test_more_pipeline_stages_than_blocks_is_explained():
    with pytest.raises(plan.NothingFitsError, match=r"pp=8: more pipeline stages than the model's 6 blocks"):
        plan.layouts(GPT, global_batch=16, ranks=8, memory_per_rank="1GiB", pp=8)


def test_ranks_that_the_pinned_sizes_do_not_divide_are_explained():
    with pytest.raises(plan.NothingFitsError, match=r"6 ranks cannot be laid out as tp=4"):
        plan.layouts(GPT, global_batch=12, ranks=6, memory_per_rank="1GiB", tp=4)


def test_too_little_memory_names_the_smallest_layout_and_what_would_fit():
    with pytest.raises(plan.NothingFitsError) as caught:
        plan.layouts(GPT, global_batch=16, ranks=2, memory_per_rank="1MiB")
    message, smallest = str(caught.value), caught.value.smallest
    assert smallest is not None and smallest.memory.total > 1 << 20
    assert f"needs {format_bytes(smallest.memory.total)} per rank" in message
    assert "dominate" in message and "Would fit: with 4 ranks" in message


def test_a_pinned_knob_that_keeps_anything_from_fitting_is_named():
    with pytest.raises(plan.NothingFitsError, match=r"Would fit: without recompute=none") as caught:
        plan.layouts(GPT, global_batch=64, ranks=1, memory_per_rank="30MiB", recompute="none", micro_batch=64)
    assert "activations" in str(caught.value).lower()


@pytest.mark.parametrize("kwargs, error", [
    ({"global_batch": "16"}, ArgumentTypeError), ({"ranks": 0}, InvalidArgumentError),
    ({"memory_per_rank": "lots"}, InvalidArgumentError), ({"memory_per_rank": [1]}, ArgumentTypeError),
    ({"zero": 4}, InvalidArgumentError), ({"recompute": "some"}, InvalidArgumentError),
    ({"tp": 1.5}, ArgumentTypeError), ({"precision": "fp8"}, InvalidArgumentError),
    ({"machine": 42}, ArgumentTypeError), ({"model": 42}, ArgumentTypeError)])
def test_wrong_arguments_raise_before_any_search(kwargs, error):
    arguments = {"model": GPT, "global_batch": 16, "ranks": 2, "memory_per_rank": "1GiB"}
    arguments.update(kwargs)
    with pytest.raises(error):
        plan.layouts(arguments.pop("model"), **arguments)


def test_a_transformer_with_impossible_shapes_is_refused():
    with pytest.raises(InvalidArgumentError, match=r"hidden size \(64\) is not divisible by the number of heads"):
        plan.Transformer(layers=2, hidden=64, heads=6, vocab=10, sequence_length=8)


# -- sizes, the machine profile ----------------------------------------------------------------------
@pytest.mark.parametrize("text, value", [("16GiB", 16 << 30), ("16G", 16 << 30), ("80GB", 80 * 10 ** 9),
                                         ("1.5 MiB", 3 << 19), ("512", 512), (2048, 2048)])
def test_sizes_are_read_as_people_write_them(text, value):
    assert parse_bytes(text) == value


def test_a_link_is_fitted_from_measured_points():
    link = plan.Link.fit([(v, 50e-6 + v / 2e9) for v in (4e3, 64e3, 1e6, 8e6)])
    assert link.latency_s == pytest.approx(50e-6) and link.bandwidth == pytest.approx(2e9)


def test_matmul_rates_are_interpolated_in_log_log():
    machine = ideal_machine(matmul=((64, 1e9), (256, 4e9)))
    assert machine.flops(128) == pytest.approx(2e9) and machine.flops(8) == 1e9 and machine.flops(4096) == 4e9


def test_a_profile_survives_its_json_file(tmp_path):
    path = tmp_path / "machine.json"
    path.write_text(plan.default_machine().to_json())
    assert plan.load_machine(str(path)) == plan.default_machine()
    path.write_text('{"name": "x"}')
    with pytest.raises(InvalidArgumentError, match="not a psrt machine profile"):
        plan.load_machine(str(path))


# -- the command line ----------------------------------------------------------------------------------
TINY = ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--vocab", "88", "--seq", "64", "--batch", "16"]


def test_the_cli_prints_a_ranked_table(capsys):
    assert psrt_main(TINY + ["--ranks", "2", "--memory", "1GiB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "machine: default profile (NOT measured here" in out and "run `psrt plan --measure`" in out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert [line.split()[0] for line in lines[start + 1:start + 4]] == ["1", "2", "3"] and not lines[start + 5]
    assert lines[start + 4].startswith("step times from the machine profile: default profile (NOT measured here")
    assert out.count("\nlayout ") == 1


def test_the_cli_writes_json(capsys):
    assert psrt_main(TINY + ["--ranks", "2", "--memory", "1GiB", "--json", "--tp", "2"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["layout"]["tp"] == 2 and p["total_bytes"] <= 1 << 30 for p in plans)


def test_the_cli_explains_why_nothing_fits(capsys):
    assert psrt_main(TINY + ["--ranks", "2", "--memory", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psrt: error: nothing fits in 1 MiB per rank") and "Would fit: with 4 ranks" in err


def test_the_cli_asks_for_a_model(capsys):
    assert psrt_main(["plan", "--batch", "16", "--ranks", "2", "--memory", "1GiB"]) == 2
    assert "describe the model" in capsys.readouterr().err


def test_measure_runs_the_probe_under_psrun(monkeypatch, tmp_path, capsys):
    ran = []

    def fake_run(command, **kwargs):
        ran.append(command)
        (tmp_path / "m.json").write_text(plan.default_machine().to_json())
        return type("Done", (), {"returncode": 0, "stderr": ""})()
    monkeypatch.setattr(plan_cli.probe_job.subprocess, "run", fake_run)
    out = str(tmp_path / "m.json")
    assert psrt_main(["plan", "--measure", "--profile-out", out, "--probe-ranks", "2"]) == 0
    assert ran[0][1:6] == ["-m", "launcher.cli", "-np", "2", sys.executable]
    assert ran[0][6:] == ["-m", "psrt.plan.probe", "--out", out]
    assert psrt_main(TINY + ["--ranks", "2", "--memory", "1GiB", "--machine", out]) == 0


def test_a_transformers_config_is_planned_and_its_calls_emitted(tmp_path, capsys):
    """``--hf-config`` reads the shapes of a Llama-layout config (its gated MLP as SwiGLU), and the
    recommended layout comes with the tp.parallelize / pp.split calls."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=4,
                num_attention_heads=4).save_pretrained(str(tmp_path))
    model = plan.from_hf_config(str(tmp_path), 32)
    assert (model.layers, model.hidden, model.heads, model.vocab, model.ffn_hidden, model.swiglu) == \
        (4, 64, 4, 1000, 172, True)
    psrt_main(["plan", "--hf-config", str(tmp_path), "--seq", "32", "--batch", "8", "--ranks", "4",
               "--memory", "1GiB", "--tp", "2", "--pp", "2", "--zero", "0"])
    out = capsys.readouterr().out
    assert "grid = ProcessGrid(dp=1, tp=2, pp=2)" in out
    assert "tp.parallelize(model, grid.tp_set, sequence_parallel=True)" in out
    assert "stage = pp.split(model, grid.pp_set, split=[2, 2]" in out
    assert psrt_main(["plan", "--hf-config", str(tmp_path), "--layers", "4", "--seq", "32", "--batch", "8",
                      "--ranks", "4", "--memory", "1GiB"]) == 2
    assert "--hf-config describes the model: give it with --seq only" in capsys.readouterr().err
