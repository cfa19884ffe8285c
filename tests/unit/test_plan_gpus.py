"""The planner on GPU clusters, in one process: the shipped node profiles and their sources,
NVLink inside a node and InfiniBand across, SwiGLU and grouped-query attention, and the
shape and ``--params`` descriptions of one model recommending the same layout."""
from __future__ import annotations

import json

import pytest

from psrt import plan
from psrt.cli import main as psrt_main
from psrt.errors import InvalidArgumentError
from psrt.plan import gpus

LLAMA_8B = plan.Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                            sequence_length=8192)
GPT_1B = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50304"]  # 1.42e9 parameters


# -- the shipped profiles --------------------------------------------------------------------------
@pytest.mark.parametrize("name, flops, hbm, nvlink, nic, memory", [
    ("a100", 312e12, 2.039e12, 600e9, 25e9, 80e9), ("h100", 989e12, 3.35e12, 900e9, 50e9, 80e9),
    ("h200", 989e12, 4.8e12, 900e9, 50e9, 141e9)])
def test_each_profile_holds_the_datasheet_figures_with_their_sources(name, flops, hbm, nvlink, nic, memory):
    data = gpus.figures(name)
    got = {key: data[key]["value"] for key in ("bf16_flops", "hbm_bandwidth", "nvlink_bandwidth", "ib_bandwidth",
                                               "memory", "gpus_per_node")}
    assert got == {"bf16_flops": flops, "hbm_bandwidth": hbm, "nvlink_bandwidth": nvlink, "ib_bandwidth": nic,
                   "memory": memory, "gpus_per_node": 8}
    assert all(entry["source"] for entry in data.values() if isinstance(entry, dict))
    machine = gpus.gpu_machine(name)
    assert machine.ranks_per_node == 8 and machine.memory_per_rank == memory
    assert machine.flops(16384) == pytest.approx(0.68 * flops)  # the measured fraction, said in its source
    assert set(machine.details["sources"]) >= {"bf16_flops", "matmul_fraction", "link_fraction"}


def test_a_machine_is_a_shipped_name_or_a_file(tmp_path):
    assert gpus.resolve("h100") == gpus.gpu_machine("h100")
    path = tmp_path / "m.json"
    path.write_text(plan.default_machine().to_json())
    assert gpus.resolve(str(path)) == plan.default_machine()
    with pytest.raises(InvalidArgumentError, match=r"'b200' is neither a shipped profile \(a100, h100, h200\) nor"):
        gpus.resolve("b200")


def test_a_profile_with_nodes_survives_its_json_file(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(gpus.gpu_machine("h200").to_json())
    assert plan.load_machine(str(path)) == gpus.gpu_machine("h200")


# -- NVLink inside a node, InfiniBand across ------------------------------------------------------------
def test_groups_inside_a_node_use_nvlink_and_groups_across_use_the_nics():
    machine = gpus.gpu_machine("h100")
    nvlink, nic = machine.engine_allreduce, machine.inter_node
    assert machine.group_link(nvlink, 8, 1) == nvlink  # tp8, or dp8 on one node
    assert machine.group_link(nvlink, 4, 2) == nvlink  # dp4 beside tp2
    across = machine.group_link(nvlink, 16, 1)  # dp16 over 2 nodes: 8 rings, one per NIC
    assert across.bandwidth == min(nvlink.bandwidth, 8 * nic.bandwidth) and across.latency_s == nic.latency_s
    assert machine.group_link(nvlink, 4, 8).bandwidth == nic.bandwidth  # dp4 beside tp8: one rank per node
    assert machine.group_link(machine.p2p, 2, 8, messages=True).bandwidth == nic.bandwidth  # a pipeline hop


def test_data_parallel_reduction_slows_when_it_leaves_the_node():
    model = plan.ParameterBlocks.uniform(100_000_000, 4, sequence_length=1024)
    lay = {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "micro_batch": 1, "micro_batches": 1}
    machine, bf16 = gpus.gpu_machine("h100"), plan.precision("bf16")
    one_node = plan.evaluate(model, plan.Layout(dp=8, **lay), global_batch=8, machine=machine, precision=bf16)
    two_nodes = plan.evaluate(model, plan.Layout(dp=16, **lay), global_batch=16, machine=machine, precision=bf16)
    assert two_nodes.time.dp_comm > one_node.time.dp_comm
    assert two_nodes.machine == machine.name


# -- SwiGLU and grouped-query attention ----------------------------------------------------------------
def test_llama_3_1_8b_has_its_8_03_billion_parameters():
    """Hugging Face's meta-llama/Llama-3.1-8B: 8,030,261,248 parameters."""
    assert LLAMA_8B.swiglu and LLAMA_8B.mlp_ratio == 3.5
    assert LLAMA_8B.params == 8_030_261_248
    assert plan.Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, mlp_ratio=3.5, vocab=128256,
                            sequence_length=8192) == LLAMA_8B


