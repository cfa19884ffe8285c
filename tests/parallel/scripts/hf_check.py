"""Hugging Face models split by ``tp.parallelize`` and ``pp.split`` against the unmodified
model in one process (``psrun -np 2|4 python hf_check.py``).

GPT-2 (tied embeddings, fused ``c_attn`` in ``Conv1D`` layout) and the Llama layout (grouped-
query attention, biases on every projection, an odd vocabulary; Mistral's sliding window)
are built from small configs in float64 on every rank with the same seed.  Each check trains
3 AdamW steps on a (dp, tp, pp) layout and compares the logits of the first forward, every
step's loss and every parameter after the last step (``psrt.full_state_dict``, with the
original keys and shapes) with one process.  Checkpoints: a ``save_pretrained`` directory
written from the shards at one layout loads at another and in one process with
``transformers``; written from ZeRO-3's shards, it holds only each rank's share in memory,
and loading reads only this rank's slices.  Nothing is downloaded.
"""
from __future__ import annotations

import functools
import shutil
import tempfile

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM)

import psrt.torch as hvd
from psrt import pp, tp
from psrt.errors import InvalidArgumentError
from psrt.full_state import full_state_dict
from psrt.pretrained import load_pretrained, save_pretrained
from psrt.grid import ProcessGrid
from psrt.zero import ZeroOptimizer

import _harness
from _hf_layouts import CHECKPOINT_MODELS, LAYOUTS_2, LAYOUTS_4, name_of
from _memory import peak_growth
from _training_common import expect_raises

VOCAB, ROWS, LENGTH, STEPS, LR = 61, 4, 8, 3, 1e-2
TOLERANCE = 1e-9


def gpt2(**extra) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=4, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).double()


def llama(**extra) -> LlamaForCausalLM:
    config = LlamaConfig(**{**dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0), **extra})
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def mistral() -> MistralForCausalLM:
    config = MistralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                           max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return MistralForCausalLM(config).double()


MODELS = {"gpt2": gpt2, "llama": llama, "llama_eager": functools.partial(llama, attn_implementation="eager"),
          "mistral": mistral}


def batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (ROWS * dp, LENGTH), generator=generator),
             torch.randint(0, VOCAB, (ROWS * dp, LENGTH), generator=generator)) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference(model_name: str, dp: int) -> tuple[torch.Tensor, list[float], dict[str, torch.Tensor]]:
    """The first step's logits, every step's loss and the final state_dict of one process."""
    model = MODELS[model_name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first = [], None
    for inputs, targets in batches(dp):
        logits = model(input_ids=inputs).logits
        first = logits.detach() if first is None else first
        loss = loss_fn(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return first, losses, model.state_dict()


class Layout:
    """The model split over one (dp, tp, pp) grid, with its optimizer and pipeline."""

    def __init__(self, model_name: str, dp: int, tp_size: int, pp_size: int, *, chunks: int = 1,
                 schedule: str | None = None, sequence_parallel: bool = False, zero: int = 0,
                 recompute: str | None = None, balance: str = "parameters", checkpoint: str | None = None) -> None:
        self.grid = ProcessGrid(dp=dp, tp=tp_size, pp=pp_size)
        if checkpoint is None:
            self.model = MODELS[model_name]()
        else:  # built on the meta device, filled from the checkpoint once split
            with torch.device("meta"):
                self.model = MODELS[model_name]()
        tp.parallelize(self.model, self.grid.tp_set, sequence_parallel=sequence_parallel)
        self.microbatches = 2 * pp_size if chunks > 1 else 2
        if pp_size > 1:
            sample = batches(dp)[0][0][:ROWS] if balance == "measured" else None
            self.module = pp.split(self.model, self.grid.pp_set, chunks=chunks, recompute=recompute, balance=balance,
                                   sample=sample)
            self.pipeline = pp.Pipeline(self.module, loss_fn, microbatches=self.microbatches, schedule=schedule)
        else:
            self.module, self.pipeline = self.model, None
        if checkpoint is not None:
            load_pretrained(self.module, checkpoint)
        if zero:
            self.optimizer = ZeroOptimizer(self.module, torch.optim.AdamW, stage=zero, process_set=self.grid.dp_set,
                                           lr=LR)
        else:
            named = list(self.module.named_parameters())
            self.optimizer = hvd.DistributedOptimizer(
                torch.optim.AdamW([p for _, p in named], lr=LR), named_parameters=named, process_set=self.grid.dp_set,
                backward_passes_per_step=self.microbatches if self.pipeline else 1)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor | None]:
        """One step on the global batch; the global mean loss and, with pp = 1, the logits."""
        grid = self.grid
        rows = inputs.shape[0] // grid.shape.dp
        mine = slice(grid.coords.dp * rows, (grid.coords.dp + 1) * rows)
        logits = None
        if self.pipeline is None:
            logits = self.model(input_ids=inputs[mine]).logits
            loss = loss_fn(logits, targets[mine])
            loss.backward()
        else:
            loss = self.pipeline.step(inputs[mine] if grid.is_first_stage else None,
                                      targets[mine] if grid.is_last_stage else None)
        self.optimizer.step()
        self.optimizer.zero_grad()
        mean = hvd.allreduce(loss.detach().reshape(1), name="hf_check.loss", process_set=grid.dp_set).item()
        return mean, None if logits is None else hvd.allgather(logits.detach(), name="hf_check.logits",
                                                                process_set=grid.dp_set)

    def full_state(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.module, self.grid, self.optimizer if isinstance(self.optimizer, ZeroOptimizer)
                                    else None)


def assert_state_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ from one process's: {sorted(set(got) ^ set(want))[:5]}"
    for name, value in want.items():
        assert got[name].shape == value.shape, f"{what}: {name} has shape {tuple(got[name].shape)}, want {tuple(value.shape)}"
        assert torch.allclose(got[name], value, rtol=0, atol=TOLERANCE), \
            f"{what}: {name} differs by {(got[name] - value).abs().max().item():.3g}"


def check_matches_one_process(key: str, model_name: str, dp: int, tp_size: int, pp_size: int, **options) -> None:
    first, want_losses, want_state = reference(model_name, dp)
    layout = Layout(model_name, dp, tp_size, pp_size, **options)
    for step, (inputs, targets) in enumerate(batches(dp)):
        loss, logits = layout.step(inputs, targets)
        assert abs(loss - want_losses[step]) < TOLERANCE, f"step {step}: loss {loss!r}, one process {want_losses[step]!r}"
        if step == 0 and logits is not None:
            assert torch.allclose(logits, first, rtol=0, atol=TOLERANCE), \
                f"logits differ by {(logits - first).abs().max().item():.3g}"
    assert_state_equal(layout.full_state(), want_state, "after 3 steps")


def shared_directory() -> str:
    return hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-hf-") if hvd.rank() == 0 else None, root_rank=0,
                                name="hf_check.directory")


