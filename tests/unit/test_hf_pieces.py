"""The parts of applying TP/PP to models psrt did not write that need no second rank: plans
as values, the slices a rank reads, the refusals made before anything changes, the stage's
keys, and checkpoint round trips through ``transformers`` in one process."""
from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import psrt.torch as hvd
from psrt import pp, tp
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.pretrained import load_pretrained, save_pretrained
from psrt.models.tp_styles import resolve
from psrt.tp.sharding import Sharding


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def llama(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**dict(vocab_size=37, hidden_size=16, intermediate_size=24,
                                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
                                           **extra}))


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=37, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def test_the_first_matching_pattern_decides_a_modules_style():
    styles = resolve(llama(), {"model.layers.0.mlp.up_proj": tp.RowWise(), "model.layers.*.mlp.*_proj": tp.ColumnWise()})
    assert styles["model.layers.0.mlp.up_proj"] == tp.RowWise()
    assert styles["model.layers.1.mlp.up_proj"] == tp.ColumnWise()
    assert "model.layers.1.mlp" not in styles


def test_a_plan_naming_no_module_lists_the_nearest_names():
    with pytest.raises(InvalidArgumentError, match=r"(?s)plan entry 'layers.\*.q_proj' matches no module.*"
                                                   r"'model.layers.0.self_attn.q_proj'"):
        resolve(llama(), {"layers.*.q_proj": tp.ColumnWise()})


def test_a_plan_entry_must_be_a_style():
    with pytest.raises(InvalidArgumentError, match="is not a style"):
        resolve(llama(), {"lm_head": "colwise"})


def test_auto_plan_refuses_an_unknown_model_and_lists_its_layers():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    with pytest.raises(InvalidArgumentError, match=r"(?s)does not know this model \(Sequential\).*GPT-2.*"
                                                   r"0: Embedding\(10, 4\).*1: Linear\(4, 4\).*plan=\{"):
        tp.parallelize(model, None)


@pytest.mark.parametrize("full_size,parts,stride", [(37, 2, 1), (37, 4, 1), (48, 2, 3), (12, 3, 1), (8, 4, 2)])
def test_source_ranges_read_exactly_the_block_shard_keeps(full_size, parts, stride):
    full = torch.arange(float(full_size)).unsqueeze(1).expand(full_size, 3)
    for index in range(parts):
        sharding = Sharding(dim=0, parts=parts, index=index, full_size=full_size, stride=stride)
        pieces = []
        for begin, end, length in sharding.source_ranges():
            pieces.append(torch.cat([full[begin:end], torch.zeros(length - (end - begin), 3)]))
        assert torch.equal(torch.cat(pieces), sharding.shard(full))


def test_parallelize_keeps_keys_shapes_and_outputs_with_one_rank():
    for build in (gpt2, llama):
        model, reference = build().eval(), build().eval()  # GPT-2's config keeps dropout
        ids = torch.randint(0, 37, (2, 5))
        tp.parallelize(model, None)
        assert {k: v.shape for k, v in model.state_dict().items()} == \
               {k: v.shape for k, v in reference.state_dict().items()}
        assert torch.allclose(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_gpt2_head_stays_tied_to_the_embedding():
    model = tp.parallelize(gpt2(), None)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.wte, tp.VocabParallelEmbedding)


def test_a_tie_the_plan_would_break_is_refused_before_anything_changes():
    model = gpt2()
    before = model.transformer.wte
    with pytest.raises(InvalidArgumentError, match="lm_head.weight is the same parameter as transformer.wte's"):
        tp.parallelize(model, None, plan={"transformer.wte": tp.VocabEmbedding()})
    assert model.transformer.wte is before and getattr(model, "psrt_tp", None) is None


def test_parallelize_refuses_wrong_arguments():
    with pytest.raises(ArgumentTypeError, match="process_set must be the tensor-parallel ProcessSet"):
        tp.parallelize(llama(), "tp")
    model = tp.parallelize(llama(), None)
    with pytest.raises(InvalidArgumentError, match="already parallelized"):
        tp.parallelize(model, None)
    with pytest.raises(InvalidArgumentError, match="loss_parallel applies to plan='auto'"):
        tp.parallelize(llama(), None, plan={"lm_head": tp.ColumnWise()}, loss_parallel=True)
    with pytest.raises(InvalidArgumentError, match=r"model.norm \(LlamaRMSNorm\): the plan makes it a Linear"):
        tp.parallelize(llama(), None, plan={"model.norm": tp.ColumnWise()})


