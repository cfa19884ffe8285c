"""ZeRO-3 on Hugging Face's GPT-2, whose output projection is tied to its token embedding,
against torch's AdamW on the whole batch in one process.

Needs ``pip install transformers`` (not a psrt dependency); run with
``psrun -np 2 python examples/hf_gpt2_zero3.py``.  Prints whether psrt's one-call
full state dict has the single-process keys and how far its values are after 3 steps.
"""
import torch
import psrt.torch as hvd
from psrt.zero import ZeroOptimizer
from psrt.full_state import full_state_dict
from transformers import GPT2Config, GPT2LMHeadModel

hvd.init()
cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0)
def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).double()
mine, ref = model(), model()
assert mine.lm_head.weight is mine.transformer.wte.weight
zero = ZeroOptimizer(mine, torch.optim.AdamW, stage=3, lr=1e-3)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(3):
    ids = torch.randint(0, 97, (2 * hvd.size(), 16), generator=g)
    rows = ids[hvd.rank() * 2:(hvd.rank() + 1) * 2]
    loss = mine(rows, labels=rows).loss
    loss.backward(); zero.step(); zero.zero_grad()
    ref_loss = sum(ref(ids[r * 2:(r + 1) * 2], labels=ids[r * 2:(r + 1) * 2]).loss for r in range(hvd.size())) / hvd.size()
    ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
got = full_state_dict(mine, optimizer=zero)
want = ref.state_dict()
worst = max((got[k] - want[k]).abs().max().item() for k in want)
if hvd.rank() == 0:
    print("keys equal:", sorted(got) == sorted(want), "max abs diff after 3 steps:", worst)
hvd.shutdown()
