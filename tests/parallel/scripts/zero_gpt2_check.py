"""ZeRO-3 on Hugging Face's GPT-2, whose ``lm_head.weight`` is ``transformer.wte.weight``, against
torch's AdamW on the whole batch in one process (``psrun -np 2 python zero_gpt2_check.py``).

Checks that the tied model trains, saves and consolidates into the single-process
``state_dict`` (both names of the tied weight included) and optimizer state, that
``save_pretrained`` writes it from the shards for ``from_pretrained``, and that a stage-3
parameter read outside a gather raises a psrt error naming it instead of reading freed
memory.  The model is built from a small ``GPT2Config``: nothing is downloaded.
Float64 throughout.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import psrt.torch as hvd
from psrt.errors import InvalidArgumentError, ParameterReleasedError
from psrt.pretrained import load_pretrained, save_pretrained
from psrt.zero import ZeroOptimizer, consolidate

import _harness
from _training_common import expect_raises

ROWS, LENGTH, VOCAB, STEPS = 2, 8, 61, 3
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
CONFIG = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(CONFIG).double()
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 ties its embeddings"
    return model


def trained() -> tuple[GPT2LMHeadModel, ZeroOptimizer, GPT2LMHeadModel, torch.optim.AdamW]:
    """The stage-3 model and its optimizer, and the one-process reference, after ``STEPS`` steps."""
    model, reference = gpt2(), gpt2()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2, allgather_bucket_size=300)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS * hvd.size(), LENGTH), generator=generator)
        per_rank = ids.split(ROWS)
        model(per_rank[hvd.rank()], labels=per_rank[hvd.rank()]).loss.backward()
        zero.step()
        zero.zero_grad()
        (sum(reference(rows, labels=rows).loss for rows in per_rank) / hvd.size()).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return model, zero, reference, reference_optimizer


def check_saved_tied_gpt2_consolidates_to_one_process(key: str) -> None:
    """``opt.save()`` on the tied model, consolidated, is the reference's state_dict (every
    key, ``lm_head.weight`` included) and loads with its optimizer state into a fresh model."""
    model, zero, reference, reference_optimizer = trained()
    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-gpt2-") if hvd.rank() == 0 else None,
                                     root_rank=0, name=f"{key}.dir")
    try:
        zero.save(directory)
        full = consolidate(directory)
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    want = reference.state_dict()
    assert sorted(full["model"]) == sorted(want), f"consolidated keys {sorted(set(full['model']) ^ set(want))} differ"
    for name, value in want.items():
        torch.testing.assert_close(full["model"][name], value, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
    fresh = gpt2()
    fresh.load_state_dict(full["model"])  # strict
    optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    optimizer.load_state_dict(full["optimizer"])
    for (name, got), want_param in zip(fresh.named_parameters(), reference.parameters()):
        for state_key, value in reference_optimizer.state[want_param].items():
            torch.testing.assert_close(optimizer.state[got][state_key], value, **TIGHT,
                                       msg=lambda m, n=name, s=state_key: f"{s} of {n}: {m}")


def check_save_pretrained_writes_each_rank_s_own_parameters(key: str) -> None:
    """``save_pretrained`` from the stage-3 model: each rank writes a file of the parameters it
    owns, the tied weight once; ``from_pretrained`` in one process and ``load_pretrained``
    into a fresh model give the reference's ``state_dict``."""
    model, zero, reference, _ = trained()
    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-gpt2-") if hvd.rank() == 0 else None,
                                     root_rank=0, name=f"{key}.dir")
    try:
        save_pretrained(model, directory, config=CONFIG, optimizer=zero)
        with open(os.path.join(directory, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        size = hvd.size()
        assert sorted(set(weight_map.values())) == [f"model-{r + 1:05d}-of-{size:05d}.safetensors" for r in range(size)]
        assert "transformer.wte.weight" in weight_map and "lm_head.weight" not in weight_map, sorted(weight_map)
        want = reference.state_dict()
        one = GPT2LMHeadModel.from_pretrained(directory, dtype=torch.float64)
        fresh = GPT2LMHeadModel(CONFIG).double()
        load_pretrained(fresh, directory)
        for what, got in (("from_pretrained", one.state_dict()), ("load_pretrained", fresh.state_dict())):
            assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, **TIGHT, msg=lambda m, n=name, w=what: f"{w}: {n}: {m}")
    finally:
        hvd.barrier()
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def check_released_parameters_refuse_reads(key: str) -> None:
    """Outside a gather, reading a stage-3 parameter (by either name of a tied one, or through
    ``state_dict``) raises naming it; metadata stays readable; inside
    ``gathered_parameters()`` it holds the reference's values, and the ``state_dict`` taken
    there stays readable after the block."""
    model, zero, reference, _ = trained()
    for what, read in (("wte.weight.sum()", lambda: model.transformer.wte.weight.sum()),
                       ("lm_head.weight.clone()", lambda: model.lm_head.weight.clone()),
                       ("c_attn.weight.data", lambda: model.transformer.h[0].attn.c_attn.weight.data),
                       ("ln_f.bias + 1", lambda: model.transformer.ln_f.bias + 1)):
        expect_raises(ParameterReleasedError, read, "gathered_parameters()", what)
    expect_raises(ParameterReleasedError, lambda: model.lm_head.weight.sum(), "'transformer.wte.weight'",
                  "the tied alias names its parameter")
    expect_raises(InvalidArgumentError, model.state_dict, "gathered_parameters()", "state_dict outside a gather")
    weight = model.transformer.wte.weight
    assert weight.shape == (VOCAB, CONFIG.n_embd) and weight.dtype == torch.float64 and weight.requires_grad, \
        f"metadata of a released parameter: {weight.shape} {weight.dtype} {weight.requires_grad}"
    with zero.gathered_parameters():
        assert type(weight) is torch.nn.Parameter, f"a gathered parameter is a {type(weight).__name__}"
        entries = model.state_dict()
        torch.testing.assert_close(weight.detach(), reference.transformer.wte.weight.detach(), **TIGHT)
    for name, value in reference.state_dict().items():  # read after the block: copies, not freed memory
        torch.testing.assert_close(entries[name], value, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    checks.add("gpt2/stage3/save_consolidate_matches_one_process", check_saved_tied_gpt2_consolidates_to_one_process)
    checks.add("gpt2/stage3/released_parameters_refuse_reads", check_released_parameters_refuse_reads)
    checks.add("gpt2/stage3/save_pretrained_writes_each_rank_s_own_parameters",
               check_save_pretrained_writes_each_rank_s_own_parameters)
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