def test_a_llama_config_is_read_with_swiglu_and_its_key_value_heads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}))
    assert plan.from_hf_config(str(tmp_path), 8192) == LLAMA_8B


def test_swiglu_flops_are_three_matrices_and_gqa_narrows_k_and_v():
    """Forward products per token and layer: 2 × (q and o: 2h², k and v: 2h·kv·d, MLP: 3hf)."""
    machine = plan.Machine(name="1 FLOP/s", measured=False, matmul=((1, 1.0),), attention=((1, 1e30),),
                           layer_overhead_s=0, tp_layer_overhead_s=0, sp_layer_overhead_s=0,
                           elementwise_s_per_byte=0, engine_allreduce=plan.Link(0, 1), direct_allreduce=plan.Link(0, 1),
                           p2p=plan.Link(0, 1), optimizer_s_per_param=0, memcpy_bandwidth=1)
    model = plan.Transformer(layers=1, hidden=64, heads=8, kv_heads=2, ffn_hidden=96, vocab=10, sequence_length=4)
    from psrt.plan.cost import block_seconds
    lay = plan.Layout(dp=1, tp=1, pp=1, cp=1, zero=0, micro_batch=1, micro_batches=1)
    per_token = 2 * (2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 96)
    assert block_seconds(model, "layer", 0, lay, plan.precision("bf16"), machine) == pytest.approx(3 * 4 * per_token)


def test_a_fractional_mlp_ratio_needs_a_whole_width():
    with pytest.raises(InvalidArgumentError, match=r"not a whole MLP width: give ffn_hidden"):
        plan.Transformer(layers=1, hidden=10, heads=2, vocab=10, sequence_length=4, mlp_ratio=3.55)


def test_the_cli_takes_swiglu_and_gqa_flags(capsys):
    assert psrt_main(["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
                      "--ffn-hidden", "14336", "--vocab", "128256", "--seq", "8192", "--batch", "16", "--ranks", "8",
                      "--machine", "h100", "--precision", "bf16", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "8030 M parameters" in out and "32 heads (8 key/value), SwiGLU MLP 14336" in out
    assert "step times from the machine profile: h100 (published figures" in out


# -- one model, two descriptions, one answer -------------------------------------------------------------
def test_shapes_and_params_recommend_the_same_layout_in_seconds_not_hours(capsys):
    """A 1.4B GPT on 16 H100s (two nodes), given by its shapes and by its parameter count with the
    same layers and sequence: the same best layout, a step of about a second."""
    job = ["--seq", "2048", "--batch", "256", "--ranks", "16", "--machine", "h100", "--precision", "bf16", "--json"]
    best = []
    for model in (GPT_1B, ["--params", "1.42e9", "--layers", "24"]):
        assert psrt_main(["plan", *model, *job]) == 0
        first = json.loads(capsys.readouterr().out)[0]
        best.append(first)
    assert best[0]["layout"] == best[1]["layout"]
    assert all(0.1 < plan_["step_s"] < 10 for plan_ in best)
    assert best[0]["machine"].startswith("h100")


def test_equal_step_times_go_to_the_layout_needing_less_memory():
    plans = plan.layouts(plan.ParameterBlocks.uniform(1_000_000_000, 8, sequence_length=2048), global_batch=16,
                         ranks=8, machine="h100", precision="bf16", micro_batch=2, dp=8)
    zero1, zero2 = (next(p for p in plans if p.layout.zero == z) for z in (1, 2))
    assert zero1.time.total == zero2.time.total and zero2.memory.total < zero1.memory.total
    assert plans.index(zero2) < plans.index(zero1)


def test_params_and_shapes_are_not_mixed(capsys):
    assert psrt_main(["plan", "--params", "1e9", "--hidden", "2048", "--batch", "8", "--ranks", "8",
                      "--machine", "h100"]) == 2
    assert "give either --params (with --layers and --seq) or the transformer's shapes" in capsys.readouterr().err


def test_memory_is_needed_unless_the_machine_says_it(capsys):
    assert psrt_main(["plan", "--params", "1e9", "--batch", "8", "--ranks", "8"]) == 2
    assert "psrt plan needs --memory" in capsys.readouterr().err


def test_an_unknown_machine_name_is_said_before_anything_else_missing(capsys):
    assert psrt_main(["plan", "--params", "1e9", "--layers", "16", "--seq", "1024", "--batch", "8", "--ranks", "8",
                      "--machine", "h999"]) == 2
    assert "--machine 'h999' is neither a shipped profile (a100, h100, h200)" in capsys.readouterr().err