def check_checkpoint_moves_between_layouts(key: str, model_name: str) -> None:
    """Trained at (1,2,2) and saved from the shards; loaded at (2,1,2) from a model on the meta
    device, and in one process with transformers' from_pretrained: the same logits; resumed at
    (1,2,2) with sequence parallelism from the meta device, it trains like one process."""
    directory = shared_directory()
    try:
        trained = Layout(model_name, 1, 2, 2)
        for inputs, targets in batches(1)[:1]:
            trained.step(inputs, targets)
        want = trained.full_state()
        save_pretrained(trained.module, directory, trained.grid, config=trained.model.config)
        moved = Layout(model_name, 2, 1, 2, checkpoint=directory)
        assert_state_equal(moved.full_state(), want, "loaded at (2,1,2)")
        one = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
        assert_state_equal(one.state_dict(), want, "from_pretrained in one process")
        strict = MODELS[model_name]()
        strict.load_state_dict(want, strict=True)
        inputs, targets = batches(2)[1]
        assert torch.equal(one(input_ids=inputs).logits, strict(input_ids=inputs).logits), \
            "from_pretrained and a strict load_state_dict of full_state_dict give different logits"
        loss, _ = moved.step(inputs, targets)
        expected = loss_fn(one(input_ids=inputs).logits, targets).item()
        assert abs(loss - expected) < TOLERANCE, f"loss at (2,1,2) after loading {loss!r}, one process {expected!r}"
        # and resumed at (1,2,2) with sequence parallelism, from the meta device: trains like one process
        resumed = Layout(model_name, 1, 2, 2, sequence_parallel=True, checkpoint=directory)
        alone = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
        optimizer = torch.optim.AdamW(alone.parameters(), lr=LR)
        for step, (inputs, targets) in enumerate(batches(1)):
            loss, _ = resumed.step(inputs, targets)
            expected = loss_fn(alone(input_ids=inputs).logits, targets)
            expected.backward()
            optimizer.step()
            optimizer.zero_grad()
            assert abs(loss - expected.item()) < TOLERANCE, f"resumed step {step}: {loss!r} against {expected.item()!r}"
        assert_state_equal(resumed.full_state(), alone.state_dict(), "resumed at (1,2,2) with sequence parallelism")
    finally:
        hvd.allgather_object(None, name="hf_check.done")
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def check_zero3_save_and_load_hold_only_own_slices(key: str) -> None:
    """A 34 MB Llama trained a step under ZeRO-3 on 4 ranks, written with ``save_pretrained``:
    each rank's peak resident memory (reset before the call) grows by no more than its shard
    plus the largest tensor (and 6 MiB), well under the whole model, and ``from_pretrained``
    in one process gives one process's ``state_dict``.  Loaded into a meta model at (1,2,2),
    each rank's memory grows by no more than its own slices plus the largest tensor (and 6
    MiB)."""
    directory = shared_directory()
    shapes = dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    # MPI's message buffers, the hashing buffer, and the safetensors library's code paged in on
    # first use (1.3 MB for its writer): 2.1-4.0 MB measured beyond the shard
    slack = 6 << 20
    try:
        model = llama(**shapes)
        zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR)
        inputs, targets = batches(hvd.size())[0]
        mine = slice(hvd.rank() * ROWS, (hvd.rank() + 1) * ROWS)
        loss_fn(model(input_ids=inputs[mine]).logits, targets[mine]).backward()
        zero.step()
        zero.zero_grad()
        _, grown = peak_growth(lambda: save_pretrained(model, directory, config=model.config, optimizer=zero))
        shard = sum(group.master.numel() * group.master.element_size() for group in zero.groups)
        sizes = [info.numel * 8 for info in zero.partition.params]
        bound = shard + max(sizes) + slack
        assert bound < 0.6 * sum(sizes), f"the bound {bound} says nothing about a {sum(sizes)}-byte model"
        assert grown <= bound, (f"save_pretrained grew resident memory by {grown} bytes, above the shard {shard} + "
                                f"the largest tensor {max(sizes)} (+{slack}); the model is {sum(sizes)}")
        del model, zero
        if hvd.rank() == 0:
            reference = llama(**shapes)
            optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
            loss_fn(reference(input_ids=inputs).logits, targets).backward()
            optimizer.step()
            one = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
            assert_state_equal(one.state_dict(), reference.state_dict(), "saved from ZeRO-3, from_pretrained")
        with torch.device("meta"):
            empty = llama(**shapes)
        grid = ProcessGrid(dp=1, tp=2, pp=2)
        stage = pp.split(tp.parallelize(empty, grid.tp_set), grid.pp_set)
        report, grown = peak_growth(lambda: load_pretrained(stage, directory))
        own = sum(t.numel() * t.element_size() for t in stage.state_dict().values())
        bound = own + report.largest_tensor_bytes + slack
        assert bound < report.checkpoint_bytes * 0.6, "the checkpoint is too small for the bound to say anything"
        assert report.bytes_read == own, f"read {report.bytes_read} bytes, this rank's shards are {own}"
        assert grown <= bound, (f"peak memory grew by {grown} bytes, above shards {own} + largest tensor "
                                f"{report.largest_tensor_bytes} (+{slack}); the checkpoint is {report.checkpoint_bytes}")
    finally:
        hvd.allgather_object(None, name="hf_check.loaded")
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def check_errors_before_communication(key: str) -> None:
    """Each mistake is one clear error, raised alike on every rank before any message."""
    grid = ProcessGrid(dp=1, tp=hvd.size(), pp=1)
    size = hvd.size()
    expect_raises(InvalidArgumentError, lambda: tp.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)),
                                                               grid.tp_set),
                  "plan='auto' does not know this model (Sequential)", "an unknown model")
    heads = size + 1
    odd = llama(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=heads * 4)
    expect_raises(InvalidArgumentError, lambda: tp.parallelize(odd, grid.tp_set),
                  f"attention heads ({heads}) is not divisible by the tensor-parallel size ({size})", "odd heads")
    gqa = llama(num_attention_heads=size * 2, num_key_value_heads=1, hidden_size=size * 8)
    expect_raises(InvalidArgumentError, lambda: tp.parallelize(gqa, grid.tp_set),
                  f"key/value heads (1) is not divisible by the tensor-parallel size ({size})", "one key/value head")
    expect_raises(InvalidArgumentError,
                  lambda: tp.parallelize(llama(), grid.tp_set, plan={"model.layers.*.self_attn.qkv": tp.ColumnWise()}),
                  "plan entry 'model.layers.*.self_attn.qkv' matches no module", "a plan naming no module")
    split_sequence = tp.parallelize(llama(num_key_value_heads=4), grid.tp_set, sequence_parallel=True)
    expect_raises(InvalidArgumentError, lambda: split_sequence(input_ids=torch.zeros(2, size + 1, dtype=torch.long)),
                  f"its length must be a multiple of {size}, got {size + 1}", "a sequence SP cannot split")
    pipeline_grid = ProcessGrid(dp=1, tp=1, pp=size)
    expect_raises(InvalidArgumentError, lambda: pp.split(llama(num_hidden_layers=size - 1), pipeline_grid.pp_set),
                  f"the model has {size - 1} blocks (model.layers), fewer than the {size} pipeline stages",
                  "too few blocks")
    expect_raises(InvalidArgumentError, lambda: pp.split(llama(), pipeline_grid.pp_set, chunks=4),
                  f"{size} pipeline stages × 4 chunks", "too few blocks for the chunks")