def test_a_split_stage_has_the_models_keys_and_runs_it():
    model, reference = llama(), llama()
    stage = pp.split(model, hvd.global_process_set)
    assert list(stage.state_dict()) == list(reference.state_dict())
    ids = torch.randint(0, 37, (2, 5))
    assert torch.allclose(stage(ids), reference(input_ids=ids).logits)
    stage.load_state_dict(reference.state_dict())


def test_split_by_named_parts_calls_each_block_on_the_hidden_states():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6)
            self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
            self.head = nn.Linear(6, 11)

    model = Plain()
    stage = pp.split(model, hvd.global_process_set, blocks="blocks", before=["embed"], after=["head"])
    ids = torch.randint(0, 11, (2, 4))
    want = model.head(model.blocks[2](model.blocks[1](model.blocks[0](model.embed(ids)))))
    assert torch.equal(stage(ids), want)
    assert set(stage.state_dict()) == set(model.state_dict())
    with pytest.raises(InvalidArgumentError, match="pp.split does not know this model"):
        pp.split(Plain(), hvd.global_process_set)
    with pytest.raises(InvalidArgumentError, match="the model has no module 'norm'"):
        pp.split(Plain(), hvd.global_process_set, blocks="blocks", before=["embed"], after=["norm"])


def test_a_checkpoint_round_trips_through_transformers(tmp_path):
    model = tp.parallelize(llama(), None)
    save_pretrained(model, str(tmp_path), config=model.config)
    again = LlamaForCausalLM.from_pretrained(str(tmp_path))
    for name, value in llama().state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name
    with torch.device("meta"):
        empty = llama()
    stage = pp.split(tp.parallelize(empty, None), hvd.global_process_set)
    report = load_pretrained(stage, str(tmp_path))
    assert report.bytes_read == report.checkpoint_bytes
    ids = torch.randint(0, 37, (2, 5))
    assert torch.allclose(stage(ids), again(input_ids=ids).logits)


def test_load_names_what_the_checkpoint_lacks(tmp_path):
    with pytest.raises(InvalidArgumentError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_pretrained(llama(), str(tmp_path))
    llama(num_hidden_layers=2).save_pretrained(str(tmp_path))
    with pytest.raises(InvalidArgumentError, match=r"lacks .* entries: \['model.layers.2"):
        load_pretrained(llama(), str(tmp_path))


def test_balance_takes_one_cost_per_block_or_measures():
    stage = pp.split(llama(), hvd.global_process_set, balance=[1.0, 2.0, 3.0])
    assert stage.cut == ((0, 3),)
    with pytest.raises(InvalidArgumentError, match=r"one non-negative cost per block \(3\)"):
        pp.split(llama(), hvd.global_process_set, balance=[1.0, 2.0])
    with pytest.raises(InvalidArgumentError, match="needs sample="):
        pp.split(llama(), hvd.global_process_set, balance="measured")
    with pytest.raises(InvalidArgumentError, match="give split .* or balance, not both"):
        pp.split(llama(), hvd.global_process_set, split=[3], balance=[1.0, 1.0, 1.0])
    measured = pp.split(llama(), hvd.global_process_set, balance="measured", sample=torch.randint(0, 37, (2, 5)))
    assert measured.cut == ((0, 3),) and all(p.grad is None for p in measured.parameters())


def test_blocks_read_from_a_safetensors_file_equal_its_slices(tmp_path):
    from safetensors.torch import save_file

    from psrt.checkpoint.safetensors_reader import SafetensorsReader

    tensors = {"matrix": torch.randn(5, 7, dtype=torch.float64), "cube": torch.randn(3, 4, 6).bfloat16(),
               "scalar": torch.tensor(3, dtype=torch.int64), "flags": torch.tensor([True, False, True])}
    path = str(tmp_path / "t.safetensors")
    save_file(tensors, path)
    with SafetensorsReader(path) as reader:
        assert torch.equal(reader.read("scalar"), tensors["scalar"])
        assert torch.equal(reader.read("flags"), tensors["flags"])
        assert torch.equal(reader.read("flags", 0, 1, 3), tensors["flags"][1:3])
        into = torch.empty(2, 7, dtype=torch.float64)
        assert reader.read("matrix", 0, 1, 3, out=into) is into and torch.equal(into, tensors["matrix"][1:3])
        assert torch.equal(reader.read("scalar", out=torch.empty((), dtype=torch.int64)), tensors["scalar"])
        with pytest.raises(InvalidArgumentError, match=r"cannot read rows of 'matrix' \(\[2, 7\], torch.float64\)"):
            reader.read("matrix", 0, 1, 3, out=torch.empty(2, 7))
        for name in ("matrix", "cube"):
            full = tensors[name]
            for dim in range(full.dim()):
                for begin, end in ((0, 1), (1, full.shape[dim]), (2, 3)):
                    assert torch.equal(reader.read(name, dim, begin, end), full.narrow(dim, begin, end - begin))
        with pytest.raises(InvalidArgumentError, match=r"rows \[4, 9\) of dim 0 are outside tensor 'matrix'"):
            reader.read("matrix", 0, 4, 9)
    with open(path, "r+b") as handle:
        header = int.from_bytes(handle.read(8), "little")
        handle.truncate(8 + header + 8)  # the header whole, the data cut short
    with pytest.raises(InvalidArgumentError, match="is not a valid safetensors file: .*cut short"):
        SafetensorsReader(path)


def _resident_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1)) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak resident memory")
def test_a_block_is_read_without_the_rest_of_its_tensor(tmp_path):
    """1 MiB of rows from the middle of a 64 MiB tensor raises the peak resident memory by about
    1 MiB (the safetensors library's own slices read the whole tensor first)."""
    from safetensors.torch import save_file

    from psrt.checkpoint.safetensors_reader import SafetensorsReader

    path = str(tmp_path / "big.safetensors")
    save_file({"rows": torch.arange(16 << 20, dtype=torch.float32).reshape(16 << 10, 1 << 10)}, path)
    with SafetensorsReader(path) as reader:
        reader.read("rows", 0, 0, 1)  # the reader's first use, before the measurement
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # the peak starts again from what is resident now
        before = _resident_bytes("VmRSS")
        block = reader.read("rows", 0, 8000, 8256)
        grown = _resident_bytes("VmHWM") - before
    assert torch.equal(block[:, 0], torch.arange(8000, 8256, dtype=torch.float32) * 1024)
    assert grown < 4 << 20, f"reading 1 MiB of a 64 MiB tensor grew resident memory by {grown} bytes"


