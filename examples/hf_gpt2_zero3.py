"""ZeRO-3 on Hugging Face's GPT-2, whose output projection is tied to its token embedding,
against torch's AdamW on the whole batch in one process.

Needs ``pip install transformers`` (not a psrt dependency); run with
``psrun -np 2 python examples/hf_gpt2_zero3.py``.  Prints whether psrt's one-call
full state dict has the single-process keys and how far its values are after 3 steps.
"""
from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import psrt.torch as hvd
from psrt.full_state import full_state_dict
from psrt.zero import ZeroOptimizer

ROWS, LENGTH, VOCAB, STEPS = 2, 16, 97, 3
CONFIG = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG).double()


def main() -> None:
    hvd.init()
    model, reference = gpt2(), gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 ties its embeddings"
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS * hvd.size(), LENGTH), generator=generator)
        per_rank = ids.split(ROWS)
        mine = per_rank[hvd.rank()]
        model(mine, labels=mine).loss.backward()
        zero.step()
        zero.zero_grad()
        (sum(reference(rows, labels=rows).loss for rows in per_rank) / hvd.size()).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    got, want = full_state_dict(model, optimizer=zero), reference.state_dict()
    worst = max((got[name] - value).abs().max().item() for name, value in want.items())
    if hvd.rank() == 0:
        print(f"keys equal: {sorted(got) == sorted(want)}; largest difference after {STEPS} steps: {worst:.2g}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