def check_stages_that_cut_differently_are_stopped(key: str) -> None:
    """A rank-dependent split would run some blocks twice and others never: the first step's
    agreement refuses it on every stage, naming both cuts."""
    grid = ProcessGrid(dp=1, tp=1, pp=hvd.size())
    counts = [1] * (hvd.size() - 1) + [7 - hvd.size()]
    stage = pp.split(llama(num_hidden_layers=6), grid.pp_set, split=counts if grid.coords.pp % 2 else counts[::-1])
    pipeline = pp.Pipeline(stage, loss_fn, microbatches=2)
    ids, targets = batches(1)[0]
    expect_raises(InvalidArgumentError, lambda: pipeline.step(ids if grid.is_first_stage else None,
                                                              targets if grid.is_last_stage else None),
                  "pipeline stages cut the model differently", "different cuts")


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    for model, dp, tp_size, pp_size, options in (LAYOUTS_4 if hvd.size() == 4 else LAYOUTS_2):
        checks.add(name_of(model, dp, tp_size, pp_size, options),
                   functools.partial(check_matches_one_process, **options), model, dp, tp_size, pp_size)
    if hvd.size() == 4:
        for model in CHECKPOINT_MODELS:
            checks.add(f"checkpoint/{model}/saved_at_122_loads_at_212_and_in_one_process",
                       check_checkpoint_moves_between_layouts, model)
        checks.add("checkpoint/zero3_save_and_load_hold_only_own_slices", check_zero3_save_and_load_hold_only_own_slices)
    checks.add("errors/before_communication", check_errors_before_communication)
    checks.add("errors/stages_cut_differently", check_stages_that_cut_differently_are_stopped)
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