def test_a_save_replaces_the_weight_files_of_an_earlier_layout(tmp_path):
    for stale in ("model.safetensors.index.json", "model-00001-of-00002.safetensors",
                  "model-00002-of-00002.safetensors"):
        (tmp_path / stale).write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    model = llama()
    save_pretrained(model, str(tmp_path), config=model.config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors",
                                                          "model.safetensors.index.json", "tokenizer.json"]
    load_pretrained(llama(num_hidden_layers=3), str(tmp_path))


def test_a_base_models_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    from transformers import GPT2Model

    torch.manual_seed(0)
    base = GPT2Model(gpt2().config)
    base.save_pretrained(str(tmp_path))  # keys "h.0.attn...", as GPT-2's published checkpoints
    model = tp.parallelize(gpt2(), None)
    load_pretrained(model, str(tmp_path))
    for name, value in base.state_dict().items():
        assert torch.equal(model.state_dict()[f"transformer.{name}"], value), name
    assert model.lm_head.weight is model.transformer.wte.weight


def test_auto_refuses_families_that_compute_more_than_their_module_names_say():
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=4))
    with pytest.raises(InvalidArgumentError, match=r"does not know this model \(GemmaForCausalLM\)"):
        tp.parallelize(gemma, None)
    with pytest.raises(InvalidArgumentError, match="a subclass, whose forward may do more"):
        tp.parallelize(gemma, None, plan={"model.embed_tokens": tp.VocabEmbedding()})


def test_grouped_query_attention_is_planned_with_its_key_value_heads():
    from psrt.plan.model import Transformer

    full = Transformer(layers=2, hidden=64, heads=8, vocab=100, sequence_length=16)
    grouped = Transformer(layers=2, hidden=64, heads=8, vocab=100, sequence_length=16, kv_heads=2)
    assert full.layer_params() - grouped.layer_params() == 2 * (64 * 64 + 64) - 2 * (64 * 16 + 16)
    assert grouped.tp_problem(4) == "tp=4 does not divide the 2 key/value heads"
    assert grouped.tp_problem(2) is None
